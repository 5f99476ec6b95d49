"""Streaming (data.stream, data/stream.py and data/stream_batches.py): chunks prepared from the store
with their manifest, a stale or foreign folder refused, batches that carry ids, groups, sources,
prompts and hard negatives, every rank its own rows once an epoch, an exact resume mid-epoch (also
across a source's passes), and a missing or cut chunk named in one message."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest

pytest.importorskip("litdata", reason="data.stream needs litdata (pip install --no-deps -r requirements-nodeps.txt)")

from moco_retrieval.config import DataConfig  # noqa: E402
from moco_retrieval.data import stream  # noqa: E402
from moco_retrieval.data.datamodule import RetrievalDataModule  # noqa: E402
from moco_retrieval.data.formats import DataError  # noqa: E402
from moco_retrieval.errors import ConfigError  # noqa: E402
from tests.helpers import fake_tokenize, make_cfg, two_sources  # noqa: E402


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of a few rows, so that a rank's share and a resume span several of them."""
    monkeypatch.setattr(stream, "CHUNK_BYTES", 400)


def streamed(cfg: DataConfig, where) -> DataConfig:
    cfg.stream, cfg.stream_dir = True, str(where)
    return cfg


def module(cfg, rank=0, world=1, **kw) -> RetrievalDataModule:
    dm = RetrievalDataModule(cfg, fake_tokenize, rank=rank, world_size=world, **kw)
    dm.setup()
    return dm


def epoch(dm, epoch=0, done=0) -> list[list[int]]:
    dm.load_state_dict({**dm.state_dict(), "epoch": epoch, "batches_done": done})
    return [b["index"].tolist() for b in dm.train_dataloader()]


def test_prepare_writes_chunks_and_manifest_once(tmp_path):
    cfg = streamed(make_cfg(tmp_path, n=40, repeat_ids=True), tmp_path / "chunks")
    m = stream.prepare_stream(cfg, workers=2)
    assert m["complete"] and m["rows"] == 40 and list(m["sources"]) == ["data"]
    assert m["sources"]["data"]["store"] == stream.expected(cfg)["sources"]["data"]["store"]
    chunks = sorted(p.name for p in (tmp_path / "chunks" / "data").glob("chunk-*.bin"))
    assert len(chunks) > 2 and (tmp_path / "chunks" / "data" / "index.json").is_file()
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "chunks").rglob("*")}
    assert stream.prepare_stream(cfg, workers=2) == m  # the same data: kept, nothing rewritten
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "chunks").rglob("*")} == before


def test_batches_carry_ids_groups_and_every_row_once(tmp_path):
    cfg = streamed(make_cfg(tmp_path, n=40, repeat_ids=True, batch_size=4), tmp_path / "chunks")
    dm = module(cfg)  # chunks missing: prepared first, as the store is converted
    assert (tmp_path / "chunks" / stream.MANIFEST).is_file()
    store = RetrievalDataModule(make_cfg(tmp_path, n=40, repeat_ids=True), fake_tokenize, rank=0, world_size=1)
    pairs = store.train_pairs
    batches = list(dm.train_dataloader())
    assert len(batches) == 10
    for b in batches:  # the row's own ids and group travel with it: what the objectives mask by
        rows = b["index"].tolist()
        assert b["doc_id"].tolist() == [pairs[i].doc_id for i in rows]
        assert b["group"].tolist() == [pairs[i].group for i in rows]
        assert b["query"]["texts"] == [pairs[i].query for i in rows]
    assert sorted(i for b in batches for i in b["index"].tolist()) == list(range(40))
    # duplicates are not avoided: some batch holds a document twice (7 documents in 40 rows)
    assert any(len(set(b["doc_id"].tolist())) < 4 for b in batches)
    again, other = epoch(dm, 0), epoch(dm, 1)
    assert again == [b["index"].tolist() for b in batches] and other != again  # seeded, reshuffled per epoch


def test_a_worker_process_gives_the_same_batches_and_names_a_read_error(tmp_path):
    cfg = streamed(make_cfg(tmp_path, n=24, batch_size=4), tmp_path / "chunks")
    here = epoch(module(cfg), 0, 2)
    cfg.num_workers = 1  # the stream read and collated in one DataLoader worker
    dm = module(cfg)
    assert epoch(dm, 0, 2) == here and len(here) == 4
    loader = dm.train_dataloader()
    for chunk in (tmp_path / "chunks" / "data").glob("chunk-*.bin"):
        chunk.unlink()
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'chunks'}: cannot read the stream's chunks")) as e:
        list(loader)
    assert "Traceback" not in str(e.value)


def test_ranks_read_disjoint_shares_of_equal_length(tmp_path):
    cfg = streamed(make_cfg(tmp_path, n=42, batch_size=4), tmp_path / "chunks")
    per_rank = [epoch(module(cfg, rank=r, world=2)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 5  # 21 rows each (drop_last), 5 full batches
    seen = [i for rows in per_rank for b in rows for i in b]
    assert len(seen) == len(set(seen)) == 40


@pytest.mark.parametrize("world", [1, 2])
def test_resume_mid_epoch_yields_exactly_the_rest(tmp_path, world):
    cfg = streamed(make_cfg(tmp_path, n=64, batch_size=3), tmp_path / "chunks")
    for r in range(world):
        full = epoch(module(cfg, rank=r, world=world), 1)
        for k in (1, 4, len(full) - 1):
            assert epoch(module(cfg, rank=r, world=world), 1, k) == full[k:], (r, k)


def test_several_sources_keep_their_batches_prompts_and_weights(tmp_path):
    cfg = streamed(two_sources(tmp_path), tmp_path / "chunks")
    dm = module(cfg)
    assert dm.source_offsets.tolist() == [0, 48, 72]
    batches = list(dm.train_dataloader())
    assert Counter(int(b["source"][0]) for b in batches) == {0: 12, 1: 6}  # one pass of each, by size
    for b in batches:
        (src,) = set(b["source"].tolist())
        word, q = ("alpha", "query: ") if src == 0 else ("beta", "question: ")
        assert all(t.startswith(f"{q}{word} query") for t in b["query"]["texts"])
    weighted = _weights(cfg, [1, 3])
    full = epoch(module(weighted), 0)
    sources = [0 if rows[0] < 48 else 1 for rows in full]
    assert Counter(sources) == {0: 5, 1: 13}  # 18 batches split 1:3: source b read in a second pass
    for k in (3, 9, 15):  # resumes inside b's first pass, and inside its second
        assert epoch(module(weighted), 0, k) == full[k:], k


def _weights(cfg, weights):
    for s, w in zip(cfg.sources, weights):
        s.weight = w
    return cfg


def test_checks_from_the_manifest_before_training(tmp_path):
    (tmp_path / "whole").mkdir()
    whole = streamed(make_cfg(tmp_path / "whole", n=12, negatives=lambda i: [f"neg {i}"]), tmp_path / "whole-chunks")
    batch = next(iter(module(whole, n_negatives=2).train_dataloader()))
    assert [t.split()[1] for t in batch["neg"]["texts"]] == [str(i) for i in batch["index"].tolist() for _ in range(2)]
    cfg = streamed(make_cfg(tmp_path, n=12, negatives=lambda i: [] if i == 5 else [f"neg {i}"]), tmp_path / "chunks")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'train.jsonl'}:6: training example 5 (query 'query 5') "
                                                  f"of the stream {tmp_path / 'chunks'} (data) has no hard negatives")):
        module(cfg, n_negatives=2)


def test_a_stream_of_other_data_is_refused(tmp_path):
    cfg = streamed(make_cfg(tmp_path, n=20), tmp_path / "chunks")
    module(cfg)
    with open(tmp_path / "train.jsonl", "a") as f:  # the data changed since the chunks were written
        f.write(json.dumps({"query": "query 20", "positive": "document 20"}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"data.stream_dir={tmp_path / 'chunks'} holds the chunks of other "
                                                  "training data")):
        module(cfg)
    capped = streamed(make_cfg(tmp_path, n=20, max_train_examples=10), tmp_path / "chunks2")
    module(capped)
    capped.max_train_examples = 12
    with pytest.raises(DataError, match="capped at 10"):
        module(capped)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="holds files but no moco_stream.json"):
        module(streamed(make_cfg(tmp_path, n=20), foreign))
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_node_without_the_input_files_trains_on_finished_chunks(tmp_path, capsys):
    cfg = streamed(make_cfg(tmp_path, n=20), tmp_path / "chunks")
    with pytest.raises(DataError, match="no such file"):  # nothing to prepare from
        module(streamed(make_cfg(tmp_path, n=20, train_path=str(tmp_path / "elsewhere.jsonl")), tmp_path / "none"))
    rows = epoch(module(cfg), 0)
    (tmp_path / "train.jsonl").rename(tmp_path / "moved.jsonl")
    assert epoch(module(cfg), 0) == rows
    assert (f"training on the chunks in data.stream_dir={tmp_path / 'chunks'} as they were prepared (20 rows; "
            "sources data), unchecked against the input") in capsys.readouterr().err


def test_missing_or_cut_chunks_are_named(tmp_path):
    cfg = streamed(make_cfg(tmp_path, n=40, batch_size=4), tmp_path / "chunks")
    module(cfg)
    chunk = sorted((tmp_path / "chunks" / "data").glob("chunk-*.bin"))[1]
    data = chunk.read_bytes()
    chunk.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=re.escape(f"{chunk}: a chunk of the stream holds {len(data) // 2:,} bytes")):
        module(cfg)
    chunk.unlink()
    with pytest.raises(DataError, match=re.escape(f"{chunk}: a chunk of the stream is missing")):
        module(cfg)
    chunk.write_bytes(data)
    dm = module(cfg)
    loader = dm.train_dataloader()
    for other in (tmp_path / "chunks" / "data").glob("chunk-*.bin"):  # gone while the run reads them
        other.unlink()
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'chunks'}: cannot read the stream's chunks")):
        list(loader)


def test_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="data.stream_dir=x is read with data.stream=true only"):
        DataConfig(kind="jsonl", stream_dir="x")
    with pytest.raises(ConfigError, match="give their folder or URL, data.stream_dir=DIR"):
        DataConfig(kind="jsonl", stream=True)
    for kind in ("beir", "documents"):
        with pytest.raises(ConfigError, match=f"not data.kind={kind}"):
            DataConfig(kind=kind, stream=True, stream_dir="x")


def test_prepare_command_writes_the_chunks_with_workers(tmp_path, capsys):
    from moco_retrieval.data.__main__ import main

    cfg = make_cfg(tmp_path, n=30)
    args = ["prepare", "data=jsonl", f"data.train_path={cfg.train_path}", "data.stream=true",
            f"data.stream_dir={tmp_path / 'chunks'}"]
    assert main(args + ["workers=2"]) == 0
    assert f"stream {tmp_path / 'chunks'}: 30 rows of data" in capsys.readouterr().out
    assert json.loads((tmp_path / "chunks" / stream.MANIFEST).read_text())["workers"] == 2
    for bad, message in (("workers=0", "data.prepare_workers=0: must be >= 1"),):
        with pytest.raises(SystemExit) as stop:
            main(args + [bad])
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_resume_under_lightning_over_two_epochs(tmp_path):
    """A fit stopped by max_steps mid-epoch (0 and 1) and resumed from its last checkpoint trains the
    batches of the uninterrupted fit, each once: the fit loop's epoch reaches the stream's loader."""
    from tests.helpers import fit_recording_batches

    def fit(root, max_steps=-1, ckpt=None):
        return fit_recording_batches(RetrievalDataModule(cfg, rank=0, world_size=1), root, max_steps, ckpt)

    cfg = streamed(make_cfg(tmp_path, n=30, batch_size=4), tmp_path / "chunks")
    full = fit(tmp_path / "full")
    assert [e for e, _ in full] == [0] * 7 + [1] * 7 and [r for _, r in full[:7]] != [r for _, r in full[7:]]
    for k in (2, 9):
        root = tmp_path / f"cut{k}"
        first = fit(root, max_steps=k)
        assert first + fit(root, ckpt=str(root / "ck" / "last.ckpt")) == full, k


def test_other_commands_refuse_a_stream():
    from moco_retrieval.config import EvaluateConfig, MineConfig, SearchConfig

    data = DataConfig(kind="jsonl", stream=True, stream_dir="x")
    for cls, command, args in ((EvaluateConfig, "evaluate", {}), (SearchConfig, "search", {}),
                               (MineConfig, "mine", {"output": "o.jsonl"})):
        with pytest.raises(ConfigError, match=f"data.stream=true: {command} does not stream"):
            cls(data=data, **args)
