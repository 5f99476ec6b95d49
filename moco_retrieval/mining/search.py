"""Each query's candidates from a FAISS index of the corpus, deep enough that the rank window is
full after its positives and their groups are skipped (when the corpus has that many documents)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moco_retrieval.data.ids import NO_GROUP
from moco_retrieval.mining.corpus import Corpus
from moco_retrieval.mining.filters import MiningFilters

EXTRA_DEPTH = 16  # searched beyond the window for every query, so that few need the deeper search
CHUNK = 1024  # queries searched at once


def _excluded_count(corpus: Corpus, row: int, group_size: dict[int, int], drop_group: bool) -> int:
    n = len(corpus.row_positives[row])
    if drop_group:
        n += sum(group_size.get(g, 0) for g in corpus.row_groups[row])
    return n


@dataclass
class SearchPlan:
    """How deep each row is searched: most rows at ``base_k``, the rows whose positives and groups
    need more (large groups) in a second search at ``deep_k``."""

    base_k: int
    rows: list[int]
    deep_k: int
    deep_rows: list[int]

    def searches(self) -> list[tuple[list[int], int, str]]:
        """``(rows, depth, description)`` of each search to run."""
        both = [(self.rows, self.base_k, "searching"), (self.deep_rows, self.deep_k, "searching (large groups)")]
        return [step for step in both if step[0]]


def search_plan(corpus: Corpus, filters: MiningFilters) -> SearchPlan:
    """The search depth of every row: the window plus whatever the row must skip (its positives
    and their groups)."""
    group_size: dict[int, int] = {}
    for g in corpus.groups:
        if g != NO_GROUP:
            group_size[g] = group_size.get(g, 0) + 1
    n_rows = len(corpus.row_doc)
    need = [filters.range_max + 1 + _excluded_count(corpus, i, group_size, filters.drop_group) for i in range(n_rows)]
    base_k = min(len(corpus), filters.range_max + 1 + EXTRA_DEPTH)
    deeper = base_k < len(corpus)
    rows = [i for i in range(n_rows) if not deeper or need[i] <= base_k]
    deep_rows = [i for i in range(n_rows) if deeper and need[i] > base_k]
    return SearchPlan(base_k, rows, min(len(corpus), max((need[i] for i in deep_rows), default=0)), deep_rows)


def _search_rows(index: Any, q_emb: np.ndarray, rows: list[int], k: int, progress: bool, desc: str):
    from moco_retrieval.evaluation.index import search

    scores = np.empty((len(rows), k), np.float32)
    idx = np.empty((len(rows), k), np.int64)
    bar = None
    if progress:
        from moco_retrieval.progress import progress_bar

        bar = progress_bar(len(rows), desc, " queries")
    try:
        for s in range(0, len(rows), CHUNK):
            sl = rows[s : s + CHUNK]
            sc, ix = search(index, q_emb[sl], k)
            scores[s : s + len(sl), : sc.shape[1]] = sc
            idx[s : s + len(sl), : ix.shape[1]] = ix
            if sc.shape[1] < k:
                idx[s : s + len(sl), sc.shape[1] :] = -1
            if bar is not None:
                bar.update(len(sl))
    finally:
        if bar is not None:
            bar.close()
    return scores, idx


def search_candidates(index: Any, q_emb: np.ndarray, plan: SearchPlan, progress: bool) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Row -> ``(scores, corpus positions)`` of its candidates, best first (-1: no result)."""
    results: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for rows, k, desc in plan.searches():
        sc, ix = _search_rows(index, q_emb, rows, k, progress, desc)
        for r, i in enumerate(rows):
            results[i] = (sc[r], ix[r])
    return results


__all__ = ["SearchPlan", "search_candidates", "search_plan"]
