"""The data module: loading by kind, collate layout, the batch sampler, resume, validation batches."""
import re

import pytest
import torch

from moco_retrieval.errors import ConfigError
from moco_retrieval.config import DataConfig
from moco_retrieval.data.collate import collate, select_negatives
from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.data.formats import DataError, Negative, Pair
from moco_retrieval.data.ids import doc_id_for_text, stable_id
from moco_retrieval.data.sampler import RetrievalBatchSampler
from tests.helpers import epoch_indices, fake_tokenize, make_cfg, write_eval


# ---------------------------------------------------------------------------------- batch layout


def test_batch_layout_and_padding(tmp_path):
    dm = RetrievalDataModule(make_cfg(tmp_path), tokenize=fake_tokenize)
    batch = next(iter(dm.train_dataloader()))
    B = 4
    assert set(batch) == {"query", "doc", "doc_id", "group", "index"}
    for side, L in (("query", 2), ("doc", 2)):
        assert len(batch[side]["texts"]) == B
        assert batch[side]["input_ids"].shape == (B, L) and batch[side]["attention_mask"].dtype == torch.long
    for k in ("doc_id", "group", "index"):
        assert batch[k].dtype == torch.long and batch[k].shape == (B,)
    idx = batch["index"].tolist()
    assert batch["query"]["texts"] == [f"query {i}" for i in idx]
    assert batch["doc"]["texts"] == [f"document {i}" for i in idx]
    assert batch["doc_id"].tolist() == [doc_id_for_text(f"document {i}") for i in idx]
    assert batch["group"].tolist() == [-1] * B
    # text-only batches without a tokenizer
    plain = next(iter(RetrievalDataModule(make_cfg(tmp_path)).train_dataloader()))
    assert set(plain["query"]) == {"texts"} and set(plain["doc"]) == {"texts"}


def test_dynamic_padding_and_separate_max_lengths():
    items = [(0, Pair("a b c d e f g h", "one two three four five six seven", 1)), (1, Pair("a", "one", 2))]
    b = collate(items, fake_tokenize)
    assert b["query"]["input_ids"].shape == (2, 3) and b["doc"]["input_ids"].shape == (2, 5)
    b = collate([(1, Pair("a", "one", 2))], fake_tokenize)
    assert b["query"]["input_ids"].shape == (1, 1) and b["doc"]["input_ids"].shape == (1, 1)


def test_encoder_tokenize_separate_max_lengths(tmp_path):
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.model.encoder import build_encoder

    enc = build_encoder(ModelConfig(backbone="tiny", path=str(tmp_path / "tiny"), query_max_len=6, doc_max_len=10))
    long_text = "file " * 50
    b = collate([(0, Pair(long_text, long_text, 1)), (1, Pair("file", "file", 2))], enc.tokenize)
    assert b["query"]["input_ids"].shape == (2, 6) and b["doc"]["input_ids"].shape == (2, 10)
    assert b["query"]["attention_mask"][1].tolist() == [1, 1, 1, 0, 0, 0]  # [CLS] file [SEP] + padding
    short = collate([(1, Pair("file", "file system", 2))], enc.tokenize)
    assert short["query"]["input_ids"].shape == (1, 3) and short["doc"]["input_ids"].shape == (1, 4)


# --------------------------------------------------------------------------------------- sampler


def test_seeded_and_reshuffled_per_epoch(tmp_path):
    cfg = make_cfg(tmp_path, n=40, seed=3)
    s1 = RetrievalDataModule(cfg).batch_sampler
    s2 = RetrievalDataModule(make_cfg(tmp_path, n=40, seed=3)).batch_sampler
    e0, e1 = epoch_indices(s1, 0), epoch_indices(s1, 1)
    assert e0 == epoch_indices(s2, 0) and e1 == epoch_indices(s2, 1)
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, [])) == list(range(40))
    assert epoch_indices(RetrievalDataModule(make_cfg(tmp_path, n=40, seed=4)).batch_sampler, 0) != e0
    noshuffle = RetrievalDataModule(make_cfg(tmp_path, n=40, shuffle=False)).batch_sampler
    assert epoch_indices(noshuffle, 0) == [list(range(s, s + 4)) for s in range(0, 40, 4)]
    # the DataLoader follows the sampler
    dm = RetrievalDataModule(cfg)
    dm.batch_sampler.set_epoch(1)
    assert [b["index"].tolist() for b in dm.train_dataloader()] == e1


def _conflicts(batch, ids, groups):
    bi = [ids[i] for i in batch]
    bg = [groups[i] for i in batch if groups[i] != -1]
    return len(set(bi)) < len(bi) or len(set(bg)) < len(bg)


def test_unique_in_batch(tmp_path):
    dm = RetrievalDataModule(make_cfg(tmp_path, n=60, repeat_ids=True, batch_size=5))
    ids = [p.doc_id for p in dm.train_pairs]
    groups = [p.group for p in dm.train_pairs]
    assert len(set(ids)) == 7 and len(set(groups) - {-1}) == 5
    s = dm.batch_sampler
    for epoch in range(3):
        batches = epoch_indices(s, epoch)
        assert len(batches) >= 5 and all(len(b) == 5 for b in batches)
        assert not any(_conflicts(b, ids, groups) for b in batches)
        flat = sum(batches, [])
        assert len(flat) == len(set(flat))  # deferral never repeats a row
    assert epoch_indices(s, 1) == epoch_indices(RetrievalDataModule(make_cfg(tmp_path, n=60, repeat_ids=True, batch_size=5)).batch_sampler, 1)
    # the same data without the rule has conflicts (so the check above can fail)
    free = RetrievalBatchSampler(ids, groups, 5, unique_in_batch=False, rank=0, world_size=1)
    assert any(_conflicts(b, ids, groups) for b in epoch_indices(free, 0))


def test_too_few_distinct_ids_for_a_batch_is_said_when_the_sampler_is_made(tmp_path):
    # 7 doc ids, a batch of 8 (4 x 2 ranks) with distinct ones: none; said before any step
    dm = RetrievalDataModule(make_cfg(tmp_path, n=60, repeat_ids=True, batch_size=4), rank=0, world_size=2)
    with pytest.raises(DataError, match=r"data: 60 training pairs: no batch of 8 rows with distinct doc ids and groups"):
        dm.batch_sampler


def test_rank_shards_disjoint_same_count(tmp_path):
    cfg = make_cfg(tmp_path, n=50, repeat_ids=True, batch_size=3)
    shards = [RetrievalDataModule(cfg, rank=r, world_size=2).batch_sampler for r in (0, 1)]
    ids = [p.doc_id for p in RetrievalDataModule(cfg).train_pairs]
    groups = [p.group for p in RetrievalDataModule(cfg).train_pairs]
    for epoch in (0, 1):
        b0, b1 = epoch_indices(shards[0], epoch), epoch_indices(shards[1], epoch)
        assert len(b0) == len(b1) == len(shards[0]) == len(shards[1]) > 0
        assert not set(sum(b0, [])) & set(sum(b1, []))
        # a step's two shards together are duplicate-free (the rule holds for the global batch)
        assert not any(_conflicts(x + y, ids, groups) for x, y in zip(b0, b1))
    # without the rule: 50 rows, global batch 6 -> 8 batches per rank, tail of 2 dropped
    plain = [RetrievalBatchSampler(ids, groups, 3, unique_in_batch=False, rank=r, world_size=2) for r in (0, 1)]
    a, b = epoch_indices(plain[0], 0), epoch_indices(plain[1], 0)
    assert len(a) == len(b) == 8 and len(set(sum(a, []) + sum(b, []))) == 48


def test_resume_mid_epoch_sampler(tmp_path):
    cfg = make_cfg(tmp_path, n=60, repeat_ids=True, batch_size=4)
    dm = RetrievalDataModule(cfg)
    dm.batch_sampler.set_epoch(2)
    full = [b["index"].tolist() for b in dm.train_dataloader()]
    # a hand-written loop: train 5 batches, checkpoint, stop
    dm = RetrievalDataModule(cfg)
    dm.batch_sampler.set_epoch(2)
    it = iter(dm.train_dataloader())
    seen = []
    for _ in range(5):
        seen.append(next(it)["index"].tolist())
        dm.on_train_batch_end()
    state = dm.state_dict()
    assert state == {"epoch": 2, "batches_done": 5}
    # resume: a new module loads the state before its loader exists
    dm2 = RetrievalDataModule(cfg)
    dm2.load_state_dict(state)
    rest = [b["index"].tolist() for b in dm2.train_dataloader()]
    assert seen + rest == full and len(dm2.train_dataloader()) == len(full)
    # the next epoch starts at its beginning
    dm2.batch_sampler.set_epoch(3)
    assert len([b for b in dm2.train_dataloader()]) == len(dm2.batch_sampler)


def test_resume_mid_epoch_under_lightning(tmp_path):
    """A real fit stopped by max_steps, resumed from its last checkpoint: every batch exactly once."""
    from tests.helpers import fit_recording_batches

    def fit(root, max_steps=-1, ckpt=None):
        with _no_resume_warning():
            return fit_recording_batches(RetrievalDataModule(cfg), root, max_steps, ckpt)

    cfg = make_cfg(tmp_path, n=30, repeat_ids=True, batch_size=4)
    full = fit(tmp_path / "full")
    per_epoch = len(RetrievalDataModule(cfg).batch_sampler)
    assert len(full) >= 2 * per_epoch - 1 and {e for e, _ in full} == {0, 1}
    for k in (2, per_epoch + 1):  # stop mid-epoch 0, and mid-epoch 1
        root = tmp_path / f"cut{k}"
        first = fit(root, max_steps=k)
        second = fit(root, ckpt=str(root / "ck" / "last.ckpt"))
        assert first + second == full, k


class _no_resume_warning:
    """Fail if Lightning warns that the dataloader is not resumable."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._rec = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        msgs = [str(w.message) for w in self._rec]
        assert not any("not resumable" in m for m in msgs), msgs
        return False


# -------------------------------------------------------------------------------- hard negatives


def test_hard_negatives_layout(tmp_path):
    def negs(i):
        return [f"neg {i}.{j}" for j in range(i % 4)] if i % 4 else [{"text": f"neg {i}.x", "doc_id": f"N{i}", "group": "ng"}]

    cfg = make_cfg(tmp_path, n=16, negatives=negs, shuffle=False)
    dm = RetrievalDataModule(cfg, tokenize=fake_tokenize, n_negatives=3)
    batch = next(iter(dm.train_dataloader()))
    assert batch["index"].tolist() == [0, 1, 2, 3]
    assert batch["neg"]["input_ids"].shape[0] == 12 and len(batch["neg"]["texts"]) == 12
    assert batch["neg_id"].shape == batch["neg_group"].shape == (12,)
    texts = batch["neg"]["texts"]
    # row-major: row 0 holds its one negative three times, row 3 its first three of three
    assert texts[0:3] == ["neg 0.x"] * 3 and batch["neg_id"][0:3].tolist() == [stable_id("N0")] * 3
    assert batch["neg_group"][0:3].tolist() == [stable_id("ng")] * 3 and batch["neg_group"][3:].tolist() == [-1] * 9
    assert texts[3] == "neg 1.0" and texts[3:6] == ["neg 1.0"] * 3
    assert texts[6:8] == ["neg 2.0", "neg 2.1"] and texts[8] in ("neg 2.0", "neg 2.1")
    assert texts[9:12] == ["neg 3.0", "neg 3.1", "neg 3.2"]
    assert batch["neg_id"][9:12].tolist() == [doc_id_for_text(t) for t in texts[9:12]]


PADDING_TEXTS = ["a", "b", "c"]
PADDING_CASES = [(seed, index) for seed in (0, 1, 12345) for index in (0, 7, 8, 999_983)]


def padding_reference() -> list[list[str]]:
    """A row of 3 negatives padded to 9, for each (seed, row index) of PADDING_CASES, written from
    select_negatives' rule: its own negatives in order, then 6 drawn with replacement by numpy's
    generator seeded by (seed, row index)."""
    import numpy as np

    return [PADDING_TEXTS + [PADDING_TEXTS[j] for j in np.random.default_rng([seed, index]).integers(0, 3, size=6)]
            for seed, index in PADDING_CASES]


def test_padding_negatives_is_the_seeded_draw_of_the_row():
    """The padding is the reference's, whatever else has drawn random numbers before: the same
    wherever the row is collated (a rank, a loader worker, a resumed run)."""
    import numpy as np

    pair = Pair("q", "d", 1, negatives=[Negative(i + 1, t) for i, t in enumerate(PADDING_TEXTS)])
    want = padding_reference()
    assert len({tuple(w) for w in want}) == len(PADDING_CASES)  # each (seed, row) draws its own padding
    np.random.seed(99)  # the global generators play no part
    torch.manual_seed(99)
    assert [[n.text for n in select_negatives(pair, index, 9, seed)] for seed, index in PADDING_CASES] == want
    assert [n.text for n in select_negatives(pair, 7, 2, seed=0)] == ["a", "b"]  # enough: the first n, no draw


# The padding drawn in a fresh interpreter whose global generators and string hash are set apart
# from the test process's, as another DDP rank's, a loader worker's or a resumed run's are.
PADDING_IN_A_PROCESS = """
import json, random, sys
import numpy as np
import torch
from moco_retrieval.data.collate import select_negatives
from moco_retrieval.data.formats import Negative, Pair

salt = int(sys.argv[1])
random.seed(salt)
np.random.seed(salt)
torch.manual_seed(salt)
pair = Pair("q", "d", 1, negatives=[Negative(i + 1, t) for i, t in enumerate(json.loads(sys.argv[2]))])
print(json.dumps([[n.text for n in select_negatives(pair, index, 9, seed)] for seed, index in json.loads(sys.argv[3])]))
"""


@pytest.mark.slow  # an interpreter with torch starting (~3 s on a busy machine)
def test_padding_negatives_is_the_same_in_another_interpreter():
    """Another interpreter, its string hash and global generators set apart, pads as the reference does."""
    import json
    import os
    import subprocess
    import sys

    other = subprocess.run([sys.executable, "-c", PADDING_IN_A_PROCESS, "1", json.dumps(PADDING_TEXTS),
                            json.dumps(PADDING_CASES)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": "1", "OMP_NUM_THREADS": "1"})
    assert other.returncode == 0, other.stderr[-2000:]
    assert json.loads(other.stdout) == padding_reference()


def test_row_without_negatives_is_named(tmp_path):
    cfg = make_cfg(tmp_path, n=6, negatives=lambda i: [] if i == 4 else [f"n{i}"])
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'train.jsonl'}:5: training example 4, query_id 'q4'")):
        RetrievalDataModule(cfg, n_negatives=2).setup("fit")
    with pytest.raises(DataError, match="training example 9 .* has no negatives"):
        collate([(9, Pair("q", "d", 1))], n_negatives=2)


# --------------------------------------------------------------------------------- loading, errors


def test_missing_config_paths_are_named(tmp_path):
    with pytest.raises(DataError, match=re.escape("data.train_path is required with data=jsonl")):
        RetrievalDataModule(DataConfig(kind="jsonl")).setup()
    with pytest.raises(DataError, match=re.escape("data.eval_dir is required with data=jsonl")):
        RetrievalDataModule(DataConfig(kind="jsonl", train_path=str(make_cfg(tmp_path).train_path))).setup()
    with pytest.raises(DataError, match=re.escape(f"data.train_path={tmp_path / 'x.jsonl'}: no such file")):
        RetrievalDataModule(DataConfig(kind="jsonl", train_path=str(tmp_path / "x.jsonl"), eval_dir=str(tmp_path))).setup()
    with pytest.raises(DataError, match=re.escape("data.dir is required with data=beir")):
        RetrievalDataModule(DataConfig(kind="beir")).setup()
    with pytest.raises(ConfigError, match="data.kind='xml': expected one of debian, jsonl"):  # the schema's
        DataConfig(kind="xml")


def test_bad_training_line_stops_setup(tmp_path):
    cfg = make_cfg(tmp_path, n=3)
    with open(cfg.train_path, "a") as fh:
        fh.write('{"query": "q"}\n')
    with pytest.raises(DataError, match=re.escape(f"{cfg.train_path}:4: missing field 'positive'")):
        RetrievalDataModule(cfg).setup("fit")


def test_kind_beir(tmp_path):
    d = write_eval(tmp_path / "b", n_docs=12, n_queries=6)
    (d / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i + 6}\t1\n" for i in range(6)))
    dm = RetrievalDataModule(DataConfig(kind="beir", dir=str(d), batch_size=2))
    assert [p.doc_id for p in dm.train_pairs] == [stable_id(f"d{i + 6}") for i in range(6)]
    assert [p.group for p in dm.train_pairs] == [stable_id(f"g{(i + 6) % 4}") for i in range(6)]
    assert dm.eval_set.qrels["q0"] == {"d0": 1, "d11": 1}


def test_caps_are_deterministic_and_keep_relevant_docs(tmp_path):
    cfg = make_cfg(tmp_path, n=40, max_train_examples=10, max_eval_queries=3, max_eval_docs=5)
    a, b = RetrievalDataModule(cfg), RetrievalDataModule(cfg)
    assert [p.query for p in a.train_pairs] == [p.query for p in b.train_pairs] and len(a.train_pairs) == 10
    ev = a.eval_set
    assert ev == b.eval_set and len(ev.queries) == 3 and len(ev.corpus) == 5
    relevant = {d for q in ev.queries for d in ev.qrels[q]}
    assert relevant <= set(ev.corpus) and set(ev.qrels) == set(ev.queries)
    assert set(ev.doc_groups) == set(ev.corpus)
    # fewer slots than relevant documents: all relevant are kept anyway
    tight = RetrievalDataModule(make_cfg(tmp_path, n=40, max_eval_queries=6, max_eval_docs=2)).eval_set
    assert set(tight.corpus) == {f"d{i}" for i in range(6)} | {"d11"}


# -------------------------------------------------------------------------------------- validation


def test_val_dataloader_whole_pool_docs_first(tmp_path):
    cfg = make_cfg(tmp_path)
    # rank 1 of 2 given to the constructor, no process group: still the whole pool (validation splits
    # only over a real process group, which also gathers: tests/evaluation/test_sharded_encoding.py)
    dm = RetrievalDataModule(cfg, tokenize=fake_tokenize, rank=1, world_size=2)
    batches = list(dm.val_dataloader())
    kinds = [b["kind"] for b in batches]
    assert kinds == ["doc"] * 3 + ["query"] * 2  # 12 docs, 6 queries, eval_batch_size 5
    assert sum((b["ids"] for b in batches if b["kind"] == "doc"), []) == [f"d{i}" for i in range(12)]
    assert sum((b["ids"] for b in batches if b["kind"] == "query"), []) == [f"q{i}" for i in range(6)]
    d0 = batches[0]
    assert d0["texts"] == [f"eval document {i}" for i in range(5)]
    assert d0["input_ids"].shape == (5, 3) and "attention_mask" in d0
    assert batches[3]["input_ids"].shape == (5, 3)
    plain = next(iter(RetrievalDataModule(cfg).val_dataloader()))
    assert set(plain) == {"kind", "ids", "texts"}
