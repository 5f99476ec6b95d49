"""Training pairs from a Hugging Face ``datasets`` folder (``data=hf data.path=DIR``): a
``save_to_disk`` folder (a Dataset, or a DatasetDict with ``data.split``) or a folder of Parquet
shards (``DIR/*.parquet``, else ``DIR/<split>/*.parquet``, in name order).

Columns as for Parquet and CSV (``data.columns.*``, sentence-transformers' names: tabular.py) and
every row through the same field rules (formats.pair_from_json). Errors name the folder (or shard),
the row (from 1) and the column.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from moco_retrieval.data.formats import DataError, Pair
from moco_retrieval.data.tabular import pair_from_row, table_columns

_WHAT = "a save_to_disk folder (Dataset or DatasetDict) or a folder of Parquet shards"


@dataclass
class HFTable:
    """One table to read: its location name (for messages), its rows and its column names."""

    where: str
    header: list[str]
    rows: int
    batches: Any  # (columns, rows: a range of them or None) -> iterator of lists of row dicts




def _dataset_tables(folder: Path, split: str) -> list[HFTable]:
    import datasets

    from moco_retrieval.files import json_object  # (files.py imports torch: not in a conversion worker, parallel.py)

    target, where = folder, str(folder)
    splits = json_object(folder / "dataset_dict.json").get("splits")
    if isinstance(splits, list):  # a DatasetDict: its split's folder alone (another, empty, split would not load)
        if split not in splits:
            raise DataError(f"{folder}: no split {split!r} (data.split); the folder's splits: "
                            f"{', '.join(map(str, splits)) or '(none)'}")
        target, where = folder / split, f"{folder} (split {split!r})"
    if json_object(target / "state.json").get("_data_files") == []:  # datasets cannot load it (an IndexError)
        raise DataError(f"{where}: the dataset has no rows (save_to_disk of an empty Dataset: its state.json "
                        f"lists no data files)")
    try:
        ds = datasets.load_from_disk(str(target))
    except Exception as e:  # noqa: BLE001 - datasets raises several types for a folder it cannot read
        raise DataError(f"{target}: not a readable save_to_disk folder ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):  # (a dataset_dict.json that could not be read above)
        if split not in ds:
            raise DataError(f"{folder}: no split {split!r} (data.split); the folder's splits: {', '.join(ds) or '(none)'}")
        ds, where = ds[split], f"{folder} (split {split!r})"

    def batches(cols: list[str], rows: Optional[range] = None) -> Iterator[list[dict]]:
        part = ds if rows is None else ds.select(rows)  # (a range: a slice of the memory-mapped table, no index)
        for table in part.select_columns(cols).with_format("arrow").iter(batch_size=8192):
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

        def batches(cols: list[str], rows: Optional[range] = None, f=f) -> Iterator[list[dict]]:
            assert rows is None, "a Parquet shard is read whole (parallel.py splits by shards)"
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


def iter_table_pairs(table: HFTable, columns: Any, rows: Optional[range] = None) -> Iterator[tuple[int, Pair]]:
    """``(row, pair)`` of every row of one table (rows counted from 1), or of ``rows`` of it (counted
    from 0: parallel.py's parts), each through pair_from_row."""
    cols = table_columns(table.where, table.header, columns)
    label = cols.labels()
    row = rows.start if rows is not None else 0
    for records in table.batches(list(cols.read.values()) + cols.negative_columns, rows):
        for record in records:
            row += 1
            yield row, pair_from_row(cols.row_object(record), table.where, row, label)


def read_hf_pairs_located(folder: Path, split: str, columns: Optional[Any] = None) -> list[tuple[str, int, Pair]]:
    """``(table, row, pair)`` of every row of every table of ``folder`` (small folders; the data
    module streams them into a store instead)."""
    return [(t.where, row, p) for t in hf_tables(folder, split) for row, p in iter_table_pairs(t, columns)]


__all__ = ["HFTable", "hf_tables", "parquet_tables", "hf_input_files",
           "iter_table_pairs", "read_hf_pairs_located"]
