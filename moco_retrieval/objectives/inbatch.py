"""In-batch negatives (``InBatchObjective``): InfoNCE over the B x B score matrix, optionally symmetric.

Design notes. Under DDP with ``cross_device`` documents and hard negatives are all-gathered *with
gradient*, so each query contrasts against the global batch; the target of local row i is column
``rank * B + i``. The document -> query direction masks by the document's own id and group.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad, rank
from moco_retrieval.objectives.base import Objective, ObjectiveConfig
from moco_retrieval.objectives.infonce import Direction, Keys


@dataclass
class InBatchConfig(ObjectiveConfig):
    """``objective=inbatch``: every other document of the (global) batch is a negative."""

    name: str = "inbatch"
    symmetric: bool = False  # also document -> query, losses averaged
    cross_device: bool = True  # all-gather documents with gradient under DDP


class InBatchObjective(Objective):
    """In-batch negatives: each query's positive is its own document; every other document of the
    (global) batch, and every hard negative, is a negative. Both sides are embedded by the trained
    encoder, with gradient. Documents sharing the positive's id or group are masked.

    Args:
        cfg: ``InBatchConfig``. Defaults, and why: ``temperature`` 0.05 (MNRL's scale 20);
            ``symmetric`` off (on adds the document -> query loss and averages the two, as MNRL's
            symmetric variant does); ``cross_device`` on (a larger batch of negatives for one
            all-gather).

    References:
        - Henderson et al., "Efficient Natural Language Response Suggestion for Smart Reply", 2017.
        - Karpukhin et al., "Dense Passage Retrieval for Open-Domain Question Answering" (DPR), 2020.

    Relations: sentence-transformers' ``MultipleNegativesRankingLoss`` (and its symmetric variant),
    facebookresearch/contriever ``src/inbatch.py``; ``FeatureMemoryObjective`` adds K re-projected
    past documents (frozen backbones).
    """

    def __init__(self, cfg: InBatchConfig):
        super().__init__(cfg)
        self.symmetric = bool(cfg.symmetric)
        self.cross_device = bool(cfg.cross_device)

    def _gather(self, x: Tensor, grad: bool = False) -> Tensor:
        if not self.cross_device:
            return x
        return all_gather_with_grad(x) if grad else all_gather_no_grad(x)

    def _direction(self, embed, anchor: str, a: Tensor, keys: Keys, ids: Tensor, groups: Tensor) -> Direction:
        """Rows of ``a`` (side ``anchor``) against every row of ``keys``; row i's positive is
        ``keys[offset + i]`` (offset: this rank's first row when gathered across devices)."""
        offset = rank() * a.shape[0] if self.cross_device else 0
        guide = self.guide.scores(embed, anchor, batch_keys=keys.vectors, gather=self._gather)
        out = Direction(self.scoring, a / self.scoring.temperature(), keys.vectors[offset : offset + a.shape[0]], ids,
                        groups, guide)
        out.add_batch(keys, offset)
        return out

    def directions(self, batch: dict, embed) -> dict[str, Direction]:
        ids, groups = batch["doc_id"], batch["group"]
        q, k, neg = embed("query").float(), embed("doc").float(), embed("neg")
        ids_all, groups_all = self._gather(ids), self._gather(groups)
        self.scoring.observe(ids_all if self.cross_device else None, ids, embed.step)
        qd = self._direction(embed, "query", q, Keys(self._gather(k, grad=True), ids_all, groups_all), ids, groups)
        if neg is not None:
            if qd.guide is not None:
                qd.guide.candidates["hard"] = self._gather(self.guide.embedding(embed, "neg"))
            offset = rank() * neg.shape[0] if self.cross_device else 0
            qd.add_hard(Keys(self._gather(neg.float(), grad=True), self._gather(batch["neg_id"]),
                             self._gather(batch["neg_group"])), offset, neg.shape[0])
        if not self.symmetric:
            return {"query_to_doc": qd}
        # document -> query: documents score every query; masking by the document's own id/group
        dq = self._direction(embed, "doc", k, Keys(self._gather(q, grad=True), ids_all, groups_all), ids, groups)
        return {"query_to_doc": qd, "doc_to_query": dq}

    def total(self, losses: dict[str, Tensor]) -> Tensor:
        return sum(losses.values()) / len(losses)
