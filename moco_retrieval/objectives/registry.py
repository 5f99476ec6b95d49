"""The objectives by name: each one's config schema, class and one-line description.

``build_objective`` (``__init__.py``), the config store (config.py: the ``objective`` group's
schemas), the model card (model_card.py) and the table of objectives in docs/guide/objectives.md
(written by config_reference.py) all read this one dict, so a new objective is its module, its yaml
and one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass

from moco_retrieval.config import FeatureMemoryConfig, ICoLConfig, InBatchConfig, MoCoConfig, TwoQueueConfig
from moco_retrieval.objectives.feature_memory import FeatureMemoryObjective
from moco_retrieval.objectives.icol import ICoLObjective
from moco_retrieval.objectives.inbatch import InBatchObjective
from moco_retrieval.objectives.moco import MoCoObjective
from moco_retrieval.objectives.two_queue import TwoQueueObjective


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
    "icol": ObjectiveEntry(
        ICoLConfig, ICoLObjective,
        "ICoL: the query tower and the document tower trained in turns, each against a queue of the other's "
        "embeddings of this phase"),
}


def objectives_table() -> str:
    """The user guide's table of objectives (Markdown), from the registry."""
    rows = ["| objective | what it trains | schema |", "|---|---|---|"]
    rows += [f"| `{name}` | {e.description} | `{e.config.__name__}` |" for name, e in OBJECTIVES.items()]
    return "\n".join(rows)


__all__ = ["OBJECTIVES", "ObjectiveEntry", "objectives_table"]
