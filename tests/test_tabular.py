"""Parquet and CSV training pairs (moco_retrieval.data.tabular): the same pairs as JSONL, configurable
column names, errors that name the file, the row and the column; the data=parquet / data=csv configs."""
import csv
import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_datamodule import write_eval  # noqa: E402

from moco_retrieval.config import ColumnsConfig, DataConfig  # noqa: E402
from moco_retrieval.data.formats import DataError, read_pairs_jsonl, write_jsonl  # noqa: E402
from moco_retrieval.data.sources import load, load_documents  # noqa: E402
from moco_retrieval.data.tabular import read_pairs_csv_located, read_pairs_parquet_located  # noqa: E402

ROWS = [
    {"query": "resize images", "positive": "ImageMagick edits images.", "query_id": "q1", "doc_id": "imagemagick",
     "group": "imagemagick-src", "negatives": ["GIMP paints.", {"text": "Inkscape draws.", "doc_id": "inkscape"}],
     "positive_score": 0.9},
    {"query": "play chess", "positive": "GNOME chess.", "query_id": "q2", "doc_id": None, "group": None,
     "negatives": None, "positive_score": None},
]


def write_csv(path: Path, rows, rename=None, header=None):
    rename = rename or {}
    fields = header or [rename.get(k, k) for k in rows[0]]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in rows:
            w.writerow(["" if v is None else json.dumps(v) if isinstance(v, list) else v for v in r.values()])
    return path


def write_parquet(path: Path, rows, rename=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rename = rename or {}
    cols = {rename.get(k, k): [r[k] for r in rows] for k in rows[0] if k != "negatives"}
    table = pa.table(cols)
    negs = [[n if isinstance(n, str) else n["text"] for n in (r["negatives"] or [])] or None for r in rows]
    table = table.append_column(rename.get("negatives", "negatives"), pa.array(negs, pa.list_(pa.string())))
    pq.write_table(table, path)
    return path


def jsonl_pairs(tmp_path, rows):
    write_jsonl(tmp_path / "pairs.jsonl", [{k: v for k, v in r.items() if v is not None} for r in rows])
    return read_pairs_jsonl(tmp_path / "pairs.jsonl")


def test_csv_gives_the_pairs_jsonl_gives(tmp_path):
    located = read_pairs_csv_located(write_csv(tmp_path / "p.csv", ROWS))
    assert [row for row, _ in located] == [2, 3]  # CSV lines (the header is line 1)
    assert [p for _, p in located] == jsonl_pairs(tmp_path, ROWS)


def test_parquet_gives_the_pairs_jsonl_gives(tmp_path):
    located = read_pairs_parquet_located(write_parquet(tmp_path / "p.parquet", ROWS))
    assert [row for row, _ in located] == [1, 2]
    plain = [dict(r, negatives=[n if isinstance(n, str) else n["text"] for n in r["negatives"]] if r["negatives"] else None)
             for r in ROWS]
    assert [p for _, p in located] == jsonl_pairs(tmp_path, plain)


def test_column_names_are_configurable(tmp_path):
    rename = {"query": "title", "positive": "body", "doc_id": "package"}
    cols = ColumnsConfig(query="title", positive="body", doc_id="package")
    got = [p for _, p in read_pairs_csv_located(write_csv(tmp_path / "p.csv", ROWS, rename), cols)]
    assert got == jsonl_pairs(tmp_path, ROWS)
    got = [p for _, p in read_pairs_parquet_located(write_parquet(tmp_path / "p.parquet", ROWS, rename), cols)]
    assert [(p.query, p.positive, p.doc_id) for p in got] == [(p.query, p.positive, p.doc_id) for p in jsonl_pairs(tmp_path, ROWS)]
    # the default names are not there: the required column is named in the error
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'p.csv'}: no column 'query' (data.columns.query")):
        read_pairs_csv_located(tmp_path / "p.csv")
    # a renamed optional column that the file lacks is an error too (a typo, not "no groups")
    with pytest.raises(DataError, match="no column 'source' \\(data.columns.group"):
        read_pairs_csv_located(tmp_path / "p.csv", ColumnsConfig(query="title", positive="body", group="source"))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_errors_name_file_row_and_column(tmp_path, fmt):
    bad = [dict(ROWS[1]), dict(ROWS[1], query="  "), dict(ROWS[1])]
    write = write_csv if fmt == "csv" else write_parquet
    path = write(tmp_path / f"p.{fmt}", bad, {"query": "title"})
    row = 3 if fmt == "csv" else 2
    with pytest.raises(DataError, match=re.escape(f"{path}: row {row}, column 'title': field 'query' is empty")):
        (read_pairs_csv_located if fmt == "csv" else read_pairs_parquet_located)(path, ColumnsConfig(query="title"))


def test_csv_value_errors(tmp_path):
    path = write_csv(tmp_path / "p.csv", [ROWS[1], dict(ROWS[1], positive_score="high")])
    with pytest.raises(DataError, match=re.escape(f"{path}: row 3, column 'positive_score': expected a number, got 'high'")):
        read_pairs_csv_located(path)
    path.write_text("query,positive,negatives\na,b,[\"x\"\n")
    with pytest.raises(DataError, match=re.escape(f"{path}: row 2, column 'negatives': expected a JSON list")):
        read_pairs_csv_located(path)
    path.write_text("query,positive\na,b,c\n")
    with pytest.raises(DataError, match=re.escape(f"{path}: row 2: 3 values for 2 columns")):
        read_pairs_csv_located(path)
    path.write_bytes(b"query,positive\n\xff,b\n")
    with pytest.raises(DataError, match="not UTF-8"):
        read_pairs_csv_located(path)


def test_not_a_parquet_file(tmp_path):
    (tmp_path / "p.parquet").write_text("query,positive\n")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_pairs_parquet_located(tmp_path / "p.parquet")


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_data_kind_loads_training_and_eval(tmp_path, fmt):
    from hydra import compose, initialize_config_module

    from moco_retrieval.command import register_configs

    path = (write_csv if fmt == "csv" else write_parquet)(tmp_path / f"p.{fmt}", ROWS * 3, {"query": "title"})
    write_eval(tmp_path / "eval")
    register_configs()
    with initialize_config_module("moco_retrieval.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"data={fmt}", f"data.train_path={path}", f"data.eval_dir={tmp_path / 'eval'}",
                                          "data.columns.query=title"]).data
        with pytest.raises(Exception, match="not_a_field"):  # strict: a typo in a column key is an error
            compose("train", overrides=[f"data={fmt}", "data.columns.not_a_field=x"])
    train, pool = load(cfg)
    assert [p.query for p in train.pairs] == [r["query"] for r in ROWS] * 3
    row0 = 2 if fmt == "csv" else 1
    assert train.where[0] == f"{path}: row {row0}"
    assert pool.description["kind"] == fmt and len(pool.eval_set.queries) == 6
    docs, _ = load_documents(cfg)
    assert {"ImageMagick edits images.", "GNOME chess.", "eval document 0"} <= set(docs.values())
    with pytest.raises(DataError, match=f"data.train_path is required with data={fmt}"):
        load(DataConfig(kind=fmt, eval_dir=str(tmp_path / "eval")))
