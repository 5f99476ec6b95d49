"""Documents alone (``data=documents``): a corpus without queries, turned into pairs on the fly.

**Reading.** ``data.path`` is a JSONL, Parquet or CSV file, a ``datasets`` folder (hf_folder.py), or
a folder of ``.txt`` / ``.md`` files (one document each, its path the id). Columns
``data.columns.text`` (required), ``title`` and ``id`` (optional). Each document is stored as a row of
the pair store (convert.py): the text as the positive, the title as the query (empty without one),
the id as the document id (a hash of the text without one), so it is converted once and
memory-mapped like pairs, and a bad row stops the run as ``FILE:LINE: column 'text': ...``.

**Views** (:func:`make_views`, ``data.views``), Contriever's by default (Izacard et al. 2021, §3.1):
two independent random spans of 10-50% of the document's words, then each word of each span dropped
with probability 0.1. ``pairs=title`` pairs the title with the body, ``first_sentence`` the first
sentence with the rest; a document without a title or a second sentence falls back to crops. Spans
are cut on whitespace words, not on a tokenizer's pieces: a view is text, so prompts and the model's
own tokenizer apply to it as to any pair. Both views keep the document's id, so the id masks the
document's other views in the batch (the sampler keeps an id out of a batch twice) and in the queue.

**Determinism.** The views of a row drawn at step ``step`` of epoch ``epoch`` come from a generator
seeded by ``(seed, epoch, step, row)`` (the sampler's :class:`~.sampler.Draw` carries both), so a
resumed run draws the same views, a row drawn twice in an epoch (a small source's second pass) gets
new ones, and ranks, which draw different rows, never crop alike.

**Validation** without ``data.eval_dir``: :func:`held_out` documents (the smaller of 1,000 and a
tenth, seeded) are kept out of training; each one's query is a fixed crop of it (its views at
epoch -1), its corpus the held-out documents whole. It tells whether a crop still finds its
document (a collapsing space does not); a real query set (``data.eval_dir``) measures retrieval.
"""
from __future__ import annotations

import csv
import re
from types import SimpleNamespace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from moco_retrieval.data.convert import PairSpec
from moco_retrieval.data.formats import DataError, EvalSet, Pair, iter_jsonl
from moco_retrieval.data.ids import NO_GROUP, doc_id_for_text, stable_id
from moco_retrieval.data.store import PairRowsDataset

TEXT_SUFFIXES = (".txt", ".md")
HELD_OUT_MAX, HELD_OUT_SHARE = 1000, 0.1  # validation documents without data.eval_dir: at most, and at most this share
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_FORMS = "a JSONL, Parquet or CSV file, a datasets folder, or a folder of .txt / .md files"


# ------------------------------------------------------------------------------------- reading


def _names(columns: Any) -> dict[str, str]:
    return {f: str(getattr(columns, f, None) or f) for f in ("text", "title", "id")}


def document_pair(obj: dict, where: str, names: dict[str, str]) -> Pair:
    """One document record (``{column: value}``) as a stored row; ``where`` locates it in messages."""
    col = names["text"]
    text = obj.get(col)
    if not isinstance(text, str):
        got = "nothing" if text is None else type(text).__name__
        raise DataError(f"{where}: column {col!r} (data.columns.text): expected the document's text, got {got}")
    if not text.strip():
        raise DataError(f"{where}: column {col!r} (data.columns.text) is empty")
    title = obj.get(names["title"])
    if title is not None and not isinstance(title, str):
        raise DataError(f"{where}: column {names['title']!r} (data.columns.title): expected a text, "
                        f"got {type(title).__name__}")
    given = obj.get(names["id"])
    if given is not None and (isinstance(given, bool) or not isinstance(given, (str, int)) or not str(given).strip()):
        raise DataError(f"{where}: column {names['id']!r} (data.columns.id): expected a non-empty string or "
                        f"integer id, got {given!r}")
    doc_id = doc_id_for_text(text) if given is None else stable_id(str(given))
    return Pair(query=title or "", positive=text, doc_id=doc_id, group=NO_GROUP,
                query_id=None if given is None else str(given), given_doc_id=given)


def _csv_records(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            for record in reader:
                yield reader.line_num, {k: (v or None) for k, v in record.items() if k is not None}
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except csv.Error as e:
        raise DataError(f"{path}: {e}") from None


def _table_records(table: Any, names: dict[str, str]) -> Iterator[tuple[int, dict]]:
    cols = [c for c in names.values() if c in table.header]
    row = 0
    for records in table.batches(cols):
        for record in records:
            row += 1
            yield row, record


def text_files(folder: Path) -> list[Path]:
    """The ``.txt`` / ``.md`` files under ``folder``, in path order."""
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file())


def _file_record(folder: Path, p: Path) -> dict:
    try:
        return {"text": p.read_text(encoding="utf-8"), "id": str(p.relative_to(folder))}
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text (byte {e.start})") from None


def _need_columns(where: str, header: Sequence[str], names: dict[str, str]) -> None:
    missing = [(f, c) for f, c in names.items() if c not in header and (f == "text" or c != f)]
    if missing:
        f, c = missing[0]
        raise DataError(f"{where}: no column {c!r} (data.columns.{f}); its columns: {', '.join(header) or '(none)'}")


def document_spec(path: Path, columns: Any, split: str) -> PairSpec:
    """What convert.py converts of a documents input: one stored row per document (rows yield
    ``(file index, line, Pair)``), keyed by the files and how they are read."""
    names = _names(columns)

    def spec(inputs: list[Path], options: dict, files: list[str], location: str, rows: Any, count: Any) -> PairSpec:
        return PairSpec(str(path), inputs, {"kind": "documents", **options}, files, location, rows, count)

    if path.is_dir():
        files = text_files(path)
        if files:
            names = {"text": "text", "title": "title", "id": "id"}
            rows = lambda: ((i, 1, document_pair(_file_record(path, f), str(f), names))  # noqa: E731
                            for i, f in enumerate(files))
            return spec(files, {"form": "text_files"}, [str(f) for f in files], "{file}", rows, lambda: len(files))
        from moco_retrieval.data.hf_folder import hf_input_files, hf_tables

        try:
            tables = hf_tables(path, split)
        except DataError as e:
            raise DataError(f"{e} (or .txt / .md files)") from None
        for t in tables:
            _need_columns(t.where, t.header, names)

        def table_rows() -> Iterator[tuple[int, int, Pair]]:
            for i, t in enumerate(tables):
                for row, r in _table_records(t, names):
                    yield i, row, document_pair(r, f"{t.where}: row {row}", names)

        return spec(hf_input_files(path, tables), {"form": "hf", "split": split, "columns": names},
                    [t.where for t in tables], "{file}: row {line}", table_rows, lambda: sum(t.rows for t in tables))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = lambda: ((0, line, document_pair(r, f"{path}:{line}", names))  # noqa: E731
                        for line, r in iter_jsonl(path, "documents"))
        return spec([path], {"form": "jsonl", "columns": names}, [str(path)], "{file}:{line}", rows, lambda: 0)
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            _need_columns(str(path), next(csv.reader(f), []), names)
        rows = lambda: ((0, line, document_pair(r, f"{path}: row {line}", names))  # noqa: E731
                        for line, r in _csv_records(path))
        return spec([path], {"form": "csv", "columns": names}, [str(path)], "{file}: row {line}", rows, lambda: 0)
    if suffix == ".parquet":
        from moco_retrieval.data.hf_folder import parquet_tables

        (table,) = parquet_tables([path])
        _need_columns(table.where, table.header, names)
        rows = lambda: ((0, row, document_pair(r, f"{path}: row {row}", names))  # noqa: E731
                        for row, r in _table_records(table, names))
        return spec([path], {"form": "parquet", "columns": names}, [str(path)], "{file}: row {line}", rows,
                    lambda: table.rows)
    raise DataError(f"data.path={path}: expected {_FORMS} (by its suffix: .jsonl, .parquet, .csv)")


# --------------------------------------------------------------------------------------- views


def _words(text: str) -> list[str]:
    return text.split()


def crop(words: list[str], rng: np.random.Generator, lo: float, hi: float) -> list[str]:
    """A random span of ``lo``-``hi`` of ``words`` (at least one word)."""
    n = len(words)
    length = max(1, int(round(rng.uniform(lo, hi) * n)))
    start = int(rng.integers(0, n - length + 1))
    return words[start : start + length]


def delete(words: list[str], rng: np.random.Generator, p: float) -> list[str]:
    """Each word dropped with probability ``p`` (one kept when all would go)."""
    if p <= 0:
        return words
    keep = rng.random(len(words)) >= p
    return [w for w, k in zip(words, keep) if k] or words[:1]


def make_views(pair: Pair, rng: np.random.Generator, views: Any) -> tuple[str, str]:
    """``(query, document)`` made from one stored document (see the module docstring)."""
    words = _words(pair.positive)
    first: Optional[list[str]] = None
    if views.pairs == "title" and pair.query.strip():
        first, second = _words(pair.query), words
    elif views.pairs == "first_sentence":
        parts = _SENTENCE_END.split(pair.positive.strip(), maxsplit=1)
        if len(parts) == 2 and parts[1].strip():
            first, second = _words(parts[0]), _words(parts[1])
    if first is None:  # crops (or the fallback of a document without a title / a second sentence)
        first = crop(words, rng, views.crop_min, views.crop_max)
        second = crop(words, rng, views.crop_min, views.crop_max)
    return " ".join(delete(first, rng, views.deletion)), " ".join(delete(second, rng, views.deletion))


def view_rng(seed: int, epoch: int, step: int, row: int) -> np.random.Generator:
    # epoch -1 (validation's fixed crops) as a separate non-negative stream
    return np.random.default_rng([int(seed), int(epoch) + 1, int(step), int(row)])


def as_pair(pair: Pair, views: tuple[str, str]) -> Pair:
    return Pair(query=views[0], positive=views[1], doc_id=pair.doc_id, group=pair.group, query_id=pair.query_id,
                given_doc_id=pair.given_doc_id)


class DocumentViews(PairRowsDataset):
    """The training rows, with every document row replaced by its views at the draw: ``views[s]`` is
    source ``s``'s ``data.views`` (None: a source of pairs, left as is); ``offsets`` the sources' rows
    (one source: ``[0, rows]``). Reads each batch's :class:`~.sampler.Draw` for its epoch and step."""

    def __init__(self, rows: Any, views: Sequence[Any], offsets: Sequence[int], seed: int):
        super().__init__(rows)
        self.views, self.offsets, self.seed = list(views), np.asarray(offsets), int(seed)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[int, Pair]]:
        epoch, step = getattr(indices, "epoch", 0), getattr(indices, "step", 0)
        out = []
        for i, pair in super().__getitems__(indices):
            v = self.views[int(np.searchsorted(self.offsets, i, side="right")) - 1]
            out.append((i, pair if v is None else as_pair(pair, make_views(pair, view_rng(self.seed, epoch, step, i), v))))
        return out


# ---------------------------------------------------------------------------------- validation


def held_out(n: int, seed: int) -> np.ndarray:
    """The sorted rows kept out of training for validation (see the module docstring)."""
    k = min(HELD_OUT_MAX, int(n * HELD_OUT_SHARE))
    if k < 1:
        raise DataError(f"data=documents without data.eval_dir holds out a tenth of the documents for validation, "
                        f"but {n} make none: give at least 10 documents, or data.eval_dir")
    return np.sort(np.random.default_rng([int(seed), 4]).permutation(n)[:k])


def held_out_pool(rows: Any, keep: np.ndarray, views: Any, seed: int) -> EvalSet:
    """The validation pool of the held-out rows ``keep`` of a documents store: a fixed crop of each
    (crops whatever ``views.pairs``: a title would be the pool's one query per document) against
    the documents whole."""
    pairs = rows.take(keep.tolist())
    crops = SimpleNamespace(pairs="crops", crop_min=views.crop_min, crop_max=views.crop_max, deletion=views.deletion)
    corpus, queries, qrels = {}, {}, {}
    for row, pair in zip(keep.tolist(), pairs):
        did = f"d{row}"
        corpus[did] = pair.positive
        queries[f"q{row}"] = make_views(pair, view_rng(seed, -1, 0, row), crops)[0]
        qrels[f"q{row}"] = {did: 1}
    return EvalSet(corpus=corpus, queries=queries, qrels=qrels)


__all__ = ["HELD_OUT_MAX", "HELD_OUT_SHARE", "TEXT_SUFFIXES", "DocumentViews", "as_pair", "crop", "delete",
           "document_pair", "document_spec", "held_out", "held_out_pool", "make_views", "text_files", "view_rng"]
