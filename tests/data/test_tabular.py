"""Parquet and CSV training pairs (moco_retrieval.data.tabular): the same pairs as JSONL, configurable
column names, errors that name the file, the row and the column; the data=parquet / data=csv configs."""
import re

import pytest

from moco_retrieval.config import ColumnsConfig, DataConfig
from moco_retrieval.data.formats import DataError, read_pairs_jsonl, write_jsonl
from moco_retrieval.data.sources import load, load_documents
from moco_retrieval.data.tabular import read_pairs_csv_located, read_pairs_parquet_located
from tests.helpers import PAIR_ROWS, compose_cfg, write_csv, write_eval, write_parquet


def jsonl_pairs(tmp_path, rows):
    write_jsonl(tmp_path / "pairs.jsonl", [{k: v for k, v in r.items() if v is not None} for r in rows])
    return read_pairs_jsonl(tmp_path / "pairs.jsonl")


def test_csv_gives_the_pairs_jsonl_gives(tmp_path):
    located = read_pairs_csv_located(write_csv(tmp_path / "p.csv", PAIR_ROWS))
    assert [row for row, _ in located] == [2, 3]  # CSV lines (the header is line 1)
    assert [p for _, p in located] == jsonl_pairs(tmp_path, PAIR_ROWS)


def test_parquet_gives_the_pairs_jsonl_gives(tmp_path):
    located = read_pairs_parquet_located(write_parquet(tmp_path / "p.parquet", PAIR_ROWS))
    assert [row for row, _ in located] == [1, 2]
    plain = [dict(r, negatives=[n if isinstance(n, str) else n["text"] for n in r["negatives"]] if r["negatives"] else None)
             for r in PAIR_ROWS]
    assert [p for _, p in located] == jsonl_pairs(tmp_path, plain)


ST = {"anchor": ["resize images", "play chess"], "positive": ["ImageMagick edits images.", "GNOME chess."],
      "negative_2": ["Inkscape draws.", ""], "negative": ["GIMP paints.", "Stockfish thinks."]}


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_sentence_transformers_columns_read_as_in_a_datasets_folder(tmp_path, fmt):
    """anchor / positive / negative, negative_1 ... (issue 46, point 14): one rule for every tabular kind."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / f"st.{fmt}"
    if fmt == "csv":
        path.write_text("anchor,positive,negative_2,negative\n" + "".join(
            ",".join(ST[c][i] for c in ST) + "\n" for i in range(2)))
        located = read_pairs_csv_located(path)
    else:
        pq.write_table(pa.table({c: [v or None for v in vs] for c, vs in ST.items()}), path)
        located = read_pairs_parquet_located(path)
    expected = [{"query": ST["anchor"][i], "positive": ST["positive"][i],
                 "negatives": [n for n in (ST["negative"][i], ST["negative_2"][i]) if n]} for i in range(2)]
    assert [p for _, p in located] == jsonl_pairs(tmp_path, expected)  # negative before negative_2; empty: absent
    bad = path.with_name(f"bad.{fmt}")
    if fmt == "csv":
        bad.write_text("anchor,positive\n ,text\n")
        with pytest.raises(DataError, match=re.escape(f"{bad}: row 2, column 'anchor': field 'query' is empty")):
            read_pairs_csv_located(bad)


def test_column_names_are_configurable(tmp_path):
    rename = {"query": "title", "positive": "body", "doc_id": "package"}
    cols = ColumnsConfig(query="title", positive="body", doc_id="package")
    got = [p for _, p in read_pairs_csv_located(write_csv(tmp_path / "p.csv", PAIR_ROWS, rename), cols)]
    assert got == jsonl_pairs(tmp_path, PAIR_ROWS)
    got = [p for _, p in read_pairs_parquet_located(write_parquet(tmp_path / "p.parquet", PAIR_ROWS, rename), cols)]
    assert [(p.query, p.positive, p.doc_id) for p in got] == [(p.query, p.positive, p.doc_id) for p in jsonl_pairs(tmp_path, PAIR_ROWS)]
    # the default names are not there: the required column is named in the error
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'p.csv'}: no column 'query' (data.columns.query")):
        read_pairs_csv_located(tmp_path / "p.csv")
    # a renamed optional column that the file lacks is an error too (a typo, not "no groups")
    with pytest.raises(DataError, match="no column 'source' \\(data.columns.group"):
        read_pairs_csv_located(tmp_path / "p.csv", ColumnsConfig(query="title", positive="body", group="source"))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_errors_name_file_row_and_column(tmp_path, fmt):
    bad = [dict(PAIR_ROWS[1]), dict(PAIR_ROWS[1], query="  "), dict(PAIR_ROWS[1])]
    write = write_csv if fmt == "csv" else write_parquet
    path = write(tmp_path / f"p.{fmt}", bad, {"query": "title"})
    row = 3 if fmt == "csv" else 2
    with pytest.raises(DataError, match=re.escape(f"{path}: row {row}, column 'title': field 'query' is empty")):
        (read_pairs_csv_located if fmt == "csv" else read_pairs_parquet_located)(path, ColumnsConfig(query="title"))


def test_csv_value_errors(tmp_path):
    path = write_csv(tmp_path / "p.csv", [PAIR_ROWS[1], dict(PAIR_ROWS[1], positive_score="high")])
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
    path = (write_csv if fmt == "csv" else write_parquet)(tmp_path / f"p.{fmt}", PAIR_ROWS * 3, {"query": "title"})
    write_eval(tmp_path / "eval")
    cfg = compose_cfg("train", [f"data={fmt}", f"data.train_path={path}", f"data.eval_dir={tmp_path / 'eval'}",
                                "data.columns.query=title"]).data
    with pytest.raises(Exception, match="not_a_field"):  # strict: a typo in a column key is an error
        compose_cfg("train", [f"data={fmt}", "data.columns.not_a_field=x"])
    train, pool = load(cfg)
    assert [p.query for p in train.pairs] == [r["query"] for r in PAIR_ROWS] * 3
    row0 = 2 if fmt == "csv" else 1
    assert train.where[0] == f"{path}: row {row0}"
    assert pool.description["kind"] == fmt and len(pool.eval_set.queries) == 6
    docs, _ = load_documents(cfg)
    assert {"ImageMagick edits images.", "GNOME chess.", "eval document 0"} <= set(docs.values())
    with pytest.raises(DataError, match=f"data.train_path is required with data={fmt}"):
        load(DataConfig(kind=fmt, eval_dir=str(tmp_path / "eval")))
