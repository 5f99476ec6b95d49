"""Rows into a store's files (the layout in store.py): the Arrow table in record batches and the numpy
columns. It imports neither torch nor the store's readers, so the conversion's worker processes
(parallel.py) start in a fraction of a second.

A record batch holds ``CHUNK`` rows or about ``CHUNK_CHARS`` characters of text, whichever comes
first (:func:`chunks`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from moco_retrieval.data.formats import Pair

CHUNK = 8192  # rows per Arrow record batch, at most
CHUNK_CHARS = 1 << 25  # and at most about this many characters of text (rows with many hard negatives)

Row = tuple[int, int, Pair]  # (file index, line or row, pair)


def store_schema():
    import pyarrow as pa

    negative = pa.struct([("text", pa.string()), ("doc_id", pa.int64()), ("group", pa.int64()), ("score", pa.float64())])
    return pa.schema([("query", pa.string()), ("positive", pa.string()), ("query_id", pa.string()),
                      ("positive_score", pa.float64()), ("negatives", pa.list_(negative))])


def row_chars(p: Pair) -> int:
    """The characters of text a row puts into the table (what cuts record batches)."""
    return len(p.query) + len(p.positive) + sum(len(n.text) for n in p.negatives)


class Columns:
    """One record batch's worth of rows, as flat columns."""

    def __init__(self) -> None:
        self.query: list = []
        self.positive: list = []
        self.query_id: list = []
        self.positive_score: list = []
        self.neg_offsets = [0]
        self.neg_text: list = []
        self.neg_id: list = []
        self.neg_group: list = []
        self.neg_score: list = []

    def add(self, p: Pair) -> None:
        self.query.append(p.query)
        self.positive.append(p.positive)
        self.query_id.append(p.query_id)
        self.positive_score.append(p.positive_score)
        for n in p.negatives:
            self.neg_text.append(n.text)
            self.neg_id.append(n.doc_id)
            self.neg_group.append(n.group)
            self.neg_score.append(n.score)
        self.neg_offsets.append(len(self.neg_text))

    def record_batch(self, schema):
        import pyarrow as pa

        neg_type = schema.field("negatives").type.value_type
        negs = pa.StructArray.from_arrays(
            [pa.array(self.neg_text, pa.string()), pa.array(self.neg_id, pa.int64()),
             pa.array(self.neg_group, pa.int64()), pa.array(self.neg_score, pa.float64())],
            fields=list(neg_type),
        )
        return pa.RecordBatch.from_arrays(
            [pa.array(self.query, pa.string()), pa.array(self.positive, pa.string()), pa.array(self.query_id, pa.string()),
             pa.array(self.positive_score, pa.float64()),
             pa.ListArray.from_arrays(pa.array(self.neg_offsets, pa.int32()), negs)],
            schema=schema,
        )


def numbers(rows: list[Row]) -> dict[str, np.ndarray]:
    """The numpy columns of ``rows`` (of none: each column empty, with its type)."""
    return {
        "doc_id": np.array([p.doc_id for _, _, p in rows], dtype=np.int64),
        "group": np.array([p.group for _, _, p in rows], dtype=np.int64),
        "n_neg": np.array([len(p.negatives) for _, _, p in rows], dtype=np.int32),
        "scored": np.array([p.scored for _, _, p in rows], dtype=bool),
        "file": np.array([f for f, _, _ in rows], dtype=np.int32),
        "line": np.array([line for _, line, _ in rows], dtype=np.int64),
    }


def chunks(it: Iterable[Row]) -> Iterator[list[Row]]:
    """Rows in chunks of ``CHUNK`` rows or ``CHUNK_CHARS`` characters, whichever comes first (what the
    converter holds as Python objects at once)."""
    chunk: list = []
    chars = 0
    for row in it:
        chunk.append(row)
        chars += row_chars(row[2])
        if len(chunk) == CHUNK or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def write_rows(rows: Iterable[Row], table: Path, done: Callable[[list[Row]], None]) -> dict[str, np.ndarray]:
    """Stream ``rows`` into the Arrow stream ``table`` in record batches; their numpy columns, joined.
    ``done(chunk)`` after each batch is written (progress)."""
    import pyarrow as pa

    schema = store_schema()
    parts = {k: [v] for k, v in numbers([]).items()}
    with pa.OSFile(str(table), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for chunk in chunks(rows):
            cols = Columns()
            for _, _, p in chunk:
                cols.add(p)
            writer.write_batch(cols.record_batch(schema))
            for k, v in numbers(chunk).items():
                parts[k].append(v)
            done(chunk)
    return {k: np.concatenate(v) for k, v in parts.items()}

__all__ = ["CHUNK", "CHUNK_CHARS", "Row", "store_schema", "row_chars", "Columns", "numbers", "chunks", "write_rows"]
