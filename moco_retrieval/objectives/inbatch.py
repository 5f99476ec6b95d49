"""In-batch negatives: InfoNCE over the B x B score matrix (optionally symmetric).

Each query's positive is its own document; every other document of the batch is a negative
(Henderson et al. 2017; Karpukhin et al. 2020, "DPR"; sentence-transformers'
``MultipleNegativesRankingLoss``; facebookresearch/contriever ``src/inbatch.py``). Both sides are
embedded by the trained encoder, with gradient.

Under DDP with ``cross_device`` (default on) documents and hard negatives are all-gathered *with
gradient*, so each query contrasts against the global batch; the target of local row i is
column ``rank * B + i``. Documents sharing the positive's id or group are masked.

Defaults: temperature 0.05 (MNRL's scale 20), not symmetric (``symmetric`` adds the
document->query loss, as MNRL's symmetric variant does).
"""
from __future__ import annotations

import torch
from torch import Tensor

from moco_retrieval.config import InBatchConfig
from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad, rank
from moco_retrieval.objectives.base import Objective, View
from moco_retrieval.objectives.contrastive import Block


class InBatchObjective(Objective):
    views = {"q": View("query"), "k": View("doc"), "neg": View("neg")}

    def __init__(self, cfg: InBatchConfig):
        super().__init__(cfg)
        self.symmetric = bool(cfg.symmetric)
        self.cross_device = bool(cfg.cross_device)

    def _gather(self, x: Tensor, grad: bool) -> Tensor:
        if not self.cross_device:
            return x
        return all_gather_with_grad(x) if grad else all_gather_no_grad(x)

    def _direction(self, a: Tensor, b_all: Tensor, ids, groups, ids_all, groups_all, extra, inv_tau, guide) -> tuple:
        """Rows of ``a`` against every row of ``b_all``; row i's positive is ``b_all[offset + i]``.
        ``guide``: the guide's (anchors, positives, all batch rows), or None."""
        offset = rank() * a.shape[0] if self.cross_device else 0
        a = a * inv_tau
        pos = self.corrected((a * b_all[offset : offset + a.shape[0]]).sum(dim=1), ids)
        blocks = [self.batch_block(a, b_all, offset, ids, groups, ids_all, groups_all, guide)]
        blocks += [Block(a @ h.T, m) for h, m in extra]
        return self.info_nce(pos, blocks, 1.0 / inv_tau)

    def forward(self, q: Tensor, k: Tensor, meta: dict, *, step: int = 0) -> tuple[Tensor, dict]:
        with torch.autocast(device_type=q.device.type, enabled=False):  # logits in fp32
            q, k = q.float(), k.float()
            ids, groups = meta["doc_id"], meta["group"]
            k_all = self._gather(k, grad=True)
            ids_all, groups_all = self._gather(ids, grad=False), self._gather(groups, grad=False)
            self.observe(ids_all if self.cross_device else None, ids, step)
            g = (meta["g_q"], meta["g_k"]) if self.fixed_guide else None
            inv_tau = 1.0 / self.temperature()
            extra = []
            if meta.get("neg") is not None:
                h = self._gather(meta["neg"].float(), grad=True)
                h_ids, h_groups = self._gather(meta["neg_id"], False), self._gather(meta["neg_group"], False)
                g_h = (*g, self._gather(meta["g_neg"], False)) if g else None
                extra.append((h, self.mask(ids, groups, h_ids, h_groups, g_h)))
            g_b = (*g, self._gather(g[1], False)) if g else None
            loss, stats = self._direction(q, k_all, ids, groups, ids_all, groups_all, extra, inv_tau, g_b)
            if self.symmetric:
                # document -> query: documents score every query; masking by the document's own id/group
                q_all = self._gather(q, grad=True)
                g_d = (g[1], g[0], self._gather(g[0], False)) if g else None
                loss_d, _ = self._direction(k, q_all, ids, groups, ids_all, groups_all, [], inv_tau, g_d)
                loss = (loss + loss_d) / 2
                stats["loss"] = loss.detach()
        return loss, stats
