"""Corpora as memory-mapped stores (data/corpus_store.py): the same documents, ids and errors as
today's dict reader, converted once per content, and search giving the same index and answers."""
from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest

from moco_retrieval.data import corpus_store as cs
from moco_retrieval.data.formats import DataError, EvalSet, read_corpus, write_beir
from moco_retrieval.data.ids import stable_id
from moco_retrieval.data.prompts import Prompts
from tests.helpers import compose_cfg, tiny_overrides

WORDS = ("file system network server image audio video text editor library python tool command line "
         "package manager compress archive backup font color terminal shell mail web browser").split()


def write_corpus_file(path: Path, n: int = 50, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        row = {"_id": f"doc-{i:03d}", "title": rng.choice(["", "Title", "Q?"]),
               "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))}
        if i % 3 == 0:
            row["group"] = f"g{i % 4}"
        rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_corpus(path)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(cs, "CHUNK", 7)  # several record batches in a small corpus


def test_store_holds_what_read_corpus_reads(tmp_path, small_chunks):
    path = tmp_path / "c" / "corpus.jsonl"
    docs = write_corpus_file(path)
    store = cs.corpus_store(path, tmp_path / "cache")
    assert len(store) == 50 and store.doc_ids == list(docs)
    assert store.to_dict() == docs
    assert store.ids.tolist() == [stable_id(d) for d in docs]
    import pyarrow as pa

    batches = pa.ipc.open_stream(pa.memory_map(str(store.folder / cs.TABLE))).read_all().to_batches()
    assert [len(b) for b in batches] == [7] * 7 + [1]  # several record batches, read across below
    rows = [49, 0, 13, 7, 6, 13]
    assert store.texts(rows) == [list(docs.values())[r] for r in rows]  # the order asked, across batches
    assert store.text("doc-031") == docs["doc-031"] and store.text("nope", "-") == "-"
    groups = read_beir_groups(path)
    assert {d: int(g) for d, g in zip(store.doc_ids, store.array("group")) if g != -1} == groups
    assert store.lengths.tolist() == [len(t) for t in docs.values()]


def read_beir_groups(path: Path) -> dict[str, int]:
    from moco_retrieval.data.formats import iter_corpus_located

    return {d: g for _, d, _, g in iter_corpus_located(path) if g is not None}


def test_changed_corpus_is_converted_again_unchanged_one_reused(tmp_path, monkeypatch):
    path = tmp_path / "corpus.jsonl"
    write_corpus_file(path, 20)
    first = cs.corpus_store(path, tmp_path / "cache").folder

    def no_conversion(spec, folder):
        raise AssertionError("converted again")

    monkeypatch.setattr(cs, "write_corpus", no_conversion)
    assert cs.corpus_store(path, tmp_path / "cache").folder == first  # unchanged: reused
    monkeypatch.undo()
    docs = write_corpus_file(path, 21, seed=1)  # changed content
    second = cs.corpus_store(path, tmp_path / "cache")
    assert second.folder != first and second.to_dict() == docs


BAD = {
    "duplicate": '{"_id": "a", "text": "x"}\n{"_id": "b", "text": "y"}\n{"_id": "a", "text": "z"}\n',
    "malformed": '{"_id": "a", "text": "x"}\n{"_id": "b", "text": \n',
    "no_text": '{"_id": "a", "text": "x"}\n{"_id": "b", "title": ""}\n',
    "space_in_id": '{"_id": "a b", "text": "x"}\n',
    "empty": "\n",
    "bad_group": '{"_id": "a", "text": "x", "group": [1]}\n',
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_located_errors_read_exactly_as_today(tmp_path, case):
    path = tmp_path / "corpus.jsonl"
    path.write_text(BAD[case])
    with pytest.raises(DataError) as today:
        read_corpus(path)
    with pytest.raises(DataError) as stored:
        cs.corpus_store(path, tmp_path / "cache")
    assert str(stored.value) == str(today.value) and str(path) in str(stored.value)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == ["fingerprints"]


@pytest.fixture(scope="module")
def tiny_encoder(tiny_dir):
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.model.encoder import build_encoder

    return build_encoder(ModelConfig(backbone="tiny", path=tiny_dir))


@pytest.mark.parametrize("prompted", [False, True])
def test_encode_corpus_gives_encode_texts_embeddings(tmp_path, small_chunks, tiny_encoder, prompted):
    from moco_retrieval.evaluation.encode import encode_corpus, encode_texts
    from moco_retrieval.evaluation.forecast import corpus_timing_sample, sample_for_timing

    path = tmp_path / "corpus.jsonl"
    docs = write_corpus_file(path, 90)
    store = cs.corpus_store(path, tmp_path / "cache")
    tiny_encoder.prompts = Prompts(doc="passage: ") if prompted else Prompts()
    today = encode_texts(tiny_encoder, list(docs.values()), "doc", 8, show_progress=False)
    assert np.array_equal(encode_corpus(tiny_encoder, store, 8, show_progress=False), today)  # bit for bit
    assert corpus_timing_sample(store, 16) == sample_for_timing(list(docs.values()), 16)
    tiny_encoder.prompts = Prompts()


def test_search_index_from_the_store_is_todays(tmp_path, small_chunks, tiny_encoder):
    from moco_retrieval.config import EvalConfig
    from moco_retrieval.search import build_or_load_index

    path = tmp_path / "corpus.jsonl"
    docs = write_corpus_file(path, 60)
    store = cs.corpus_store(path, tmp_path / "cache")
    cfg = EvalConfig(index="flat")
    today, _ = build_or_load_index(tiny_encoder, docs, cfg, tmp_path / "a", {"m": 1}, progress=False)
    stored, _ = build_or_load_index(tiny_encoder, store, cfg, tmp_path / "b", {"m": 1}, progress=False)
    assert stored.doc_ids == today.doc_ids
    assert {k: v for k, v in stored.meta.items() if k != "encode_seconds"} == \
        {k: v for k, v in today.meta.items() if k != "encode_seconds"}  # same corpus digest: same saved index key
    from moco_retrieval.evaluation.encode import encode_texts

    q = encode_texts(tiny_encoder, ["python shell", "image font"], "query", show_progress=False)
    assert stored.search(q, 5) == today.search(q, 5)


def test_search_command_reads_a_corpus_file_through_the_store(tmp_path, tiny_dir, tiny_encoder, monkeypatch):
    """`search corpus=FILE` answers as before (same hits and texts) without reading the corpus into a dict."""
    from moco_retrieval.data import formats
    from moco_retrieval.search import run_search

    docs = write_corpus_file(tmp_path / "beir" / "corpus.jsonl", 40)
    overrides = tiny_overrides(tiny_dir) + [f"corpus={tmp_path / 'beir'}", f"index_dir={tmp_path / 'index'}",
                 "query=python shell", "k=4", "format=json", "progress=false", "device=cpu",
                 f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = compose_cfg("search", overrides)
    monkeypatch.setattr(formats, "_read_corpus", lambda p: (_ for _ in ()).throw(AssertionError("read into a dict")))
    answers = run_search(cfg, out=io.StringIO())
    hits = answers[0]["results"]
    assert len(hits) == 4 and all(h["text"] == docs[h["doc_id"]] for h in hits)
    assert list((tmp_path / "cache" / "corpora").glob("*/manifest.json"))
    # today's path: the same corpus as a dict, same model, gives the same hits
    from moco_retrieval.config import EvalConfig, to_config
    from moco_retrieval.evaluation.encode import encode_texts
    from moco_retrieval.model.loading import load_encoder
    from moco_retrieval.search import build_or_load_index

    enc, _ = load_encoder(checkpoint=None, model_dir=None, model=cfg.model, encoder=cfg.encoder, prompts=cfg.data.prompts)
    idx, _ = build_or_load_index(enc, docs, to_config(EvalConfig, cfg.eval), tmp_path / "dict_index", {}, progress=False)
    ref = idx.search(encode_texts(enc, ["python shell"], "query", show_progress=False), 4)[0]
    assert [(h["doc_id"], h["score"]) for h in hits] == [(d, round(s, 4)) for d, s in ref]


# --------------------------------------------------------------------------- evaluate


def write_beir_folder(folder: Path, n: int = 40) -> None:
    rng = random.Random(3)
    corpus, queries, qrels = {}, {}, {}
    for i in range(n):
        words = rng.sample(WORDS, rng.randint(2, 9))
        corpus[f"doc-{i:02d}"] = " ".join(words)
        if i % 2 == 0:
            queries[f"q-{i:02d}"] = " ".join(words[:2])
            qrels[f"q-{i:02d}"] = {f"doc-{i:02d}": 1, f"doc-{(i + 1) % n:02d}": 0}
    write_beir(folder, EvalSet(corpus=corpus, queries=queries, qrels=qrels), "test")


@pytest.mark.parametrize("caps", [[], ["data.max_eval_docs=15", "data.max_eval_queries=8"]])
def test_evaluate_from_the_store_writes_todays_metrics_and_run_file(tmp_path, tiny_dir, monkeypatch, caps):
    """evaluate on a BEIR folder through the corpus store: eval.json's metrics and run.trec are those of
    today's dict path (load_eval_pool), byte for byte; the store path reads no corpus into a dict."""
    from moco_retrieval.data import formats, sources
    from moco_retrieval.evaluate import run_evaluate

    beir = tmp_path / "beir"
    write_beir_folder(beir)
    cfg = compose_cfg("evaluate", tiny_overrides(tiny_dir) + [
        "data=beir", f"data.dir={beir}", f"data.cache_dir={tmp_path / 'cache'}", "progress=false", "device=cpu",
        "plots=false", "eval.top_k=10", "data.eval_batch_size=4", *caps])

    def outputs(out: Path) -> tuple:
        run_evaluate(cfg, out)
        data = json.loads((out / "eval.json").read_text())
        return data["metrics"], data["dataset"], (out / "run.trec").read_bytes()

    real_read_corpus = formats._read_corpus
    monkeypatch.setattr(formats, "_read_corpus", lambda p: (_ for _ in ()).throw(AssertionError("read into a dict")))
    stored = outputs(tmp_path / "store")
    assert list((tmp_path / "cache" / "corpora").glob("*/manifest.json"))
    monkeypatch.setattr(formats, "_read_corpus", real_read_corpus)
    unmapped = sources.load_eval_pools
    monkeypatch.setattr(sources, "load_eval_pools", lambda cfg, folder=None, mapped=False: unmapped(cfg, folder))  # today's path
    today = outputs(tmp_path / "dict")
    assert stored == today
    assert stored[1]["documents"] == (15 if caps else 40)


def test_eval_pool_errors_read_as_today(tmp_path):
    """A located error in corpus.jsonl, and a qrels id missing from the corpus, read exactly as today."""
    from moco_retrieval.config import DataConfig
    from moco_retrieval.data.sources import load_eval_pool, load_eval_pool_mapped

    beir = tmp_path / "beir"
    write_beir_folder(beir, 10)
    cfg = DataConfig(kind="beir", dir=str(beir), cache_dir=str(tmp_path / "cache"))
    assert load_eval_pool_mapped(cfg).eval_set.queries == load_eval_pool(cfg).eval_set.queries
    lines = (beir / "corpus.jsonl").read_text().splitlines()
    for corpus_lines in (lines[:4] + ['{"_id": "x", "text": 3}'] + lines[4:], lines[1:]):  # bad row; doc-00 missing
        (beir / "corpus.jsonl").write_text("\n".join(corpus_lines) + "\n")
        with pytest.raises(DataError) as today:
            load_eval_pool(cfg)
        with pytest.raises(DataError) as stored:
            load_eval_pool_mapped(cfg)
        assert str(stored.value) == str(today.value)
    assert "is not in" in str(today.value) and "corpus.jsonl" in str(today.value)


def test_search_default_corpus_of_data_beir_is_the_store(tmp_path):
    from moco_retrieval.config import DataConfig
    from moco_retrieval.search import load_corpus

    beir = tmp_path / "beir"
    write_beir_folder(beir, 12)
    corpus, desc = load_corpus(None, DataConfig(kind="beir", dir=str(beir), cache_dir=str(tmp_path / "cache")))
    assert isinstance(corpus, cs.CorpusStore) and desc == str(beir / "corpus.jsonl")
    assert corpus.to_dict() == read_corpus(beir / "corpus.jsonl")
    pool, _ = load_corpus("eval", DataConfig(kind="beir", dir=str(beir), cache_dir=str(tmp_path / "cache")))
    assert pool.folder == corpus.folder  # the held-out pool (uncapped) opens the same store
