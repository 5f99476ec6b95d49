"""Feature memory for frozen backbones: a queue of past documents' backbone *features*, projected
by the trained head every step, with gradient through every key.

With a frozen backbone a document's embedding is a function of (backbone feature, head) only, so a
queue of features re-projected by the current head holds exactly the keys the current encoder
would give: nothing goes stale, whatever the queue's age. Keeping the projections' gradient makes
the loss in-batch InfoNCE over the batch's queries against batch + K documents, both sides
trained: a cross-batch memory (Wang et al., "Cross-Batch Memory for Embedding Learning", CVPR
2020) made exact, since XBM stores embeddings and relies on their slow drift. Contrast MoCo
(moco.py), whose queued keys are constants and train only the query side.

The cost is one K x hidden x d projection (and its backward) per step. A fine-tuned backbone
cannot use this: its stored features would be stale, so the module refuses it.

Defaults: K = 16,384 (the ``frozen_queue`` preset's measured choice; see benchmarks/results/
batch_size.md), batch negatives on; temperature comes from the preset.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moco_retrieval.config import FeatureMemoryConfig
from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad, rank
from moco_retrieval.objectives.base import Objective, View
from moco_retrieval.objectives.contrastive import Block
from moco_retrieval.objectives.moco import require_queue
from moco_retrieval.objectives.queue import NegativeQueue


class FeatureMemoryObjective(Objective):
    views = {
        "q": View("query"),
        "k": View("doc"),
        "neg": View("neg"),
        "doc_features": View("doc", grad=False, features=True),  # what is stored
        "memory": View("memory"),  # the stored features, projected by the current head
    }
    needs_frozen_backbone = True

    def __init__(self, cfg: FeatureMemoryConfig, feature_dim: int, guide_dim: int | None = None):
        super().__init__(cfg)
        require_queue(cfg.queue_size, cfg.name)
        self.queue = NegativeQueue(cfg.queue_size, feature_dim, cfg.queue_dtype)
        # a fixed guide's embeddings of the queued documents, slot for slot with the queue
        self.guide_queue = NegativeQueue(cfg.queue_size, guide_dim, cfg.queue_dtype) if self.fixed_guide else None
        self.batch_negatives = bool(cfg.batch_negatives)
        self._pending: tuple | None = None

    def memory_features(self) -> Tensor:
        return self.queue.keys()

    def forward(self, q: Tensor, k: Tensor, meta: dict, *, step: int = 0) -> tuple[Tensor, dict]:
        with torch.autocast(device_type=q.device.type, enabled=False):  # logits in fp32
            tau = self.temperature()
            q, k = q.float() / tau, k.float()
            ids, groups = meta["doc_id"], meta["group"]
            g = (meta["g_q"], meta["g_k"]) if self.fixed_guide else None
            blocks, ids_all = [], None
            if self.batch_negatives:
                keys, ids_all, groups_all = all_gather_with_grad(k), all_gather_no_grad(ids), all_gather_no_grad(groups)
                g_b = (*g, all_gather_no_grad(g[1])) if g else None
                blocks.append(self.batch_block(q, keys, rank() * q.shape[0], ids, groups, ids_all, groups_all, g_b))
            self.observe(ids_all, ids, step)
            if meta.get("neg") is not None:
                g_h = (*g, meta["g_neg"]) if g else None
                blocks.append(Block(q @ meta["neg"].float().T,
                                    self.mask(ids, groups, meta["neg_id"], meta["neg_group"], g_h)))
            if self.queue.fill > 0:
                q_ids = self.queue.ids()
                g_m = (*g, self.guide_queue.keys()) if g else None
                logits = self.corrected(q @ meta["memory"].float().T, q_ids)
                blocks.append(Block(logits, self.mask(ids, groups, q_ids, self.queue.groups(), g_m)))
            loss, stats = self.info_nce(self.corrected((q * k).sum(dim=1), ids), blocks, tau)
        pending = (meta["doc_features"], ids, groups, step)
        self._pending = (pending, meta.get("g_k")) if self.training else None
        return loss, stats

    @torch.no_grad()
    def after_backward(self) -> None:
        if self._pending is not None:
            (features, ids, groups, step), g_k = self._pending
            self.queue.enqueue(features, ids, groups, step)
            if self.guide_queue is not None:
                self.guide_queue.enqueue(g_k, ids, groups, step)
            self._pending = None

    def stats(self, step: int) -> dict[str, float]:
        return self.queue.stats(step)
