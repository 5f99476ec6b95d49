"""Swappable contrastive objectives, one per file, one protocol (objectives/base.py):
``objective(batch: StepInput) -> (loss, stats)``, with the embeddings it needs declared in
``views`` and its key memories written in ``after_backward()``; registered by name in registry.py."""
from __future__ import annotations

from moco_retrieval.config import ObjectiveConfig, objective_config
from moco_retrieval.objectives.base import Objective
from moco_retrieval.objectives.feature_memory import FeatureMemoryObjective
from moco_retrieval.objectives.icol import ICoLObjective
from moco_retrieval.objectives.inbatch import InBatchObjective
from moco_retrieval.objectives.moco import MoCoObjective
from moco_retrieval.objectives.registry import OBJECTIVES
from moco_retrieval.objectives.step import GUIDE, MOMENTUM, TRAINED, StepInput, View, check_views
from moco_retrieval.objectives.two_queue import TwoQueueObjective


def build_objective(cfg: ObjectiveConfig, encoder, guide_encoder=None, sources: int = 1) -> Objective:
    """The objective ``cfg`` describes (its class from the registry), sized for ``encoder`` (its
    ``dim``; its ``hidden_size`` and ``frozen`` for the feature memory), for a fixed guide's
    ``guide_encoder`` (its ``dim``) and for ``sources`` training sources (``data.sources``: one
    memory each under ``objective.queue_per_source``)."""
    cfg = objective_config(cfg)
    guide_dim = guide_encoder.dim if guide_encoder is not None else None
    objective = OBJECTIVES[cfg.name].objective.build(cfg, encoder, guide_dim, sources)
    check_views(type(objective).__name__, objective.views)
    if objective.scoring.matryoshka is not None:  # prefixes of the encoder's embeddings, unit when they are
        objective.scoring.matryoshka.check(encoder.dim)
        objective.scoring.matryoshka.normalize = bool(getattr(encoder, "normalize", True))
    return objective


__all__ = [
    "build_objective", "Objective", "View", "StepInput", "TRAINED", "MOMENTUM", "GUIDE", "OBJECTIVES",
    "InBatchObjective", "MoCoObjective", "TwoQueueObjective", "FeatureMemoryObjective", "ICoLObjective",
]
