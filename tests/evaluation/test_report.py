"""End to end on a fake encoder: encode -> index -> metrics/geometry -> eval.json, run.trec,
report.md, PNGs, W&B objects."""
import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from moco_retrieval.config import EvalConfig
from moco_retrieval.evaluation.encode import encode_texts, evaluate_embeddings, evaluate_encoder
from moco_retrieval.evaluation.metrics import METRIC_NAMES, evaluate_run, read_trec_run
from moco_retrieval.evaluation.report import (
    TABLE_COLUMNS,
    sample_query_ids,
    topk_rows,
    write_report,
)


def _hash_vec(word: str, dim: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "little")
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))


class FakeEncoder(nn.Module):
    """Implements the encoder contract: forward(side, kind) -> [B, d]; bag of hashed words
    (or fixed vectors for listed texts) through a linear layer; normalized when asked."""

    def __init__(self, dim=16, normalize=True, table=None, needs_tokens=True, offset=0.0):
        super().__init__()
        self.offset = offset
        self.dim = dim
        self.normalize = normalize
        self.needs_tokens = needs_tokens
        self.table = table or {}
        self.proj = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(dim))
        self.calls = []

    def tokenize(self, texts, kind):
        words = [t.split() or [""] for t in texts]
        length = max(len(w) for w in words)
        ids = torch.zeros(len(texts), length, dtype=torch.long)
        mask = torch.zeros(len(texts), length, dtype=torch.long)
        for i, ws in enumerate(words):
            ids[i, : len(ws)] = torch.arange(1, len(ws) + 1)
            mask[i, : len(ws)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def forward(self, side, kind):
        texts = side["texts"]
        self.calls.append((kind, len(texts), self.training, torch.is_grad_enabled(), "input_ids" in side))
        if self.needs_tokens:
            assert side["input_ids"].shape[0] == len(texts)
        rows = []
        for t in texts:
            if t in self.table:
                rows.append(torch.tensor(self.table[t], dtype=torch.float32))
            else:
                rows.append(torch.stack([_hash_vec(w, self.dim) for w in t.split()]).mean(0))
        out = self.proj(torch.stack(rows)) + self.offset
        return nn.functional.normalize(out, dim=-1) if self.normalize else out


def _evalset(n_docs=60, seed=0):
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(200)]
    corpus, queries, qrels = {}, {}, {}
    for i in range(n_docs):
        words = list(rng.choice(vocab, size=int(rng.integers(3, 9)), replace=False))
        corpus[f"doc{i}"] = " ".join(words)
        if i % 2 == 0:  # a query for every other doc: two of its words, plus noise
            queries[f"q{i}"] = " ".join(words[:2] + [str(rng.choice(vocab))])
            qrels[f"q{i}"] = {f"doc{i}": 1}
            if i % 6 == 0:
                qrels[f"q{i}"][f"doc{i + 1}"] = 2  # several relevant, graded
    queries["q_none"] = "w1 w2"  # a query without qrels
    return SimpleNamespace(corpus=corpus, queries=queries, qrels=qrels)


def test_encode_texts_batched_eval_no_grad_order_preserved():
    enc = FakeEncoder()
    enc.train()
    texts = ["a b c d e", "a", "b c", "x y z", "q"]
    emb = encode_texts(enc, texts, "doc", batch_size=2, show_progress=False)
    assert emb.dtype == np.float32 and emb.shape == (5, 16)
    assert enc.training  # mode restored
    assert [c[1] for c in enc.calls] == [2, 2, 1]
    assert all(kind == "doc" and not training and not grad and has_ids for kind, _, training, grad, has_ids in enc.calls)
    one_by_one = np.concatenate([encode_texts(enc, [t], "doc", show_progress=False) for t in texts])
    np.testing.assert_allclose(emb, one_by_one, rtol=1e-6, atol=1e-6)
    # without tokens the side is texts only
    enc2 = FakeEncoder(needs_tokens=False)
    encode_texts(enc2, texts, "query", batch_size=8, show_progress=False)
    assert enc2.calls == [("query", 5, False, False, False)]
    assert encode_texts(enc2, [], "doc", show_progress=False).shape == (0, 16)


def test_encode_texts_progress_bar_description(capsys):
    encode_texts(FakeEncoder(), ["a b"] * 3, "doc", batch_size=2, show_progress=True)
    assert "encoding 3 documents" in capsys.readouterr().err


def test_unnormalized_model_is_ranked_by_dot_product():
    # the relevant doc is long and less aligned: first by dot product, second by cosine
    table = {"query": [1.0, 0.0], "short doc": [1.0, 0.05], "long doc": [3.0, 2.0]}
    evalset = SimpleNamespace(
        corpus={"s": "short doc", "l": "long doc"}, queries={"q": "query"}, qrels={"q": {"l": 1}}
    )
    cfg = EvalConfig(top_k=2)
    raw = evaluate_encoder(FakeEncoder(dim=2, normalize=False, table=table), evalset, cfg, show_progress=False)
    assert raw.metrics["recall@1"] == 1.0
    assert raw.run["q"] == pytest.approx({"l": 3.0, "s": 1.0})
    assert raw.info["similarity"] == "dot"
    cos = evaluate_encoder(FakeEncoder(dim=2, normalize=True, table=table), evalset, cfg, show_progress=False)
    assert cos.metrics["recall@1"] == 0.0
    assert cos.info["similarity"] == "cosine"


def test_evaluate_embeddings_is_the_same_path():
    evalset = _evalset()
    enc = FakeEncoder()
    cfg = EvalConfig(top_k=100)
    res = evaluate_encoder(enc, evalset, cfg, batch_size=16, show_progress=False)
    doc_ids, query_ids = list(evalset.corpus), list(evalset.queries)
    d = encode_texts(enc, [evalset.corpus[i] for i in doc_ids], "doc", show_progress=False)
    q = encode_texts(enc, [evalset.queries[i] for i in query_ids], "query", show_progress=False)
    res2 = evaluate_embeddings(doc_ids, torch.from_numpy(d), query_ids, q, evalset.qrels, cfg)
    assert res2.metrics == pytest.approx(res.metrics)
    assert res2.geometry == pytest.approx(res.geometry, nan_ok=True)
    assert set(res.metrics) == set(METRIC_NAMES)
    assert res.metrics["recall@100"] == 1.0  # 60 docs, all retrieved
    assert len(res.run) == len(evalset.queries) and all(len(r) == 60 for r in res.run.values())
    assert res.info["num_scored_queries"] == 30 and res.info["num_docs"] == 60
    assert len(res.recall_curve) == 100
    for key in ("encode_docs", "encode_queries", "encode", "index", "search", "geometry"):
        assert res.timings[key] >= 0
    with pytest.raises(ValueError, match="differ in length"):
        evaluate_embeddings(doc_ids[:-1], d, query_ids, q, evalset.qrels, cfg)


def test_write_report_single_model(tmp_path):
    evalset = _evalset()
    res = evaluate_encoder(FakeEncoder(), evalset, EvalConfig(top_k=20), show_progress=False)
    files = write_report(tmp_path, res, models={"fake": {"backbone": "fake", "normalize": True}},
                         dataset={"kind": "test", "docs": 60})
    data = json.loads((tmp_path / "eval.json").read_text())
    assert set(data["metrics"]) == set(METRIC_NAMES)
    for key in ("anisotropy", "unrelated_cos_p05", "unrelated_cos_p95", "positive_cos_mean", "cos_gap",
                "alignment", "uniformity"):
        assert isinstance(data["geometry"][key], float)
    assert data["timings"]["encode"] > 0 and "search" in data["timings"]
    assert data["model"] == {"backbone": "fake", "normalize": True}
    assert data["name"] == "fake" and data["dataset"] == {"kind": "test", "docs": 60}
    assert data["run_file"] == "run.trec" and len(data["recall_curve"]) == 20
    # the metrics recomputed from run.trec equal those in eval.json
    run = read_trec_run(files["run"])
    assert len(run) == len(evalset.queries)
    assert evaluate_run(run, evalset.qrels).mean == data["metrics"]
    md = (tmp_path / "report.md").read_text()
    assert "| recall@1 |" in md and "anisotropy" in md and "![cosine_hist](cosine_hist.png)" in md
    for name in ("cosine_hist.png", "recall_at_k.png"):
        blob = (tmp_path / name).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000


def test_write_report_side_by_side(tmp_path):
    evalset = _evalset()
    cfg = EvalConfig(top_k=100)
    a = evaluate_encoder(FakeEncoder(), evalset, cfg, show_progress=False)
    # an anisotropic model: a shared offset pulls every embedding the same way
    b = evaluate_encoder(FakeEncoder(offset=1.0), evalset, cfg, show_progress=False)
    assert b.geometry["anisotropy"] > a.geometry["anisotropy"] + 0.3
    write_report(tmp_path, {"base": b, "trained": a}, models={"base": {"step": 0}, "trained": {"step": 100}})
    data = json.loads((tmp_path / "eval.json").read_text())
    assert list(data["models"]) == ["base", "trained"]
    assert data["models"]["trained"]["model"] == {"step": 100}
    for name, r in (("base", b), ("trained", a)):
        run = read_trec_run(tmp_path / f"run.{name}.trec")
        assert evaluate_run(run, evalset.qrels).mean == data["models"][name]["metrics"]
    md = (tmp_path / "report.md").read_text()
    assert "| | base | trained |" in md
    assert (tmp_path / "cosine_hist.png").stat().st_size > 10_000


def test_topk_rows_and_fixed_sample():
    run = {"q1": {"a": 0.9, "b": 0.8, "c": 0.7}, "q2": {"a": 0.5, "c": 0.4}}
    qrels = {"q1": {"b": 1}, "q2": {"z": 1}}
    rows = topk_rows(run, qrels, {"q1": "one", "q2": "two"}, {"a": "A", "b": "B", "c": "C"}, ["q1", "q2"], k=2)
    assert rows == [
        ["q1", "one", 1, "a", "A", 0.9, False, 2],
        ["q1", "one", 2, "b", "B", 0.8, True, 2],
        ["q2", "two", 1, "a", "A", 0.5, False, 0],
        ["q2", "two", 2, "c", "C", 0.4, False, 0],
    ]
    assert len(rows[0]) == len(TABLE_COLUMNS)
    ids = [f"q{i}" for i in range(100)]
    s1 = sample_query_ids(ids, 10, seed=0)
    assert s1 == sample_query_ids(list(reversed(ids)), 10, seed=0) and len(s1) == 10
    assert sample_query_ids(["b", "a"], 10) == ["a", "b"]
    assert sample_query_ids(["a", "b"], 10, qrels={"a": {"x": 0}, "b": {"x": 1}}) == ["b"]


def test_wandb_objects():
    wandb = pytest.importorskip("wandb")
    from moco_retrieval.evaluation.report import wandb_cosine_histograms, wandb_topk_table

    evalset = _evalset(n_docs=20)
    res = evaluate_encoder(FakeEncoder(), evalset, EvalConfig(top_k=10), show_progress=False)
    hists = wandb_cosine_histograms(res)
    assert set(hists) == {"val/cos_positive", "val/cos_unrelated"}
    assert all(isinstance(h, wandb.Histogram) for h in hists.values())
    table = wandb_topk_table(res.run, evalset.qrels, evalset.queries, evalset.corpus, n=3, k=5)
    assert isinstance(table, wandb.Table)
    assert table.columns == TABLE_COLUMNS and len(table.data) == 15


def _captured_figures(monkeypatch):
    from moco_retrieval.evaluation import report

    figures, make = [], report._figure

    def capture(*a, **kw):
        figures.append(make(*a, **kw))
        return figures[-1]

    monkeypatch.setattr(report, "_figure", capture)
    return figures


def _result(pos, unrel, curve):
    from moco_retrieval.evaluation.encode import EvalResult

    geometry = {"unrelated_cos_mean": float(np.mean(unrel)), "positive_cos_mean": float(np.mean(pos)),
                "cos_gap": float(np.mean(pos) - np.mean(unrel))}
    return EvalResult(metrics={}, per_query={}, geometry=geometry, positive_cosines=pos, unrelated_cosines=unrel,
                      run={}, recall_curve=curve, timings={})


def test_plots_keep_the_legend_off_the_histograms_and_zoom_recall(tmp_path, monkeypatch):
    """The MiniLM shape: a tall unrelated peak near 0.1 on the left, positives near 0.65."""
    from moco_retrieval.evaluation.report import plot_cosine_histograms, plot_recall_curves

    rng = np.random.default_rng(0)
    res = {"base": _result(np.clip(rng.normal(0.65, 0.12, 600), -1, 1), rng.normal(0.1, 0.08, 20000),
                           list(np.linspace(0.80, 0.99, 100))),
           "trained": _result(np.clip(rng.normal(0.7, 0.1, 600), -1, 1), rng.normal(0.03, 0.08, 20000),
                              list(np.linspace(0.84, 0.995, 100)))}
    figures = _captured_figures(monkeypatch)
    plot_cosine_histograms(res, tmp_path / "c.png")
    plot_recall_curves(res, tmp_path / "r.png")
    hist, recall = figures
    hist.canvas.draw()
    for ax in hist.axes:
        box = ax.get_legend().get_window_extent()
        bars = [p.get_window_extent() for p in ax.patches if p.get_height() > 0]
        assert bars and not any(b.overlaps(box) for b in bars)
    low, high = recall.axes[0].get_ylim()
    assert 0.7 <= low < 0.80 and high >= 0.995  # not 0-1: the band where the curves differ fills the plot


def test_the_guide_names_the_run_files_as_evaluate_writes_them():
    """One model: run.trec; a comparison: run.<name>.trec per model (the guide said run.<model>.trec always)."""
    from moco_retrieval.evaluation.report import run_file_name
    from tests.helpers import REPO

    guide = " ".join((REPO / "docs" / "guide" / "commands.md").read_text(encoding="utf-8").split())
    assert run_file_name("minilm", single=True) == "run.trec" and run_file_name("minilm", single=False) == "run.minilm.trec"
    assert "`run.trec` (one model), or `run.<name>.trec` for each model of a comparison" in guide
