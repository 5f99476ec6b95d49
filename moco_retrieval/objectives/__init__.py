"""Swappable contrastive objectives: same call ``objective(q, k, meta, step=...) -> (loss, stats)``."""
from __future__ import annotations

from moco_retrieval.config import ObjectiveConfig
from moco_retrieval.objectives.inbatch import InBatchObjective
from moco_retrieval.objectives.moco import MoCoObjective


def build_objective(cfg: ObjectiveConfig, dim: int):
    temp = dict(
        temperature=cfg.temperature,
        learn_temperature=cfg.learn_temperature,
        temperature_min=cfg.temperature_min,
        temperature_max=cfg.temperature_max,
        label_smoothing=cfg.label_smoothing,
        mask_false_negatives=cfg.mask_false_negatives,
    )
    if cfg.name == "moco":
        return MoCoObjective(
            dim,
            queue_size=cfg.queue_size,
            queue_dtype=cfg.queue_dtype,
            batch_negatives=cfg.batch_negatives,
            enqueue_hard_negatives=cfg.enqueue_hard_negatives,
            **temp,
        )
    if cfg.name == "inbatch":
        return InBatchObjective(symmetric=cfg.symmetric, cross_device=cfg.cross_device, **temp)
    raise ValueError(f"objective.name must be 'moco' or 'inbatch', got {cfg.name!r}")


__all__ = ["build_objective", "InBatchObjective", "MoCoObjective"]
