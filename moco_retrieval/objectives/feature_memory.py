"""Feature memory for frozen backbones (``FeatureMemoryObjective``): a queue of past documents'
backbone *features*, projected by the trained head every step, with gradient through every key.

Design notes. With a frozen backbone a document's embedding is a function of (backbone feature,
head) only, so a queue of features re-projected by the current head holds exactly the keys the
current encoder would give: nothing goes stale, whatever the queue's age. The module serves the
projection as the "memory" view (the stored features through the head, with gradient). The cost is
one K x hidden x d projection (and its backward) per step. A fine-tuned backbone cannot use this:
its stored features would be stale, so ``build`` refuses it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moco_retrieval.config import FeatureMemoryConfig
from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad
from moco_retrieval.objectives.base import Objective
from moco_retrieval.objectives.direction import Direction, Keys
from moco_retrieval.objectives.memory import KeyMemory
from moco_retrieval.objectives.step import Enqueue, StepInput, View


class FeatureMemoryObjective(Objective):
    """In-batch InfoNCE whose candidates also include K past documents: each query against its document,
    the batch's other documents, the hard negatives and the memory's documents, every one embedded by
    the current encoder with gradient, so both sides train. Candidates sharing the positive's document
    id or group are masked.

    Args:
        cfg: ``FeatureMemoryConfig``. Defaults, and why: ``queue_size`` 16,384 (the ``frozen_queue``
            preset's measured choice; see benchmarks/results/batch_size.md); ``batch_negatives`` on;
            the temperature comes from the preset.
        feature_dim: the frozen backbone's feature width (what the memory stores).
        guide_dim: a fixed guide encoder's dimension, when ``cfg.guide`` names one.

    References:
        - Wang et al., "Cross-Batch Memory for Embedding Learning" (XBM), CVPR 2020: a cross-batch
          memory, made exact here (XBM stores embeddings and relies on their slow drift).

    Parts: one ``Direction``; one ``KeyMemory`` of features, ``memory``.

    Relations:
        - ``MoCoObjective``'s queued keys are constants and train only the query side.
        - ``InBatchObjective`` is this without the memory.
    """

    VIEWS = {
        "q": View("query"),
        "k": View("doc"),
        "neg": View("neg"),
        "doc_features": View("doc", grad=False, features=True),  # what is stored
        "memory": View("memory"),  # the stored features, projected by the current head
    }
    LEGACY_KEYS = {**Objective.LEGACY_KEYS, "queue.": "memory.queue.", "guide_queue.": "memory.guide."}

    def __init__(self, cfg: FeatureMemoryConfig, feature_dim: int, guide_dim: int | None = None):
        super().__init__(cfg)
        # (a fixed guide's embeddings of the queued documents, slot for slot with the features)
        self.memory = KeyMemory.of(cfg, feature_dim, guide_dim=guide_dim if self.fixed_guide else None)
        self.batch_negatives = bool(cfg.batch_negatives)

    @classmethod
    def build(cls, cfg: FeatureMemoryConfig, encoder, guide_dim: int | None, sources: int = 1) -> "FeatureMemoryObjective":
        if not encoder.frozen:
            raise ValueError(
                "objective=feature_memory needs model.frozen_backbone=true: only a frozen backbone's features stay "
                "valid, so the queue can hold features and re-project them every step; use objective=moco or "
                "objective=two_queue to fine-tune the backbone"
            )
        return cls(cfg, encoder.hidden_size, guide_dim)

    def memory_features(self) -> Tensor:
        return self.memory.keys()

    def forward(self, batch: StepInput) -> tuple[Tensor, dict]:
        with torch.autocast(device_type=batch.q.device.type, enabled=False):  # logits in fp32
            tau = self.scoring.temperature()
            q, k = batch.q.float() / tau, batch.k.float()
            ids, groups = batch.doc_id, batch.group
            keys = None
            if self.batch_negatives:
                keys = Keys(all_gather_with_grad(k), all_gather_no_grad(ids), all_gather_no_grad(groups))
            self.scoring.observe(keys.ids if keys is not None else None, ids, batch.step)
            guide = self.guide.scores(batch, "query", memory=self.memory, hard=True,
                                      batch_keys=keys.vectors if keys is not None else None)
            hard = Keys(batch.neg.float(), batch.neg_id, batch.neg_group) if batch.neg is not None else None
            fm = Direction(self.scoring, q, k, ids, groups, guide).add_keys(keys, hard)
            if self.memory.fill > 0:  # the stored features as the current head projects them
                fm.add(batch.memory.float(), self.memory.ids(), self.memory.groups(), "queue")
            loss, stats = fm.loss(tau)
        self.hold(self.memory, Enqueue(batch.doc_features, ids, groups, batch.step,
                                       guide_keys=batch.g_k if self.fixed_guide else None))
        return loss, stats
