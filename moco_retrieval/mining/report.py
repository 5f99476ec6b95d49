"""What ``mine`` tells its user: the statistics as text, and a warning when rows got no negative
(how many, what removed their candidates, what is in the file)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from moco_retrieval.mining.filters import REMOVAL_REASONS, SCORE_FILTERS


def format_stats(stats: dict) -> str:
    c = stats["candidates"]
    lines = [
        f"mined {stats['negatives_written']:,} negatives for {stats['rows_written']:,} of {stats['queries']:,} queries "
        f"(corpus {stats['corpus_documents']:,} documents)",
        f"  candidates considered: {c['considered']:,}",
    ]
    for r in REMOVAL_REASONS:
        alone = f" (alone: {c['would_remove_alone'][r]:,})" if r in SCORE_FILTERS else ""
        lines.append(f"  removed by {r:<16} {c['removed'][r]:>10,}{alone}")
    lines += [
        f"  passed all filters:        {c['passed']:>10,}  (kept {c['kept']:,}, not sampled {c['not_sampled']:,})",
        f"  queries with {stats['settings']['n_negatives']} negatives: {stats['queries_with_n_negatives']:,}, "
        f"with fewer: {stats['queries_with_fewer']:,}, with none: {stats['queries_without_negatives']:,}",
        f"  mean score: positive {stats['mean_positive_score']:.4f}, negatives {stats['mean_negative_score']:.4f} "
        f"(mean rank {stats['mean_negative_rank']:.1f})",
    ]
    return "\n".join(lines)


def dropped_rows_warning(stats: dict, out: Path, keep_empty: bool) -> Optional[str]:
    """What a user must know before training on ``out`` when rows got no negative: how many, why,
    and what is in the file (None: every row got one)."""
    n, total = stats["queries_without_negatives"], stats["queries"]
    if not n:
        return None
    why = stats["candidates_of_queries_without_negatives"]
    removed = sorted(((why[r], r) for r in REMOVAL_REASONS if why[r]), reverse=True)
    reasons = ", ".join(f"{r} {k:,}" for k, r in removed) or "none: the corpus has no other document"
    lines = [f"[moco_retrieval] warning: {n:,} of {total:,} training pairs ({100 * n / total:.1f}%) got no hard "
             f"negative: the filters removed every candidate they had ({why['considered']:,} candidates; removed "
             f"by {reasons})."]
    if keep_empty:
        lines.append(f"They are in {out} without negatives (keep_empty=true); training with data.n_negatives "
                     "refuses such rows.")
    else:
        written = stats["rows_written"]
        lines.append(f"They are left out: {out} holds {written:,} rows, {100 * written / total:.1f}% of the pairs. "
                     "keep_empty=true writes them too, without negatives.")
    lines.append("A weak model scores unrelated documents close to the positive: looser filters "
                 "(relative_margin=null, margin=null, range_min=0, a larger range_max) or a trained model "
                 "(checkpoint=...) leave more.")
    return " ".join(lines)


__all__ = ["dropped_rows_warning", "format_stats"]
