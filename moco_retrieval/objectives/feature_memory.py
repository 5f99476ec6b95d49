"""Feature memory for frozen backbones (``FeatureMemoryObjective``): a queue of past documents'
backbone *features*, projected by the trained head every step, with gradient through every key.

Design notes. With a frozen backbone a document's embedding is a function of (backbone feature,
head) only, so a queue of features re-projected by the current head holds exactly the keys the
current encoder would give: nothing goes stale, whatever the queue's age. The cost is one
K x hidden x d projection (and its backward) per step. A fine-tuned backbone cannot use this: its
stored features would be stale, so ``build`` refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass

from moco_retrieval.config import ConfigError
from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad
from moco_retrieval.objectives.base import TRAINED, Objective, ObjectiveConfig, hard_keys
from moco_retrieval.objectives.infonce import Direction, Keys
from moco_retrieval.objectives.memory import Enqueue, QueueOptions, side_memories


@dataclass
class FeatureMemoryConfig(QueueOptions, ObjectiveConfig):
    """``objective=feature_memory`` (frozen backbones): a queue of backbone features, projected by
    the trained head every step, with gradient."""

    name: str = "feature_memory"
    temperature: float = 0.02  # the best for both queue and in-batch setups (benchmarks B2)
    queue_size: int = 16384  # the frozen_queue preset's measured choice (benchmarks B1)


class FeatureMemoryObjective(Objective):
    """In-batch InfoNCE whose candidates also include K past documents: each query against its
    document, the batch's other documents, the hard negatives and the memory's documents, every one
    embedded by the current encoder with gradient, so both sides train. Candidates sharing the
    positive's document id or group are masked.

    Args:
        cfg: ``FeatureMemoryConfig``. Defaults, and why: ``queue_size`` 16,384 (benchmarks B1) and
            ``temperature`` 0.02 (B2); ``batch_negatives`` on.
        feature_dim: the frozen backbone's feature width (what the memory stores).
        guide_dim: a fixed guide encoder's dimension, when ``cfg.guide`` names one.

    References: Wang et al., "Cross-Batch Memory for Embedding Learning" (XBM), CVPR 2020: a
    cross-batch memory, made exact here (XBM stores embeddings and relies on their slow drift).

    Relations: ``MoCoObjective``'s queued keys are constants and train only the query side;
    ``InBatchObjective`` is this without the memory.
    """

    def __init__(self, cfg: FeatureMemoryConfig, feature_dim: int, guide_dim: int | None = None):
        super().__init__(cfg)
        (self.memory,) = side_memories(cfg, feature_dim, 1, ("doc",), guide_dim if self.guide.fixed else None)
        self.batch_negatives = bool(cfg.batch_negatives)

    @classmethod
    def build(cls, cfg, encoder, guide_dim, sources=1):
        if not encoder.frozen:
            raise ConfigError(
                "objective=feature_memory needs model.frozen_backbone=true: only a frozen backbone's features stay "
                "valid, so the queue can hold features and re-project them every step; use objective=moco or "
                "objective=two_queue to fine-tune the backbone")
        return cls(cfg, encoder.hidden_size, guide_dim)

    def directions(self, batch: dict, embed) -> dict[str, Direction]:
        ids, groups = batch["doc_id"], batch["group"]
        q, k = embed("query"), embed("doc").float()
        features = embed.features("doc")  # what is stored
        keys = None
        if self.batch_negatives:
            keys = Keys(all_gather_with_grad(k), all_gather_no_grad(ids), all_gather_no_grad(groups))
        self.scoring.observe(keys.ids if keys is not None else None, ids, embed.step)
        guide = self.guide.scores(embed, "query", memory=self.memory, hard=True,
                                  batch_keys=keys.vectors if keys is not None else None)
        hard = hard_keys(batch, embed, TRAINED, grad=True)
        fm = Direction(self.scoring, q.float() / self.scoring.temperature(), k, ids, groups, guide).add_keys(keys, hard)
        if self.memory.fill > 0:  # the stored features as the current head projects them, with gradient
            fm.add(embed.project(self.memory.keys()), self.memory.ids(), self.memory.groups(), "queue")
        self.hold(self.memory, Enqueue(features, ids, groups, embed.step,
                                       guide_keys=self.guide.embedding(embed, "doc") if self.guide.fixed else None))
        return {"query_to_doc": fm}
