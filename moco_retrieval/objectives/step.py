"""What one training step hands an objective, and what an objective keeps for after the backward pass.

An objective declares the embeddings it needs as ``View``s, by name; the Lightning module makes
each one and hands them, with the batch's labels, as one ``StepInput`` whose fields are the view
names. What a forward pass holds back for a key memory until after backward is an ``Enqueue``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from torch import Tensor

TRAINED, MOMENTUM, GUIDE = "trained", "momentum", "guide"
SIDES = ("query", "doc", "neg", "memory", "stored_query", "stored_doc")


@dataclass(frozen=True)
class View:
    """One embedding an objective needs from the module.

    side: "query" / "doc" / "neg" (the batch's texts), "memory" (the objective's own stored
        backbone features, see ``memory_features``), embedded by the encoder's head now, or
        "stored_query" / "stored_doc" (queued texts the objective re-encodes, see ``stored_inputs``).
    encoder: "trained" (the encoder the optimizer trains), "momentum" (its EMA copy) or "guide"
        (the frozen guide encoder of guided false-negative masking).
    grad: keep the graph (only the trained encoder has one).
    features: the frozen backbone's features before the head (frozen backbones; no gradient).
    """

    side: str
    encoder: str = TRAINED
    grad: bool = True
    features: bool = False

    def __post_init__(self):
        if self.side not in SIDES or self.encoder not in (TRAINED, MOMENTUM, GUIDE):
            raise ValueError(f"bad view {self}")
        if self.grad and (self.encoder != TRAINED or self.features):
            raise ValueError(f"{self}: only the trained encoder's embeddings carry gradient")


@dataclass
class StepInput:
    """One step as an objective sees it: the embeddings its views declared (a view's name is a
    field here; a view not declared, or a "neg" view of a batch without hard negatives, is None)
    and the batch's labels.

    q, k: the batch's queries and their positive documents [B, d] (views "q" and "k").
    doc_id, group: each positive's document id and group (-1: none) [B].
    step: the optimizer step.
    neg, neg_id, neg_group: the batch's hard negatives [B*n, d] and their ids and groups.
    d: the documents by the trained encoder, with gradient (two_queue's document -> query anchors).
    q_key: the queries by the EMA key encoder.
    g_q, g_k, g_neg: queries, documents and hard negatives by a fixed guide encoder (guided.py).
    k_fresh, q_key_fresh: queued documents / queries drawn for refresh, re-encoded by the EMA key
        encoder (refresh.py; None when none was drawn).
    doc_features: the documents' frozen backbone features (what feature_memory stores).
    memory: the stored features through the current head, with gradient (feature_memory).
    tokens: the batch's sides as collated ("query", "doc", "neg"), for memories that keep texts.
    source: each row's training source (data.sources) [B], when the batch says (per-source memories).
    """

    q: Tensor
    k: Tensor
    doc_id: Tensor
    group: Tensor
    step: int = 0
    neg: Tensor | None = None
    neg_id: Tensor | None = None
    neg_group: Tensor | None = None
    d: Tensor | None = None
    q_key: Tensor | None = None
    g_q: Tensor | None = None
    g_k: Tensor | None = None
    g_neg: Tensor | None = None
    k_fresh: Tensor | None = None
    q_key_fresh: Tensor | None = None
    doc_features: Tensor | None = None
    memory: Tensor | None = None
    tokens: dict = field(default_factory=dict)
    source: Tensor | None = None


VIEW_NAMES = frozenset(f.name for f in fields(StepInput)) - {"doc_id", "group", "step", "neg_id", "neg_group", "tokens",
                                                             "source"}


def check_views(owner: str, views: dict[str, View]) -> None:
    """Every view an objective declares must have a field of ``StepInput`` to arrive in."""
    unknown = sorted(set(views) - VIEW_NAMES)
    if unknown:
        raise TypeError(f"{owner} declares views {unknown}: StepInput has fields for {sorted(VIEW_NAMES)}")


@dataclass
class Enqueue:
    """Keys a forward pass holds back for a key memory (memory.py), written after the backward pass:
    the memory's logits' backward needs the memory as it was.

    keys, ids, groups: the rows to write, with their documents' ids and groups.
    step: the optimizer step that made them.
    gathered: already all-gathered in rank order (forward needed them as batch negatives).
    guide_keys: a fixed guide's embeddings of the same rows (gathered likewise), for a guided memory.
    tokens: the rows' texts as collated sides, in row order, for a memory that refreshes.
    """

    keys: Tensor
    ids: Tensor
    groups: Tensor
    step: int
    gathered: bool = False
    guide_keys: Tensor | None = None
    tokens: list[dict] = field(default_factory=list)


__all__ = ["View", "StepInput", "Enqueue", "VIEW_NAMES", "check_views", "TRAINED", "MOMENTUM", "GUIDE", "SIDES"]
