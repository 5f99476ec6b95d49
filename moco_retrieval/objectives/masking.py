"""False-negative masks, shared by every objective.

A candidate negative is a false negative of query i when it *is* query i's positive document
(same document id) or a known duplicate of it (same group id, groups >= 0). Such candidates are
removed from the softmax instead of being pushed away.
"""
from __future__ import annotations

import torch
from torch import Tensor


def false_negative_mask(pos_ids: Tensor, pos_groups: Tensor, cand_ids: Tensor, cand_groups: Tensor) -> Tensor:
    """Bool [B, N]: True where candidate j shares query i's positive id, or its (non-negative) group."""
    mask = cand_ids.unsqueeze(0) == pos_ids.unsqueeze(1)
    same_group = cand_groups.unsqueeze(0) == pos_groups.unsqueeze(1)
    same_group &= (pos_groups >= 0).unsqueeze(1)
    return mask.logical_or_(same_group)


def self_mask(rows: int, cols: int, offset: int, device: torch.device) -> Tensor:
    """Bool [rows, cols]: True at (i, offset + i), the positive's own column in a batch block."""
    mask = torch.zeros(rows, cols, dtype=torch.bool, device=device)
    idx = torch.arange(rows, device=device)
    mask[idx, idx + offset] = True
    return mask
