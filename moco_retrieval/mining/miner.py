"""Mining itself: encode (or take) the embeddings, search, filter and sample each row, and count
what every rule removed (see the package docstring)."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

import numpy as np

from moco_retrieval.data.formats import Pair
from moco_retrieval.errors import ConfigError
from moco_retrieval.mining.corpus import Corpus, build_corpus
from moco_retrieval.mining.filters import (
    REMOVAL_REASONS,
    SAMPLINGS,
    MiningFilters,
    add_counts,
    filter_candidates,
    new_counts,
    sample_candidates,
)
from moco_retrieval.mining.search import SearchPlan, search_candidates, search_plan
from moco_retrieval.mining.teacher import Teacher


@dataclass
class MiningOptions:
    """What is kept of the candidates that pass the filters, and how the search runs."""

    n_negatives: int = 8  # per query (fewer when fewer pass)
    sampling: str = "top"  # top | random (seeded by (seed, row))
    seed: int = 0
    keep_empty: bool = False  # also return the rows left without a negative
    index_cfg: Any = None  # an EvalConfig (index kind and its settings); None: a flat index
    progress: bool = True

    def check(self) -> "MiningOptions":
        if self.n_negatives < 1:
            raise ConfigError(f"n_negatives={self.n_negatives}: expected >= 1")
        if self.sampling not in SAMPLINGS:
            raise ConfigError(f"sampling={self.sampling!r}: expected one of {', '.join(SAMPLINGS)}")
        return self


@dataclass
class MiningResult:
    pairs: list[Pair]  # the rows to write (with their mined negatives)
    ranks: list[list[int]]  # per written row, the rank of each negative
    stats: dict[str, Any]


@dataclass
class _Tally:
    """What the filtering of every row adds up to (the statistics' counts and means)."""

    counts: dict[str, Any] = field(default_factory=new_counts)
    empty_removed: dict[str, int] = field(default_factory=lambda: {"considered": 0, **{r: 0 for r in REMOVAL_REASONS}})
    n_hist: dict[str, int] = field(default_factory=lambda: {"full": 0, "short": 0, "empty": 0})
    pos_scores: list[float] = field(default_factory=list)
    neg_scores: list[float] = field(default_factory=list)
    neg_ranks: list[int] = field(default_factory=list)


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else math.nan


def _choose_negatives(pairs: Sequence[Pair], corpus: Corpus, q_emb: np.ndarray, d_emb: np.ndarray,
                      results: dict, filters: MiningFilters, options: MiningOptions, tally: _Tally,
                      pos_scores: Optional[np.ndarray] = None):
    """The rows to write, their negatives' ranks and (row, corpus positions of its negatives) of
    each, counting into ``tally``; ``pos_scores``: the positives' scores (default: the embeddings')."""
    out_pairs: list[Pair] = []
    out_ranks: list[list[int]] = []
    out_docs: list[tuple[int, list[int]]] = []
    bar = None
    if options.progress:
        from moco_retrieval.progress import progress_bar

        bar = progress_bar(len(pairs), "filtering", " queries")
    for i, p in enumerate(pairs):
        pos_score = float(q_emb[i] @ d_emb[corpus.row_doc[i]]) if pos_scores is None else float(pos_scores[i])
        sc, ix = results[i]
        row_counts = new_counts()
        passing = filter_candidates(
            ix.tolist(), sc.tolist(), pos_score, corpus.row_positives[i], corpus.row_groups[i], corpus.groups, filters,
            row_counts,
        )
        add_counts(tally.counts, row_counts)
        if not passing:  # why this row gets no negative: what removed its candidates
            add_counts(tally.empty_removed, row_counts["removed"])
            tally.empty_removed["considered"] += row_counts["considered"]
        chosen = sample_candidates(passing, options.n_negatives, options.sampling, options.seed, i)
        tally.counts["not_sampled"] += len(passing) - len(chosen)
        tally.counts["kept"] += len(chosen)
        tally.n_hist["full" if len(chosen) >= options.n_negatives else "short" if chosen else "empty"] += 1
        tally.pos_scores.append(pos_score)
        if chosen or options.keep_empty:  # (replace: the pair's ids stay as the data gave them)
            out_pairs.append(replace(p, negatives=[corpus.negative(c) for c in chosen], positive_score=round(pos_score, 6)))
            out_ranks.append([c.rank for c in chosen])
            out_docs.append((i, [c.doc for c in chosen]))
            tally.neg_scores.extend(c.score for c in chosen)
            tally.neg_ranks.extend(c.rank for c in chosen)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out_pairs, out_ranks, out_docs


def _teacher_results(teacher: Teacher, corpus: Corpus, results: dict) -> tuple[dict, np.ndarray]:
    """The search results with the teacher's scores in place of the miner's (the miner's order
    kept: the rank window stays the miner's), and the teacher's score of each row's positive."""
    rows = sorted(results)
    found = [np.flatnonzero(results[i][1] >= 0) for i in rows]
    r = np.concatenate([np.full(len(f), i) for i, f in zip(rows, found)] + [np.asarray(rows, dtype=np.int64)])
    c = np.concatenate([results[i][1][f] for i, f in zip(rows, found)] + [np.asarray(corpus.row_doc)[rows]])
    scores = teacher.score(r.astype(np.int64), c.astype(np.int64))
    out, at = {}, 0
    for i, f in zip(rows, found):
        sc = np.full(len(results[i][1]), -np.inf)
        sc[f] = scores[at : at + len(f)]
        out[i], at = (sc, results[i][1]), at + len(f)
    pos = np.zeros(len(corpus.row_doc))
    pos[rows] = scores[at:]
    return out, pos


def _rescored(teacher: Teacher, corpus: Corpus, pairs: list[Pair], chosen: list[tuple[int, list[int]]]) -> list[Pair]:
    """``pairs`` with the teacher's scores of their positives and negatives (one call for all)."""
    r = np.asarray([i for i, docs in chosen for _ in range(1 + len(docs))], dtype=np.int64)
    c = np.asarray([d for i, docs in chosen for d in [corpus.row_doc[i], *docs]], dtype=np.int64)
    scores = teacher.score(r, c).tolist()
    out, at = [], 0
    for p, (_, docs) in zip(pairs, chosen):
        row = scores[at : at + 1 + len(docs)]
        at += 1 + len(docs)
        out.append(replace(p, positive_score=round(row[0], 6),
                           negatives=[replace(n, score=round(s, 6)) for n, s in zip(p.negatives, row[1:])]))
    return out

def _stats(pairs: Sequence[Pair], corpus: Corpus, plan: SearchPlan, tally: _Tally, rows_written: int,
           filters: MiningFilters, options: MiningOptions, timings: dict[str, float]) -> dict[str, Any]:
    return {
        "queries": len(pairs),
        "corpus_documents": len(corpus),
        "search_depth": {"k": plan.base_k, "queries_searched_deeper": len(plan.deep_rows)},
        "candidates": tally.counts,
        "queries_with_n_negatives": tally.n_hist["full"],
        "queries_with_fewer": tally.n_hist["short"],
        "queries_without_negatives": tally.n_hist["empty"],
        # the rows without a negative: how many candidates they had, and what removed them
        "candidates_of_queries_without_negatives": tally.empty_removed,
        "rows_written": rows_written,
        "negatives_written": tally.counts["kept"],
        "mean_positive_score": _mean(tally.pos_scores),
        "mean_negative_score": _mean(tally.neg_scores),
        "mean_negative_rank": _mean(tally.neg_ranks),
        "settings": {**asdict(filters), "n_negatives": options.n_negatives, "sampling": options.sampling,
                     "seed": options.seed, "keep_empty": options.keep_empty,
                     "index": getattr(options.index_cfg, "index", "flat")},
        "timings": timings,
    }


def mine_from_embeddings(pairs: Sequence[Pair], corpus: Corpus, q_emb: np.ndarray, d_emb: np.ndarray,
                         filters: MiningFilters, options: Optional[MiningOptions] = None,
                         teacher: Optional[Teacher] = None, filter_by_teacher: bool = False) -> MiningResult:
    """Mine with given embeddings: ``q_emb[i]`` of ``pairs[i].query``, ``d_emb[j]`` of ``corpus.texts[j]``
    (``options``: the defaults of :class:`MiningOptions` when None). ``teacher`` (prepared on the
    queries and ``corpus.texts``): its scores of each written positive and negative replace the
    miner's; ``filter_by_teacher``: the score filters judge the candidates by them too."""
    from moco_retrieval.config import EvalConfig
    from moco_retrieval.evaluation.index import build_index_from_config

    filters.check()
    options = (options or MiningOptions()).check()
    q_emb = np.ascontiguousarray(q_emb, dtype=np.float32)
    d_emb = np.ascontiguousarray(d_emb, dtype=np.float32)
    if len(q_emb) != len(pairs) or len(d_emb) != len(corpus):
        raise ValueError(f"{len(q_emb)} query vectors for {len(pairs)} pairs, {len(d_emb)} document vectors for {len(corpus)} documents")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    index = build_index_from_config(d_emb, options.index_cfg or EvalConfig())
    timings["index"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = search_plan(corpus, filters)
    results = search_candidates(index, q_emb, plan, options.progress)
    timings["search"] = time.perf_counter() - t0
    pos_scores = None
    if teacher is not None and filter_by_teacher:
        t0 = time.perf_counter()
        results, pos_scores = _teacher_results(teacher, corpus, results)
        timings["teacher"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tally = _Tally()
    out_pairs, out_ranks, chosen = _choose_negatives(pairs, corpus, q_emb, d_emb, results, filters, options, tally,
                                                     pos_scores)
    timings["filter"] = time.perf_counter() - t0
    if teacher is not None and not filter_by_teacher:
        t0 = time.perf_counter()
        out_pairs = _rescored(teacher, corpus, out_pairs, chosen)
        timings["teacher"] = time.perf_counter() - t0
    stats = _stats(pairs, corpus, plan, tally, len(out_pairs), filters, options, timings)
    if teacher is not None:
        written = [s for p in out_pairs for s in [p.positive_score] + [n.score for n in p.negatives]]
        stats["teacher"] = {**teacher.description, "kind": teacher.kind,
                            "filters_judge_by": "teacher" if filter_by_teacher else "miner",
                            "mean_positive_score": _mean([p.positive_score for p in out_pairs]),
                            "mean_negative_score": _mean([n.score for p in out_pairs for n in p.negatives]),
                            "scores_written": len(written)}
    return MiningResult(out_pairs, out_ranks, stats)


def mine_hard_negatives(encoder: Any, pairs: Sequence[Pair], filters: MiningFilters,
                        options: Optional[MiningOptions] = None, batch_size: int = 256,
                        teacher: Optional[Teacher] = None, filter_by_teacher: bool = False) -> MiningResult:
    """Encode the corpus of ``pairs`` (their positives) and their queries with ``encoder`` (a
    ``TextEncoder``, or any ``encoder(side, kind)`` module) and mine (see the package docstring);
    ``teacher``, ``filter_by_teacher``: as :func:`mine_from_embeddings`'s."""
    from moco_retrieval.evaluation.encode import encode_texts_sharded as encode_texts  # 1/N per rank under a process group

    options = options or MiningOptions()
    if not pairs:
        raise ValueError("no training pairs to mine for")
    corpus = build_corpus(pairs)
    t0 = time.perf_counter()
    d_emb = encode_texts(encoder, corpus.texts, "doc", batch_size, options.progress,
                         description=f"encoding {len(corpus):,} documents")
    t_docs = time.perf_counter() - t0
    t0 = time.perf_counter()
    q_emb = encode_texts(encoder, [p.query for p in pairs], "query", batch_size, options.progress,
                         description=f"encoding {len(pairs):,} queries")
    t_queries = time.perf_counter() - t0
    t_teacher = 0.0
    if teacher is not None:
        t0 = time.perf_counter()
        teacher.prepare([p.query for p in pairs], corpus.texts, batch_size, options.progress)
        t_teacher = time.perf_counter() - t0
    res = mine_from_embeddings(pairs, corpus, q_emb, d_emb, filters, options, teacher, filter_by_teacher)
    res.stats["timings"] = {"encode_docs": t_docs, "encode_queries": t_queries, **res.stats["timings"]}
    if teacher is not None:
        res.stats["timings"]["teacher"] = res.stats["timings"].get("teacher", 0.0) + t_teacher
    return res


__all__ = ["MiningOptions", "MiningResult", "mine_from_embeddings", "mine_hard_negatives"]
