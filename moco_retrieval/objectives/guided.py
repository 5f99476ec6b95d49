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

from moco_retrieval.distributed import all_gather_no_grad
from moco_retrieval.objectives.masking import Pairs
from moco_retrieval.objectives.step import GUIDE, MOMENTUM, StepInput, View

NONE, MOMENTUM_GUIDE = "none", "momentum"
# the batch's sides as each guide sees them: StepInput fields
FIXED_VIEWS = {"g_q": View("query", GUIDE, grad=False), "g_k": View("doc", GUIDE, grad=False),
               "g_neg": View("neg", GUIDE, grad=False)}
MOMENTUM_VIEWS = {"q_key": View("query", MOMENTUM, grad=False)}  # "k" and "neg" are EMA keys already
EMBEDDING = {MOMENTUM_GUIDE: {"query": "q_key", "doc": "k", "neg": "neg"},
             "fixed": {"query": "g_q", "doc": "g_k", "neg": "g_neg"}}
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


class Guide:
    """The guide of an objective: which embeddings it needs (``views``) and, for one direction, its
    scores of that direction's candidates (``scores``). ``name``: ``objective.guide``;
    ``momentum_ok``: the objective has EMA keys of both sides (``guide=momentum`` needs them)."""

    def __init__(self, name: str, objective: str, momentum_ok: bool):
        self.name = str(name)
        if self.name == MOMENTUM_GUIDE and not momentum_ok:
            raise ValueError(
                f"objective.guide=momentum needs an EMA key encoder (objective=moco or two_queue); "
                f"objective={objective} has none: use guide=base or a model folder"
            )

    @property
    def on(self) -> bool:
        return self.name != NONE

    @property
    def fixed(self) -> bool:
        """A frozen guide encoder ("base" or a model folder), built by the module, embeds the batch."""
        return self.name not in (NONE, MOMENTUM_GUIDE)

    @property
    def views(self) -> dict[str, View]:
        if not self.on:
            return {}
        return FIXED_VIEWS if self.fixed else MOMENTUM_VIEWS

    def embedding(self, batch: StepInput, side: str) -> Tensor | None:
        """The guide's embeddings of the batch's ``side`` ("query", "doc" or "neg")."""
        return getattr(batch, EMBEDDING["fixed" if self.fixed else MOMENTUM_GUIDE][side])

    def memory_keys(self, memory) -> Tensor:
        """The guide's embeddings of a key memory's negatives: the EMA keys themselves, or the fixed
        guide's, kept slot for slot in the memory."""
        return memory.guide_keys() if self.fixed else memory.keys()

    def scores(self, batch: StepInput, anchor: str, *, memory=None, batch_keys: Tensor | None = None,
               hard: bool = False, gather=all_gather_no_grad) -> GuideScores | None:
        """The guide's view of one direction, whose anchors are the batch's ``anchor`` side and whose
        candidates are the other side's: its blocks "queue" (``memory``), "batch" (when the direction
        has the batch's keys, ``batch_keys``: the EMA guide scores those, a fixed guide its own
        embeddings of them, through ``gather``) and "hard" (the hard negatives, local). None: off."""
        if not self.on:
            return None
        other = OTHER_SIDE[anchor]
        cands = {}
        if memory is not None:
            cands["queue"] = self.memory_keys(memory)
        if batch_keys is not None:
            cands["batch"] = gather(self.embedding(batch, other)) if self.fixed else batch_keys
        if hard and batch.neg is not None:
            cands["hard"] = self.embedding(batch, "neg")
        return GuideScores(self.embedding(batch, anchor), self.embedding(batch, other), cands)


__all__ = ["GuidedMask", "GuideScores", "Guide", "NONE", "MOMENTUM_GUIDE"]
