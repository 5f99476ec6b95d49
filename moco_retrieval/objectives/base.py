"""The protocol every objective follows, and what they all share.

An objective is called as ``objective(q, k, meta, *, step) -> (loss, stats)``. It says what it
needs through ``views``: which encoder embeds which side of the batch, with or without gradient.
The Lightning module serves those declarations without knowing which objective it holds:

* ``"q"`` and ``"k"`` arrive as ``q`` and ``k`` (the batch's queries and their positives);
* every other view arrives in ``meta`` under its name (``"neg"``: the batch's hard negatives,
  only when the batch carries them);
* ``meta`` also holds ``doc_id`` and ``group`` of each positive (and ``neg_id``, ``neg_group``).

After the backward pass the module calls ``after_backward()`` (queues enqueue there: the queue
logits' backward needs the queue as it was); ``stats(step)`` reports what is remembered between
steps (queue fill and age) for logging. Temperature, label smoothing and false-negative masking
live here, so every objective scores and masks its blocks the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from moco_retrieval.config import ObjectiveConfig
from moco_retrieval.model.momentum import momentum_at
from moco_retrieval.objectives.contrastive import Block, Temperature, info_nce
from moco_retrieval.objectives.masking import Pairs, false_negative_pairs, merge_pairs, own_pairs

TRAINED, MOMENTUM = "trained", "momentum"
SIDES = ("query", "doc", "neg", "memory")


@dataclass(frozen=True)
class View:
    """One embedding an objective needs from the module.

    side: "query" / "doc" / "neg" (the batch's texts), or "memory" (the objective's own stored
        backbone features, see ``memory_features``), embedded by the encoder's head now.
    encoder: "trained" (the encoder the optimizer trains) or "momentum" (its EMA copy).
    grad: keep the graph (only the trained encoder has one).
    features: the frozen backbone's features before the head (frozen backbones; no gradient).
    """

    side: str
    encoder: str = TRAINED
    grad: bool = True
    features: bool = False

    def __post_init__(self):
        if self.side not in SIDES or self.encoder not in (TRAINED, MOMENTUM):
            raise ValueError(f"bad view {self}")
        if self.grad and (self.encoder == MOMENTUM or self.features):
            raise ValueError(f"{self}: only the trained encoder's embeddings carry gradient")


class Objective(nn.Module):
    """Base of every objective: see the module docstring for the protocol."""

    views: dict[str, View] = {"q": View("query"), "k": View("doc"), "neg": View("neg")}

    def __init__(self, cfg: ObjectiveConfig):
        super().__init__()
        self.temperature = Temperature(cfg.temperature, cfg.learn_temperature, cfg.temperature_min, cfg.temperature_max)
        self.label_smoothing = float(cfg.label_smoothing)
        self.mask_false_negatives = bool(cfg.mask_false_negatives)

    # ---- what the module asks
    @property
    def uses_momentum_encoder(self) -> bool:
        return any(v.encoder == MOMENTUM for v in self.views.values())

    # objectives with a "momentum" view set these from their config
    momentum: "MomentumSchedule | None" = None
    key_encoder_dropout = False

    def memory_features(self) -> Tensor:
        raise TypeError(f"{type(self).__name__} stores no features (it declares no 'memory' view)")

    def after_backward(self) -> None:
        """Called once per training batch after its backward pass (enqueue here)."""

    def stats(self, step: int) -> dict[str, float]:
        """What is remembered between steps, for logging (e.g. queue fill and age)."""
        return {}

    # ---- shared pieces
    def mask(self, pos_ids: Tensor, pos_groups: Tensor, cand_ids: Tensor, cand_groups: Tensor) -> Pairs | None:
        """False negatives among candidates (same document id or group as the positive), if masking."""
        if not self.mask_false_negatives:
            return None
        return false_negative_pairs(pos_ids, pos_groups, cand_ids, cand_groups)

    def batch_block(self, a: Tensor, b_all: Tensor, offset: int, ids: Tensor, groups: Tensor, ids_all: Tensor,
                    groups_all: Tensor) -> Block:
        """Rows ``a`` (already / tau) against all batch rows ``b_all``; row i's own positive,
        ``b_all[offset + i]``, is scored separately and masked here, with its false negatives."""
        masked = own_pairs(a.shape[0], offset, a.device)
        fn = self.mask(ids, groups, ids_all, groups_all)
        return Block(a @ b_all.T, masked if fn is None else merge_pairs(masked, fn, b_all.shape[0]))

    def info_nce(self, pos: Tensor, blocks: list[Block], tau: Tensor) -> tuple[Tensor, dict]:
        return info_nce(pos, blocks, tau, self.label_smoothing)


class MomentumSchedule:
    """The EMA momentum of an objective's key encoder: constant, or cosine from m0 to 1."""

    def __init__(self, m0: float, schedule: str):
        if not 0.0 <= m0 <= 1.0 or math.isnan(m0):
            raise ValueError(f"objective.momentum must be in [0, 1], got {m0}")
        momentum_at(0, 1, m0, schedule)  # validates the schedule's name
        self.m0, self.schedule = float(m0), str(schedule)

    def __call__(self, step: int, total_steps: int) -> float:
        return momentum_at(step, total_steps, self.m0, self.schedule)


__all__ = ["View", "Objective", "MomentumSchedule", "TRAINED", "MOMENTUM"]
