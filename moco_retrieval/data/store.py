"""Training pairs on disk: a converted store (written by :mod:`.convert`) opened memory-mapped.

A store is a folder::

    pairs.arrow      Arrow stream (the format ``datasets`` writes; ``Dataset.from_file`` opens it), one row per
                     pair: query, positive, query_id, positive_score, negatives (list of {text, doc_id,
                     group, score})
    doc_id.npy group.npy n_neg.npy     int64, int64, int32 per row: what the sampler and the masks need
    scored.npy       bool per row: a teacher scored its positive and every negative (formats.Pair.scored),
                     what a distilling run checks before the model loads
    file.npy line.npy                  per row, the input file (index into manifest "files") and its line/row
    offsets.npy      row offsets of the sources in the store ([0, rows] for one; concatenated sources add theirs)
    manifest.json    version, rows, files, location template, conversion time; ``contents``: each
                     file's size and sha256 (:func:`seal`)

A store is trusted only as far as :func:`check_folder` finds it whole: on every open (cheap: each
file's size, the numpy arrays' sha256, a few bytes a row, and the table's row count from its batch
headers, never its texts) and, with ``full``, the sha256 of every file (``prepare --verify``).

Every process memory-maps the same pages (``np.load(mmap_mode="r")`` and Arrow's memory map), so
nothing is parsed again and the pages are shared by the ranks of a node. :class:`PairRows` is the
view training uses (a store, pairs already in memory, or several of them concatenated:
:class:`ConcatStores`, with the per-source offsets a multi-source sampler takes), with the rows a
cap keeps; its :meth:`~PairRows.take` reads one batch's rows.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from torch.utils.data import Dataset

from moco_retrieval.files import sha256_file

from moco_retrieval.data.formats import Negative, Pair

STORE_VERSION = 3  # 2: the manifest's contents (sizes and sha256), checked on open; 3: scored.npy, finite scores
TABLE = "pairs.arrow"
MANIFEST = "manifest.json"
ARRAYS = ("doc_id", "group", "n_neg", "scored", "file", "line", "offsets")


def read_manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST).read_text())


# ------------------------------------------------------------------------------------ integrity


def seal(folder: Path, manifest: dict) -> dict:
    """Write ``manifest`` into ``folder`` with the size and sha256 of every other file there
    (``contents``, what :func:`check_folder` compares); the manifest written. Last step of a conversion."""
    folder = Path(folder)
    contents = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {**manifest, "contents": contents}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _table_rows(path: Path) -> int:
    """Rows of an Arrow stream from its record batch headers (memory-mapped: the data pages are not read)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


def check_folder(folder: Path, full: bool = False) -> Optional[str]:
    """What makes the converted ``folder`` untrustworthy, in a few words naming the file (None: it
    matches its manifest). Every open: the manifest, each file's size, the sha256 of the numpy
    arrays and the Arrow table's row count; ``full``: the sha256 of every file."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is not readable JSON ({type(e).__name__})"
    contents = manifest.get("contents") if isinstance(manifest, dict) else None
    if not isinstance(contents, dict) or not contents or not isinstance(manifest.get("rows"), int):
        return f"{MANIFEST} lists no contents (a store of an older version, or not a store)"
    if not all(isinstance(w, dict) and isinstance(w.get("bytes"), int) and isinstance(w.get("sha256"), str)
               for w in contents.values()):
        return f"{MANIFEST} is not a store's manifest (its contents are not sizes and sha256s)"
    unlisted = sorted(p.name for p in folder.iterdir()  # (a dot file: NFS's place for a file deleted while open)
                      if p.name != MANIFEST and p.name not in contents and not p.name.startswith("."))
    if unlisted:
        return f"{unlisted[0]} is not in the manifest"
    for name, want in contents.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} holds {path.stat().st_size:,} bytes, the manifest says {want['bytes']:,}"
    for name, want in contents.items():
        if (full or name.endswith(".npy")) and sha256_file(folder / name) != want["sha256"]:
            return f"{name} differs from its sha256 in the manifest (changed on disk)"
        if name.endswith(".arrow"):
            try:
                rows = _table_rows(folder / name)
            except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
                return f"{name} is not a readable Arrow stream ({type(e).__name__})"
            if rows != manifest["rows"]:
                return f"{name} holds {rows:,} rows, the manifest says {manifest['rows']:,}"
    return None


class MappedFolder:
    """A converted folder, opened lazily: its manifest, its numpy arrays (memory-mapped) and its Arrow
    table (``TABLE_FILE``, memory-mapped through pyarrow: the stream ``datasets.Dataset.from_file``
    opens too, without importing ``datasets`` in every rank and worker). Pickled as its folder, so
    DataLoader workers open their own maps. The pair store and the corpus store are both one."""

    TABLE_FILE = TABLE

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self._unmap()

    def _unmap(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._table: Any = None
        self._batches: list = []
        self._batch_starts = np.zeros(1, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.manifest["rows"])

    def array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = np.load(self.folder / f"{name}.npy", mmap_mode="r")
        return self._arrays[name]

    @property
    def table(self) -> Any:
        if self._table is None:
            import pyarrow as pa

            self._table = pa.ipc.open_stream(pa.memory_map(str(self.folder / self.TABLE_FILE))).read_all()
            self._batches = self._table.to_batches()
            self._batch_starts = np.cumsum([0] + [len(b) for b in self._batches])
        return self._table

    def gather(self, rows: Sequence[int], column: Optional[str] = None) -> list:
        """The records (dicts), or one column's values, at ``rows`` in the order asked, taken from each
        record batch they fall in (a take on the whole table would first concatenate its chunks: the
        whole file in memory, in every worker)."""
        import pyarrow as pa

        _ = self.table
        rows = np.asarray(rows, dtype=np.int64)
        batch_of = np.searchsorted(self._batch_starts, rows, side="right") - 1
        out: list = [None] * len(rows)
        for b in np.unique(batch_of):
            at = np.flatnonzero(batch_of == b)
            batch = self._batches[int(b)]
            source = batch if column is None else batch.column(batch.schema.get_field_index(column))
            for k, value in zip(at.tolist(), source.take(pa.array(rows[at] - self._batch_starts[b])).to_pylist()):
                out[k] = value
        return out

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "manifest": self.manifest}

    def __setstate__(self, state: dict) -> None:
        self.folder, self.manifest = state["folder"], state["manifest"]
        self._unmap()


class PairStore(MappedFolder):
    """A converted pair store: the pairs of a batch's rows as :class:`Pair` objects, ids and groups
    from the memory-mapped arrays."""

    def open(self) -> None:
        """Map the table and the arrays now (e.g. before DataLoader workers fork, so that they share
        the maps and the imported modules instead of each opening its own)."""
        for name in ("doc_id", "group", "n_neg"):
            self.array(name)
        _ = self.table

    def where(self, row: int) -> str:
        files = self.manifest["files"]
        return self.manifest["location"].format(file=files[int(self.array("file")[row])], line=int(self.array("line")[row]))

    def take(self, rows: Sequence[int]) -> list[Pair]:
        """The pairs at ``rows`` (one read of the table for all of them)."""
        rows = np.asarray(rows, dtype=np.int64)
        records = self.gather(rows)
        ids, groups = self.array("doc_id")[rows], self.array("group")[rows]
        return [_pair(rec, int(d), int(g)) for rec, d, g in zip(records, ids, groups)]

    def column(self, name: str) -> list:
        """One text column of every row (e.g. every query, for frozen features)."""
        return self.table.column(name).to_pylist()

def _pair(rec: dict, doc_id: int, group: int) -> Pair:
    negs = [Negative(doc_id=n["doc_id"], text=n["text"], score=n["score"], group=n["group"]) for n in rec["negatives"] or ()]
    return Pair(query=rec["query"], positive=rec["positive"], doc_id=doc_id, group=group, query_id=rec["query_id"],
                negatives=negs, positive_score=rec["positive_score"])

class PairList:
    """Pairs already in memory (BEIR qrels, ``from_loaded``) behind the interface of :class:`PairStore`."""

    def __init__(self, pairs: Sequence[Pair], where: Optional[Sequence[str]] = None):
        self.pairs, self._where = list(pairs), list(where) if where is not None else None
        if self._where is not None and len(self._where) != len(self.pairs):
            raise ValueError(f"{len(self._where)} source locations for {len(self.pairs)} training pairs")
        self._arrays = {
            "doc_id": np.array([p.doc_id for p in self.pairs], dtype=np.int64),
            "group": np.array([p.group for p in self.pairs], dtype=np.int64),
            "n_neg": np.array([len(p.negatives) for p in self.pairs], dtype=np.int32),
            "scored": np.array([p.scored for p in self.pairs], dtype=bool),
        }

    def __len__(self) -> int:
        return len(self.pairs)

    def array(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def open(self) -> None:
        """Nothing to open: the pairs are in memory."""

    def where(self, row: int) -> Optional[str]:
        return self._where[row] if self._where is not None else None

    def take(self, rows: Sequence[int]) -> list[Pair]:
        return [self.pairs[int(r)] for r in rows]

    def column(self, name: str) -> list:
        return [getattr(p, name) for p in self.pairs]

class Segments:
    """Several arrays as one sequence without joining them: a slice within one of them is a view of
    it (a source's memory-mapped ids stay mapped and shared, as the multi-source sampler slices them
    per source); any other slice joins the pieces it covers."""

    def __init__(self, parts: Sequence[np.ndarray]):
        self.parts = list(parts)
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            return self.join()[key]
        a, b, _ = key.indices(len(self))
        s = int(np.searchsorted(self.offsets, a, side="right")) - 1
        if s < len(self.parts) and b <= self.offsets[s + 1]:
            base = int(self.offsets[s])
            return self.parts[s][a - base : max(a, b) - base]
        return self.join()[a:b]

    def join(self) -> np.ndarray:
        return np.concatenate([np.asarray(p) for p in self.parts])

class ConcatStores:
    """Several stores (or pair lists) as one, source after source: row ``offsets[s] + i`` is row ``i``
    of source ``s`` (what a multi-source run samples from; the per-source ``offsets`` array is the
    sampler's). Texts stay in each store; :meth:`array` joins a numeric column (in memory, on each
    call), :meth:`segments` gives it per source without a copy."""

    def __init__(self, sources: Sequence[Any]):
        if not sources:
            raise ValueError("no sources to concatenate")
        self.sources = list(sources)
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in self.sources])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def array(self, name: str) -> np.ndarray:
        if name == "offsets":
            return self.offsets
        return self.segments(name).join()

    def segments(self, name: str) -> Segments:
        """Column ``name`` of every source, each its own array (a store's: memory-mapped)."""
        return Segments([s.array(name) for s in self.sources])

    def open(self) -> None:
        for s in self.sources:
            s.open()

    def _split(self, row: int) -> tuple[int, int]:
        s = int(np.searchsorted(self.offsets, row, side="right")) - 1
        return s, int(row) - int(self.offsets[s])

    def where(self, row: int) -> Optional[str]:
        s, i = self._split(row)
        return self.sources[s].where(i)

    def take(self, rows: Sequence[int]) -> list[Pair]:
        """The pairs at ``rows``, one read per source touched, in the order asked."""
        rows = np.asarray(rows, dtype=np.int64)
        src = np.searchsorted(self.offsets, rows, side="right") - 1
        out: list[Optional[Pair]] = [None] * len(rows)
        for s in np.unique(src):
            at = np.flatnonzero(src == s)
            for k, pair in zip(at, self.sources[int(s)].take((rows[at] - self.offsets[s]).tolist())):
                out[int(k)] = pair
        return out  # type: ignore[return-value]

    def column(self, name: str) -> list:
        return [v for s in self.sources for v in s.column(name)]

class PairRows:
    """Training rows: a :class:`PairStore` or :class:`PairList` and the rows of it kept (a cap), in
    order. Index ``i`` of the view is row ``rows[i]`` of the source."""

    def __init__(self, source: Any, rows: Optional[np.ndarray] = None):
        self.source = source
        self.rows = None if rows is None else np.asarray(rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.source) if self.rows is None else len(self.rows)

    def array(self, name: str) -> np.ndarray:
        """A numeric column of the kept rows (so a capped view can be one source of :class:`ConcatStores`)."""
        a = self.source.array(name)
        return a if self.rows is None else a[self.rows]

    @property
    def doc_ids(self) -> np.ndarray:
        return self.array("doc_id")

    @property
    def groups(self) -> np.ndarray:
        return self.array("group")

    @property
    def negative_counts(self) -> np.ndarray:
        return self.array("n_neg")

    @property
    def scored(self) -> np.ndarray:
        """Whether each row carries a teacher's scores (formats.Pair.scored)."""
        return self.array("scored")

    def open(self) -> None:
        self.source.open()

    def _row(self, i: int) -> int:
        return int(i) if self.rows is None else int(self.rows[int(i)])

    def where(self, i: int) -> Optional[str]:
        return self.source.where(self._row(i))

    def take(self, indices: Sequence[int]) -> list[Pair]:
        return self.source.take([self._row(i) for i in indices])

    def column(self, name: str) -> list:
        values = self.source.column(name)
        return values if self.rows is None else [values[int(r)] for r in self.rows]

    def pairs(self) -> list[Pair]:
        """Every row as a Pair (small sets and tests: a store's rows stay on disk otherwise)."""
        return self.take(range(len(self)))

class PairRowsDataset(Dataset):
    """``(index, Pair)`` items (what the collate takes); a batch's rows are read in one go
    (``__getitems__``, which the DataLoader calls with the sampler's batch)."""

    def __init__(self, rows: PairRows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[int, Pair]:
        return int(i), self.rows.take([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[int, Pair]]:
        return list(zip((int(i) for i in indices), self.rows.take(indices)))

__all__ = ["STORE_VERSION", "TABLE", "MANIFEST", "ARRAYS", "read_manifest", "seal",
           "check_folder", "PairStore", "PairList",
           "Segments", "ConcatStores", "PairRows", "PairRowsDataset"]
