"""Training pairs from Parquet and CSV files (``data=parquet`` / ``data=csv``), with the JSONL
reader's fields and checks (formats.py) under configurable column names (``data.columns.*``).

Columns: ``query`` and ``positive`` required; ``query_id``, ``doc_id``, ``group``, ``negatives``,
``positive_score`` optional (read when the file has the configured column). CSV: a header row,
every value a string (ids are hashed as strings; ``negatives`` a JSON list; an empty cell is
absent). Parquet (pyarrow): string columns, integer ids used as is, ``negatives`` a list of
strings or of ``{text, doc_id, group, score}`` structs, a null is absent.

Every error names the file, the row (the CSV line; the Parquet row, counted from 1), the column and
what was expected, and the whole file is checked before training starts.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Iterator, Optional

from moco_retrieval.data.formats import DataError, Pair, PathLike, pair_from_json

FIELDS = ("query", "positive", "query_id", "doc_id", "group", "negatives", "positive_score")
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
    if field == "negatives":
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: row {row}, column {column!r}: expected a JSON list of texts or objects "
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
            read = columns_in_file(p, list(reader.fieldnames or []), column_names(columns))
            for record in reader:
                row = reader.line_num
                if None in record:
                    raise DataError(f"{p}: row {row}: {len(record) - 1 + len(record[None])} values for "
                                    f"{len(reader.fieldnames)} columns")
                obj = {f: _csv_value(f, record[c] if record[c] is not None else "", p, row, c) for f, c in read.items()}
                yield row, pair_from_row(obj, p, row, read)
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except csv.Error as e:
        raise DataError(f"{p}: row {reader.line_num}: {e}") from None


def _parquet_rows(p: Path, read: dict[str, str]) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(p)
    for batch in table.iter_batches(columns=list(read.values()), batch_size=8192):
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


def iter_pairs_parquet_located(path: PathLike, columns: Any = None) -> Iterator[tuple[int, Pair]]:
    """:func:`read_pairs_parquet_located`, streamed."""
    p = Path(path)
    read = columns_in_file(p, _parquet_schema(p), column_names(columns))
    for row, record in enumerate(_parquet_rows(p, read), 1):
        obj = {f: record[c] for f, c in read.items() if record[c] is not None}
        yield row, pair_from_row(obj, p, row, read)


READERS = {"csv": read_pairs_csv_located, "parquet": read_pairs_parquet_located}
STREAMS = {"csv": iter_pairs_csv_located, "parquet": iter_pairs_parquet_located}


def read_pairs_table_located(path: PathLike, kind: str, columns: Optional[Any] = None) -> list[tuple[int, Pair]]:
    """The pairs of a ``kind`` ("csv" | "parquet") file, each with its row."""
    return READERS[kind](path, columns)


__all__ = ["FIELDS", "READERS", "STREAMS", "column_names", "columns_in_file", "pair_from_row", "read_pairs_csv_located",
           "read_pairs_parquet_located", "iter_pairs_csv_located", "iter_pairs_parquet_located", "read_pairs_table_located"]
