"""Retrieval metrics with trec_eval's definitions, and TREC run / qrels file IO.

Inputs are plain dicts::

    run   = {qid: {docid: score}}     # scores, higher is better
    qrels = {qid: {docid: grade}}     # integer relevance grades

Definitions (those of trec_eval 9.x, ``usnistgov/trec_eval``):

* Ranking: a query's documents are sorted by score descending, ties broken by docid
  *descending* (byte order); ``comp_sim_docno`` in ``form_res_rels.c``. The rank column of a
  run file is ignored, as trec_eval ignores it.
* Relevant: grade > 0 (trec_eval's default ``-l 1``).
* ``recall@k``: relevant documents in the top k divided by all relevant documents of the query
  (``recall_k``).
* ``mrr@10``: 1 / rank of the first relevant document if it is in the top 10, else 0 (the
  MS MARCO cut of trec_eval's ``recip_rank``).
* ``ndcg@10``: gain = grade (linear, trec_eval's default; grades <= 0 gain nothing), discount
  ``log2(rank + 1)``; the ideal ranking is built from *all* judged relevant documents of the
  query, retrieved or not (``ndcg_cut.10``).
* ``map@100``: sum, over relevant documents in the top 100, of the precision at their rank,
  divided by the number of relevant documents of the query (``map_cut.100``).

Averaging: over the queries of ``qrels`` that have at least one relevant document (a query
whose judgments are all non-relevant is left out; trec_eval would count it as 0). A query of
``qrels`` absent from the run scores 0 on every metric and is counted (``trec_eval -c``) unless
``missing="skip"`` (trec_eval's default, which averages only over queries present in both).
Queries of the run absent from ``qrels`` are ignored.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Sequence

Run = dict[str, dict[str, float]]
Qrels = dict[str, dict[str, int]]

DEFAULT_RECALL_KS: tuple[int, ...] = (1, 5, 10, 100)
METRIC_NAMES: tuple[str, ...] = (
    "recall@1",
    "recall@5",
    "recall@10",
    "recall@100",
    "mrr@10",
    "ndcg@10",
    "map@100",
)


@dataclass
class MetricsResult:
    """Mean metrics, per-query metrics, and the number of queries averaged over."""

    mean: dict[str, float]
    per_query: dict[str, dict[str, float]]
    num_queries: int  # queries in the means
    num_missing: int = 0  # queries of the qrels with relevant docs but absent from the run
    num_without_relevant: int = 0  # queries of the qrels with no relevant doc (left out)
    skipped: list[str] = field(default_factory=list)  # ids of the latter two kinds left out


def rank_documents(scores: Mapping[str, float]) -> list[tuple[str, float]]:
    """``(docid, score)`` in trec_eval order: score descending, then docid descending."""
    return sorted(scores.items(), key=lambda kv: (float(kv[1]), kv[0]), reverse=True)


def _relevant(grades: Mapping[str, int]) -> dict[str, int]:
    return {d: int(g) for d, g in grades.items() if int(g) > 0}


def _gains(ranked: Sequence[tuple[str, float]], grades: Mapping[str, int]) -> list[int]:
    return [max(int(grades.get(d, 0)), 0) for d, _ in ranked]


def query_metrics(
    ranked_gains: Sequence[int],
    relevant_grades: Sequence[int],
    *,
    recall_ks: Iterable[int] = DEFAULT_RECALL_KS,
    mrr_k: int = 10,
    ndcg_k: int = 10,
    map_k: int = 100,
) -> dict[str, float]:
    """Metrics of one query.

    ``ranked_gains``: the grade (0 when not relevant or unjudged) of each retrieved document in
    rank order. ``relevant_grades``: the grades (> 0) of all relevant documents of the query.
    """
    num_rel = len(relevant_grades)
    out: dict[str, float] = {}
    if num_rel == 0:
        raise ValueError("query_metrics needs a query with at least one relevant document")
    is_rel = [g > 0 for g in ranked_gains]
    for k in recall_ks:
        out[f"recall@{k}"] = sum(is_rel[:k]) / num_rel
    rr = 0.0
    for i, r in enumerate(is_rel[:mrr_k]):
        if r:
            rr = 1.0 / (i + 1)
            break
    out[f"mrr@{mrr_k}"] = rr
    dcg = sum(g / math.log2(i + 2) for i, g in enumerate(ranked_gains[:ndcg_k]) if g > 0)
    ideal = sorted(relevant_grades, reverse=True)[:ndcg_k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    out[f"ndcg@{ndcg_k}"] = dcg / idcg if idcg > 0 else 0.0
    hits, ap = 0, 0.0
    for i, r in enumerate(is_rel[:map_k]):
        if r:
            hits += 1
            ap += hits / (i + 1)
    out[f"map@{map_k}"] = ap / num_rel
    return out


def evaluate_run(
    run: Mapping[str, Mapping[str, float]],
    qrels: Mapping[str, Mapping[str, int]],
    *,
    recall_ks: Iterable[int] = DEFAULT_RECALL_KS,
    mrr_k: int = 10,
    ndcg_k: int = 10,
    map_k: int = 100,
    missing: str = "zero",
) -> MetricsResult:
    """Per-query and mean metrics of ``run`` against ``qrels`` (see the module docstring).

    ``missing``: ``"zero"`` (a query of the qrels absent from the run scores 0 and is counted)
    or ``"skip"`` (it is left out of the means).
    """
    if missing not in ("zero", "skip"):
        raise ValueError(f"missing must be 'zero' or 'skip', got {missing!r}")
    recall_ks = tuple(recall_ks)
    names = [f"recall@{k}" for k in recall_ks] + [f"mrr@{mrr_k}", f"ndcg@{ndcg_k}", f"map@{map_k}"]
    per_query: dict[str, dict[str, float]] = {}
    skipped: list[str] = []
    n_missing = n_norel = 0
    for qid, grades in qrels.items():
        rel = _relevant(grades)
        if not rel:
            n_norel += 1
            skipped.append(qid)
            continue
        if qid not in run:
            n_missing += 1
            if missing == "skip":
                skipped.append(qid)
                continue
            per_query[qid] = {n: 0.0 for n in names}
            continue
        gains = _gains(rank_documents(run[qid]), grades)
        per_query[qid] = query_metrics(
            gains, list(rel.values()), recall_ks=recall_ks, mrr_k=mrr_k, ndcg_k=ndcg_k, map_k=map_k
        )
    n = len(per_query)
    mean = {name: (sum(m[name] for m in per_query.values()) / n if n else 0.0) for name in names}
    return MetricsResult(mean, per_query, n, n_missing, n_norel, skipped)


def recall_curve(
    run: Mapping[str, Mapping[str, float]],
    qrels: Mapping[str, Mapping[str, int]],
    max_k: int = 100,
    *,
    missing: str = "zero",
) -> list[float]:
    """Mean recall@k for k = 1..max_k (element k-1), averaged as :func:`evaluate_run` does."""
    totals = [0.0] * max_k
    n = 0
    for qid, grades in qrels.items():
        rel = _relevant(grades)
        if not rel:
            continue
        if qid not in run:
            if missing == "skip":
                continue
            n += 1
            continue
        n += 1
        hits = 0
        ranked = rank_documents(run[qid])
        for i in range(max_k):
            if i < len(ranked) and ranked[i][0] in rel:
                hits += 1
            totals[i] += hits / len(rel)
    return [t / n if n else 0.0 for t in totals]


# --------------------------------------------------------------------------- TREC files


def _check_token(kind: str, value: str) -> str:
    value = str(value)
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"{kind} {value!r} is empty or contains whitespace; TREC files cannot hold it")
    return value


def write_trec_run(
    path: str | os.PathLike,
    run: Mapping[str, Mapping[str, float]],
    tag: str = "moco-retrieval",
    top_k: int | None = None,
) -> None:
    """Write ``qid Q0 docid rank score tag`` lines, each query in trec_eval order.

    Scores are written with ``repr`` (shortest round-trip form), so reading the file back gives
    the same floats and the same metrics.
    """
    tag = _check_token("tag", tag)
    with open(path, "w", encoding="utf-8") as f:
        for qid, scores in run.items():
            q = _check_token("query id", qid)
            ranked = rank_documents(scores)
            if top_k is not None:
                ranked = ranked[:top_k]
            for rank, (docid, score) in enumerate(ranked, start=1):
                d = _check_token("doc id", docid)
                f.write(f"{q} Q0 {d} {rank} {float(score)!r} {tag}\n")


def read_trec_run(path: str | os.PathLike) -> Run:
    """Read a TREC run file into ``{qid: {docid: score}}`` (the rank column is ignored)."""
    run: Run = {}
    for lineno, (qid, _, docid, _, score, _) in _trec_lines(path, "qid Q0 docid rank score tag"):
        try:
            value = float(score)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: score {score!r} is not a number") from None
        docs = run.setdefault(qid, {})
        if docid in docs:
            raise ValueError(f"{path}:{lineno}: document {docid!r} appears twice for query {qid!r}")
        docs[docid] = value
    return run


def _trec_lines(path: str | os.PathLike, fields: str) -> Iterator[tuple[int, list[str]]]:
    """``(line number, fields)`` of each non-blank line of a whitespace-separated TREC file whose
    lines hold the ``fields`` named (an error names the line with another count)."""
    n = len(fields.split())
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != n:
                raise ValueError(f"{path}:{lineno}: expected {n} fields '{fields}', got {len(parts)}")
            yield lineno, parts


def write_trec_qrels(path: str | os.PathLike, qrels: Mapping[str, Mapping[str, int]]) -> None:
    """Write ``qid 0 docid grade`` lines (the qrels format of trec_eval)."""
    with open(path, "w", encoding="utf-8") as f:
        for qid, grades in qrels.items():
            q = _check_token("query id", qid)
            for docid, grade in grades.items():
                f.write(f"{q} 0 {_check_token('doc id', docid)} {int(grade)}\n")


def read_trec_qrels(path: str | os.PathLike) -> Qrels:
    """Read a TREC qrels file (``qid iter docid grade``)."""
    qrels: Qrels = {}
    for lineno, (qid, _, docid, grade) in _trec_lines(path, "qid iter docid grade"):
        try:
            qrels.setdefault(qid, {})[docid] = int(grade)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: grade {grade!r} is not an integer") from None
    return qrels


__all__ = [
    "Run",
    "Qrels",
    "METRIC_NAMES",
    "DEFAULT_RECALL_KS",
    "MetricsResult",
    "rank_documents",
    "query_metrics",
    "evaluate_run",
    "recall_curve",
    "write_trec_run",
    "read_trec_run",
    "write_trec_qrels",
    "read_trec_qrels",
]
