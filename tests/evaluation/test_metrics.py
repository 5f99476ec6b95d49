"""Hand-computed trec_eval cases for recall@k, MRR@10, nDCG@10, MAP@100, and TREC file IO."""
import math
import re

import numpy as np
import pytest

from moco_retrieval.evaluation.metrics import (
    evaluate_run,
    query_metrics,
    rank_documents,
    read_trec_qrels,
    read_trec_run,
    recall_curve,
    write_trec_qrels,
    write_trec_run,
)


def L(r):  # discount of rank r (1-based)
    return math.log2(r + 1)


def test_ties_break_by_docid_descending():
    # trec_eval's comp_sim_docno: score descending, then strcmp(docno2, docno1): docid DEScending
    ranked = rank_documents({"a": 0.5, "b": 0.5, "c": 0.9, "B": 0.5})
    assert [d for d, _ in ranked] == ["c", "b", "a", "B"]  # byte order: "B" < "a" < "b"


def test_tie_puts_relevant_doc_after_larger_docid():
    run = {"q": {"a": 0.5, "b": 0.5, "c": 0.9}}
    qrels = {"q": {"a": 1}}
    m = evaluate_run(run, qrels).per_query["q"]
    # order c, b, a: the relevant "a" is at rank 3 (rank 2 if ties went ascending)
    assert m["recall@1"] == 0.0
    assert m["recall@5"] == 1.0
    assert m["mrr@10"] == pytest.approx(1 / 3)
    assert m["ndcg@10"] == pytest.approx(1 / L(3))
    assert m["map@100"] == pytest.approx(1 / 3)


def test_several_relevant_one_not_retrieved():
    run = {"q": {"d1": 0.9, "d2": 0.8, "d3": 0.7, "d4": 0.6, "d5": 0.5}}
    qrels = {"q": {"d2": 1, "d4": 1, "d9": 1, "d3": 0}}
    m = evaluate_run(run, qrels).per_query["q"]
    assert m["recall@1"] == 0.0
    assert m["recall@5"] == pytest.approx(2 / 3)
    assert m["recall@10"] == pytest.approx(2 / 3)
    assert m["recall@100"] == pytest.approx(2 / 3)
    assert m["mrr@10"] == pytest.approx(1 / 2)
    # MAP divides by all 3 relevant docs, the unretrieved d9 included
    assert m["map@100"] == pytest.approx((1 / 2 + 2 / 4) / 3)
    # ideal DCG from all judged relevant docs (3 of grade 1), retrieved or not
    dcg = 1 / L(2) + 1 / L(4)
    idcg = 1 / L(1) + 1 / L(2) + 1 / L(3)
    assert m["ndcg@10"] == pytest.approx(dcg / idcg)


def test_relevant_doc_not_retrieved_scores_zero():
    m = evaluate_run({"q": {"x": 1.0, "y": 0.5}}, {"q": {"z": 1}}).per_query["q"]
    assert all(v == 0.0 for v in m.values())
    assert set(m) == {"recall@1", "recall@5", "recall@10", "recall@100", "mrr@10", "ndcg@10", "map@100"}


def test_graded_gains_are_linear():
    run = {"q": {"a": 3.0, "b": 2.0, "c": 1.0}}
    qrels = {"q": {"a": 1, "b": 0, "c": 3, "d": 2}}  # b judged non-relevant
    m = evaluate_run(run, qrels).per_query["q"]
    dcg = 1 / L(1) + 3 / L(3)  # = 2.5
    idcg = 3 / L(1) + 2 / L(2) + 1 / L(3)
    assert dcg == pytest.approx(2.5)
    assert m["ndcg@10"] == pytest.approx(dcg / idcg)  # 0.52501...
    assert m["ndcg@10"] == pytest.approx(0.525005, abs=1e-6)
    # binary measures ignore the grade value
    assert m["recall@1"] == pytest.approx(1 / 3)
    assert m["recall@5"] == pytest.approx(2 / 3)
    assert m["mrr@10"] == 1.0
    assert m["map@100"] == pytest.approx((1 / 1 + 2 / 3) / 3)


def test_cutoffs():
    # first relevant at rank 11: MRR@10 = 0, recall@10 = 0, recall@100 = 1, MAP@100 = 1/11
    run = {"q": {f"d{i:02d}": 100.0 - i for i in range(1, 21)}}
    m = evaluate_run(run, {"q": {"d11": 1}}).per_query["q"]
    assert m["mrr@10"] == 0.0 and m["recall@10"] == 0.0 and m["ndcg@10"] == 0.0
    assert m["recall@100"] == 1.0
    assert m["map@100"] == pytest.approx(1 / 11)
    # 12 relevant docs, the top 10 all relevant: nDCG@10 = 1 (ideal truncated at 10)
    qrels = {"q": {f"d{i:02d}": 1 for i in range(1, 13)}}
    m = evaluate_run(run, qrels).per_query["q"]
    assert m["ndcg@10"] == pytest.approx(1.0)
    assert m["recall@10"] == pytest.approx(10 / 12)
    assert m["map@100"] == pytest.approx(1.0)
    # MAP@100 ignores a relevant doc at rank 101
    run = {"q": {f"d{i:03d}": 1000.0 - i for i in range(1, 102)}}
    m = evaluate_run(run, {"q": {"d001": 1, "d101": 1}}).per_query["q"]
    assert m["map@100"] == pytest.approx(1 / 2)
    assert m["recall@100"] == pytest.approx(1 / 2)


def test_means_missing_queries_and_queries_without_relevant_docs():
    run = {
        "q1": {"a": 0.9, "b": 0.1},  # relevant at rank 1
        "q2": {"a": 0.9, "b": 0.1},  # relevant at rank 2
        "q_extra": {"a": 1.0},  # not in qrels: ignored
        "q_norel": {"a": 1.0},
    }
    qrels = {
        "q1": {"a": 1},
        "q2": {"b": 2},
        "q_absent": {"a": 1},  # not in the run
        "q_norel": {"a": 0},  # no relevant doc: left out of the means
    }
    res = evaluate_run(run, qrels)
    assert set(res.per_query) == {"q1", "q2", "q_absent"}
    assert res.num_queries == 3 and res.num_missing == 1 and res.num_without_relevant == 1
    assert all(v == 0.0 for v in res.per_query["q_absent"].values())
    assert res.mean["mrr@10"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert res.mean["recall@1"] == pytest.approx(1 / 3)
    assert res.mean["ndcg@10"] == pytest.approx((1 + 1 / L(2) + 0) / 3)
    skip = evaluate_run(run, qrels, missing="skip")
    assert skip.num_queries == 2
    assert skip.mean["mrr@10"] == pytest.approx(0.75)
    with pytest.raises(ValueError):
        evaluate_run(run, qrels, missing="nope")


def test_recall_curve_matches_recall_at_k():
    rng = np.random.default_rng(0)
    docs = [f"d{i}" for i in range(50)]
    run = {f"q{j}": {d: float(s) for d, s in zip(docs, rng.random(50))} for j in range(8)}
    qrels = {f"q{j}": {docs[i]: 1 for i in rng.choice(50, 3, replace=False)} for j in range(8)}
    qrels["q_absent"] = {"d0": 1}
    curve = recall_curve(run, qrels, max_k=100)
    res = evaluate_run(run, qrels)
    for k in (1, 5, 10, 100):
        assert curve[k - 1] == pytest.approx(res.mean[f"recall@{k}"])
    assert all(a <= b + 1e-12 for a, b in zip(curve, curve[1:]))


def test_query_metrics_needs_relevant():
    with pytest.raises(ValueError):
        query_metrics([0, 0], [])


def test_trec_run_roundtrip_keeps_scores_ties_and_metrics(tmp_path):
    f32 = np.float32
    run = {
        "q1": {"a": float(f32(0.1) + f32(0.2)), "b": float(f32(0.3)), "c": float(f32(1 / 3))},
        "q2": {"x": 0.5, "y": 0.5, "z": -1.25e-7},
    }
    qrels = {"q1": {"b": 1, "c": 2}, "q2": {"x": 1}}
    path = tmp_path / "run.trec"
    write_trec_run(path, run, tag="t1")
    lines = path.read_text().splitlines()
    assert lines[3].split()[:4] == ["q2", "Q0", "y", "1"]  # tie: y before x
    assert lines[4].split()[:4] == ["q2", "Q0", "x", "2"]
    assert all(len(line.split()) == 6 and line.endswith(" t1") for line in lines)
    back = read_trec_run(path)
    assert back == run
    assert evaluate_run(back, qrels).mean == evaluate_run(run, qrels).mean
    # top_k truncates per query
    write_trec_run(path, run, top_k=1)
    assert {q: len(d) for q, d in read_trec_run(path).items()} == {"q1": 1, "q2": 1}


def test_trec_file_errors_are_located(tmp_path):
    p = tmp_path / "bad.trec"
    p.write_text("q1 Q0 a 1 0.5 t\nq1 Q0 b 2 oops t\n")
    with pytest.raises(ValueError, match=r"bad.trec:2: score"):
        read_trec_run(p)
    p.write_text("q1 Q0 a 1 0.5\n")
    with pytest.raises(ValueError, match=r"bad.trec:1: expected 6 fields"):
        read_trec_run(p)
    p.write_text("q1 Q0 a 1 0.5 t\nq1 Q0 a 2 0.4 t\n")
    with pytest.raises(ValueError, match="twice"):
        read_trec_run(p)
    with pytest.raises(ValueError, match="whitespace"):
        write_trec_run(tmp_path / "x.trec", {"q 1": {"a": 1.0}})
    # qrels: blank lines skipped, the same located field-count error, a grade that is not an integer
    q = tmp_path / "bad.qrels"
    q.write_text("q1 0 a 1\n\n   \nq2 0 b 2\n")
    assert read_trec_qrels(q) == {"q1": {"a": 1}, "q2": {"b": 2}}
    q.write_text("q1 0 a 1\nq2 0 b\n")
    with pytest.raises(ValueError, match=re.escape("bad.qrels:2: expected 4 fields 'qid iter docid grade', got 3")):
        read_trec_qrels(q)
    q.write_text("q1 0 a 1\n\nq2 0 b high\n")
    with pytest.raises(ValueError, match="bad.qrels:3: grade 'high' is not an integer"):
        read_trec_qrels(q)


def test_qrels_roundtrip(tmp_path):
    qrels = {"q1": {"a": 1, "b": 0}, "q2": {"c": 3}}
    write_trec_qrels(tmp_path / "qrels.txt", qrels)
    assert read_trec_qrels(tmp_path / "qrels.txt") == qrels
