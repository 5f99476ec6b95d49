"""Training pairs from Parquet and CSV files (``data=parquet`` / ``data=csv``), with the JSONL
reader's fields and checks (formats.py) under configurable column names (``data.columns.*``).

Columns: ``query`` and ``positive`` required; ``query_id``, ``doc_id``, ``group``, ``negatives``,
``positive_score``, ``negative_scores`` optional (read when the file has the configured column). What sentence-transformers
trains on reads as it is, in every tabular kind (CSV, Parquet, ``datasets`` folders: hf_folder.py):
``anchor`` is the query when there is no ``query`` column, and ``negative`` / ``negative_1``,
``negative_2`` ... are the hard negatives when there is no ``negatives`` column (:func:`table_columns`). CSV: a header row,
every value a string (ids are hashed as strings; ``negatives`` and ``negative_scores`` JSON lists;
an empty cell is absent). Parquet (pyarrow): string columns, integer ids used as is, ``negatives`` a
list of strings or of ``{text, doc_id, group, score}`` structs, ``negative_scores`` a list of
numbers, a null is absent.

Every error names the file, the row (the CSV line; the Parquet row, counted from 1), the column and
what was expected, and the whole file is checked before training starts.
"""
from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from moco_retrieval.data.formats import DataError, Pair, PathLike, pair_from_json

FIELDS = ("query", "positive", "query_id", "doc_id", "group", "negatives", "positive_score", "negative_scores")
REQUIRED = ("query", "positive")


def column_names(columns: Any) -> dict[str, str]:
    """``{field: column}`` from a ``data.columns`` config (None: the field names themselves)."""
    if columns is None:
        return {f: f for f in FIELDS}
    return {f: str(getattr(columns, f, None) or f) for f in FIELDS}


def columns_in_file(path: PathLike, header: list[str], names: dict[str, str]) -> dict[str, str]:
    """The ``{field: column}`` to read: required columns must be there, and so must an optional
    one renamed in the config (a default-named optional column may be absent)."""
    have = set(header)
    for field, col in names.items():
        if col not in have and (field in REQUIRED or col != field):
            raise DataError(f"{path}: no column {col!r} (data.columns.{field}; expected the {field} of each pair); "
                            f"the file's columns: {', '.join(header) or '(none)'}")
    return {f: c for f, c in names.items() if c in have}


# sentence-transformers' column names, used when the configured (default) column is absent
ST_QUERY = "anchor"
_ST_NEGATIVE = re.compile(r"^negative(?:_(\d+))?$")


@dataclass
class TableColumns:
    """``{field: column}`` to read, and the sentence-transformers negative columns (in order)."""

    read: dict[str, str]
    negative_columns: list[str]

    def row_object(self, record: dict) -> dict:
        """A row's fields (a None is absent), the sentence-transformers negatives joined into ``negatives``."""
        obj = {f: record[c] for f, c in self.read.items() if record[c] is not None}
        if self.negative_columns:
            obj["negatives"] = [record[c] for c in self.negative_columns if record[c] is not None]
        return obj

    def labels(self) -> dict[str, str]:
        """The columns to name in an error, ``negatives`` as the sentence-transformers ones joined."""
        if not self.negative_columns:
            return self.read
        return dict(self.read, negatives=", ".join(self.negative_columns))


def st_negative_columns(header: list[str]) -> list[str]:
    """``negative``, ``negative_1``, ``negative_2`` ... of a header, in their numeric order."""
    found = [(int(m.group(1) or 0), c) for c in header if (m := _ST_NEGATIVE.match(c))]
    return [c for _, c in sorted(found)]


def table_columns(where: PathLike, header: list[str], columns: Any) -> TableColumns:
    """The configured columns (:func:`columns_in_file`'s rules), with the sentence-transformers names
    standing in for default-named ``query`` and ``negatives`` columns that the table lacks."""
    names = column_names(columns)
    have = set(header)
    if names["query"] == "query" and "query" not in have and ST_QUERY in have:
        names["query"] = ST_QUERY
    negs: list[str] = []
    if names["negatives"] == "negatives" and "negatives" not in have:
        negs = st_negative_columns(header)
    return TableColumns(columns_in_file(where, header, names), negs)


def pair_from_row(obj: dict, path: PathLike, row: int, read: dict[str, str]) -> Pair:
    """formats.pair_from_json on one row, its error re-located to the row and the column."""
    try:
        return pair_from_json(obj, path, row)
    except DataError as e:
        detail = str(e).removeprefix(f"{path}:{row}: ")
        field = next((f for f in read if f"'{f}'" in detail or detail.startswith(f)), None)
        where = f", column {read[field]!r}" if field else ""
        raise DataError(f"{path}: row {row}{where}: {detail}") from None


def _csv_value(field: str, value: str, path: PathLike, row: int, column: str) -> Any:
    if value == "":
        return None
    if field == "positive_score":
        try:
            return float(value)
        except ValueError:
            raise DataError(f"{path}: row {row}, column {column!r}: expected a number, got {value!r}") from None
    if field in ("negatives", "negative_scores"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            what = "texts or objects" if field == "negatives" else "numbers"
            raise DataError(f"{path}: row {row}, column {column!r}: expected a JSON list of {what} "
                            f"({e.msg} at character {e.pos})") from None
    return value


def read_pairs_csv_located(path: PathLike, columns: Any = None) -> list[tuple[int, Pair]]:
    """``(line, pair)`` of every row of a CSV file with a header."""
    return list(iter_pairs_csv_located(path, columns))


def iter_pairs_csv_located(path: PathLike, columns: Any = None) -> Iterator[tuple[int, Pair]]:
    """:func:`read_pairs_csv_located`, streamed."""
    p = Path(path)
    try:
        with open(p, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            cols = table_columns(p, list(reader.fieldnames or []), columns)
            for record in reader:
                row = reader.line_num
                if None in record:
                    raise DataError(f"{p}: row {row}: {len(record) - 1 + len(record[None])} values for "
                                    f"{len(reader.fieldnames)} columns")
                obj = {f: _csv_value(f, record[c] if record[c] is not None else "", p, row, c) for f, c in cols.read.items()}
                if cols.negative_columns:  # one text per column; an empty cell is absent
                    obj["negatives"] = [record[c] for c in cols.negative_columns if record[c]]
                yield row, pair_from_row(obj, p, row, cols.labels())
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except csv.Error as e:
        raise DataError(f"{p}: row {reader.line_num}: {e}") from None


def _parquet_rows(p: Path, names: list[str], groups: Optional[range] = None) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(p)
    for batch in table.iter_batches(columns=names, batch_size=8192, row_groups=groups):
        yield from batch.to_pylist()


def _parquet_schema(p: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(p).names)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not Parquet
        raise DataError(f"{p}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def read_pairs_parquet_located(path: PathLike, columns: Any = None) -> list[tuple[int, Pair]]:
    """``(row, pair)`` of every row of a Parquet file (rows counted from 1)."""
    return list(iter_pairs_parquet_located(path, columns))


def iter_pairs_parquet_located(path: PathLike, columns: Any = None, groups: Optional[range] = None) -> Iterator[tuple[int, Pair]]:
    """:func:`read_pairs_parquet_located`, streamed (of the row groups ``groups`` only: a part of a
    parallel conversion, its rows numbered as in the whole file)."""
    p = Path(path)
    cols = table_columns(p, _parquet_schema(p), columns)
    first = 1
    if groups is not None:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(p).metadata
        first += sum(meta.row_group(g).num_rows for g in range(groups.start))
    for row, record in enumerate(_parquet_rows(p, [*cols.read.values(), *cols.negative_columns], groups), first):
        yield row, pair_from_row(cols.row_object(record), p, row, cols.labels())


READERS = {"csv": read_pairs_csv_located, "parquet": read_pairs_parquet_located}
STREAMS = {"csv": iter_pairs_csv_located, "parquet": iter_pairs_parquet_located}


def read_pairs_table_located(path: PathLike, kind: str, columns: Optional[Any] = None) -> list[tuple[int, Pair]]:
    """The pairs of a ``kind`` ("csv" | "parquet") file, each with its row."""
    return READERS[kind](path, columns)


__all__ = ["FIELDS", "READERS", "STREAMS", "ST_QUERY", "TableColumns", "column_names", "columns_in_file", "st_negative_columns",
           "table_columns", "pair_from_row", "read_pairs_csv_located",
           "read_pairs_parquet_located", "iter_pairs_csv_located", "iter_pairs_parquet_located", "read_pairs_table_located"]
