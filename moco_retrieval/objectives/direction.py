"""One InfoNCE direction: anchors against their positives and blocks of candidates.

Every objective is a few of these (docs/design.md): MoCo one (queries -> documents), two-queue two
(and an in-batch one), in-batch one or two, ICoL one per phase. A direction's candidates come in
blocks, in this order when present:

* the batch's keys (``add_batch``): row i's own positive among them is masked (it is scored apart);
* hard negatives (``add_hard``): chosen per query, so not logQ-corrected;
* a key memory's negatives (``add_memory``), or any other block of keys (``add``).

Each block is masked by the objective's ``Scoring`` (id, group and the guide's rule) and, but for
hard negatives, logQ-corrected. Anchors arrive already divided by the temperature, so every block
is logits; blocks are never concatenated (contrastive.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from moco_retrieval.distributed import all_gather_no_grad, rank
from moco_retrieval.objectives.contrastive import Block
from moco_retrieval.objectives.guided import GuideScores
from moco_retrieval.objectives.masking import Mask, own_pairs
from moco_retrieval.objectives.scoring import Scoring


class Keys(NamedTuple):
    """Candidate keys [N, d] with their documents' ids and groups [N]."""

    vectors: Tensor
    ids: Tensor
    groups: Tensor


def gathered_keys(keys: Tensor, ids: Tensor, groups: Tensor) -> Keys:
    """The global batch's keys, ids and groups (rank order), without gradient."""
    return Keys(all_gather_no_grad(keys), all_gather_no_grad(ids), all_gather_no_grad(groups))


@dataclass
class Candidates:
    """One block of a direction: its candidates (vectors [N, d], or a key memory's negatives), their
    ids, its mask (id, group, guide: the same at every Matryoshka prefix) and whether logQ corrects it."""

    keys: Tensor | None
    memory: Any
    ids: Tensor
    mask: Mask
    logq: bool


class Direction:
    """Anchors [B, d] (already / tau) with their positives [B, d], labelled by the positives' ids and
    groups [B]; ``guide``: the guide's scores of this direction's candidates by block, or None."""

    def __init__(self, scoring: Scoring, anchors: Tensor, positives: Tensor, ids: Tensor, groups: Tensor,
                 guide: GuideScores | None = None):
        self.scoring, self.anchors, self.positives = scoring, anchors, positives
        self.ids, self.groups, self.guide = ids, groups, guide
        self.blocks: list[Candidates] = []

    def _guide(self, block: str | None) -> tuple[Tensor, Tensor, Tensor] | None:
        g = self.guide
        if g is None or block is None or block not in g.candidates:
            return None
        return g.anchor, g.positive, g.candidates[block]

    def add(self, keys: Tensor | None, ids: Tensor, groups: Tensor, guide: str | None = None, logq: bool = True,
            own_offset: int | None = None, mask: Mask | None = None, memory=None) -> Candidates:
        """A block of candidate ``keys`` [N, d] (or ``memory``'s negatives) labelled ``ids``, ``groups``
        [N]; ``guide``: which of the guide's candidate blocks scores them; ``own_offset``: row i's
        own positive is candidate ``own_offset + i`` (masked, not counted); ``mask``: another
        block's mask over the same candidates, reused; ``logq``: logQ corrects its logits."""
        if mask is None:
            own = None if own_offset is None else own_pairs(self.anchors.shape[0], own_offset, ids.device)
            mask = self.scoring.mask(self.ids, self.groups, ids, groups, self._guide(guide), own)
        block = Candidates(keys, memory, ids, mask, logq)
        self.blocks.append(block)
        return block

    def add_batch(self, keys: Keys, offset: int | None = None, guided: bool = True, mask: Mask | None = None) -> Candidates:
        """The batch's keys (all ranks', rank order); this rank's rows start at ``offset``
        (default: rank * B)."""
        offset = rank() * self.anchors.shape[0] if offset is None else offset
        return self.add(keys.vectors, keys.ids, keys.groups, "batch" if guided else None, own_offset=offset, mask=mask)

    def add_hard(self, keys: Keys) -> Candidates:
        return self.add(keys.vectors, keys.ids, keys.groups, "hard", logq=False)

    def add_memory(self, memory, guided: bool = True) -> Candidates | None:
        """A key memory's negatives (none yet: no block)."""
        if memory is None or memory.fill == 0:
            return None
        return self.add(None, memory.ids(), memory.groups(), "queue" if guided else None, memory=memory)

    def add_keys(self, batch: Keys | None, hard: Keys | None = None, memory=None, guided: bool = True) -> "Direction":
        """The batch's keys, the hard negatives and a memory's negatives, each when present."""
        if batch is not None:
            self.add_batch(batch, guided=guided)
        if hard is not None:
            self.add_hard(hard)
        self.add_memory(memory, guided)
        return self

    def _scored(self, anchors: Tensor, positives: Tensor, prefix: int | None) -> tuple[Tensor, list[Block]]:
        """The positive logits and every block's logits (masks attached) of ``anchors`` (already / tau),
        at the full dimension or (``prefix``) the first that many coordinates of every candidate."""
        corrected, m = self.scoring.corrected, self.scoring.matryoshka
        blocks = []
        for c in self.blocks:
            if c.memory is not None:
                logits = c.memory.logits(anchors, None if prefix is None else (lambda k: m.prefix(k, prefix)))
            else:
                logits = anchors @ (c.keys if prefix is None else m.prefix(c.keys, prefix)).T
            blocks.append(Block(corrected(logits, c.ids) if c.logq else logits, c.mask))
        return corrected((anchors * positives).sum(dim=1), self.ids), blocks

    def loss(self, tau: Tensor) -> tuple[Tensor, dict]:
        """InfoNCE over the positive and every block added (contrastive.info_nce), with its stats;
        with Matryoshka prefixes the weighted sum over them (stats: the first prefix's, and
        ``loss_dim<d>`` each)."""
        m = self.scoring.matryoshka
        if m is None:
            return self.scoring.info_nce(*self._scored(self.anchors, self.positives, None), tau)
        total, out = 0.0, None
        for dim, weight in m:
            # a prefix of anchors / tau: its direction re-normalised, then / tau again
            anchors = m.prefix(self.anchors, dim) / tau if m.normalize else self.anchors[:, :dim]
            loss, stats = self.scoring.info_nce(*self._scored(anchors, m.prefix(self.positives, dim), dim), tau)
            total = total + weight * loss
            out = stats if out is None else out
            out[f"loss_dim{dim}"] = loss.detach()
        out["loss"] = total.detach()
        return total, out


__all__ = ["Direction", "Keys", "gathered_keys"]
