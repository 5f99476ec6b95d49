"""Swappable contrastive objectives, one per file, one protocol (objectives/base.py):
``objective(q, k, meta, step=...) -> (loss, stats)``, with the embeddings it needs declared in
``views`` and its queues written in ``after_backward()``."""
from __future__ import annotations

from moco_retrieval.config import (
    FeatureMemoryConfig, ICoLConfig, InBatchConfig, MoCoConfig, ObjectiveConfig, TwoQueueConfig, objective_config,
)
from moco_retrieval.objectives.base import GUIDE, MOMENTUM, TRAINED, Objective, View
from moco_retrieval.objectives.feature_memory import FeatureMemoryObjective
from moco_retrieval.objectives.icol import ICoLObjective
from moco_retrieval.objectives.inbatch import InBatchObjective
from moco_retrieval.objectives.moco import MoCoObjective
from moco_retrieval.objectives.two_queue import TwoQueueObjective


def build_objective(cfg: ObjectiveConfig, encoder, guide_encoder=None) -> Objective:
    """The objective ``cfg`` describes, sized for ``encoder`` (its ``dim``; its ``hidden_size`` and
    ``frozen`` for the feature memory) and for a fixed guide's ``guide_encoder`` (its ``dim``)."""
    cfg = objective_config(cfg)
    guide_dim = guide_encoder.dim if guide_encoder is not None else None
    if isinstance(cfg, InBatchConfig):
        return InBatchObjective(cfg)
    if isinstance(cfg, MoCoConfig):
        if cfg.queue_refresh and encoder.frozen:  # (TrainConfig refuses the combination first)
            raise ValueError("objective.queue_refresh needs a trained backbone: a frozen one never changes its keys")
        max_len = {kind: encoder.max_len(kind) for kind in ("query", "doc")}
        cls = TwoQueueObjective if isinstance(cfg, TwoQueueConfig) else MoCoObjective  # TwoQueueConfig is a MoCoConfig
        return cls(cfg, encoder.dim, guide_dim, max_len)
    if isinstance(cfg, ICoLConfig):
        if encoder.shared_tower:  # (TrainConfig refuses the combination first)
            raise ValueError("objective=icol needs model.shared_tower=false: it trains the two towers in turns")
        return ICoLObjective(cfg, encoder.dim)
    if isinstance(cfg, FeatureMemoryConfig):
        if not encoder.frozen:
            raise ValueError(
                "objective=feature_memory needs model.frozen_backbone=true: only a frozen backbone's features stay "
                "valid, so the queue can hold features and re-project them every step; use objective=moco or "
                "objective=two_queue to fine-tune the backbone"
            )
        return FeatureMemoryObjective(cfg, encoder.hidden_size, guide_dim)
    raise ValueError(f"no objective for {type(cfg).__name__}")


__all__ = [
    "build_objective", "Objective", "View", "TRAINED", "MOMENTUM", "GUIDE",
    "InBatchObjective", "MoCoObjective", "TwoQueueObjective", "FeatureMemoryObjective", "ICoLObjective",
]
