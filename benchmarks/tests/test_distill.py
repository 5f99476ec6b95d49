"""B16's harness (benchmarks/distill.py): the rows differ only in the objective, the 3-layer student
is the first 3 layers of its model, a dry run mines, trains and reports, and the goal lines compute
from the cache."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from benchmarks import distill
from benchmarks.harness import equal_data
from benchmarks.harness.training import compose_cfg


def test_our_rows_compose_strictly_and_differ_only_in_the_objective_keys():
    cfgs = {n: compose_cfg(equal_data.DEFAULT_BASE + list(spec) + [f"data.batch_size={b}"])
            for n, (kind, b, spec, _) in distill.RUNS.items() if kind == "ours"}
    assert set(cfgs) == {"main", "main_kl", "kl_only", "main_margin_mse"}
    main = dataclasses.asdict(cfgs["main"])
    assert main["data"]["n_negatives"] == 7 and main["objective"]["distill"] == "none"
    assert main["objective"]["name"] == "two_queue" and main["objective"]["inbatch_weight"] == 1.0
    expected = {"main_kl": {"distill": "kl"}, "kl_only": {"distill": "kl", "contrastive_weight": 0.0},
                "main_margin_mse": {"distill": "margin_mse"}}
    for name, diff in expected.items():
        other = dataclasses.asdict(cfgs[name])
        assert {k: v for k, v in other.items() if k != "objective"} == {k: v for k, v in main.items() if k != "objective"}
        changed = {k: v for k, v in other["objective"].items() if main["objective"][k] != v}
        assert changed == diff, name
    # the peers: the same rows, 7 negatives each, at the same batch
    assert all(distill.RUNS[n][1] == 32 and distill.RUNS[n][2]["n_negatives"] == 7 for n in ("st_kl", "st_margin_mse"))
    assert distill.LOGITS == {"main_kl", "kl_only", "st_kl"}  # KL learns logits, MarginMSE raw scores


def test_the_student_is_the_first_three_layers_of_its_model(tmp_path):
    from transformers import AutoModel, AutoTokenizer

    from moco_retrieval.model.tiny import build_tiny_bert

    src = build_tiny_bert(tmp_path / "l4", layers=4)
    dst = distill.truncate(src, tmp_path / "l3")
    full, cut = AutoModel.from_pretrained(src).eval(), AutoModel.from_pretrained(dst).eval()
    assert cut.config.num_hidden_layers == 3 and len(cut.encoder.layer) == 3
    batch = AutoTokenizer.from_pretrained(dst)(["a debian package", "python bindings for the library"],
                                                padding=True, return_tensors="pt")
    with torch.no_grad():
        want = full(**batch, output_hidden_states=True).hidden_states[3]  # after the third layer
        got = cut(**batch).last_hidden_state
    assert torch.allclose(got, want, atol=1e-6)
    assert distill.truncate(src, dst) == dst  # written once


def test_scores_scaled_to_logits_keep_the_rows():
    from moco_retrieval.data.formats import Negative, Pair

    p = Pair("q", "d", 1, negatives=[Negative(text="n", doc_id=2, score=0.5)], positive_score=0.9)
    (q,) = distill.scaled([p], distill.kl_scale({"teacher": {"kind": "bi-encoder"}}))
    assert q.positive_score == pytest.approx(18.0) and q.negatives[0].score == pytest.approx(10.0) and q.query == "q"
    assert distill.kl_scale({"teacher": {"kind": "cross-encoder"}}) == 1.0


@pytest.mark.slow
def test_dry_run_mines_trains_and_reports(debian_dir, tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("MOCO_RETRIEVAL_DEBIAN_DIR", str(debian_dir))
    monkeypatch.setattr(equal_data, "BASE", list(equal_data.BASE))  # main() points BASE at its student
    argv = ["--dry-run", "--only", "main,st_kl", "--seeds", "0", "--out", str(tmp_path)]
    assert distill.main(argv) == 0
    runs = [json.loads(line) for line in (tmp_path / "distill_dry_run_runs.jsonl").read_text().splitlines()]
    assert [r["name"] for r in runs] == ["main", "st_kl"]
    assert all(r["steps"] == 4 and r["pairs"] == 128 and r["model"] == "tiny" for r in runs)
    assert runs[0]["teacher_scores"] == "raw" and runs[1]["teacher_scores"] == "logits" and runs[1]["n_negatives"] == 7
    mined = list((tmp_path / "work").glob("mined-*.jsonl"))
    assert len(mined) == 1 and json.loads(mined[0].open().readline())["positive_score"] is not None
    md = (tmp_path / "distill_dry_run.md").read_text()
    assert "| main |" in md and "| st_kl |" in md and "main_kl (seed 2)" in md
    data = json.loads((tmp_path / "distill_dry_run.json").read_text())
    assert data["mining"]["teacher"]["kind"] == "bi-encoder" and len(data["runs"]) == 2


def _rec(name: str, seed: int, recall: float) -> dict:
    final = {"recall@1": recall, "mrr@10": recall, "ndcg@10": recall + 0.05}
    return {"key": f"{name}|seed={seed}", "name": name, "seed": seed, "final": final, "curve": [final], "train_s": 100.0,
            "s_per_step": 9.0}


def test_goal_lines_compute_from_the_cache(tmp_path):
    recs = [_rec("main", s, r) for s, r in enumerate((0.80, 0.81, 0.82))]
    recs += [_rec("main_kl", s, r) for s, r in enumerate((0.81, 0.82, 0.83))]
    recs += [_rec("kl_only", 0, 0.797), _rec("st_kl", 0, 0.800), _rec("main_margin_mse", 0, 0.79),
             _rec("st_margin_mse", 0, 0.80), _rec("teacher", 0, 0.85), _rec("untrained", 0, 0.70)]
    by = {}
    for r in recs:
        by.setdefault(r["name"], []).append(r)
    lines = "\n".join(distill.goal(by))
    assert "every seed: **met** (recall@1 main_kl - main, seed by seed: +0.010 / +0.010 / +0.010" in lines
    assert "kl_only vs st_kl (KL alone against KL alone): recall@1 0.797 vs 0.800 (-0.003): matches or beats" in lines
    assert "main_margin_mse vs st_margin_mse" in lines and "(-0.010): **behind**" in lines
    assert "same rows: **met** (best of ours main_kl 0.820 against their best st_kl 0.800, +0.020)" in lines
    by["main_kl"][1] = _rec("main_kl", 1, 0.805)  # one seed behind
    assert "every seed: **not met**" in "\n".join(distill.goal(by))
    assert "so far on 1 of 3 seeds" in "\n".join(distill.goal({"main": by["main"][:1], "main_kl": by["main_kl"][:1]}))

    args = argparse.Namespace(dry_run=True, out_dir=tmp_path, teacher="T", teacher_tag="T-0", mine_pairs=256, pairs=128,
                              max_queries=50, max_docs=100, model="tiny")
    distill.report(recs, args, tmp_path, "distill_x", [])
    md = (tmp_path / "distill_x.md").read_text()
    assert "| teacher | the teacher | 1 | 0.850 |" in md and "| untrained |" in md
    assert "| 1 | +0.010 | +0.010 |" in md  # main_kl - main, seed by seed
    assert "## Not run yet" not in md  # every planned run is there
    assert "9.9 s a step, 570 steps (the full run)" in md and "10 training runs" in md
