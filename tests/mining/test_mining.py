"""Hard-negative mining: each filter on a planted score table, positives and their groups never
mined, sampling, and the output read back by training (JSONL -> data module -> a training step)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moco_retrieval.config import DataConfig
from moco_retrieval.errors import ConfigError
from moco_retrieval.data.formats import Pair, read_pairs_jsonl
from moco_retrieval.mining import (
    MiningFilters,
    build_corpus,
    filter_candidates,
    MiningOptions,
    mine_from_embeddings,
    mine_hard_negatives,
    new_counts,
    sample_candidates,
    stats_path_for,
    write_mined,
)
from tests.helpers import compose_cfg

# ---------------------------------------------------------------- planted score table (one query)
# corpus position -> (score, group); the positive is doc 0 (group 7), doc 3 shares its group.
POS_SCORE = 0.80


pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py
TABLE = [  # search order (best first)
    (0, 0.95, 7),  # the positive itself
    (1, 0.90, -1),  # rank 0: above the positive
    (2, 0.78, -1),  # rank 1: within 5% of the positive (0.76)
    (3, 0.77, 7),  # same group as the positive
    (4, 0.75, -1),  # rank 2: passes the relative margin, fails an absolute margin of 0.1 (0.70)
    (5, 0.65, -1),  # rank 3
    (6, 0.55, -1),  # rank 4
    (7, 0.45, -1),  # rank 5
    (8, 0.35, -1),  # rank 6
]
GROUPS = [g for _, _, g in sorted(TABLE)]


def run_table(**kw):
    filters = MiningFilters(**{"relative_margin": None, "range_max": 100, **kw})
    counts = new_counts()
    docs = [d for d, _, _ in TABLE]
    scores = [s for _, s, _ in TABLE]
    out = filter_candidates(docs, scores, POS_SCORE, {0}, {7}, GROUPS, filters, counts)
    return [c.doc for c in out], [c.rank for c in out], counts


def test_no_filter_keeps_all_but_positive_and_group():
    docs, ranks, counts = run_table()
    assert docs == [1, 2, 4, 5, 6, 7, 8] and ranks == list(range(7))
    assert counts["removed"]["positive"] == 1 and counts["removed"]["group"] == 1
    assert counts["passed"] == 7 and counts["considered"] == 9


def test_group_filter_off_keeps_group_but_never_the_positive():
    docs, _, counts = run_table(drop_group=False)
    assert 3 in docs and 0 not in docs
    assert counts["removed"]["group"] == 0 and counts["removed"]["positive"] == 1


def test_rank_window():
    docs, ranks, counts = run_table(range_min=2, range_max=4)
    assert docs == [4, 5, 6] and ranks == [2, 3, 4]
    assert counts["removed"]["rank_window"] == 2  # ranks 0 and 1
    assert counts["considered"] == 7  # the list stops at rank 4


def test_relative_margin():
    docs, _, counts = run_table(relative_margin=0.05)  # keep iff score <= 0.80 * 0.95 = 0.76
    assert docs == [4, 5, 6, 7, 8]
    assert counts["removed"]["relative_margin"] == 2


def test_relative_margin_zero_still_removes_scores_above_the_positive():
    docs, _, _ = run_table(relative_margin=0.0)
    assert docs == [2, 4, 5, 6, 7, 8]


def test_absolute_margin():
    docs, _, counts = run_table(margin=0.1)  # keep iff score <= 0.70
    assert docs == [5, 6, 7, 8]
    assert counts["removed"]["margin"] == 3


def test_max_score():
    docs, _, counts = run_table(max_score=0.5)
    assert docs == [7, 8]
    assert counts["removed"]["max_score"] == 5


def test_filters_combine_and_counts_go_to_the_first():
    docs, _, counts = run_table(range_min=1, range_max=5, margin=0.1, relative_margin=0.05, max_score=0.6)
    assert docs == [6, 7]
    removed = counts["removed"]
    assert removed == {"positive": 1, "group": 1, "rank_window": 1, "margin": 2, "relative_margin": 0, "max_score": 1}
    # alone, the relative margin would have rejected doc 2 (taken by the margin first)
    assert counts["would_remove_alone"] == {"margin": 2, "relative_margin": 1, "max_score": 3}


def test_filter_arguments_are_checked():
    with pytest.raises(ValueError, match="range_min"):
        MiningFilters(range_min=5, range_max=2).check()
    with pytest.raises(ValueError, match="relative_margin"):
        MiningFilters(relative_margin=1.5).check()


def test_sampling_top_and_random():
    docs = list(range(10))
    cands = filter_candidates(docs, [1.0 - i / 10 for i in docs], 2.0, set(), set(), [-1] * 10,
                              MiningFilters(relative_margin=None))
    assert [c.doc for c in sample_candidates(cands, 3, "top", 0, 0)] == [0, 1, 2]
    a = [c.doc for c in sample_candidates(cands, 4, "random", 0, 5)]
    assert a == [c.doc for c in sample_candidates(cands, 4, "random", 0, 5)]  # seeded
    assert a == sorted(a) and len(set(a)) == 4
    draws = {tuple(c.doc for c in sample_candidates(cands, 4, "random", s, 5)) for s in range(6)}
    assert len(draws) > 1
    assert len(sample_candidates(cands[:2], 4, "random", 0, 0)) == 2


# ---------------------------------------------------------------- mining on embeddings


def make_pairs():
    """Six groups of three documents; queries point exactly at their positive. Two rows share a
    query text (two positives of one query)."""
    pairs = []
    for g in range(6):
        for m in range(3):
            pairs.append(Pair(query=f"query {g}-{m}", positive=f"document {g}-{m}", doc_id=100 + 3 * g + m, group=g))
    pairs.append(Pair(query="query 0-0", positive="another answer to 0-0", doc_id=999, group=-1))
    return pairs


def embeddings(pairs, corpus, spread=0.2, seed=0):
    """Documents of a group lie together (so a query's own group scores highest after its
    positive); each query is its positive's vector."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(7, 16))
    d = np.stack([centers[g if g >= 0 else 6] + spread * rng.normal(size=16) for g in corpus.groups])
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    q = np.stack([d[j] for j in corpus.row_doc])
    return q.astype(np.float32), d.astype(np.float32)


@pytest.mark.parametrize("drop_group", [True, False])
def test_positive_and_group_never_mined(drop_group):
    pairs = make_pairs()
    corpus = build_corpus(pairs)
    q, d = embeddings(pairs, corpus)
    res = mine_from_embeddings(pairs, corpus, q, d, MiningFilters(relative_margin=None, range_max=10, drop_group=drop_group),
                               MiningOptions(n_negatives=4, progress=False))
    assert len(res.pairs) == len(pairs)
    by_query = {}
    for p in pairs:
        by_query.setdefault(p.query, set()).add(p.doc_id)
    saw_group = False
    for p in res.pairs:
        assert len(p.negatives) == 4
        for n in p.negatives:
            assert n.doc_id not in by_query[p.query]  # neither positive of "query 0-0"
            if n.group == p.group and p.group >= 0:
                saw_group = True
        assert p.positive_score == pytest.approx(1.0, abs=1e-5)
        assert [n.score for n in p.negatives] == sorted([n.score for n in p.negatives], reverse=True)
    # without the group rule the (closest) same-group documents are mined: the rule is what removes them
    assert saw_group == (not drop_group)


def test_large_group_is_searched_past():
    """A group bigger than the default search depth: the window is still filled from outside it."""
    pairs = [Pair(query=f"q{i}", positive=f"same group doc {i}", doc_id=i, group=1) for i in range(40)]
    pairs += [Pair(query=f"other q{i}", positive=f"other doc {i}", doc_id=1000 + i, group=-1) for i in range(10)]
    corpus = build_corpus(pairs)
    rng = np.random.default_rng(0)
    base = rng.normal(size=8)
    d = np.stack([base + (0.01 if g == 1 else 2.0) * rng.normal(size=8) for g in corpus.groups]).astype(np.float32)
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    q = np.stack([d[j] for j in corpus.row_doc])
    res = mine_from_embeddings(pairs, corpus, q, d, MiningFilters(relative_margin=None, range_max=2),
                               MiningOptions(n_negatives=3, progress=False))
    first = res.pairs[0]
    assert len(first.negatives) == 3 and all(n.group == -1 for n in first.negatives)
    assert res.stats["search_depth"]["queries_searched_deeper"] == 40


class StubEncoder(nn.Module):
    """encoder(side, kind) from a text -> vector table (what encode_texts needs)."""

    def __init__(self, table: dict[str, np.ndarray]):
        super().__init__()
        self.table = table
        self.dim = len(next(iter(table.values())))
        self.normalize = True

    def forward(self, side, kind):
        return torch.tensor(np.stack([self.table[t] for t in side["texts"]]))


def write_beir(folder: Path, pairs):
    (folder / "qrels").mkdir(parents=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for i, p in enumerate(pairs):
            f.write(json.dumps({"_id": f"d{i}", "text": p.positive}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for i, p in enumerate(pairs):
            f.write(json.dumps({"_id": f"q{i}", "text": p.query}) + "\n")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(len(pairs))))


def test_jsonl_round_trips_into_training(tmp_path):
    from moco_retrieval.data.datamodule import RetrievalDataModule

    pairs = make_pairs()[:-1]
    corpus = build_corpus(pairs)
    q, d = embeddings(pairs, corpus)
    table = {t: d[j] for j, t in enumerate(corpus.texts)}
    table.update({p.query: q[i] for i, p in enumerate(pairs)})
    res = mine_hard_negatives(StubEncoder(table), pairs, MiningFilters(relative_margin=0.05, range_max=8),
                              MiningOptions(n_negatives=2, progress=False))
    out = tmp_path / "mined.jsonl"
    assert write_mined(out, res) == len(res.pairs) == len(pairs)
    assert stats_path_for(out).name == "mined.stats.json"
    back = read_pairs_jsonl(out)
    assert back == res.pairs  # ids, groups, scores, texts survive
    raw = json.loads(out.read_text().splitlines()[0])
    assert set(raw["negatives"][0]) == {"doc_id", "text", "score", "group", "rank"} and "positive_score" in raw

    write_beir(tmp_path / "eval", pairs)
    cfg = DataConfig(kind="jsonl", train_path=str(out), eval_dir=str(tmp_path / "eval"), batch_size=4, shuffle=False)

    def tokenize(texts, kind):
        ids = torch.tensor([[len(t), 1] for t in texts])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    dm = RetrievalDataModule(cfg, tokenize=tokenize, n_negatives=2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    rows = [back[i] for i in batch["index"].tolist()]
    assert batch["neg"]["input_ids"].shape == (8, 2)
    assert batch["neg_id"].tolist() == [n.doc_id for p in rows for n in p.negatives[:2]]
    assert batch["neg_group"].tolist() == [n.group for p in rows for n in p.negatives[:2]]
    assert batch["neg"]["texts"] == [n.text for p in rows for n in p.negatives[:2]]


# ---------------------------------------------------------------- training on mined negatives


@pytest.fixture(scope="module")
def mined_dir(tmp_path_factory):
    """Mined pairs (2 negatives each) and a BEIR eval folder for them."""
    root = tmp_path_factory.mktemp("mined")
    pairs = make_pairs()[:-1]
    corpus = build_corpus(pairs)
    q, d = embeddings(pairs, corpus)
    res = mine_from_embeddings(pairs, corpus, q, d, MiningFilters(relative_margin=None, range_max=6),
                               MiningOptions(n_negatives=2, progress=False))
    write_mined(root / "mined.jsonl", res)
    write_beir(root / "eval", pairs)
    return root


@pytest.mark.parametrize("objective", ["inbatch", "moco"])
def test_training_sees_shared_hard_negatives(mined_dir, tmp_path, objective):
    """A smoke run on mined pairs: every query scores against the batch's B*n hard negatives."""
    import csv

    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.training.module import RetrievalModule
    from moco_retrieval.train import train

    B, n = 4, 2
    cfg = compose_cfg("train", [
        # the smoke preset configures a queue, which objective=inbatch has not: its pieces instead
        "model=tiny", "trainer=cpu", f"objective={objective}", "logger=csv", "data=jsonl", "optim.lr=1e-3",
        "optim.warmup_steps=2", "data.eval_batch_size=128",
        f"data.train_path={mined_dir / 'mined.jsonl'}", f"data.eval_dir={mined_dir / 'eval'}",
        f"data.n_negatives={n}", f"data.batch_size={B}", "data.max_train_examples=null",
        "data.max_eval_queries=null", "data.max_eval_docs=null", f"model.path={tmp_path / 'tiny'}",
        "trainer.max_steps=3", "trainer.log_every_n_steps=1", "trainer.val_check_interval=null",
        "trainer.enable_progress_bar=false", *(["objective.queue_size=64"] if objective == "moco" else []),
    ], to_object=True)
    assert cfg.data.n_negatives == n

    # one step by hand: the exact count of unmasked negatives
    module = RetrievalModule.from_config(cfg)
    dm = RetrievalDataModule(cfg.data, tokenize=module.encoder.tokenize, n_negatives=n)
    batch = next(iter(dm.train_dataloader()))
    assert batch["neg"]["input_ids"].shape[0] == B * n
    _, stats = module.shared_step(batch)
    masked = 0
    for i in range(B):
        same_id = batch["neg_id"] == batch["doc_id"][i]
        same_group = (batch["neg_group"] == batch["group"][i]) & (batch["group"][i] >= 0)
        masked += int((same_id | same_group).sum())
    assert float(stats["negatives_per_query"]) == pytest.approx((B - 1) + B * n - masked / B)

    # the full training job: config -> data module with n_negatives -> fit -> metrics
    metrics = train(cfg, tmp_path / "run")
    assert "val/recall@1" in metrics
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/negatives_per_query")]
    assert len(rows) == 3
    for r in rows:
        seen = float(r["train/negatives_per_query"]) + float(r["train/masked_per_query"])
        queue = float(r.get("train/queue_fill") or 0)
        assert seen == pytest.approx(B + B * n + queue)  # own positive (masked) + B-1 + B*n (+ queue)

    # and the trained checkpoint mines again (checkpoint=PATH; a MoCo checkpoint's key encoder too)
    from moco_retrieval.config import MineConfig
    from moco_retrieval.mine import run_mine

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    for encoder in ["query"] + (["key"] if objective == "moco" else []):
        mcfg = MineConfig(data=cfg.data, checkpoint=str(ckpt), encoder=encoder, output=str(tmp_path / f"again-{encoder}.jsonl"),
                          n_negatives=2, range_max=6, relative_margin=None, progress=False)
        res = run_mine(mcfg)
        assert res.stats["model"]["source"] == "checkpoint" and res.stats["model"]["encoder"] == encoder
        assert len(read_pairs_jsonl(tmp_path / f"again-{encoder}.jsonl")) == len(res.pairs) > 0


def test_mine_command_config_and_outputs(tmp_path, capsys):
    """conf/mine.yaml composed as the command does, run on a JSONL file with a tiny base encoder."""
    from moco_retrieval.data.formats import write_pairs_jsonl
    from moco_retrieval.mine import to_mine_config
    from moco_retrieval.mine import run_mine

    write_pairs_jsonl(tmp_path / "pairs.jsonl", make_pairs())
    dcfg = compose_cfg("mine", [
        "model=tiny", f"model.path={tmp_path / 'tiny'}", "data=jsonl", f"data.train_path={tmp_path / 'pairs.jsonl'}",
        f"output={tmp_path / 'out' / 'mined.jsonl'}", "n_negatives=3", "range_max=5", "relative_margin=null",
        "progress=false",
    ])
    cfg = to_mine_config(dcfg)
    assert cfg.data.eval_dir is None and cfg.relative_margin is None and cfg.drop_group
    res = run_mine(cfg)
    rows = read_pairs_jsonl(tmp_path / "out" / "mined.jsonl")
    assert len(rows) == len(res.pairs) == len(make_pairs()) and all(len(p.negatives) == 3 for p in rows)
    stats = json.loads((tmp_path / "out" / "mined.stats.json").read_text())
    assert stats["candidates"]["removed"]["positive"] > 0 and stats["model"]["source"] == "base"
    assert "removed by group" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="output"):
        to_mine_config(compose_cfg("mine", ["data=jsonl"]))
