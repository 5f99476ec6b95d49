"""Search and evaluation corpora on disk: a BEIR ``corpus.jsonl`` converted once into a store and
opened memory-mapped, like the training pairs (convert.py: content-keyed, atomic, locked, progress).

A corpus store is a folder::

    corpus.arrow     Arrow stream, one row per document in file order: doc_id (string), text (string)
    ids.npy          int64: the 63-bit ``stable_id`` of each doc_id (row order)
    group.npy        int64: each document's group (-1: none)
    length.npy       int64: each text's length in characters (the encoder's longest-first order)
    line.npy         int64: each document's line in the input
    manifest.json    version, rows, file, whether any group was given, conversion time, contents (store.seal)

:class:`CorpusStore` is the read-only, mapping-like view commands use (``len``, ``doc_ids`` in order,
``texts(rows)`` of a batch, ``text(doc_id)``); :class:`CorpusDict` gives a corpus already in memory
(``{doc id: text}``) the same interface, so the encoders stream either in batches.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from moco_retrieval.progress import progress_bar

from moco_retrieval.data.convert import ensure_store
from moco_retrieval.data.ids import NO_GROUP, stable_id
from moco_retrieval.data.store import MappedFolder
from moco_retrieval.data.writer import CHUNK

CORPUS_VERSION = 1
TABLE = "corpus.arrow"


@dataclass
class CorpusSpec:
    """A ``corpus.jsonl`` to convert (``name``, ``inputs`` and ``options`` key the store, as PairSpec's)."""

    path: Path
    name: str = ""
    inputs: list[Path] = field(default_factory=list)
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.name = self.name or str(self.path)
        self.inputs = [self.path]
        self.options = {"kind": "beir-corpus", "corpus_version": CORPUS_VERSION}


def _schema():
    import pyarrow as pa

    return pa.schema([("doc_id", pa.string()), ("text", pa.string())])


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 22), b""))


def write_corpus(spec: CorpusSpec, folder: Path) -> dict:
    """Stream ``spec.path``'s documents (validated by formats.iter_corpus_located: today's messages)
    into ``folder``; the manifest to seal (convert.ensure_store)."""
    import pyarrow as pa

    from moco_retrieval.data.formats import iter_corpus_located

    schema, t0 = _schema(), time.monotonic()
    numbers: dict[str, list] = {"ids": [], "group": [], "length": [], "line": []}
    ids: list[str] = []
    texts: list[str] = []
    bar = progress_bar(_count_lines(spec.path), f"converting {spec.name}", " documents")
    with pa.OSFile(str(folder / TABLE), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:

        def flush() -> None:
            writer.write_batch(pa.RecordBatch.from_arrays([pa.array(ids, pa.string()), pa.array(texts, pa.string())],
                                                          schema=schema))
            bar.update(len(ids))
            ids.clear()
            texts.clear()

        for line, did, doc, group in iter_corpus_located(spec.path):
            ids.append(did)
            texts.append(doc)
            for k, v in (("ids", stable_id(did)), ("group", NO_GROUP if group is None else group),
                         ("length", len(doc)), ("line", line)):
                numbers[k].append(v)
            if len(ids) == CHUNK:
                flush()
        if ids:
            flush()
    bar.close()
    for k, v in numbers.items():
        np.save(folder / f"{k}.npy", np.array(v, dtype=np.int64))
    n, seconds = len(numbers["ids"]), time.monotonic() - t0
    return {"version": CORPUS_VERSION, "rows": n, "file": str(spec.path), "name": spec.name,
            "has_groups": any(g != NO_GROUP for g in numbers["group"]),
            "converted_s": round(seconds, 3), "rows_per_s": round(n / max(seconds, 1e-9))}


class CorpusStore(MappedFolder):
    """A converted corpus, memory-mapped: ``len``, ``doc_ids`` (strings, in file order), ``ids``
    (their int64 ``stable_id``), ``texts(rows)`` (the texts of a batch of rows, one read per record
    batch), ``text(doc_id)``; no text is held beyond the batch asked for."""

    TABLE_FILE = TABLE

    def _unmap(self) -> None:
        super()._unmap()
        self._doc_ids: Optional[list[str]] = None
        self._sorted: Optional[tuple[np.ndarray, np.ndarray]] = None

    @property
    def ids(self) -> np.ndarray:
        return self.array("ids")

    @property
    def lengths(self) -> np.ndarray:
        return self.array("length")

    @property
    def doc_ids(self) -> list[str]:
        """Every document id, in file order (ids only: the texts stay on disk)."""
        if self._doc_ids is None:
            self._doc_ids = self.table.column("doc_id").to_pylist()
        return self._doc_ids

    def texts(self, rows: Sequence[int]) -> list[str]:
        """The texts at ``rows``, in the order asked."""
        return self.gather(rows, column="text")

    def row_of(self, doc_id: str) -> Optional[int]:
        """The row of ``doc_id`` (None: not in the corpus), by its int id (a sorted copy of ``ids``)."""
        if self._sorted is None:
            order = np.argsort(self.ids, kind="stable")
            self._sorted = (np.asarray(self.ids)[order], order)
        keys, order = self._sorted
        h = stable_id(doc_id)
        for j in range(int(np.searchsorted(keys, h)), len(keys)):
            if keys[j] != h:
                break
            row = int(order[j])
            if self.doc_ids[row] == doc_id:
                return row
        return None

    def text(self, doc_id: str, default: str = "") -> str:
        row = self.row_of(doc_id)
        return default if row is None else self.texts([row])[0]

    def __contains__(self, doc_id: object) -> bool:
        return isinstance(doc_id, str) and self.row_of(doc_id) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.doc_ids)

    def groups(self) -> dict[str, int]:
        """``{doc id: group}`` of the documents given one (ids and numbers only)."""
        if not self.manifest["has_groups"]:
            return {}
        g = np.asarray(self.array("group"))
        return {self.doc_ids[int(i)]: int(g[i]) for i in np.flatnonzero(g != NO_GROUP)}

    def select(self, keep: Any) -> dict[str, str]:
        """``{doc id: text}`` of the documents in ``keep``, in file order (a capped pool)."""
        rows = [i for i, d in enumerate(self.doc_ids) if d in keep]
        return dict(zip((self.doc_ids[i] for i in rows), self.texts(rows)))

    def to_dict(self) -> dict[str, str]:
        """Every document as ``{doc id: text}`` (small corpora and tests only)."""
        return dict(zip(self.doc_ids, self.texts(range(len(self)))))


class CorpusDict:
    """A corpus already in memory (``{doc id: text}``) behind :class:`CorpusStore`'s interface."""

    def __init__(self, corpus: Mapping[str, str]):
        self.corpus = corpus
        self.doc_ids = list(corpus)

    def __len__(self) -> int:
        return len(self.doc_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(self.corpus[d]) for d in self.doc_ids], dtype=np.int64)

    def texts(self, rows: Sequence[int]) -> list[str]:
        return [self.corpus[self.doc_ids[int(i)]] for i in rows]

    def text(self, doc_id: str, default: str = "") -> str:
        return self.corpus.get(doc_id, default)

    def to_dict(self) -> dict[str, str]:
        return dict(self.corpus)


def as_corpus(corpus: Any) -> Any:
    """A :class:`CorpusStore` / :class:`CorpusDict` as is; a mapping wrapped in a CorpusDict."""
    return corpus if isinstance(corpus, (CorpusStore, CorpusDict)) else CorpusDict(corpus)


def iter_texts(corpus: Any, size: int = CHUNK) -> Iterator[list[str]]:
    """Every text of ``corpus`` in row order, ``size`` at a time."""
    for start in range(0, len(corpus), size):
        yield corpus.texts(range(start, min(start + size, len(corpus))))


def store_reader(root: Path) -> Any:
    """A ``corpus_reader`` for formats.read_beir: corpus.jsonl as a store under ``root``, and its groups."""

    def read(path: Path) -> tuple[CorpusStore, dict[str, int]]:
        store = corpus_store(path, root)
        return store, store.groups()

    return read


def corpus_store(path: Path, root: Path) -> CorpusStore:
    """The store of the ``corpus.jsonl`` at ``path`` under ``root``, converted on first use (a changed
    file again; an unchanged one never)."""
    return CorpusStore(ensure_store(CorpusSpec(Path(path)), root, write_corpus))


__all__ = ["CORPUS_VERSION", "CorpusSpec", "write_corpus", "CorpusStore", "CorpusDict", "as_corpus", "iter_texts",
           "corpus_store", "store_reader"]
