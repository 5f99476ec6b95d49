"""Training pairs from a Hugging Face ``datasets`` folder (``data=hf data.path=DIR``): a
``save_to_disk`` folder (a Dataset, or a DatasetDict with ``data.split``) or a folder of Parquet
shards (``DIR/*.parquet``, else ``DIR/<split>/*.parquet``, in name order).

Columns as for Parquet (``data.columns.*``, tabular.py) and every row through the same field rules
(formats.pair_from_json). What sentence-transformers trains on reads as it is: ``anchor`` is the
query when there is no ``query`` column, and ``negative`` / ``negative_1``, ``negative_2`` ... are
the hard negatives when there is no ``negatives`` column. Errors name the folder (or shard), the
row (from 1) and the column.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from moco_retrieval.data.formats import DataError, Pair
from moco_retrieval.data.tabular import column_names, columns_in_file, pair_from_row

# sentence-transformers' column names, used when the configured (default) column is absent
ST_QUERY = "anchor"
_ST_NEGATIVE = re.compile(r"^negative(?:_(\d+))?$")
_WHAT = "a save_to_disk folder (Dataset or DatasetDict) or a folder of Parquet shards"


@dataclass
class HFColumns:
    """``{field: column}`` to read, and the sentence-transformers negative columns (in order)."""

    read: dict[str, str]
    negative_columns: list[str]


def st_negative_columns(header: list[str]) -> list[str]:
    """``negative``, ``negative_1``, ``negative_2`` ... of a header, in their numeric order."""
    found = [(int(m.group(1) or 0), c) for c in header if (m := _ST_NEGATIVE.match(c))]
    return [c for _, c in sorted(found)]


def hf_columns(where: str, header: list[str], columns: Any) -> HFColumns:
    """The configured columns (tabular.columns_in_file's rules), with the sentence-transformers names
    standing in for default-named ``query`` and ``negatives`` columns that the table lacks."""
    names = column_names(columns)
    have = set(header)
    if names["query"] == "query" and "query" not in have and ST_QUERY in have:
        names["query"] = ST_QUERY
    negs: list[str] = []
    if names["negatives"] == "negatives" and "negatives" not in have:
        negs = st_negative_columns(header)
    return HFColumns(columns_in_file(where, header, names), negs)


@dataclass
class HFTable:
    """One table to read: its location name (for messages), its rows and its column names."""

    where: str
    header: list[str]
    rows: int
    batches: Any  # () -> iterator of lists of row dicts


def _dataset_tables(folder: Path, split: str) -> list[HFTable]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # noqa: BLE001 - datasets raises several types for a folder it cannot read
        raise DataError(f"{folder}: not a readable save_to_disk folder ({type(e).__name__}: {e})") from None
    where = str(folder)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{folder}: no split {split!r} (data.split); the folder's splits: {', '.join(ds) or '(none)'}")
        ds, where = ds[split], f"{folder} (split {split!r})"

    def batches(cols: list[str]) -> Iterator[list[dict]]:
        for table in ds.select_columns(cols).with_format("arrow").iter(batch_size=8192):
            yield table.to_pylist()

    return [HFTable(where, list(ds.column_names), len(ds), batches)]


def parquet_tables(shards: list[Path]) -> list[HFTable]:
    import pyarrow.parquet as pq

    out = []
    for shard in shards:
        try:
            f = pq.ParquetFile(shard)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not Parquet
            raise DataError(f"{shard}: not a readable Parquet file ({type(e).__name__}: {e})") from None

        def batches(cols: list[str], f=f) -> Iterator[list[dict]]:
            for b in f.iter_batches(columns=cols, batch_size=8192):
                yield b.to_pylist()

        out.append(HFTable(str(shard), list(f.schema_arrow.names), f.metadata.num_rows, batches))
    return out


def hf_tables(folder: Path, split: str) -> list[HFTable]:
    """The tables of ``folder``: one for a save_to_disk folder, one per Parquet shard."""
    if not folder.is_dir():
        raise DataError(f"data.path={folder}: not a directory (expected {_WHAT})")
    if (folder / "dataset_dict.json").is_file() or (folder / "dataset_info.json").is_file():
        return _dataset_tables(folder, split)
    shards = sorted(folder.glob("*.parquet")) or sorted((folder / split).glob("*.parquet"))
    if not shards:
        raise DataError(f"data.path={folder}: no dataset_dict.json / dataset_info.json and no *.parquet "
                        f"(nor {split}/*.parquet) in it; expected {_WHAT}")
    return parquet_tables(shards)


def hf_input_files(folder: Path, tables: list[HFTable]) -> list[Path]:
    """The files whose content a converted copy of ``tables`` depends on (their hashes key the cache):
    the shards, or every file of a save_to_disk folder."""
    if tables[0].where.endswith(".parquet"):
        return [Path(t.where) for t in tables]
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _row_object(record: dict, cols: HFColumns) -> dict:
    obj = {f: record[c] for f, c in cols.read.items() if record[c] is not None}
    if cols.negative_columns:
        obj["negatives"] = [record[c] for c in cols.negative_columns]
    return obj


def _negative_label(cols: HFColumns) -> dict[str, str]:
    """The columns to name in an error about ``negatives`` (the sentence-transformers ones, joined)."""
    if not cols.negative_columns:
        return cols.read
    return dict(cols.read, negatives=", ".join(cols.negative_columns))


def iter_table_pairs(table: HFTable, columns: Any) -> Iterator[tuple[int, Pair]]:
    """``(row, pair)`` of every row of one table (rows counted from 1), each through pair_from_row."""
    cols = hf_columns(table.where, table.header, columns)
    label = _negative_label(cols)
    row = 0
    for records in table.batches(list(cols.read.values()) + cols.negative_columns):
        for record in records:
            row += 1
            yield row, pair_from_row(_row_object(record, cols), table.where, row, label)


def read_hf_pairs_located(folder: Path, split: str, columns: Optional[Any] = None) -> list[tuple[str, int, Pair]]:
    """``(table, row, pair)`` of every row of every table of ``folder`` (small folders; the data
    module streams them into a store instead)."""
    return [(t.where, row, p) for t in hf_tables(folder, split) for row, p in iter_table_pairs(t, columns)]


__all__ = ["ST_QUERY", "HFColumns", "HFTable", "st_negative_columns", "hf_columns", "hf_tables", "parquet_tables", "hf_input_files",
           "iter_table_pairs", "read_hf_pairs_located"]
