"""In-batch negatives: InfoNCE over the B x B score matrix (optionally symmetric).

Each query's positive is its own document; every other document of the batch is a negative
(Henderson et al. 2017; Karpukhin et al. 2020, "DPR"; sentence-transformers'
``MultipleNegativesRankingLoss``; facebookresearch/contriever ``src/inbatch.py``).

Under DDP with ``cross_device`` (default on) documents and hard negatives are all-gathered *with
gradient*, so each query contrasts against the global batch; the target of local row i is
column ``rank * B + i``. Documents sharing the positive's id or group are masked.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad, rank
from moco_retrieval.objectives.contrastive import Block, Temperature, info_nce
from moco_retrieval.objectives.masking import false_negative_pairs, merge_pairs, own_pairs


class InBatchObjective(nn.Module):
    """Args:
    temperature / learn_temperature / temperature_min / temperature_max: see ``Temperature``.
    label_smoothing: target mass spread over unmasked candidates (default 0).
    symmetric: average query->document and document->query losses (default False).
    mask_false_negatives: mask batch documents sharing the positive's id or group (default True).
    cross_device: gather documents from every rank with gradient (default True; no-op alone).
    """

    keys_from_key_encoder = False

    def __init__(
        self,
        temperature: float = 0.05,
        learn_temperature: bool = False,
        temperature_min: float = 0.01,
        temperature_max: float = 1.0,
        label_smoothing: float = 0.0,
        symmetric: bool = False,
        mask_false_negatives: bool = True,
        cross_device: bool = True,
    ):
        super().__init__()
        self.temperature = Temperature(temperature, learn_temperature, temperature_min, temperature_max)
        self.label_smoothing = label_smoothing
        self.symmetric = symmetric
        self.mask_false_negatives = mask_false_negatives
        self.cross_device = cross_device

    def _gather(self, x: Tensor, grad: bool) -> Tensor:
        if not self.cross_device:
            return x
        return all_gather_with_grad(x) if grad else all_gather_no_grad(x)

    def _direction(self, a: Tensor, b_all: Tensor, ids: Tensor, groups: Tensor, ids_all, groups_all, extra, inv_tau) -> tuple:
        """Rows of ``a`` (scaled by 1/tau) against every row of ``b_all``; row i's positive is
        ``b_all[offset + i]``."""
        offset = rank() * a.shape[0] if self.cross_device else 0
        masked = own_pairs(a.shape[0], offset, a.device)
        if self.mask_false_negatives:
            masked = merge_pairs(masked, false_negative_pairs(ids, groups, ids_all, groups_all), b_all.shape[0])
        a = a * inv_tau
        pos = (a * b_all[offset : offset + a.shape[0]]).sum(dim=1)
        blocks = [Block(a @ b_all.T, masked)] + [Block(a @ h.T, m) for h, m in extra]
        return info_nce(pos, blocks, 1.0 / inv_tau, self.label_smoothing)

    def forward(self, q: Tensor, k: Tensor, meta: dict, *, step: int = 0) -> tuple[Tensor, dict]:
        with torch.autocast(device_type=q.device.type, enabled=False):  # logits in fp32
            q, k = q.float(), k.float()
            ids, groups = meta["doc_id"], meta["group"]
            k_all = self._gather(k, grad=True)
            ids_all, groups_all = self._gather(ids, grad=False), self._gather(groups, grad=False)
            inv_tau = 1.0 / self.temperature()
            extra = []
            if meta.get("neg") is not None:
                h = self._gather(meta["neg"].float(), grad=True)
                h_ids, h_groups = self._gather(meta["neg_id"], False), self._gather(meta["neg_group"], False)
                h_mask = false_negative_pairs(ids, groups, h_ids, h_groups) if self.mask_false_negatives else None
                extra.append((h, h_mask))
            loss, stats = self._direction(q, k_all, ids, groups, ids_all, groups_all, extra, inv_tau)
            if self.symmetric:
                # document -> query: documents score every query; masking by the document's own id/group
                q_all = self._gather(q, grad=True)
                loss_d, _ = self._direction(k, q_all, ids, groups, ids_all, groups_all, [], inv_tau)
                loss = (loss + loss_d) / 2
                stats["loss"] = loss.detach()
        return loss, stats
