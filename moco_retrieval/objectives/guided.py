"""Guided false-negative masking: candidates a guide model scores too close to the positive.

Id and group masks (masking.py) catch only the false negatives the data labels. A user's own data
rarely has groups, so near-duplicates and other relevant documents stay in the softmax and are
pushed away. A guide scores every candidate against the anchor; candidate j of anchor i is masked
when

    g(i, j) > g(i, i+) - margin        (relative: the guide ranks it about as high as the positive)
    or g(i, j) > threshold             (absolute, when a threshold is set)

where g are the guide's cosines. This is GISTEmbed's rule (Solatorio 2024, "GISTEmbed: Guided
In-sample Selection of Training Negatives"; sentence-transformers' ``GISTEmbedLoss``, whose default
is the relative rule with margin 0).

Guides (``objective.guide``): "momentum" uses the EMA key encoder's embeddings, which MoCo-style
objectives compute anyway (the queue already holds its keys), so it costs nothing extra; "base" or
a model folder is a fixed frozen encoder, one more forward pass per step without gradient, whose
embeddings of queued documents are kept in a queue of their own. Defaults: off; margin 0 (mask what
the guide ranks above the positive), no absolute threshold.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moco_retrieval.objectives.masking import Pairs

NONE, MOMENTUM_GUIDE = "none", "momentum"


@dataclass
class GuideScores:
    """The guide's embeddings for one direction: anchors [B, d], their positives [B, d], and the
    candidates of each block by block name ("batch", "hard", "queue"; absent: not guided)."""

    anchor: Tensor
    positive: Tensor
    candidates: dict[str, Tensor]


class GuidedMask:
    """The masking rule above; ``pairs`` returns the (row, col) entries it masks."""

    def __init__(self, margin: float = 0.0, threshold: float | None = None):
        if not -2.0 <= margin <= 2.0:
            raise ValueError(f"objective.guide_margin must be in [-2, 2] (a cosine difference), got {margin}")
        if threshold is not None and not -1.0 <= threshold <= 1.0:
            raise ValueError(f"objective.guide_threshold must be a cosine in [-1, 1] or null, got {threshold}")
        self.margin, self.threshold = float(margin), threshold

    @torch.no_grad()
    def pairs(self, anchor: Tensor, positive: Tensor, candidates: Tensor) -> Pairs:
        a = anchor.float()
        scores = a @ candidates.float().T
        hit = scores > ((a * positive.float()).sum(dim=1, keepdim=True) - self.margin)
        if self.threshold is not None:
            hit |= scores > self.threshold
        return hit.nonzero(as_tuple=True)


__all__ = ["GuidedMask", "GuideScores", "NONE", "MOMENTUM_GUIDE"]
