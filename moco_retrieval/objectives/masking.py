"""False-negative masks, shared by every objective.

A candidate negative is a false negative of query i when it *is* query i's positive document
(same document id) or a known duplicate of it (same group id, groups >= 0). Such candidates are
removed from the softmax instead of being pushed away.

Masks are sparse, as (rows, cols) index pairs: false negatives are rare, so finding them with one
``isin`` over the N candidates and a small compare is far cheaper than B x N boolean passes over a
65,536-key queue, and masking them is one ``index_put_``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

Pairs = tuple[Tensor, Tensor]  # (rows, cols) of masked entries


@dataclass
class Mask:
    """One block's masked entries and how many of them each rule (id, group, guide) masked.

    The counts travel with the pairs so that a loss reports exactly the masks of its own blocks,
    however many softmaxes an objective builds, and in whatever order. A row's own positive,
    scored apart, is among the pairs but not counted."""

    pairs: Pairs | None = None
    counts: dict[str, Tensor] = field(default_factory=dict)


def false_negative_pairs(pos_ids: Tensor, pos_groups: Tensor, cand_ids: Tensor, cand_groups: Tensor) -> Pairs:
    """(i, j) for every candidate j sharing query i's positive id or its (non-negative) group."""
    # a positive without a group (-1) must match nothing: give it a value no candidate carries
    pg = torch.where(pos_groups >= 0, pos_groups, torch.full_like(pos_groups, -2))
    hit = torch.isin(cand_ids, pos_ids).logical_or_(torch.isin(cand_groups, pg))
    cols = hit.nonzero().squeeze(1)
    sub = (cand_ids[cols].unsqueeze(0) == pos_ids.unsqueeze(1)) | (cand_groups[cols].unsqueeze(0) == pg.unsqueeze(1))
    rows, c = sub.nonzero(as_tuple=True)
    return rows, cols[c]


def own_pairs(rows: int, offset: int, device: torch.device) -> Pairs:
    """(i, offset + i): each query's own positive inside a batch block (it is scored separately)."""
    r = torch.arange(rows, device=device)
    return r, r + offset


def merge_pairs(a: Pairs, b: Pairs, ncols: int) -> Pairs:
    """Union of two index sets, each entry once."""
    key = torch.unique(torch.cat([a[0] * ncols + a[1], b[0] * ncols + b[1]]))
    return key // ncols, key % ncols

