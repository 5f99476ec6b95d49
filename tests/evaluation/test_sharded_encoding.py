"""Encoding split across ranks: each of two gloo ranks encodes its block, the blocks are gathered,
and every rank ends with what one process computes; embeddings stream into a memory-mapped file.

Validation under a real two-rank training run is checked by tests/training/test_torchrun.py (its
validation metrics equal one process's over the whole pool).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moco_retrieval.config import EvalConfig, ModelConfig
from moco_retrieval.data.collate import EvalItems
from moco_retrieval.data.formats import EvalSet
from moco_retrieval.distributed import all_gather_rows, shard_range
from moco_retrieval.evaluation.encode import embedding_file, encode_texts, encode_texts_sharded, evaluate_encoder

W = 2
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 12)))) for _ in range(n)]


def _evalset(n_docs: int = 23, n_queries: int = 9, seed: int = 1) -> EvalSet:
    docs, queries = _texts(n_docs, seed), _texts(n_queries, seed + 1)  # odd sizes: the ranks' blocks differ by one
    return EvalSet(corpus={f"d{i}": t for i, t in enumerate(docs)}, queries={f"q{i}": t for i, t in enumerate(queries)},
                   qrels={f"q{i}": {f"d{(3 * i) % n_docs}": 1} for i in range(n_queries)})


SETS = {"main": {}, "second": dict(n_docs=11, n_queries=5, seed=7)}  # validation on two sets: each split over the ranks


def _encoder(tiny_dir: str):
    from moco_retrieval.model.encoder import build_encoder

    torch.manual_seed(0)
    return build_encoder(ModelConfig(backbone="tiny", path=tiny_dir))


def _rows(rank: int, n: int) -> np.ndarray:
    return (np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 1000 * rank)


def _validate(tiny_dir: str) -> dict:
    """The module's validation pass on two evaluation sets as Lightning drives it: this rank's val
    batches of each set's loader through ``validation_step``, then the rows the epoch end scores of
    each set (gathered when the set is split)."""
    from moco_retrieval.config import DataConfig, OptimConfig
    from moco_retrieval.objectives.inbatch import InBatchConfig
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.training.module import RetrievalModule

    torch.manual_seed(0)
    module = RetrievalModule(ModelConfig(backbone="tiny", path=tiny_dir), InBatchConfig(), OptimConfig()).eval()
    dm = RetrievalDataModule.from_loaded(DataConfig(kind="jsonl", eval_batch_size=4), [],
                                         {name: _evalset(**kw) for name, kw in SETS.items()},
                                         tokenize=module.encoder.tokenize)
    module.on_validation_epoch_start()
    out = {}
    with torch.no_grad():
        for index, (name, loader) in enumerate(zip(SETS, dm.val_dataloader())):
            batches = list(loader)
            for i, batch in enumerate(batches):
                module.validation_step(batch, i, index)
            out[name] = {"shard": dm.eval_shard(index),
                         "local_docs": sum((b["ids"] for b in batches if b["kind"] == "doc"), []),
                         "doc": module._val_rows("doc", dm, index), "query": module._val_rows("query", dm, index)}
    return out


def _rank(tiny_dir, folder, rank, world):
    enc = _encoder(tiny_dir)
    texts = _texts(37, 0)
    out = {"memory": encode_texts_sharded(enc, texts, "doc", 4, False)}
    on_disk = embedding_file(os.path.join(folder, f"docs{rank}.npy"), len(texts), enc.dim)
    assert encode_texts_sharded(enc, texts, "doc", 4, False, out=on_disk) is on_disk
    on_disk.flush()
    # blocks of 5 and 0 rows, and of 5 and 3, sent 2 rows at a time
    out["empty_rank"] = all_gather_rows(_rows(rank, 5 if rank == 0 else 0), chunk_rows=2)
    out["unequal"] = all_gather_rows(_rows(rank, 5 if rank == 0 else 3), chunk_rows=2)
    res = evaluate_encoder(enc, _evalset(), EvalConfig(top_k=5), batch_size=4, show_progress=False)
    out["metrics"], out["run"] = res.metrics, res.run
    out["validation"] = _validate(tiny_dir)
    return out


def test_two_gloo_ranks_encode_half_each_and_gather_what_one_process_encodes(tiny_dir, tmp_path, one_thread):
    from tests.helpers import on_ranks

    ranks = on_ranks(_rank, (tiny_dir, str(tmp_path)), W, tmp_path, weights_only=False)
    enc = _encoder(tiny_dir)
    texts = _texts(37, 0)
    single = encode_texts(enc, texts, "doc", 4, False)
    reference = evaluate_encoder(enc, _evalset(), EvalConfig(top_k=5), batch_size=4, show_progress=False)
    for rank in range(W):
        got = ranks[rank]
        # batches pad differently across the split, so equal up to float rounding
        np.testing.assert_allclose(got["memory"], single, rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.load(tmp_path / f"docs{rank}.npy"), single, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(got["empty_rank"], _rows(0, 5))
        np.testing.assert_array_equal(got["unequal"], np.concatenate([_rows(0, 5), _rows(1, 3)]))
        assert got["metrics"] == pytest.approx(reference.metrics, abs=1e-6)
        for name, kw in SETS.items():
            val, pool = got["validation"][name], _evalset(**kw)
            a, b = shard_range(len(pool.corpus), rank, W)
            assert val["shard"] == (rank, W) and val["local_docs"] == list(pool.corpus)[a:b]
            for kind, texts in (("doc", pool.corpus), ("query", pool.queries)):
                ids, rows = val[kind]
                assert ids == list(texts)  # every rank scores the whole set, in its order
                np.testing.assert_allclose(rows, encode_texts(enc, list(texts.values()), kind, 4, False), rtol=0, atol=1e-5)
        assert {q: list(hits) for q, hits in got["run"].items()} == {q: list(hits) for q, hits in reference.run.items()}


def test_shard_blocks_cover_the_items_in_rank_order():
    for n in (0, 1, 7, 8, 9):
        for world in (1, 2, 3, 4):
            blocks = [shard_range(n, r, world) for r in range(world)]
            assert [i for a, b in blocks for i in range(a, b)] == list(range(n))
            sizes = [b - a for a, b in blocks]
            assert max(sizes) - min(sizes) <= 1


def test_eval_items_batches_are_the_ranks_blocks_of_documents_then_queries():
    items = EvalItems(_evalset())  # 23 documents (rows 0-22), 9 queries (rows 23-31)
    r0, r1 = items.batches(5, 0, 2), items.batches(5, 1, 2)
    flat0, flat1 = sum(r0, []), sum(r1, [])
    assert flat0 == list(range(0, 12)) + list(range(23, 28))
    assert flat1 == list(range(12, 23)) + list(range(28, 32))
    for batch in r0 + r1:  # one kind per batch
        assert len({items[i][0] for i in batch}) == 1
    assert sum(items.batches(5), []) == list(range(32))


def test_encoding_streams_into_a_memory_map_in_the_order_given(tiny_dir, tmp_path, one_thread):
    enc = _encoder(tiny_dir)
    texts = _texts(29, 3)
    out = embedding_file(tmp_path / "emb.npy", len(texts), enc.dim)
    got = encode_texts(enc, texts, "doc", 4, False, out=out)
    assert got is out and isinstance(got, np.memmap)
    out.flush()
    reread = np.load(tmp_path / "emb.npy", mmap_mode="r")
    np.testing.assert_allclose(reread, encode_texts(enc, texts, "doc", 4, False), rtol=0, atol=1e-6)
    # row i is text i's embedding, whatever order the batches went in (longest first)
    np.testing.assert_allclose(reread[7], encode_texts(enc, [texts[7]], "doc", 4, False)[0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="out has 3 rows for 29 texts"):
        encode_texts(enc, texts, "doc", 4, False, out=np.zeros((3, enc.dim), np.float32))
