"""In-batch negatives (``InBatchObjective``): InfoNCE over the B x B score matrix, optionally symmetric.

Design notes. Under DDP with ``cross_device`` documents and hard negatives are all-gathered *with
gradient*, so each query contrasts against the global batch; the target of local row i is column
``rank * B + i``. The document -> query direction masks by the document's own id and group.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moco_retrieval.config import InBatchConfig
from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad, rank
from moco_retrieval.objectives.base import Objective
from moco_retrieval.objectives.direction import Direction, Keys
from moco_retrieval.objectives.step import StepInput, View


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

    Parts: one ``Direction`` (two when symmetric); no memory.

    Relations:
        - sentence-transformers' ``MultipleNegativesRankingLoss`` (and its symmetric variant);
          facebookresearch/contriever ``src/inbatch.py``.
        - ``FeatureMemoryObjective`` adds K re-projected past documents (frozen backbones).
    """

    VIEWS = {"q": View("query"), "k": View("doc"), "neg": View("neg")}

    def __init__(self, cfg: InBatchConfig):
        super().__init__(cfg)
        self.symmetric = bool(cfg.symmetric)
        self.cross_device = bool(cfg.cross_device)

    def _gather(self, x: Tensor, grad: bool) -> Tensor:
        if not self.cross_device:
            return x
        return all_gather_with_grad(x) if grad else all_gather_no_grad(x)

    def _gather_labels(self, x: Tensor) -> Tensor:
        return self._gather(x, grad=False)

    def _direction(self, batch: StepInput, anchor: str, a: Tensor, keys: Keys, inv_tau: Tensor) -> Direction:
        """Rows of ``a`` (side ``anchor``) against every row of ``keys``; row i's positive is
        ``keys[offset + i]`` (offset: this rank's first row when gathered across devices)."""
        offset = rank() * a.shape[0] if self.cross_device else 0
        a = a * inv_tau
        guide = self.guide.scores(batch, anchor, batch_keys=keys.vectors, gather=self._gather_labels)
        out = Direction(self.scoring, a, keys.vectors[offset : offset + a.shape[0]], batch.doc_id, batch.group, guide)
        out.add_batch(keys, offset)
        return out

    def forward(self, batch: StepInput) -> tuple[Tensor, dict]:
        with torch.autocast(device_type=batch.q.device.type, enabled=False):  # logits in fp32
            q, k = batch.q.float(), batch.k.float()
            ids_all, groups_all = self._gather_labels(batch.doc_id), self._gather_labels(batch.group)
            self.scoring.observe(ids_all if self.cross_device else None, batch.doc_id, batch.step)
            inv_tau = 1.0 / self.scoring.temperature()
            qd = self._direction(batch, "query", q, Keys(self._gather(k, grad=True), ids_all, groups_all), inv_tau)
            if batch.neg is not None:
                if qd.guide is not None:
                    qd.guide.candidates["hard"] = self._gather_labels(self.guide.embedding(batch, "neg"))
                qd.add_hard(Keys(self._gather(batch.neg.float(), grad=True), self._gather_labels(batch.neg_id),
                                 self._gather_labels(batch.neg_group)))
            loss, stats = qd.loss(1.0 / inv_tau)
            if self.symmetric:
                # document -> query: documents score every query; masking by the document's own id/group
                dq = self._direction(batch, "doc", k, Keys(self._gather(q, grad=True), ids_all, groups_all), inv_tau)
                loss_d, _ = dq.loss(1.0 / inv_tau)
                loss = (loss + loss_d) / 2
                stats["loss"] = loss.detach()
        return loss, stats
