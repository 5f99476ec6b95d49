"""Loading by ``data.kind`` (debian | jsonl | parquet | csv | hf | beir), with the seeded subsets and caps.

The one place that knows which files a data config names:

* ``debian``: :func:`~.debian.ensure_debian_dataset` -> ``train.jsonl`` + ``eval/`` (split ``test``).
* ``jsonl``, ``parquet``, ``csv``: ``cfg.train_path`` pairs (parquet / csv: tabular.py, columns
  ``cfg.columns``); ``cfg.eval_dir`` BEIR folder, split ``cfg.eval_split``.
* ``hf``: ``cfg.path`` a ``datasets`` folder (hf_folder.py, split ``cfg.split``, columns ``cfg.columns``);
  ``cfg.eval_dir`` as above.
* ``beir``: ``cfg.dir``; train from ``qrels/<train_split>.tsv``, eval from ``qrels/<eval_split>.tsv``.

:func:`load_training_rows` is what training reads: the rows of a store converted once per input
content (convert.py; every kind but ``beir``, whose pairs come from qrels in memory), capped, with
only numbers in memory. :func:`load_training_pairs` reads the same rows as Python objects (mining).

:func:`load_training_pairs` reads only the training side (``jsonl`` needs only ``train_path``),
:func:`load_eval_pool` only the evaluation side (``jsonl`` needs only ``eval_dir``), :func:`load`
both (a BEIR corpus is then read once), :func:`load_documents` every document of a kind (the
search corpus). Caps are deterministic from ``cfg.seed`` and keep the original order:
``max_train_examples`` rows; ``max_eval_queries`` queries; ``max_eval_docs`` documents, always
keeping every relevant (score > 0) document of the kept queries (:func:`cap_eval_set`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
from omegaconf import OmegaConf

from moco_retrieval.config import DataKind
from moco_retrieval.data.convert import PairSpec, ensure_store
from moco_retrieval.data.parallel import dataset_split, jsonl_split, parquet_split, shards_split
from moco_retrieval.data.formats import (
    DataError,
    EvalSet,
    Pair,
    beir_train_pairs,
    read_beir,
    read_beir_splits,
    read_corpus,
    read_pairs_jsonl,
    iter_pairs_jsonl_located,
    read_pairs_jsonl_located,
)
from moco_retrieval.data.store import PairList, PairRows, PairStore

# training pairs (a file, or hf's folder) + a BEIR folder for validation
PAIR_KINDS = (DataKind.jsonl, DataKind.parquet, DataKind.csv, DataKind.hf)


@dataclass
class TrainingPairs:
    """Training pairs (capped) with where each came from (``file:line``, or the qrels file and query
    id), for error messages; ``folder`` is the built Debian folder (``kind=debian``), else None."""

    pairs: list[Pair]
    where: list[str]
    folder: Optional[Path] = None

    def __len__(self) -> int:
        return len(self.pairs)


@dataclass
class EvalPool:
    """The (capped) evaluation set and its description: ``kind``, ``dir``, ``split``, ``queries``,
    ``documents``, ``judgments`` and, when capped, ``capped_from`` (the full pool's counts)."""

    eval_set: EvalSet
    description: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------- caps


def subset(n: int, cap: Optional[int], seed: list[int]) -> Optional[list[int]]:
    """Sorted indices of a seeded subset of ``cap`` of ``n`` rows (None: keep all)."""
    if cap is None or cap >= n:
        return None
    if cap < 1:
        raise DataError(f"caps must be >= 1, got {cap}")
    return sorted(np.random.default_rng(seed).permutation(n)[:cap].tolist())


def cap_training_pairs(data: TrainingPairs, cap: Optional[int], seed: int = 0) -> TrainingPairs:
    """``cap`` of the rows (seeded by ``(seed, 1)``, original order kept)."""
    keep = subset(len(data.pairs), cap, [seed, 1])
    if keep is None:
        return data
    return TrainingPairs([data.pairs[i] for i in keep], [data.where[i] for i in keep], data.folder)


def cap_eval_set(
    ev: EvalSet, max_queries: Optional[int] = None, max_docs: Optional[int] = None, seed: int = 0
) -> EvalSet:
    """A deterministic smaller eval set: ``max_queries`` queries, ``max_docs`` documents (every
    relevant document of the kept queries is kept, even beyond ``max_docs``)."""
    if max_queries is None and max_docs is None:
        return ev
    qids = list(ev.queries)
    keep_q = subset(len(qids), max_queries, [seed, 2])
    if keep_q is not None:
        qids = [qids[i] for i in keep_q]
    qrels = {q: ev.qrels[q] for q in qids}
    corpus = ev.corpus
    if max_docs is not None:
        relevant = {d for q in qids for d, s in ev.qrels[q].items() if s > 0}
        if len(relevant) > max_docs:
            print(
                f"[moco_retrieval] data.max_eval_docs={max_docs} is below the {len(relevant)} relevant documents "
                "of the kept queries; keeping those",
                file=sys.stderr,
            )
        others = [d for d in ev.corpus if d not in relevant]
        room = max(0, max_docs - len(relevant))
        if room == 0:
            chosen = relevant
        else:
            pick = subset(len(others), room, [seed, 3])
            chosen = relevant | (set(others) if pick is None else {others[i] for i in pick})
        corpus = ev.corpus.select(chosen) if hasattr(ev.corpus, "select") else \
            {d: t for d, t in ev.corpus.items() if d in chosen}  # a store: only the kept texts are read
        qrels = {q: {d: s for d, s in rel.items() if d in corpus} for q, rel in qrels.items()}
    groups = None if ev.doc_groups is None else {d: g for d, g in ev.doc_groups.items() if d in corpus}
    return EvalSet(corpus=corpus, queries={q: ev.queries[q] for q in qids}, qrels=qrels, doc_groups=groups)


# ---------------------------------------------------------------------------------- locations


def _check_kind(cfg: Any) -> DataKind:
    return DataKind(cfg.kind)


def _value(cfg: Any, key: str) -> Any:
    """``cfg.key``, None when absent or a missing (``???``) value of an OmegaConf config."""
    if OmegaConf.is_config(cfg) and (key not in cfg or OmegaConf.is_missing(cfg, key)):
        return None
    return getattr(cfg, key, None)


def _need(cfg: Any, key: str, kind: str, what: str, file: bool) -> Path:
    value = _value(cfg, key)
    if not value:
        raise DataError(f"data.{key} is required with data={kind} ({what})")
    p = Path(value).expanduser()
    if not p.exists():
        raise DataError(f"data.{key}={value}: no such {'file' if file else 'directory'} ({what})")
    if file and not p.is_file():
        raise DataError(f"data.{key}={value}: {'a directory' if p.is_dir() else 'not a regular file'}, "
                        f"expected {what}")
    if not file and not p.is_dir():
        raise DataError(f"data.{key}={value}: a file, expected {what}")
    return p


_TRAIN_FILE = "a {} file of training pairs"
_EVAL_DIR = "a BEIR-layout folder for validation"
_EVAL_DIRS = f"{_EVAL_DIR}; or several: data.eval_dirs=[DIR,...]"
_BEIR_DIR = "a BEIR folder with corpus.jsonl, queries.jsonl, qrels/"
_HF_DIR = "a datasets save_to_disk folder or a folder of Parquet shards"
_DOCUMENTS = "documents: a JSONL, Parquet or CSV file, a datasets folder or a folder of .txt / .md files"


def debian_folder(cfg: Any) -> Path:
    """The built Debian data set of ``cfg`` (built on first use, see :func:`~.debian.ensure_debian_dataset`)."""
    from moco_retrieval.data.builders.debian import ensure_debian_dataset

    return ensure_debian_dataset(cfg)


def _eval_location(cfg: Any, kind: str, folder: Optional[Path] = None) -> tuple[Path, str]:
    """``(BEIR folder, split)`` of the evaluation pool."""
    if kind == "debian":
        return (folder or debian_folder(cfg)) / "eval", "test"
    if kind in PAIR_KINDS or kind == "documents":
        return _need(cfg, "eval_dir", kind, _EVAL_DIRS, file=False), cfg.eval_split
    return _need(cfg, "dir", kind, _BEIR_DIR, file=False), cfg.eval_split


# ------------------------------------------------------------------------------------ loading


def _located_pairs(path: Path, folder: Optional[Path] = None) -> TrainingPairs:
    located = read_pairs_jsonl_located(path)
    return TrainingPairs([p for _, p in located], [f"{path}:{line}" for line, _ in located], folder)


def _table_pairs(path: Path, kind: str, columns: Any) -> TrainingPairs:
    from moco_retrieval.data.tabular import read_pairs_table_located

    located = read_pairs_table_located(path, kind, columns)
    return TrainingPairs([p for _, p in located], [f"{path}: row {row}" for row, _ in located])


def _hf_pairs(cfg: Any, folder: Path) -> TrainingPairs:
    from moco_retrieval.data.hf_folder import read_hf_pairs_located

    located = read_hf_pairs_located(folder, cfg.split, _value(cfg, "columns"))
    return TrainingPairs([p for _, _, p in located], [f"{where}: row {row}" for where, row, _ in located])


def _train_input(cfg: Any, kind: str) -> Path:
    """``data.path`` (hf: a folder; documents: a file or a folder) or ``data.train_path`` (a file) of a pair kind."""
    if kind == "documents":
        value = _value(cfg, "path")
        if not value:
            raise DataError(f"data.path is required with data=documents ({_DOCUMENTS})")
        p = Path(value).expanduser()
        if not p.exists():
            raise DataError(f"data.path={value}: no such file or directory ({_DOCUMENTS})")
        return p
    if kind == "hf":
        return _need(cfg, "path", kind, _HF_DIR, file=False)
    return _need(cfg, "train_path", kind, _TRAIN_FILE.format(kind.upper() if kind != "parquet" else "Parquet"), file=True)


def _pairs_file(cfg: Any, kind: str) -> TrainingPairs:
    path = _train_input(cfg, kind)
    if kind == "hf":
        return _hf_pairs(cfg, path)
    return _located_pairs(path) if kind == "jsonl" else _table_pairs(path, kind, _value(cfg, "columns"))


def _beir_pairs(cfg: Any, d: Path, train: EvalSet) -> TrainingPairs:
    pairs = beir_train_pairs(train)
    qrels = d / "qrels" / f"{cfg.train_split}.tsv"
    return TrainingPairs(pairs, [f"{qrels} (query {p.query_id!r})" for p in pairs])


def _finish_pairs(cfg: Any, kind: str, data: TrainingPairs) -> TrainingPairs:
    if not data.pairs:
        raise DataError(f"data={kind}: no training pairs")
    return cap_training_pairs(data, cfg.max_train_examples, cfg.seed)


def _finish_pool(cfg: Any, kind: str, folder: Path, split: str, full: EvalSet) -> EvalPool:
    ev = cap_eval_set(full, cfg.max_eval_queries, cfg.max_eval_docs, cfg.seed)
    desc = {
        "kind": kind,
        "dir": str(folder),
        "split": split,
        "queries": len(ev.queries),
        "documents": len(ev.corpus),
        "judgments": sum(len(r) for r in ev.qrels.values()),
    }
    if len(ev.queries) != len(full.queries) or len(ev.corpus) != len(full.corpus):
        desc["capped_from"] = {"queries": len(full.queries), "documents": len(full.corpus)}
    return EvalPool(ev, desc)


def load_training_pairs(cfg: Any) -> TrainingPairs:
    """The training pairs of a DataConfig, capped by ``max_train_examples``, without reading the
    evaluation pool (``kind=jsonl`` needs only ``train_path``)."""
    kind = _check_kind(cfg)
    if kind == "documents":
        raise DataError("data=documents has no queries: its pairs are made as they are drawn in training "
                        "(data/documents.py); this command needs pairs")
    if kind == "debian":
        d = debian_folder(cfg)
        data = _located_pairs(d / "train.jsonl", d)
    elif kind in PAIR_KINDS:
        data = _pairs_file(cfg, kind)
    else:
        d = _need(cfg, "dir", kind, _BEIR_DIR, file=False)
        data = _beir_pairs(cfg, d, read_beir(d, cfg.train_split))
    return _finish_pairs(cfg, kind, data)


# ------------------------------------------------------------------------- stores (training)


def store_root(cfg: Any) -> Path:
    """Where converted stores go: ``cfg.cache_dir`` (default $MOCO_RETRIEVAL_CACHE or
    ~/.cache/moco_retrieval) / pairs."""
    from moco_retrieval.config import cache_root

    return Path(_value(cfg, "cache_dir") or cache_root()).expanduser() / "pairs"


def corpus_root(cfg: Any) -> Path:
    """Where converted corpora go (corpus_store.py): beside the training stores, under corpora/."""
    return store_root(cfg).parent / "corpora"


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 22), b""))


def _jsonl_spec(path: Path) -> PairSpec:
    return PairSpec(str(path), [path], {"kind": "jsonl"}, [str(path)], "{file}:{line}",
                    lambda: ((0, line, p) for line, p in iter_pairs_jsonl_located(path)), lambda: _count_lines(path),
                    lambda n: jsonl_split(path, n))


def _table_spec(path: Path, kind: str, columns: Any) -> PairSpec:
    from moco_retrieval.data.tabular import STREAMS, column_names

    def count() -> int:
        if kind == "csv":
            return max(_count_lines(path) - 1, 0)
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows

    return PairSpec(str(path), [path], {"kind": kind, "columns": column_names(columns)}, [str(path)], "{file}: row {line}",
                    lambda: ((0, row, p) for row, p in STREAMS[kind](path, columns)), count,
                    (lambda n: parquet_split(path, columns, n)) if kind == "parquet" else None)


def _hf_spec(folder: Path, split: str, columns: Any) -> PairSpec:
    from moco_retrieval.data.hf_folder import hf_input_files, hf_tables, iter_table_pairs
    from moco_retrieval.data.tabular import column_names

    tables = hf_tables(folder, split)

    def rows() -> Iterator[tuple[int, int, Pair]]:
        for i, t in enumerate(tables):
            yield from ((i, row, p) for row, p in iter_table_pairs(t, columns))

    shards = tables[0].where.endswith(".parquet")  # (a save_to_disk folder is one table, read through datasets)
    return PairSpec(str(folder), hf_input_files(folder, tables), {"kind": "hf", "split": split, "columns": column_names(columns)},
                    [t.where for t in tables], "{file}: row {line}", rows, lambda: sum(t.rows for t in tables),
                    (lambda n: shards_split(tables, columns, n)) if shards else
                    (lambda n: dataset_split(folder, split, columns, tables[0].rows, n)))


def pair_spec(cfg: Any, data_folder: Optional[Path] = None) -> PairSpec:
    """What to convert for a data config's training pairs (every kind but ``beir``; documents: one
    row each, documents.py); ``data_folder``: the built Debian folder, when known."""
    kind = _check_kind(cfg)
    if kind == "debian":
        return _jsonl_spec((data_folder or debian_folder(cfg)) / "train.jsonl")
    if kind == "documents":
        from moco_retrieval.data.documents import document_spec

        return document_spec(_train_input(cfg, kind), _value(cfg, "columns"), cfg.split)
    if kind not in PAIR_KINDS:
        raise DataError(f"data={kind}: its training pairs are not read from a file")
    path = _train_input(cfg, kind)
    if kind == "jsonl":
        return _jsonl_spec(path)
    if kind == "hf":
        return _hf_spec(path, cfg.split, _value(cfg, "columns"))
    return _table_spec(path, kind, _value(cfg, "columns"))


@dataclass
class TrainingRows:
    """Training rows (capped) for the data module: a converted store's (or, for ``beir``, in-memory
    pairs), with the built Debian folder (``kind=debian``) and the store folder when there is one."""

    rows: PairRows
    folder: Optional[Path] = None
    store: Optional[Path] = None

    def __len__(self) -> int:
        return len(self.rows)


def prepare_store(cfg: Any, data_folder: Optional[Path] = None, verify: bool = False) -> Path:
    """The converted store of a data config's training pairs (converted first when absent or not
    whole; ``verify``: the sha256 of every file checked, convert.ensure_store)."""
    spec = pair_spec(cfg, data_folder)
    spec.workers = cfg.prepare_workers
    return ensure_store(spec, store_root(cfg), verify=verify)


def load_training_rows(cfg: Any) -> TrainingRows:
    """The training rows of a DataConfig, capped by ``max_train_examples`` (the same rows, order and
    locations as :func:`load_training_pairs`), with only ids, groups and counts in memory."""
    kind = _check_kind(cfg)
    if kind == "beir":
        data = load_training_pairs(cfg)
        return TrainingRows(PairRows(PairList(data.pairs, data.where)))
    folder = debian_folder(cfg) if kind == "debian" else None
    store = prepare_store(cfg, folder)
    source = PairStore(store)
    rows = np.arange(len(source))
    if _holds_out(cfg):  # documents without eval_dir: validation's documents never train
        from moco_retrieval.data.documents import held_out

        rows = np.setdiff1d(rows, held_out(len(source), cfg.seed))
    keep = subset(len(rows), cfg.max_train_examples, [cfg.seed, 1])
    rows = rows if keep is None else rows[keep]
    return TrainingRows(PairRows(source, None if len(rows) == len(source) else rows), folder, store)


def _holds_out(cfg: Any) -> bool:
    """Documents without ``data.eval_dir`` (or ``eval_dirs``) validate on documents held out of training (documents.py)."""
    return _check_kind(cfg) == "documents" and not _value(cfg, "eval_dir") and not _value(cfg, "eval_dirs")


def _held_out_pool(cfg: Any) -> EvalPool:
    from moco_retrieval.data.documents import held_out, held_out_pool

    source = PairStore(prepare_store(cfg))
    keep = held_out(len(source), cfg.seed)
    full = held_out_pool(PairRows(source), keep, cfg.views, cfg.seed)
    pool = _finish_pool(cfg, "documents", Path(cfg.path), "held out", full)
    pool.description["held_out"] = "a fixed crop of each held-out document against those documents"
    return pool


def load_eval_pool(cfg: Any, data_folder: Optional[Path] = None) -> EvalPool:
    """The evaluation pool of a DataConfig, capped by ``max_eval_queries`` / ``max_eval_docs``,
    without reading training data (``kind=jsonl`` needs only ``eval_dir``; ``kind=beir`` reads only
    ``qrels/<eval_split>.tsv``). ``data_folder``: the built Debian folder, when known. Several
    ``data.eval_dirs``: a DataError (:func:`load_eval_pools` reads them)."""
    return _one_pool(load_eval_pools(cfg, data_folder))


def load_eval_pool_mapped(cfg: Any, data_folder: Optional[Path] = None) -> EvalPool:
    """:func:`load_eval_pool` with the corpus a memory-mapped store (corpus_store.py, converted once
    per content) instead of a dict: the same pool, errors and caps (a capped pool keeps only its
    documents' texts, in memory). ``evaluate`` reads this; training's validation the dict."""
    return _one_pool(load_eval_pools(cfg, data_folder, mapped=True))


def _one_pool(pools: dict[str, EvalPool]) -> EvalPool:
    if len(pools) > 1:
        raise DataError(f"data.eval_dirs names {len(pools)} sets ({', '.join(pools)}); this reads one pool: "
                        "give one folder")
    return next(iter(pools.values()))


def eval_folders(cfg: Any) -> list[tuple[str, Path]]:
    """``(name, folder)`` of each of ``data.eval_dirs`` (config.eval_set_names), every folder checked
    to be there before any is read."""
    from moco_retrieval.config import eval_set_names

    dirs = [str(d) for d in _value(cfg, "eval_dirs") or []]
    out = []
    for i, (name, d) in enumerate(zip(eval_set_names(dirs), dirs)):
        p = Path(d).expanduser()
        if not p.is_dir():
            raise DataError(f"data.eval_dirs[{i}]={d}: {'a file' if p.exists() else 'no such directory'}, "
                            f"expected {_EVAL_DIR}")
        out.append((name, p))
    return out


def load_eval_pools(cfg: Any, data_folder: Optional[Path] = None, mapped: bool = False) -> dict[str, EvalPool]:
    """Every evaluation set of a DataConfig by name, each capped as :func:`load_eval_pool` caps its
    pool: each of ``data.eval_dirs`` (split ``eval_split``), else the one pool of the kind, named by
    its folder. ``mapped``: corpora as memory-mapped stores (:func:`load_eval_pool_mapped`)."""
    reader = None
    if mapped:
        from moco_retrieval.data.corpus_store import store_reader

        reader = store_reader(corpus_root(cfg))
    kind = _check_kind(cfg)
    folders = eval_folders(cfg)
    if folders:
        return {name: _finish_pool(cfg, kind, folder, cfg.eval_split, read_beir(folder, cfg.eval_split, reader))
                for name, folder in folders}
    if _holds_out(cfg):
        return {Path(cfg.path).name: _held_out_pool(cfg)}
    folder, split = _eval_location(cfg, kind, data_folder)
    return {folder.name: _finish_pool(cfg, kind, folder, split, read_beir(folder, split, reader))}


def check_paths(cfg: Any) -> str:
    """The kind of a data config, after checking that the paths both sides need are given and exist."""
    kind = check_train_paths(cfg)
    if _value(cfg, "eval_dirs"):
        eval_folders(cfg)
    elif kind in PAIR_KINDS or (kind == "documents" and _value(cfg, "eval_dir")):
        _need(cfg, "eval_dir", kind, _EVAL_DIRS, file=False)
    return kind


def check_train_paths(cfg: Any) -> str:
    """The kind of a data config, after checking that its training input is given and exists
    (``data.sources``: every source's, before the first one is converted)."""
    kind = _check_kind(cfg)
    if kind in PAIR_KINDS or kind == "documents":
        _train_input(cfg, kind)
    elif kind == "beir":
        _need(cfg, "dir", kind, _BEIR_DIR, file=False)
    return kind


def load(cfg: Any) -> tuple[TrainingPairs, EvalPool]:
    """Both sides (what training needs): :func:`load_training_pairs` and :func:`load_eval_pool`,
    checking every required path before reading anything, and reading a BEIR folder's corpus once."""
    kind = check_paths(cfg)
    if kind == "documents":
        raise DataError("data=documents: its pairs are made as they are drawn (read them with load_training_rows)")
    if kind != "beir" or _value(cfg, "eval_dirs"):
        train = load_training_pairs(cfg)
        return train, load_eval_pool(cfg, train.folder)
    d = _need(cfg, "dir", kind, _BEIR_DIR, file=False)
    splits = read_beir_splits(d, [cfg.train_split, cfg.eval_split])
    train = _finish_pairs(cfg, kind, _beir_pairs(cfg, d, splits[cfg.train_split]))
    return train, _finish_pool(cfg, kind, d, cfg.eval_split, splits[cfg.eval_split])


def load_document_corpus(cfg: Any) -> tuple[Any, str]:
    """:func:`load_documents` as a corpus view (corpus_store.py): ``beir``'s corpus.jsonl as a
    memory-mapped store (converted once per content), the other kinds' documents in a CorpusDict."""
    from moco_retrieval.data.corpus_store import CorpusDict, corpus_store

    if cfg.kind == "beir" and _value(cfg, "dir"):
        p = Path(cfg.dir).expanduser() / "corpus.jsonl"
        if p.is_file():
            return corpus_store(p, corpus_root(cfg)), str(p)
    docs, desc = load_documents(cfg)
    return CorpusDict(docs), desc


def load_documents(cfg: Any) -> tuple[dict[str, str], str]:
    """Every document of a data config, uncapped: ``({doc id: text}, description)`` (the search corpus).

    ``debian``: the training positives (the package name as id) and the held-out corpus;
    ``beir``: ``dir``'s corpus.jsonl; ``jsonl`` / ``parquet`` / ``csv`` / ``hf``: the training positives of
    ``train_path`` (hf: ``path``) and/or ``eval_dir``'s corpus (at least one of them)."""
    kind = cfg.kind
    docs: dict[str, str] = {}

    def add_pairs(pairs: list[Pair]) -> None:
        for pair in pairs:
            docs.setdefault(pair.query_id or str(pair.doc_id), pair.positive)

    def add_corpus(path: Path) -> None:
        for did, text in read_corpus(path).items():
            docs.setdefault(did, text)

    if kind == "debian":
        d = debian_folder(cfg)
        add_pairs(read_pairs_jsonl(d / "train.jsonl"))
        add_corpus(d / "eval" / "corpus.jsonl")
        return docs, f"Debian package descriptions ({d})"
    if kind == "documents":
        source = PairStore(prepare_store(cfg))
        for i, pair in enumerate(source.take(range(len(source)))):
            docs.setdefault(pair.query_id or str(pair.doc_id), pair.positive)
        return docs, f"documents of data.path ({cfg.path})"
    if kind == "beir":
        if not _value(cfg, "dir"):
            raise DataError("data.dir is required with data=beir (or give corpus=PATH)")
        p = Path(cfg.dir).expanduser() / "corpus.jsonl"
        return read_corpus(p), str(p)
    if kind in PAIR_KINDS:
        if _value(cfg, "path" if kind == "hf" else "train_path"):
            add_pairs(_pairs_file(cfg, kind).pairs)
        if _value(cfg, "eval_dir"):
            add_corpus(Path(cfg.eval_dir).expanduser() / "corpus.jsonl")
        if not docs:
            raise DataError(f"data={kind}: set data.train_path and/or data.eval_dir (or give corpus=PATH)")
        return docs, "data.train_path + data.eval_dir"
    raise DataError(f"data.kind={kind!r}: expected one of {', '.join(DataKind)}")


__all__ = [
    "PAIR_KINDS",
    "TrainingPairs",
    "EvalPool",
    "subset",
    "cap_training_pairs",
    "cap_eval_set",
    "debian_folder",
    "load_training_pairs",
    "TrainingRows",
    "store_root",
    "pair_spec",
    "prepare_store",
    "load_training_rows",
    "load_eval_pool",
    "load_eval_pool_mapped",
    "load_eval_pools",
    "eval_folders",
    "check_paths",
    "check_train_paths",
    "load",
    "load_documents",
    "load_document_corpus",
    "corpus_root",
]
