"""Which search results become hard negatives: the filters, in order, and the sampling.

Candidates are removed in this order (each candidate is counted under the first rule that removes
it; ``stats["removed"]``):

* ``positive``: a positive of the query: the pair's own document, and every document paired with
  the same query text elsewhere in the data. Always removed: a positive is never a negative.
* ``group``: a document of the same group as one of those positives (``drop_group``, default on):
  known duplicates (the Debian set: binary packages of one source package).
* ``rank_window``: ranks are 0-based and counted over the candidates left after the two rules above
  (rank 0 = the best-scoring document that is neither a positive nor in its group); a candidate is
  kept only when ``range_min <= rank <= range_max``. The search goes deep enough that every query
  has ``range_max + 1`` ranked candidates after the removals (when the corpus has them, see
  :mod:`.search`); candidates below ``range_min`` are counted as removed, the list ends at
  ``range_max``.
* ``margin`` (absolute): keep only if ``score(neg) <= score(pos) - margin``.
* ``relative_margin``: keep only if ``score(neg) <= score(pos) * (1 - r)``; r = 0.05 by default.
  Positive-aware mining ("TopK-PercPos", Moreira et al. 2024, "NV-Retriever"): a candidate that
  scores nearly as high as the labelled positive is likely an unlabelled relevant document, and
  training against it teaches the model to push relevant documents away. ``null`` turns it off;
  ``0`` still removes candidates scoring above the positive. (Meant for positive scores, e.g.
  cosine > 0; with a negative positive score the bound lies above it.)
* ``max_score``: keep only if ``score(neg) <= max_score``.

``stats["would_remove_alone"]`` also says how many candidates of the window each score filter
rejects by itself (the filters overlap).

``n_negatives`` of the candidates that pass are kept per query: the best-ranked (``sampling=top``)
or a uniform random choice (``sampling=random``, generator seeded by ``(seed, row)``), listed by
rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from moco_retrieval.data.ids import NO_GROUP
from moco_retrieval.errors import ConfigError

SAMPLINGS = ("top", "random")
REMOVAL_REASONS = ("positive", "group", "rank_window", "margin", "relative_margin", "max_score")
SCORE_FILTERS = ("margin", "relative_margin", "max_score")


@dataclass
class MiningFilters:
    """What a candidate must satisfy to become a negative (see the module docstring)."""

    range_min: int = 0
    range_max: int = 50
    margin: Optional[float] = None
    relative_margin: Optional[float] = 0.05
    max_score: Optional[float] = None
    drop_group: bool = True

    def check(self) -> "MiningFilters":
        for name in SCORE_FILTERS:
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{name}={value}: expected a finite number (or null: no such filter)")
        if self.range_min < 0 or self.range_max < self.range_min:
            raise ConfigError(
                f"rank window [range_min={self.range_min}, range_max={self.range_max}]: expected "
                "0 <= range_min <= range_max"
            )
        if self.margin is not None and self.margin < 0:
            raise ConfigError(f"margin={self.margin}: expected >= 0 (or null for no absolute margin)")
        if self.relative_margin is not None and not 0 <= self.relative_margin < 1:
            raise ConfigError(f"relative_margin={self.relative_margin}: expected 0 <= r < 1 (or null)")
        return self

    def score_rejects(self, score: float, pos_score: float) -> Optional[str]:
        """The first score filter that rejects ``score`` (None: it passes)."""
        for name in SCORE_FILTERS:
            if self.rejects(name, score, pos_score):
                return name
        return None

    def rejects(self, name: str, score: float, pos_score: float) -> bool:
        """Whether the score filter ``name`` (one of :data:`SCORE_FILTERS`) rejects ``score``."""
        if name == "margin":
            return self.margin is not None and not score <= pos_score - self.margin
        if name == "relative_margin":
            return self.relative_margin is not None and not score <= pos_score * (1 - self.relative_margin)
        if name == "max_score":
            return self.max_score is not None and not score <= self.max_score
        raise KeyError(name)


@dataclass
class Candidate:
    doc: int  # corpus position
    score: float
    rank: int  # 0-based rank after removing positives and their groups


def add_counts(total: dict[str, Any], part: dict[str, Any]) -> None:
    """``total += part``, key by key (nested dicts of counts, as :func:`new_counts` makes)."""
    for key, value in part.items():
        if isinstance(value, dict):
            add_counts(total[key], value)
        else:
            total[key] += value


def new_counts() -> dict[str, Any]:
    return {
        "considered": 0,
        "removed": {r: 0 for r in REMOVAL_REASONS},
        "would_remove_alone": {r: 0 for r in SCORE_FILTERS},
        "passed": 0,
        "not_sampled": 0,
        "kept": 0,
    }


def filter_candidates(
    docs: Sequence[int],
    scores: Sequence[float],
    pos_score: float,
    positives: set[int],
    positive_groups: set[int],
    doc_groups: Sequence[int],
    filters: MiningFilters,
    counts: Optional[dict] = None,
) -> list[Candidate]:
    """The candidates of one query that pass every filter, in rank order.

    ``docs``/``scores``: the query's search results, best first (corpus positions; -1 = no result).
    ``positives``: corpus positions of the query's positives; ``positive_groups``: their groups
    (>= 0). ``doc_groups[j]``: group of corpus document j (-1 none). ``counts`` (from
    :func:`new_counts`) is updated in place.
    """
    counts = counts if counts is not None else new_counts()
    out: list[Candidate] = []
    rank = -1
    for j, s in zip(docs, scores):
        j = int(j)
        if j < 0:
            continue
        if rank >= filters.range_max:
            break  # the window is complete
        s = float(s)
        counts["considered"] += 1
        if j in positives:
            counts["removed"]["positive"] += 1
            continue
        if filters.drop_group and doc_groups[j] != NO_GROUP and doc_groups[j] in positive_groups:
            counts["removed"]["group"] += 1
            continue
        rank += 1
        if rank < filters.range_min:
            counts["removed"]["rank_window"] += 1
            continue
        for name in SCORE_FILTERS:
            if filters.rejects(name, s, pos_score):
                counts["would_remove_alone"][name] += 1
        reason = filters.score_rejects(s, pos_score)
        if reason is not None:
            counts["removed"][reason] += 1
            continue
        counts["passed"] += 1
        out.append(Candidate(j, s, rank))
    return out


def sample_candidates(passing: list[Candidate], n: int, sampling: str, seed: int, row: int) -> list[Candidate]:
    """``n`` of the passing candidates: the best-ranked, or a seeded uniform choice (rank order kept)."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling={sampling!r}: expected one of {SAMPLINGS}")
    if len(passing) <= n:
        return list(passing)
    if sampling == "top":
        return passing[:n]
    rng = np.random.default_rng([int(seed), int(row)])
    pick = sorted(rng.choice(len(passing), size=n, replace=False).tolist())
    return [passing[i] for i in pick]


__all__ = ["Candidate", "MiningFilters", "REMOVAL_REASONS", "SAMPLINGS", "SCORE_FILTERS", "add_counts",
           "filter_candidates", "new_counts", "sample_candidates"]
