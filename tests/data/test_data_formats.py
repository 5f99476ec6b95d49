"""ids and formats: JSONL pairs, BEIR, and a located error for each kind of bad input."""
import json
import re
from pathlib import Path

import pytest

from moco_retrieval.data.formats import (
    DataError,
    EvalSet,
    Negative,
    Pair,
    beir_doc_text,
    beir_train_pairs,
    read_beir,
    read_beir_splits,
    read_pairs_jsonl,
    write_beir,
    write_pairs_jsonl,
)
from moco_retrieval.data.ids import doc_id_for_text, group_id, stable_id


# ------------------------------------------------------------------------------------------- ids


def test_ids_are_stable_normalized_int63():
    a = doc_id_for_text("Caf\u00e9  au\tlait\n")
    b = doc_id_for_text(" Cafe\u0301 au lait")  # NFD + other whitespace
    assert a == b
    assert 0 <= a < 2**63
    # pinned value: the hash never changes between versions / machines
    assert doc_id_for_text("hello world") == int.from_bytes(
        bytes.fromhex("b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9")[:8], "big"
    ) & (2**63 - 1)
    assert doc_id_for_text("a") != doc_id_for_text("b")
    assert stable_id("linux") == doc_id_for_text("linux")
    assert group_id(None) == -1 and group_id("") == -1 and group_id("linux") == stable_id("linux")


# ------------------------------------------------------------------------------------------ JSONL


def _write(path: Path, lines) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines), encoding="utf-8")
    return path


def test_read_pairs_all_fields(tmp_path):
    p = _write(
        tmp_path / "pairs.jsonl",
        [
            {"query": "q1", "positive": "doc one"},
            "",  # blank lines are skipped
            {
                "query": "q2",
                "positive": "doc two",
                "query_id": "Q2",
                "doc_id": "D2",
                "group": "G",
                "positive_score": 3,
                "negatives": ["neg a", {"text": "neg b", "doc_id": "NB", "score": 0.5, "group": "H"}, {"text": "neg c"}],
            },
            {"query": "q3", "positive": "doc one", "doc_id": 17, "group": 5},
        ],
    )
    pairs = read_pairs_jsonl(p)
    assert len(pairs) == 3
    a, b, c = pairs
    assert a.doc_id == doc_id_for_text("doc one") and a.group == -1 and a.query_id is None and a.negatives == []
    assert b.doc_id == stable_id("D2") and b.group == stable_id("G") and b.query_id == "Q2"
    assert b.positive_score == 3.0
    assert b.negatives == [
        Negative(doc_id_for_text("neg a"), "neg a"),
        Negative(stable_id("NB"), "neg b", 0.5, stable_id("H")),
        Negative(doc_id_for_text("neg c"), "neg c"),
    ]
    assert c.doc_id == 17 and c.group == 5  # integers are ids as they are


def test_same_text_same_id(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"query": "x", "positive": "same  text"}, {"query": "y", "positive": "same text"}])
    a, b = read_pairs_jsonl(p)
    assert a.doc_id == b.doc_id


def test_pairs_round_trip(tmp_path):
    pairs = [
        Pair("q", "d", doc_id=5, group=7, query_id="a", negatives=[Negative(9, "n", 1.5, 3)], positive_score=0.25),
        Pair("q2", "d2", doc_id=doc_id_for_text("d2")),
    ]
    write_pairs_jsonl(tmp_path / "o.jsonl", pairs)
    assert read_pairs_jsonl(tmp_path / "o.jsonl") == pairs


BAD_PAIRS = [
    # (lines, line number in the message, expected fragment)
    ([{"query": "q", "positive": "d"}, '{"query": "q", "positive": '], 2, "malformed JSON"),
    ([{"positive": "d"}], 1, "missing field 'query'"),
    ([{"query": "q"}], 1, "missing field 'positive'"),
    ([{"query": "  ", "positive": "d"}], 1, "field 'query' is empty"),
    ([{"query": "q", "positive": 3}], 1, "field 'positive' must be a string"),
    (["[1, 2]"], 1, "expected a JSON object"),
    ([{"query": "q", "positive": "d", "negatives": "n"}], 1, "'negatives' must be a list"),
    ([{"query": "q", "positive": "d", "negatives": [{"doc_id": "x"}]}], 1, "negatives[0]: missing field 'text'"),
    ([{"query": "q", "positive": "d", "negatives": [""]}], 1, "negatives[0] is an empty string"),
    ([{"query": "q", "positive": "d", "doc_id": -4}], 1, "out of range"),
    ([{"query": "q", "positive": "d", "doc_id": 1.5}], 1, "'doc_id' must be a string or an integer"),
    ([{"query": "q", "positive": "d", "group": True}], 1, "'group' must be a string or an integer"),
    ([{"query": "q", "positive": "d", "positive_score": "high"}], 1, "'positive_score' must be a number"),
]


@pytest.mark.parametrize("lines,line,fragment", BAD_PAIRS)
def test_bad_pairs_name_file_line_and_expectation(tmp_path, lines, line, fragment):
    p = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as ei:
        read_pairs_jsonl(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:{line}: "), msg
    assert fragment in msg, msg
    assert isinstance(ei.value, ValueError)


def test_empty_and_missing_pairs_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=re.escape(f"{empty}: empty file")):
        read_pairs_jsonl(empty)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'nope.jsonl'}: no such file")):
        read_pairs_jsonl(tmp_path / "nope.jsonl")


def test_bad_utf8_is_located(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_bytes(b'{"query": "q", "positive": "d"}\n{"query": "\xff", "positive": "d"}\n')
    with pytest.raises(DataError, match=re.escape(f"{p}:2: not valid UTF-8")):
        read_pairs_jsonl(p)


# ------------------------------------------------------------------------------------------- BEIR


def make_beir(d: Path, corpus=None, queries=None, qrels=None, split="test", header="query-id\tcorpus-id\tscore"):
    d.mkdir(parents=True, exist_ok=True)
    corpus = corpus if corpus is not None else [
        {"_id": "d1", "title": "Title", "text": "body one"},
        {"_id": "d2", "title": "", "text": "body two", "group": "g"},
        {"_id": "d3", "text": "body three"},
    ]
    queries = queries if queries is not None else [{"_id": "q1", "text": "first"}, {"_id": "q2", "text": "second"}, {"_id": "q3", "text": "third"}]
    qrels = qrels if qrels is not None else ["q1\td1\t1", "q1\td3\t0", "q2\td2\t2", "q3\td3\t0"]
    _write(d / "corpus.jsonl", corpus)
    _write(d / "queries.jsonl", queries)
    (d / "qrels").mkdir(exist_ok=True)
    (d / "qrels" / f"{split}.tsv").write_text("\n".join(([header] if header is not None else []) + qrels) + "\n")
    return d


def test_read_beir(tmp_path):
    ev = read_beir(make_beir(tmp_path / "b"), "test")
    assert ev.corpus == {"d1": "Title. body one", "d2": "body two", "d3": "body three"}
    # q3 has no judgment with score > 0: not an evaluation query
    assert ev.queries == {"q1": "first", "q2": "second"}
    assert ev.qrels == {"q1": {"d1": 1, "d3": 0}, "q2": {"d2": 2}}
    assert ev.doc_groups == {"d2": stable_id("g")}
    assert beir_doc_text("Title!", "x") == "Title! x" and beir_doc_text("T", "") == "T"


def test_byte_order_marks_blank_lines_and_bad_utf8_read_alike_in_jsonl_and_qrels(tmp_path):
    """Both line readers (pairs JSONL, BEIR qrels) drop a leading byte-order mark and blank lines
    (CRLF included), and name the line that is not UTF-8."""
    d = make_beir(tmp_path / "b")
    qrels = d / "qrels" / "test.tsv"
    qrels.write_bytes(b"\xef\xbb\xbfquery-id\tcorpus-id\tscore\r\n\r\nq1\td1\t1\r\n  \nq2\td2\t2\r\n")
    assert read_beir(d, "test").qrels == {"q1": {"d1": 1}, "q2": {"d2": 2}}
    qrels.write_bytes(b"query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td\xff\t1\n")
    with pytest.raises(DataError, match=re.escape(f"{qrels}:3: not valid UTF-8")):
        read_beir(d, "test")
    pairs = tmp_path / "bom.jsonl"
    pairs.write_bytes(b'\xef\xbb\xbf{"query": "q", "positive": "d"}\r\n\r\n{"query": "r", "positive": "e"}\n')
    assert [(p.query, p.positive) for p in read_pairs_jsonl(pairs)] == [("q", "d"), ("r", "e")]


def test_beir_train_pairs_and_splits(tmp_path):
    d = make_beir(tmp_path / "b")
    (d / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq3\td3\t1\nq1\td2\t1\n")
    splits = read_beir_splits(d, ["train", "test"])
    assert splits["train"].corpus is splits["test"].corpus  # read once
    pairs = beir_train_pairs(splits["train"])
    assert [(p.query_id, p.positive, p.doc_id, p.group) for p in pairs] == [
        ("q3", "body three", stable_id("d3"), -1),
        ("q1", "body two", stable_id("d2"), stable_id("g")),
    ]


def test_beir_round_trip(tmp_path):
    ev = EvalSet(
        corpus={"a": "doc a", "b": "doc b"}, queries={"x": "qx"}, qrels={"x": {"a": 1, "b": 0}}, doc_groups={"a": 3}
    )
    write_beir(tmp_path / "o", ev, "dev")
    assert read_beir(tmp_path / "o", "dev") == ev


BAD_BEIR = [
    # (overrides, file, line or None, fragment)
    ({"qrels": ["q1\td9\t1"]}, "qrels/test.tsv", 2, "corpus-id 'd9' is not in"),
    ({"qrels": ["q9\td1\t1"]}, "qrels/test.tsv", 2, "query-id 'q9' is not in"),
    ({"qrels": ["q1\td1"]}, "qrels/test.tsv", 2, "expected 3 tab-separated columns"),
    ({"qrels": ["q1\td1\thigh"]}, "qrels/test.tsv", 2, "score 'high' is not an integer"),
    ({"qrels": ["q1\td1\t1", "q1\td1\t1"]}, "qrels/test.tsv", 3, "duplicate judgment"),
    ({"header": None, "qrels": ["q1\td1\t1"]}, "qrels/test.tsv", 1, "bad header"),
    ({"header": "qid\tdid\trel"}, "qrels/test.tsv", 1, "bad header"),
    ({"qrels": []}, "qrels/test.tsv", None, "no judgments"),
    ({"qrels": ["q1\td1\t0"]}, "qrels/test.tsv", None, "no query has a judgment with score > 0"),
    ({"corpus": [{"_id": "d1", "text": "x"}, {"_id": "d1", "text": "y"}]}, "corpus.jsonl", 2, "duplicate _id 'd1'"),
    ({"corpus": [{"text": "x"}]}, "corpus.jsonl", 1, "missing field '_id'"),
    ({"corpus": [{"_id": "d1", "title": "", "text": ""}]}, "corpus.jsonl", 1, "empty 'title' and 'text'"),
    ({"corpus": [{"_id": "d1"}]}, "corpus.jsonl", 1, "missing field 'text'"),
    ({"corpus": []}, "corpus.jsonl", None, "empty file"),
    ({"queries": [{"_id": "q1"}]}, "queries.jsonl", 1, "missing field 'text'"),
    ({"queries": [{"_id": "q1", "text": ["a"]}]}, "queries.jsonl", 1, "field 'text' must be a string"),
]


@pytest.mark.parametrize("overrides,fname,line,fragment", BAD_BEIR)
def test_bad_beir_is_located(tmp_path, overrides, fname, line, fragment):
    d = make_beir(tmp_path / "b", **overrides)
    with pytest.raises(DataError) as ei:
        read_beir(d, "test")
    msg = str(ei.value)
    where = f"{d / fname}:{line}: " if line is not None else f"{d / fname}: "
    assert msg.startswith(where), msg
    assert fragment in msg, msg


def test_beir_missing_split_and_dir(tmp_path):
    d = make_beir(tmp_path / "b")
    with pytest.raises(DataError, match=r"dev\.tsv: no such file .*splits present: \['test'\]"):
        read_beir(d, "dev")
    with pytest.raises(DataError, match="no such directory"):
        read_beir(tmp_path / "missing", "test")
    (d / "queries.jsonl").unlink()
    with pytest.raises(DataError, match=re.escape(f"{d / 'queries.jsonl'}: no such file")):
        read_beir(d, "test")


def test_normalize_text_fast_path_agrees_with_the_rule():
    """ids.normalize_text skips NFC and split/join for text they would not change: same result always."""
    import random
    import unicodedata

    from moco_retrieval.data.ids import normalize_text

    chars = [" ", "a", "b", "\t", "\n", "\x0b", "\x0c", "\r", "\x1c", "\x1f", "\x85", "\xa0", "e\u0301", "\u2003", "é", "~"]
    rng = random.Random(0)
    for _ in range(20000):
        t = "".join(rng.choice(chars) for _ in range(rng.randint(0, 8)))
        assert normalize_text(t) == " ".join(unicodedata.normalize("NFC", t).split()), repr(t)


def test_jsonl_errors_and_values_are_those_of_json(tmp_path):
    """Lines go through orjson; what it refuses (NaN, huge integers) is json's to decide."""
    from moco_retrieval.data.formats import iter_jsonl

    p = tmp_path / "x.jsonl"
    p.write_text('{"a": NaN, "b": 123456789012345678901234567890}\n{"a": 1,}\n')
    it = iter_jsonl(p)
    _, obj = next(it)
    assert obj["b"] == 123456789012345678901234567890 and obj["a"] != obj["a"]
    with pytest.raises(DataError, match=re.escape(f"{p}:2: malformed JSON (Expecting property name enclosed in double quotes: column 9)")):
        next(it)
