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

from typing import NamedTuple

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


class Direction:
    """Anchors [B, d] (already / tau) with their positives [B, d], labelled by the positives' ids and
    groups [B]; ``guide``: the guide's scores of this direction's candidates by block, or None."""

    def __init__(self, scoring: Scoring, anchors: Tensor, positives: Tensor, ids: Tensor, groups: Tensor,
                 guide: GuideScores | None = None):
        self.scoring, self.anchors, self.ids, self.groups, self.guide = scoring, anchors, ids, groups, guide
        self.positive = scoring.corrected((anchors * positives).sum(dim=1), ids)
        self.blocks: list[Block] = []

    def _guide(self, block: str | None) -> tuple[Tensor, Tensor, Tensor] | None:
        g = self.guide
        if g is None or block is None or block not in g.candidates:
            return None
        return g.anchor, g.positive, g.candidates[block]

    def add(self, logits: Tensor, ids: Tensor, groups: Tensor, guide: str | None = None, logq: bool = True,
            own_offset: int | None = None, mask: Mask | None = None) -> Block:
        """A block of ``logits`` [B, N] against candidates labelled ``ids``, ``groups`` [N]; ``guide``:
        which of the guide's candidate blocks scores them; ``own_offset``: row i's own positive is
        candidate ``own_offset + i`` (masked, not counted); ``mask``: another block's mask over the
        same candidates, reused."""
        if mask is None:
            own = None if own_offset is None else own_pairs(self.anchors.shape[0], own_offset, logits.device)
            mask = self.scoring.mask(self.ids, self.groups, ids, groups, self._guide(guide), own)
        block = Block(self.scoring.corrected(logits, ids) if logq else logits, mask)
        self.blocks.append(block)
        return block

    def add_batch(self, keys: Keys, offset: int | None = None, guided: bool = True, mask: Mask | None = None) -> Block:
        """The batch's keys (all ranks', rank order); this rank's rows start at ``offset``
        (default: rank * B)."""
        offset = rank() * self.anchors.shape[0] if offset is None else offset
        return self.add(self.anchors @ keys.vectors.T, keys.ids, keys.groups, "batch" if guided else None,
                        own_offset=offset, mask=mask)

    def add_hard(self, keys: Keys) -> Block:
        return self.add(self.anchors @ keys.vectors.T, keys.ids, keys.groups, "hard", logq=False)

    def add_memory(self, memory, guided: bool = True) -> Block | None:
        """A key memory's negatives (none yet: no block)."""
        if memory is None or memory.fill == 0:
            return None
        return self.add(memory.logits(self.anchors), memory.ids(), memory.groups(), "queue" if guided else None)

    def add_keys(self, batch: Keys | None, hard: Keys | None = None, memory=None, guided: bool = True) -> "Direction":
        """The batch's keys, the hard negatives and a memory's negatives, each when present."""
        if batch is not None:
            self.add_batch(batch, guided=guided)
        if hard is not None:
            self.add_hard(hard)
        self.add_memory(memory, guided)
        return self

    def loss(self, tau: Tensor) -> tuple[Tensor, dict]:
        """InfoNCE over the positive and every block added (contrastive.info_nce), with its stats."""
        return self.scoring.info_nce(self.positive, self.blocks, tau)


__all__ = ["Direction", "Keys", "gathered_keys"]
