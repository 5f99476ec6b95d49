"""evaluate / search on a tiny model, a tiny BEIR folder and a 2-step training checkpoint, and the
commands' strict configs (export's own tests: tests/export/test_export.py)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from moco_retrieval.data.formats import EvalSet, read_beir, write_beir
from moco_retrieval.errors import ConfigError
from moco_retrieval.evaluate import run_evaluate
from moco_retrieval.evaluation.metrics import METRIC_NAMES, evaluate_run, read_trec_run
from moco_retrieval.search import run_search
from tests.helpers import compose_cfg, tiny_overrides

# --------------------------------------------------------------------------- evaluate


def test_compare_base_is_the_checkpoints_own_model_untrained(tiny_dir, beir_dir, moco_checkpoint, tmp_path):
    """Issue 46, point 13: without model=..., compare=[base] built the model group's MiniLM (305 of 349 s
    of the README's first run) instead of the tiny checkpoint's own untrained encoder."""
    cfg = compose_cfg("evaluate", ["data=beir", f"data.dir={beir_dir}", f"checkpoint={moco_checkpoint}", "compare=[base]",
                                   "progress=false", "device=cpu", "plots=false"])
    assert cfg.model.backbone != "tiny"  # the model group's default, which base no longer means here
    run_evaluate(cfg, tmp_path)
    models = json.loads((tmp_path / "eval.json").read_text())["models"]
    trained, base = (models[n]["model"] for n in models)
    assert base["source"] == "base" and base["parameters"] == trained["parameters"]
    assert base["backbone"] == trained["backbone"] != cfg.model.backbone


def test_evaluate_checkpoint_against_base_side_by_side(tiny_dir, beir_dir, moco_checkpoint, tmp_path):
    cfg = compose_cfg("evaluate", tiny_overrides(tiny_dir) + [
        "data=beir", f"data.dir={beir_dir}", f"checkpoint={moco_checkpoint}", "compare=[base]",
        "progress=false", "device=cpu", "eval.top_k=25",
    ])
    files = run_evaluate(cfg, tmp_path)
    data = json.loads((tmp_path / "eval.json").read_text())
    names = list(data["models"])
    assert names == [f"{Path(moco_checkpoint).parent.parent.name}-last", "base"]
    qrels = read_beir(beir_dir, "test").qrels
    for name in names:
        entry = data["models"][name]
        assert set(entry["metrics"]) == set(METRIC_NAMES)
        assert {"anisotropy", "unrelated_cos_p05", "unrelated_cos_p95", "positive_cos_mean", "cos_gap",
                "alignment", "uniformity"} <= set(entry["geometry"])
        assert {"encode", "search"} <= set(entry["timings"])
        run = read_trec_run(tmp_path / entry["run_file"])
        assert len(run) == 20 and all(len(r) == 25 for r in run.values())
        assert evaluate_run(run, qrels).mean == entry["metrics"]
    assert data["models"][names[0]]["model"]["source"] == "checkpoint"
    assert data["models"][names[0]]["model"]["global_step"] == 2
    assert data["dataset"]["queries"] == 20 and data["dataset"]["documents"] == 40
    md = (tmp_path / "report.md").read_text()
    assert f"| | {names[0]} | base |" in md
    assert (tmp_path / "cosine_hist.png").is_file() and (tmp_path / "recall_at_k.png").is_file()
    assert files["eval_json"] == tmp_path / "eval.json"


def test_evaluate_command_line(tiny_dir, beir_dir, tmp_path):
    """The real entry point: Hydra, the model/data groups, the files, run.trec = eval.json."""
    out = tmp_path / "out"
    env = {**os.environ, "MOCO_RETRIEVAL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "moco_retrieval.evaluate", *tiny_overrides(tiny_dir), "data=beir", f"data.dir={beir_dir}",
         f"out_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}", "progress=false", "device=cpu", "plots=false"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "eval.json").read_text())
    assert data["name"] == "base" and data["model"]["source"] == "base"
    assert set(data["metrics"]) == set(METRIC_NAMES)
    run = read_trec_run(out / "run.trec")
    assert evaluate_run(run, read_beir(beir_dir, "test").qrels).mean == data["metrics"]
    assert "recall@1" in proc.stdout and (out / "report.md").is_file()


def test_configs_are_strict():
    with pytest.raises(ConfigCompositionException):
        compose_cfg("evaluate", ["model.not_a_key=1"])
    with pytest.raises(ConfigCompositionException):
        compose_cfg("search", ["not_a_key=1"])
    cfg = compose_cfg("export", ["out_dir=/tmp/x"])
    assert cfg.encoder == "query" and cfg.model.backbone == "minilm"


# --------------------------------------------------------------------------- search


def test_search_returns_the_planted_document_first(tiny_dir, beir_dir, tmp_path, capsys):
    planted = "convert and resize images from the command line"
    corpus = {d: t for d, t in read_beir(beir_dir, "test").corpus.items()}
    corpus["planted-doc"] = planted
    folder = tmp_path / "corpus"
    write_beir(folder, EvalSet(corpus=corpus, queries={"q": "x"}, qrels={"q": {"planted-doc": 1}}), "test")
    overrides = tiny_overrides(tiny_dir) + [f"corpus={folder}", f"index_dir={tmp_path / 'index'}", f"query={planted}",
                                   "queries=[shell terminal]", "k=3", "format=json", "progress=false", "device=cpu"]
    out = io.StringIO()
    answers = run_search(compose_cfg("search", overrides), out=out)
    assert [a["query"] for a in answers] == [planted, "shell terminal"]
    first = answers[0]["results"]
    assert first[0]["doc_id"] == "planted-doc" and first[0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert [r["rank"] for r in first] == [1, 2, 3] and first[0]["score"] >= first[1]["score"]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == answers
    assert "built index of 41 documents" in capsys.readouterr().err
    # second call: the saved index is loaded, same answer
    again = run_search(compose_cfg("search", overrides), out=io.StringIO())
    assert again == answers
    assert "loaded index" in capsys.readouterr().err
    assert {p.name for p in (tmp_path / "index").iterdir()} == {"index.faiss", "doc_ids.json", "meta.json"}


def _planted_sets(beir_dir, tmp_path) -> dict[str, Path]:
    """Two evaluation sets named ``alpha`` and ``beta``, each the tiny BEIR corpus plus a document of its own."""
    base = read_beir(beir_dir, "test")
    sets = {}
    for name in ("alpha", "beta"):
        corpus = {**base.corpus, f"{name}-doc": f"the {name} planted document about compressing audio"}
        sets[name] = tmp_path / name
        write_beir(sets[name], EvalSet(corpus=corpus, queries={"q": "x"}, qrels={"q": {f"{name}-doc": 1}}), "test")
    return sets


def test_search_corpus_eval_of_several_sets_searches_the_named_one(tiny_dir, beir_dir, tmp_path):
    sets = _planted_sets(beir_dir, tmp_path)
    overrides = tiny_overrides(tiny_dir) + [
        "data=beir", f"data.dir={beir_dir}", f"data.eval_dirs=[{sets['alpha']},{sets['beta']}]", "data.eval_split=test",
        "corpus=eval", "eval_set=beta", f"index_dir={tmp_path / 'index'}", "query=the beta planted document",
        "k=41", "format=json", "progress=false", "device=cpu"]
    hits = run_search(compose_cfg("search", overrides), out=io.StringIO())[0]["results"]
    ids = {h["doc_id"] for h in hits}
    assert hits[0]["doc_id"] == "beta-doc" and "alpha-doc" not in ids and len(ids) == 41  # beta's pool alone


@pytest.mark.parametrize("extra, message", [
    (["corpus=eval"], r"corpus=eval: data.eval_dirs holds 2 sets; choose one with eval_set=NAME, NAME one of alpha, beta"),
    (["corpus=eval", "eval_set=gamma"], r"eval_set=gamma: expected one of data.eval_dirs' sets: alpha, beta"),
    (["eval_set=alpha"], r"eval_set=alpha: it chooses the held-out set that corpus=eval searches; add corpus=eval"),
])
def test_search_eval_set_is_checked_before_the_model_loads(beir_dir, tmp_path, extra, message):
    sets = _planted_sets(beir_dir, tmp_path)
    overrides = ["model=tiny", f"model.path={tmp_path / 'no-such-model'}", "data=beir", f"data.dir={beir_dir}",
                 f"data.eval_dirs=[{sets['alpha']},{sets['beta']}]", "query=x", *extra]
    with pytest.raises(ConfigError, match=message):
        run_search(compose_cfg("search", overrides), out=io.StringIO())
