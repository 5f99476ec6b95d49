"""The converted store (moco_retrieval.data.convert / store): the same batches, ids, groups and masks as
the in-memory loader; converted once per content; located errors as today; rank 0 converts; data=hf."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from moco_retrieval.config import ColumnsConfig, DataConfig
from moco_retrieval.data import convert, writer
from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.data.formats import DataError, read_pairs_jsonl
from moco_retrieval.data.sources import load, load_training_pairs, pair_spec, prepare_store, store_root
from moco_retrieval.objectives.infonce import false_negative_pairs
from tests.helpers import PAIR_ROWS, compose_cfg, fake_tokenize, write_csv, write_eval, write_jsonl, write_parquet


def rich_rows(n):
    """Pairs with every field: given and derived ids, groups, query ids, scores, 1-4 negatives."""
    rows = []
    for i in range(n):
        r = {"query": f"query {i}", "positive": f"document {i % 23}", "query_id": f"q{i}"}
        if i % 3 == 0:
            r["doc_id"] = f"doc{i % 23}"
        if i % 2:
            r["group"] = f"grp{i % 5}"
        r["negatives"] = [f"neg {i}.{j}" for j in range(i % 4)] + [
            {"text": f"hard {i}", "doc_id": f"H{i % 9}", "group": "hg", "score": i / 7}]
        if i % 4:
            r["positive_score"] = i / 3
        rows.append(r)
    return rows


def cfg_for(tmp_path, rows, **kw):
    write_jsonl(tmp_path / "train.jsonl", rows)
    if not (tmp_path / "eval").exists():
        write_eval(tmp_path / "eval")
    args = dict(kind="jsonl", train_path=str(tmp_path / "train.jsonl"), eval_dir=str(tmp_path / "eval"), batch_size=4,
                cache_dir=str(tmp_path / "cache"))
    args.update(kw)
    return DataConfig(**args)


def epoch_batches(dm, epoch):
    dm.batch_sampler.set_epoch(epoch)
    return list(dm.train_dataloader())


def same_batch(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert a[k].keys() == b[k].keys()
            for kk in a[k]:
                assert (a[k][kk] == b[k][kk]) if kk == "texts" else torch.equal(a[k][kk], b[k][kk]), (k, kk)
        else:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("cap", [None, 37])
def test_store_gives_the_in_memory_loaders_batches_ids_groups_and_masks(tmp_path, cap):
    cfg = cfg_for(tmp_path, rich_rows(90), max_train_examples=cap, seed=2)
    store = RetrievalDataModule(cfg, tokenize=fake_tokenize, n_negatives=3)
    train, pool = load(cfg)  # today's loader: every pair a Python object
    memory = RetrievalDataModule.from_loaded(cfg, train.pairs, pool.eval_set, fake_tokenize, 3, where=train.where)
    assert store.train_pairs == train.pairs and store.store_dir is not None
    assert store.train_rows.doc_ids.tolist() == [p.doc_id for p in train.pairs]
    assert store.train_rows.groups.tolist() == [p.group for p in train.pairs]
    assert [store.train_rows.where(i) for i in range(len(train))] == train.where
    for epoch in (0, 1):
        a, b = epoch_batches(store, epoch), epoch_batches(memory, epoch)
        assert len(a) == len(b) > 3
        for x, y in zip(a, b):
            same_batch(x, y)
            got = false_negative_pairs(x["doc_id"], x["group"], torch.cat([x["doc_id"], x["neg_id"]]),
                                       torch.cat([x["group"], x["neg_group"]]))
            want = false_negative_pairs(y["doc_id"], y["group"], torch.cat([y["doc_id"], y["neg_id"]]),
                                        torch.cat([y["group"], y["neg_group"]]))
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    # the store's numbers are memory-mapped arrays, not Python objects
    assert isinstance(store.train_rows.source.array("doc_id"), np.memmap)


def test_store_matches_the_debian_set(debian_dir, tmp_path, monkeypatch):
    """Parity on the real set (skipped when ../shared/data is absent)."""
    cfg = DataConfig(kind="debian", debian_dir=str(debian_dir), cache_dir=str(tmp_path / "cache"), batch_size=64)
    dm = RetrievalDataModule(cfg)
    dm.setup("fit")
    pairs = read_pairs_jsonl(dm.data_dir / "train.jsonl")
    rows = dm.train_rows
    assert len(rows) == len(pairs) > 10_000
    assert rows.doc_ids.tolist() == [p.doc_id for p in pairs] and rows.groups.tolist() == [p.group for p in pairs]
    memory = RetrievalDataModule.from_loaded(cfg, pairs, dm.eval_set)
    a, b = epoch_batches(dm, 0), epoch_batches(memory, 0)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        same_batch(x, y)


def test_converted_once_per_content(tmp_path, monkeypatch):
    cfg = cfg_for(tmp_path, rich_rows(20))
    first = prepare_store(cfg)
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["rows"] == 20 and manifest["location"] == "{file}:{line}"
    assert sorted(p.name for p in first.iterdir()) == sorted(
        ["pairs.arrow", "manifest.json"] + [f"{k}.npy" for k in ("doc_id", "group", "n_neg", "scored", "file", "line", "offsets")])

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    real_write = convert.write_store
    monkeypatch.setattr(convert, "write_store", no_conversion)
    assert prepare_store(cfg) == first  # unchanged: opened, not converted
    assert len(RetrievalDataModule(cfg).train_rows) == 20
    # unchanged content under a new mtime: the content hash is computed again and finds the same store
    Path(cfg.train_path).touch()
    assert prepare_store(cfg) == first
    # a changed file is converted again, into its own store
    write_jsonl(Path(cfg.train_path), rich_rows(21))
    with pytest.raises(AssertionError, match="converted again"):
        prepare_store(cfg)
    monkeypatch.setattr(convert, "write_store", real_write)
    second = prepare_store(cfg)
    assert second != first and len(RetrievalDataModule(cfg).train_rows) == 21
    # other columns or options are other stores too (the same file read differently)
    assert pair_spec(cfg).options == {"kind": "jsonl"}


def test_failed_conversion_leaves_nothing(tmp_path):
    rows = rich_rows(30)
    rows[17]["negatives"] = [""]
    cfg = cfg_for(tmp_path, rows)
    with pytest.raises(DataError, match=re.escape(f"{cfg.train_path}:18: negatives[0] is an empty string")):
        RetrievalDataModule(cfg).setup("fit")
    root = store_root(cfg)
    assert [p.name for p in root.iterdir() if p.is_dir()] == ["fingerprints"]  # no store, no temporary folder


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_tabular_errors_come_out_as_today(tmp_path, fmt):
    bad = [dict(PAIR_ROWS[1]), dict(PAIR_ROWS[1], query="  "), dict(PAIR_ROWS[1])]
    path = (write_csv if fmt == "csv" else write_parquet)(tmp_path / f"p.{fmt}", bad, {"query": "title"})
    write_eval(tmp_path / "eval")
    cfg = DataConfig(kind=fmt, train_path=str(path), eval_dir=str(tmp_path / "eval"), columns=ColumnsConfig(query="title"),
                     cache_dir=str(tmp_path / "cache"))
    row = 3 if fmt == "csv" else 2
    with pytest.raises(DataError, match=re.escape(f"{path}: row {row}, column 'title': field 'query' is empty")):
        RetrievalDataModule(cfg).setup("fit")


def test_tabular_store_keeps_rows_and_locations(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", PAIR_ROWS * 3)
    write_eval(tmp_path / "eval")
    cfg = DataConfig(kind="parquet", train_path=str(path), eval_dir=str(tmp_path / "eval"), cache_dir=str(tmp_path / "c"))
    dm = RetrievalDataModule(cfg)
    want = load_training_pairs(cfg)
    assert dm.train_pairs == want.pairs
    assert [dm.train_rows.where(i) for i in range(6)] == want.where == [f"{path}: row {r}" for r in range(1, 7)]


# ------------------------------------------------------------------------------ rank 0 converts


def _convert_on_rank(cfg, rank, world):
    import torch.distributed as dist

    calls = []
    real = convert.write_store

    def counted(spec, folder):
        calls.append(rank)
        return real(spec, folder)

    convert.write_store = counted
    dist.barrier()  # both ranks ask at the same time
    dm = RetrievalDataModule(cfg)
    dm.setup("fit")
    return {"converted": len(calls), "store": str(dm.store_dir), "ids": dm.train_rows.doc_ids.tolist()}


def test_one_process_converts_the_others_open_it(tmp_path):
    from tests.helpers import on_ranks

    cfg = cfg_for(tmp_path, rich_rows(3000))
    out = on_ranks(_convert_on_rank, (cfg,), 2, tmp_path)
    assert sum(o["converted"] for o in out) == 1
    assert out[0]["store"] == out[1]["store"] and out[0]["ids"] == out[1]["ids"]
    assert len(out[0]["ids"]) == 3000


# ------------------------------------------------------------------------------------------ hf


ST_ROWS = {"anchor": ["resize images", "play chess", "edit video"],
           "positive": ["ImageMagick edits images.", "GNOME chess.", "Kdenlive edits video."],
           "negative_2": ["Inkscape draws.", "Xboard plays.", "Audacity edits audio."],
           "negative_1": ["GIMP paints.", "Stockfish thinks.", "VLC plays video."]}


def expected_st_pairs(tmp_path):
    rows = [{"query": q, "positive": p, "negatives": [n1, n2]} for q, p, n1, n2 in
            zip(ST_ROWS["anchor"], ST_ROWS["positive"], ST_ROWS["negative_1"], ST_ROWS["negative_2"])]
    return read_pairs_jsonl(write_jsonl(tmp_path / "expected.jsonl", rows))


def hf_cfg(tmp_path, path, **kw):
    if not (tmp_path / "eval").exists():
        write_eval(tmp_path / "eval")
    return DataConfig(kind="hf", path=str(path), eval_dir=str(tmp_path / "eval"), cache_dir=str(tmp_path / "cache"),
                      batch_size=2, **kw)


def test_hf_save_to_disk_with_sentence_transformers_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(ST_ROWS).save_to_disk(str(tmp_path / "ds"))
    dm = RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "ds"), n_negatives=2)
    assert dm.train_pairs == expected_st_pairs(tmp_path)  # negative_1 before negative_2, anchor as the query
    assert dm.train_rows.where(1) == f"{tmp_path / 'ds'}: row 2"
    # a DatasetDict: data.split picks the split, a missing one is named with those there
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(ST_ROWS)}).save_to_disk(str(tmp_path / "dd"))
    assert RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "dd")).train_pairs == expected_st_pairs(tmp_path)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'dd'}: no split 'dev' (data.split); the folder's splits: train")):
        RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "dd", split="dev")).setup()


def test_hf_errors_name_folder_row_and_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    bad = dict(ST_ROWS, anchor=["ok", " ", "ok"])
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(bad)}).save_to_disk(str(tmp_path / "dd"))
    where = f"{tmp_path / 'dd'} (split 'train')"
    with pytest.raises(DataError, match=re.escape(f"{where}: row 2, column 'anchor': field 'query' is empty")):
        RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "dd")).setup()
    datasets.Dataset.from_dict({"title": ["a"], "body": ["b"]}).save_to_disk(str(tmp_path / "other"))
    with pytest.raises(DataError, match=re.escape("no column 'query' (data.columns.query")):
        RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "other")).setup()
    cols = ColumnsConfig(query="title", positive="body")
    assert RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "other", columns=cols)).train_pairs[0].positive == "b"
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no dataset_dict.json / dataset_info.json and no \\*.parquet"):
        RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "empty")).setup()
    with pytest.raises(DataError, match=re.escape("data.path is required with data=hf")):
        RetrievalDataModule(DataConfig(kind="hf", eval_dir=str(tmp_path / "eval"))).setup()


def write_shards(folder: Path, n_shards=2, rows_per_shard=40):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for s in range(n_shards):
        idx = range(s * rows_per_shard, (s + 1) * rows_per_shard)
        pq.write_table(pa.table({"query": [f"shard query {i}" for i in idx], "positive": [f"shard doc {i}" for i in idx]}),
                       folder / f"train-{s:05d}-of-{n_shards:05d}.parquet")
    return folder


def test_hf_parquet_shards(tmp_path):
    folder = write_shards(tmp_path / "shards" / "train")  # DIR/<split>/*.parquet
    dm = RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "shards"))
    assert [p.query for p in dm.train_pairs] == [f"shard query {i}" for i in range(80)]
    assert dm.train_rows.where(41) == f"{folder / 'train-00001-of-00002.parquet'}: row 2"  # rows per shard


@pytest.mark.parametrize("layout", ["save_to_disk", "parquet_shards"])
def test_hf_folder_trains(tmp_path, layout, one_thread):
    datasets = pytest.importorskip("datasets")
    from omegaconf import OmegaConf

    from moco_retrieval.train import train

    if layout == "save_to_disk":
        n = 48
        datasets.Dataset.from_dict({"anchor": [f"q {i} {'x' * (i % 5)}" for i in range(n)],
                                    "positive": [f"doc {i} words" for i in range(n)]}).save_to_disk(str(tmp_path / "ds"))
    else:
        write_shards(tmp_path / "ds", 2, 24)
    write_eval(tmp_path / "eval")
    cfg = OmegaConf.to_object(compose_cfg("train", [
        "+experiment=smoke", "data=hf", f"data.path={tmp_path / 'ds'}", f"data.eval_dir={tmp_path / 'eval'}",
        "data.batch_size=8", "data.max_train_examples=null", "data.max_eval_docs=null", "data.max_eval_queries=null",
        "trainer.max_steps=3", "trainer.val_check_interval=3", f"data.cache_dir={tmp_path / 'cache'}"]))
    metrics = train(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists() and 0.0 <= metrics["val/recall@1"] <= 1.0
    assert len(list((tmp_path / "cache" / "pairs").glob("*/manifest.json"))) == 1


def test_stores_concatenate_with_per_source_offsets(tmp_path):
    """Several sources as one row space (the multi-source run's input): offsets, ids, rows, locations."""
    from moco_retrieval.data.store import ConcatStores, PairList, PairStore

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = cfg_for(tmp_path / "a", rich_rows(30))
    b = cfg_for(tmp_path / "b", [{"query": f"other {i}", "positive": f"other doc {i}"} for i in range(12)])
    stores = [PairStore(prepare_store(a)), PairStore(prepare_store(b)), PairList(load_training_pairs(a).pairs[:5])]
    both = ConcatStores(stores)
    assert both.array("offsets").tolist() == [0, 30, 42, 47] and len(both) == 47
    want = load_training_pairs(a).pairs + load_training_pairs(b).pairs + load_training_pairs(a).pairs[:5]
    assert both.array("doc_id").tolist() == [p.doc_id for p in want]
    rows = [41, 0, 30, 45, 7, 29]
    assert both.take(rows) == [want[r] for r in rows]
    assert both.where(31) == f"{b.train_path}:2" and both.where(3) == f"{a.train_path}:4"


def test_the_store_is_a_datasets_arrow_file(tmp_path):
    """datasets opens a store's table as it is (the field's format), with the rows training reads."""
    datasets = pytest.importorskip("datasets")
    cfg = cfg_for(tmp_path, rich_rows(25))
    ds = datasets.Dataset.from_file(str(prepare_store(cfg) / "pairs.arrow"))
    pairs = load_training_pairs(cfg).pairs
    assert ds["query"] == [p.query for p in pairs] and len(ds) == 25
    assert [[n["text"] for n in r] for r in ds["negatives"]] == [[n.text for n in p.negatives] for p in pairs]


def test_a_store_finished_elsewhere_first_wins(tmp_path):
    """Without a working lock (some network file systems) two converters may race: the second rename
    finds the first's complete store and keeps it, dropping its own copy."""
    first, second = tmp_path / "a", tmp_path / "b"
    for d in (first, second):
        d.mkdir()
        (d / "manifest.json").write_text(json.dumps({"who": d.name}))
    final = tmp_path / "store"
    convert._publish(first, final)
    convert._publish(second, final)
    assert json.loads((final / "manifest.json").read_text()) == {"who": "a"} and not second.exists()
    (tmp_path / "c").mkdir()
    with pytest.raises(OSError):  # a non-empty folder without a manifest is not a finished store
        (tmp_path / "half").mkdir()
        (tmp_path / "half" / "x").write_text("")
        convert._publish(tmp_path / "c", tmp_path / "half")


def test_rows_across_record_batches_come_back_in_the_order_asked(tmp_path, monkeypatch):
    from moco_retrieval.data.store import PairStore

    monkeypatch.setattr(writer, "CHUNK", 7)  # 60 rows in 9 record batches
    cfg = cfg_for(tmp_path, rich_rows(60))
    store = PairStore(prepare_store(cfg))
    assert len(store.table.to_batches()) == 9
    monkeypatch.setattr(writer, "CHUNK_CHARS", 100)  # or cut by text volume: fewer than 7 rows a batch here
    (tmp_path / "cache").rename(tmp_path / "cache_rows")
    store = PairStore(prepare_store(cfg))
    assert 9 < len(store.table.to_batches()) < 60 and len(store) == 60
    want = load_training_pairs(cfg).pairs
    rows = np.random.default_rng(0).permutation(60)[:25].tolist() + [3, 3, 59]
    assert store.take(rows) == [want[r] for r in rows]


def test_prepare_command_converts_ahead_and_reports(tmp_path, capsys, monkeypatch):
    """`python -m moco_retrieval.data prepare` with the run's data overrides: the store training then opens."""
    from moco_retrieval.data.__main__ import main

    cfg = cfg_for(tmp_path, rich_rows(20))
    args = ["prepare", "data=jsonl", f"data.train_path={cfg.train_path}", f"data.cache_dir={cfg.cache_dir}"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    store = prepare_store(cfg)
    assert f"store {store}: 20 rows of {cfg.train_path}" in out
    assert re.search(r"converted .*train\.jsonl: 20 rows in [\d.]+s \([\d,]+ rows/s\), [\d.]+ MB", err)
    monkeypatch.setattr(convert, "write_store", lambda *a: pytest.fail("converted again"))
    dm = RetrievalDataModule(cfg)
    dm.setup("fit")
    assert dm.store_dir == store  # training finds it
    with pytest.raises(SystemExit) as stop:
        main(args + ["data.not_a_key=1"])
    assert stop.value.code == 2 and "not_a_key" in capsys.readouterr().err
    monkeypatch.undo()
    Path(cfg.train_path).write_text('{"query": "q"}\n')
    with pytest.raises(SystemExit, match="2"):
        main(args)
    assert f"{cfg.train_path}:1: missing field 'positive'" in " ".join(capsys.readouterr().err.split())


def test_conversion_progress_lines_give_rows_rate_and_eta(monkeypatch, capsys):
    """Progress while converting (a log file, not a terminal): rows done of the estimate, rows/s, time left."""
    from moco_retrieval.progress import LogLineBar

    bar = LogLineBar(100_000, "converting pairs.jsonl", " rows", interval=0.0)
    bar.update(8192)
    err = capsys.readouterr().err
    assert re.search(r"converting pairs\.jsonl: 8,192/100,000 rows \(8%\) [\d.]+/s, [\d.]+ min left", err)


def test_an_empty_datasets_folder_is_said_not_an_index_error(tmp_path):
    """datasets cannot load a save_to_disk folder of 0 rows (an IndexError); its split alone is read,
    so an empty other split of a DatasetDict does not stop the run."""
    datasets = pytest.importorskip("datasets")
    empty = datasets.Dataset.from_dict({"query": [], "positive": []})
    empty.save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(DataError) as err:
        RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "ds")).setup()
    assert str(err.value) == (f"{tmp_path / 'ds'}: the dataset has no rows (save_to_disk of an empty Dataset: its "
                              f"state.json lists no data files)")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(ST_ROWS), "test": empty}).save_to_disk(str(tmp_path / "dd"))
    assert RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "dd")).train_pairs == expected_st_pairs(tmp_path)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'dd'} (split 'test'): the dataset has no rows")):
        RetrievalDataModule(hf_cfg(tmp_path, tmp_path / "dd", split="test")).setup()
