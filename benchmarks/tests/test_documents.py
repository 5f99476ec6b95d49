"""B15's harness (benchmarks/documents.py): the queue rows are the main job's scaled to their batch,
every run reads documents with the documents pipeline, and the report states the goal seed by seed."""
from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import documents
from benchmarks.harness.training import compose_cfg


def test_queue_rows_hold_the_main_jobs_keys_and_ema_span_at_their_batch():
    for name, batch in (("queue-32", 32), ("queue-8", 8), ("moco-8", 8)):
        b, overrides, _ = documents.RUNS[name]
        assert b == batch
        obj = compose_cfg(["data=documents", "data.path=x.jsonl", *overrides]).objective
        assert obj.queue_max_age * batch == obj.queue_size == 128 * 32  # the same 4,096 keys at any batch
        assert 1 / (1 - obj.momentum) == pytest.approx(200 * 32 / batch)  # the EMA spans the same pairs


def _args(**kw):
    base = dict(hidden=128, epochs=1, docs=20000, lr=5e-4, adapt_steps=200, adapt_every=50, then_steps=150)
    return argparse.Namespace(**{**base, **kw})


def test_report_gives_the_goal_seed_by_seed_and_the_adaptation_curves(tmp_path, monkeypatch):
    args = _args()
    recs = []
    for name, scores in (("queue-32", (0.24, 0.23, 0.25)), ("inbatch-256", (0.22, 0.23, 0.21))):
        for seed, r1 in enumerate(scores):
            recs.append({"key": documents.run_key(name, seed, args), "name": name, "seed": seed, "steps": 625,
                         "train_s": 1.0, "unrelated_cos_mean": 0.3, "corpus": {"debian": 10, "stdlib": 2},
                         "metrics": {"recall@1": r1, "recall@10": 0.4, "ndcg@10": 0.3}})
    recs.append({"key": documents.run_key("queue-32", 0, _args(docs=500)), "name": "queue-32", "seed": 0, "steps": 1,
                 "train_s": 1.0, "unrelated_cos_mean": 0.3, "corpus": {}, "metrics": {"recall@1": 0.9, "recall@10": 0.9,
                                                                                        "ndcg@10": 0.9}})
    recs.append({"key": documents.adapt_key("adapt_queue-debian", 0, args), "name": "adapt_queue-debian", "seed": 0,
                 "documents": 100, "pool_queries": 10, "peak": 0.8, "peak_step": 50,
                 "curve": [{"step": 0, "recall@1": 0.7}, {"step": 50, "recall@1": 0.8}]})
    cache = tmp_path / "documents_runs.jsonl"
    cache.write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setattr(documents, "CACHE", cache)
    documents.report(args, tmp_path)
    md = (tmp_path / "documents.md").read_text()
    # another protocol's record (docs=500) is not mixed in
    assert "- recall@1 queue-32 vs inbatch-256: 0.240 vs 0.220 (+0.020); seed by seed +0.020 / +0.000 / +0.040" in md
    assert "| adapt_queue-debian | 0 | 100 | 10 | 0.700 | 0.800 | 0.800 (50) | +0.100 |" in md
    assert "- adapt_queue-debian (1 seed(s)): step 50 +0.100" in md
    assert "inbatch-32 (seed 0)" in md and "adapt_inbatch-debian (seed 0)" in md  # listed as not run


def test_part_c_sets_the_adapted_main_job_beside_b6s_main_job_alone(tmp_path, monkeypatch):
    """(c) reads B6's cached main job (finetune_runs.jsonl, B6's protocol only) as the baseline."""
    from benchmarks.harness.equal_data import MAIN_RUN

    args = _args()
    then = {"key": documents.then_key("then_main-inbatch", 0, args), "name": "then_main-inbatch", "seed": 0,
            "adapted": {"name": "adapt_inbatch-debian", "before": 0.742, "final": 0.793, "steps": 150},
            "final": {"recall@1": 0.851, "ndcg@10": 0.9}}
    (tmp_path / "documents_runs.jsonl").write_text(json.dumps(then) + "\n")
    b6 = [{"key": f"{MAIN_RUN}|seed=0|{documents.B6_PROTOCOL}", "name": MAIN_RUN, "seed": 0,
           "final": {"recall@1": 0.846, "ndcg@10": 0.89}},
          {"key": f"{MAIN_RUN}|seed=0|pairs=512|pool=50x100", "name": MAIN_RUN, "seed": 0,
           "final": {"recall@1": 0.1, "ndcg@10": 0.1}}]
    (tmp_path / "finetune_runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in b6))
    monkeypatch.setattr(documents, "CACHE", tmp_path / "documents_runs.jsonl")
    monkeypatch.setattr(documents, "RESULTS", tmp_path)
    documents.report(args, tmp_path)
    md = (tmp_path / "documents.md").read_text()
    assert "| then_main-inbatch | 0 | 0.742 -> 0.793 | 0.851 | 0.900 |" in md
    assert "| main job alone (B6) | 0 |  | 0.846 | 0.890 |" in md and "0.100" not in md.split("## (c)")[1]
    assert "then_main-queue (seed 0)" in md  # listed as not run
