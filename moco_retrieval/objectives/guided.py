"""Guided false-negative masking: candidates a guide model scores too close to the positive.

Id and group masks (infonce.py) catch only the false negatives the data labels. A user's own data
rarely has groups, so near-duplicates and other relevant documents stay in the softmax and are
pushed away. A guide scores every candidate against the anchor; candidate j of anchor i is masked
when

    g(i, j) > g(i, i+) - margin        (relative: the guide ranks it about as high as the positive)
    or g(i, j) > threshold             (absolute, when a threshold is set)

where g are the guide's cosines. This is GISTEmbed's rule (Solatorio 2024, "GISTEmbed: Guided
In-sample Selection of Training Negatives"; sentence-transformers' ``GISTEmbedLoss``, whose default
is the relative rule with margin 0).

Guides (``objective.guide``): "momentum" uses the EMA key encoder's embeddings, which MoCo-style
objectives compute anyway (the queue already holds its keys), so it costs at most the queries' EMA
pass; "base" or a model folder is a fixed frozen encoder, one more forward pass per step without
gradient, whose embeddings of queued documents are kept in a queue of their own (memory.py).
Defaults: off; margin 0 (mask what the guide ranks above the positive), no absolute threshold.
Measured (benchmarks B7): it pays only with a guide stronger than the model it trains.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moco_retrieval.distributed import all_gather_no_grad

NONE, MOMENTUM = "none", "momentum"
OTHER_SIDE = {"query": "doc", "doc": "query"}


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
        self.margin, self.threshold = float(margin), threshold

    @torch.no_grad()
    def pairs(self, anchor: Tensor, positive: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
        a = anchor.float()
        scores = a @ candidates.float().T
        hit = scores > ((a * positive.float()).sum(dim=1, keepdim=True) - self.margin)
        if self.threshold is not None:
            hit |= scores > self.threshold
        return hit.nonzero(as_tuple=True)


class Guide:
    """An objective's guide (``objective.guide``): its masking ``rule`` (None: off) and, for one
    direction, its scores of that direction's candidates (``scores``)."""

    def __init__(self, name: str, margin: float = 0.0, threshold: float | None = None, keys: str = MOMENTUM):
        self.name = str(name)
        self.rule = GuidedMask(margin, threshold) if self.name != NONE else None
        self.encoder = "guide" if self.fixed else keys  # "momentum": the encoder that makes the keys

    @property
    def fixed(self) -> bool:
        """A frozen guide encoder ("base" or a model folder), built by the module, embeds the batch."""
        return self.name not in (NONE, MOMENTUM)

    def embedding(self, embed, side: str) -> Tensor | None:
        """The guide's embeddings of the batch's ``side`` ("query", "doc" or "neg")."""
        return embed(side, self.encoder, grad=False)

    def scores(self, embed, anchor: str, *, memory=None, batch_keys: Tensor | None = None, hard: bool = False,
               gather=all_gather_no_grad) -> GuideScores | None:
        """The guide's view of one direction whose anchors are the batch's ``anchor`` side and whose
        candidates are the other side's: its blocks "queue" (``memory``'s: the EMA keys themselves,
        or the fixed guide's kept slot for slot), "batch" (when the direction has the batch's keys,
        ``batch_keys``: the EMA guide scores those, a fixed guide its own embeddings of them, through
        ``gather``) and "hard" (the hard negatives). None: off."""
        if self.rule is None:
            return None
        other = OTHER_SIDE[anchor]
        cands = {}
        if memory is not None:
            cands["queue"] = memory.guide_keys() if self.fixed else memory.keys()
        if batch_keys is not None:
            cands["batch"] = gather(self.embedding(embed, other)) if self.fixed else batch_keys
        if hard:
            neg = self.embedding(embed, "neg")
            if neg is not None:
                cands["hard"] = neg
        return GuideScores(self.embedding(embed, anchor), self.embedding(embed, other), cands)


__all__ = ["GuidedMask", "GuideScores", "Guide", "NONE", "MOMENTUM"]
