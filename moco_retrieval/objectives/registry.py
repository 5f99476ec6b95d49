"""The objectives by name: each one's schema, class and one-line description; building one, reading
one's config back from a checkpoint, and the Hydra group ``objective``.

``build_objective``, the config store (``register``: ``objective=NAME`` is the schema itself, its
defaults the schema's), the model card and the table of objectives in docs/guide/objectives.md all
read this one dict, so a new objective is its module and one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from moco_retrieval.config import ConfigError, to_config
from moco_retrieval.objectives.base import Objective, ObjectiveConfig
from moco_retrieval.objectives.feature_memory import FeatureMemoryConfig, FeatureMemoryObjective
from moco_retrieval.objectives.inbatch import InBatchConfig, InBatchObjective
from moco_retrieval.objectives.matryoshka import Matryoshka
from moco_retrieval.objectives.moco import MoCoConfig, MoCoObjective
from moco_retrieval.objectives.two_queue import TwoQueueConfig, TwoQueueObjective


@dataclass(frozen=True)
class ObjectiveEntry:
    config: type
    objective: type
    description: str


OBJECTIVES: dict[str, ObjectiveEntry] = {
    "two_queue": ObjectiveEntry(
        TwoQueueConfig, TwoQueueObjective,
        "two-queue MoCo: query->document and document->query, each against an EMA encoder's keys and a queue of them, "
        "plus in-batch negatives"),
    "moco": ObjectiveEntry(
        MoCoConfig, MoCoObjective,
        "MoCo: queries against a momentum (EMA) key encoder's documents and a FIFO queue of its past keys"),
    "inbatch": ObjectiveEntry(
        InBatchConfig, InBatchObjective,
        "in-batch InfoNCE: every other document of the (global) batch is a negative"),
    "feature_memory": ObjectiveEntry(
        FeatureMemoryConfig, FeatureMemoryObjective,
        "in-batch InfoNCE plus a queue of frozen-backbone features re-projected by the trained head"),
}


def register() -> None:
    """``objective=NAME`` for every objective: its schema, registered in Hydra's config store."""
    cs = ConfigStore.instance()
    for name, entry in OBJECTIVES.items():
        cs.store(group="objective", name=name, node=entry.config)


def objective_config(node: Any) -> ObjectiveConfig:
    """The objective's own schema from a dataclass, DictConfig or dict (as saved in a checkpoint),
    chosen by its ``name``; an unknown name or a field that objective does not use is an error."""
    if isinstance(node, ObjectiveConfig):
        return node
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    name = node.get("name") if isinstance(node, dict) else None
    if name not in OBJECTIVES:
        raise ConfigError(f"objective.name={name!r}: expected one of {', '.join(OBJECTIVES)}")
    return to_config(OBJECTIVES[name].config, node)


def build_objective(cfg: Any, encoder, guide_encoder=None, sources: int = 1) -> Objective:
    """The objective ``cfg`` describes, sized for ``encoder`` (its ``dim``; its ``hidden_size`` and
    ``frozen`` for the feature memory), a fixed guide's ``guide_encoder`` and ``sources`` training
    sources; wrapped by Matryoshka when ``cfg.matryoshka_dims`` are set."""
    cfg = objective_config(cfg)
    guide_dim = guide_encoder.dim if guide_encoder is not None else None
    objective = OBJECTIVES[cfg.name].objective.build(cfg, encoder, guide_dim, sources)
    if cfg.matryoshka_dims:
        objective = Matryoshka(objective, cfg.matryoshka_dims, cfg.matryoshka_weights, encoder.dim,
                               bool(getattr(encoder, "normalize", True)))
    return objective


def objectives_table() -> str:
    """The user guide's table of objectives (Markdown), from the registry."""
    rows = ["| objective | what it trains | schema |", "|---|---|---|"]
    rows += [f"| `{name}` | {e.description} | `{e.config.__name__}` |" for name, e in OBJECTIVES.items()]
    return "\n".join(rows)


__all__ = ["OBJECTIVES", "ObjectiveEntry", "register", "objective_config", "build_objective", "objectives_table"]
