"""Loading by data kind (moco_retrieval.data.sources) and the data module built from loaded data."""
import re
from pathlib import Path

import pytest

from moco_retrieval.errors import ConfigError
from moco_retrieval.config import DataConfig
from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.data.formats import DataError
from moco_retrieval.data.sources import (
    cap_eval_set,
    load,
    load_documents,
    load_eval_pool,
    load_training_pairs,
    subset,
)
from tests.helpers import epoch_indices, fake_tokenize, make_cfg, write_eval


def test_caps_and_order_are_pinned_for_a_fixed_seed(tmp_path):
    """The same rows, queries and documents as before the move to sources (seed 3)."""
    assert subset(40, 10, [3, 1]) == [2, 5, 8, 10, 11, 12, 13, 17, 18, 27]
    assert subset(40, 40, [3, 1]) is None and subset(40, None, [3, 1]) is None
    with pytest.raises(DataError, match="caps must be >= 1"):
        subset(40, 0, [3, 1])
    cfg = make_cfg(tmp_path, n=40, max_train_examples=10, max_eval_queries=3, max_eval_docs=5, seed=3)
    train = load_training_pairs(cfg)
    assert [p.query_id for p in train.pairs] == ["q2", "q5", "q8", "q10", "q11", "q12", "q13", "q17", "q18", "q27"]
    assert train.where == [f"{cfg.train_path}:{i + 1}" for i in (2, 5, 8, 10, 11, 12, 13, 17, 18, 27)]
    pool = load_eval_pool(cfg)
    ev = pool.eval_set
    assert list(ev.queries) == ["q0", "q1", "q4"]
    assert list(ev.corpus) == ["d0", "d1", "d3", "d4", "d11"]
    assert ev.qrels == {"q0": {"d0": 1, "d11": 1}, "q1": {"d1": 1}, "q4": {"d4": 1}}
    assert pool.description == {
        "kind": "jsonl", "dir": str(tmp_path / "eval"), "split": "test", "queries": 3, "documents": 5, "judgments": 4,
        "capped_from": {"queries": 6, "documents": 12},
    }
    # the data module, mining and evaluate read the same through sources
    dm = RetrievalDataModule(cfg)
    assert dm.train_pairs == train.pairs and dm.eval_set == ev
    from moco_retrieval.evaluate import load_eval_sets
    from moco_retrieval.mine import load_training_pairs as mining_pairs

    assert mining_pairs(cfg) == train.pairs
    assert load_eval_sets(cfg) == {"eval": (ev, pool.description)}
    # capping an uncapped pool the same way gives the same pool
    full = load_eval_pool(make_cfg(tmp_path, n=40, seed=3)).eval_set
    assert cap_eval_set(full, 3, 5, seed=3) == ev and "capped_from" not in load_eval_pool(make_cfg(tmp_path)).description


def test_each_side_reads_only_its_files(tmp_path):
    cfg = make_cfg(tmp_path, n=8)
    (tmp_path / "bad.jsonl").write_text("not json\n")
    eval_only = DataConfig(kind="jsonl", train_path=str(tmp_path / "bad.jsonl"), eval_dir=cfg.eval_dir)
    assert len(load_eval_pool(eval_only).eval_set.queries) == 6  # the broken training file is never read
    assert len(load_eval_pool(DataConfig(kind="jsonl", eval_dir=cfg.eval_dir)).eval_set.corpus) == 12
    assert len(load_training_pairs(DataConfig(kind="jsonl", train_path=cfg.train_path))) == 8  # no eval_dir needed
    with pytest.raises(DataError, match=re.escape("data.eval_dir is required with data=jsonl")):
        load_eval_pool(DataConfig(kind="jsonl", train_path=cfg.train_path))
    with pytest.raises(DataError, match=re.escape(f"data.eval_dir={tmp_path / 'nope'}: no such directory")):
        load_eval_pool(DataConfig(kind="jsonl", eval_dir=str(tmp_path / "nope")))
    with pytest.raises(DataError, match=re.escape("data.dir is required with data=beir")):
        load_eval_pool(DataConfig(kind="beir"))
    with pytest.raises(ConfigError, match="data.kind='xml': expected one of debian, jsonl, parquet, csv, hf, beir, documents"):
        DataConfig(kind="xml")
    # both sides: every required path is checked before any file is read
    with pytest.raises(DataError, match=re.escape("data.eval_dir is required with data=jsonl")):
        load(DataConfig(kind="jsonl", train_path=str(tmp_path / "bad.jsonl")))


def test_beir_sides_and_locations(tmp_path):
    d = write_eval(tmp_path / "b", n_docs=12, n_queries=6)
    (d / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i + 6}\t1\n" for i in range(6)))
    cfg = DataConfig(kind="beir", dir=str(d), max_train_examples=4)
    train, pool = load(cfg)
    assert train.pairs == load_training_pairs(cfg).pairs and len(train) == 4
    assert train.where[0] == f"{d / 'qrels' / 'train.tsv'} (query {train.pairs[0].query_id!r})"
    assert pool.eval_set == load_eval_pool(cfg).eval_set and pool.description["split"] == "test"


def test_load_documents(tmp_path):
    cfg = make_cfg(tmp_path, n=5)
    docs, desc = load_documents(cfg)
    assert [docs[f"q{i}"] for i in range(5)] == [f"document {i}" for i in range(5)]  # training positives, by query id
    assert docs["d3"] == "eval document 3" and len(docs) == 5 + 12 and desc == "data.train_path + data.eval_dir"
    only_eval, _ = load_documents(DataConfig(kind="jsonl", eval_dir=cfg.eval_dir))
    assert len(only_eval) == 12
    with pytest.raises(DataError, match="data=jsonl: set data.train_path and/or data.eval_dir"):
        load_documents(DataConfig(kind="jsonl"))
    beir, where = load_documents(DataConfig(kind="beir", dir=cfg.eval_dir))
    assert len(beir) == 12 and where == str(Path(cfg.eval_dir) / "corpus.jsonl")
    from moco_retrieval.search import load_corpus

    got, got_desc = load_corpus(None, cfg)
    assert (got.to_dict(), got_desc) == (docs, desc) and load_corpus(cfg.eval_dir, cfg)[0].to_dict() == only_eval


def test_datamodule_from_loaded_data_yields_the_same_batches(tmp_path):
    cfg = make_cfg(tmp_path, n=40, repeat_ids=True, negatives=lambda i: [f"neg {i}"], batch_size=4,
                   max_train_examples=30, max_eval_queries=4, seed=5)
    loaded = RetrievalDataModule(cfg, tokenize=fake_tokenize, n_negatives=2)
    train, pool = load(cfg)
    given = RetrievalDataModule.from_loaded(cfg, train.pairs, pool.eval_set, tokenize=fake_tokenize, n_negatives=2)
    assert given.train_pairs is not loaded.train_pairs and given.train_pairs == loaded.train_pairs
    for epoch in (0, 1):
        for dm in (loaded, given):
            dm.batch_sampler.set_epoch(epoch)
        a, b = list(loaded.train_dataloader()), list(given.train_dataloader())
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            assert x["index"].tolist() == y["index"].tolist() and x["neg"]["texts"] == y["neg"]["texts"]
            assert x["query"]["input_ids"].equal(y["query"]["input_ids"]) and x["doc_id"].equal(y["doc_id"])
    assert [v["ids"] for v in loaded.val_dataloader()] == [v["ids"] for v in given.val_dataloader()]
    assert epoch_indices(given.batch_sampler, 2) == epoch_indices(loaded.batch_sampler, 2)


def test_from_loaded_reads_and_builds_nothing(tmp_path):
    cfg = make_cfg(tmp_path, n=12)
    train, pool = load(cfg)
    nowhere = DataConfig(kind="debian", debian_dir=str(tmp_path / "no-apt-lists"), batch_size=4)
    dm = RetrievalDataModule.from_loaded(nowhere, train.pairs, pool.eval_set)
    dm.prepare_data()  # would fail building the Debian set from a folder that does not exist
    dm.setup("fit")
    assert len(dm.batch_sampler) == 3 and dm.eval_set is pool.eval_set
    with pytest.raises(DataError, match="cannot build the Debian data set"):
        RetrievalDataModule(nowhere).prepare_data()
    # the negatives check names the row by its given source location
    with pytest.raises(DataError, match=re.escape(f"{cfg.train_path}:1: training example 0")):
        RetrievalDataModule.from_loaded(cfg, train.pairs, pool.eval_set, n_negatives=1, where=train.where)
    with pytest.raises(ValueError, match="2 source locations for 12 training pairs"):
        RetrievalDataModule.from_loaded(cfg, train.pairs, pool.eval_set, where=train.where[:2])
