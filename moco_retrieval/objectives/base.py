"""The protocol every objective follows, and what they all share.

An objective is called as ``objective(q, k, meta, *, step) -> (loss, stats)``. It says what it
needs through ``views``: which encoder embeds which side of the batch, with or without gradient
(``views_for(step)``: those of one training step, for an objective whose views change, icol.py).
The Lightning module serves those declarations without knowing which objective it holds:

* ``"q"`` and ``"k"`` arrive as ``q`` and ``k`` (the batch's queries and their positives);
* every other view arrives in ``meta`` under its name (``"neg"``: the batch's hard negatives,
  only when the batch carries them);
* ``meta`` also holds ``doc_id`` and ``group`` of each positive (and ``neg_id``, ``neg_group``),
  and ``tokens``: the batch's sides as collated (``query``, ``doc``, ``neg`` when present), for
  objectives that keep the texts of what they queue (refresh.py).

With ``objective.guide`` set, the objective also declares guide views (``"g_q"``, ``"g_k"``,
``"g_neg"``: the batch by a frozen guide encoder, encoder "guide"), or, for the "momentum" guide,
reuses its EMA embeddings; candidates the guide scores too close to the positive are masked
(guided.py). With ``objective.logq_correction`` batch and queue logits are corrected by the
documents' estimated sampling probability (logq.py).

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
from moco_retrieval.distributed import all_gather_no_grad
from moco_retrieval.model.momentum import momentum_at
from moco_retrieval.objectives.contrastive import Block, Temperature, info_nce
from moco_retrieval.objectives.guided import MOMENTUM_GUIDE, NONE, GuidedMask
from moco_retrieval.objectives.logq import StreamingFrequency
from moco_retrieval.objectives.masking import Mask, Pairs, false_negative_pairs, merge_pairs, own_pairs

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


class Objective(nn.Module):
    """Base of every objective: see the module docstring for the protocol."""

    views: dict[str, View] = {"q": View("query"), "k": View("doc"), "neg": View("neg")}
    guides_with_momentum = False  # objectives with EMA keys of both sides accept guide=momentum
    unused_parameters = False  # True: some trained parameters get no gradient in some steps (DDP must know)

    def __init__(self, cfg: ObjectiveConfig):
        super().__init__()
        self.temperature = Temperature(cfg.temperature, cfg.learn_temperature, cfg.temperature_min, cfg.temperature_max)
        self.label_smoothing = float(cfg.label_smoothing)
        self.mask_false_negatives = bool(cfg.mask_false_negatives)
        self.guide_name = str(cfg.guide)
        if self.guide_name == MOMENTUM_GUIDE and not self.guides_with_momentum:
            raise ValueError(
                f"objective.guide=momentum needs an EMA key encoder (objective=moco or two_queue); "
                f"objective={cfg.name} has none: use guide=base or a model folder"
            )
        self.guide = GuidedMask(cfg.guide_margin, cfg.guide_threshold) if self.guide_name != NONE else None
        if self.fixed_guide:  # the batch as the frozen guide encoder embeds it
            self.views = {**type(self).views, "g_q": View("query", GUIDE, grad=False),
                          "g_k": View("doc", GUIDE, grad=False), "g_neg": View("neg", GUIDE, grad=False)}
        self.logq = StreamingFrequency(cfg.logq_buckets, cfg.logq_alpha) if cfg.logq_correction else None

    # ---- what the module asks
    @property
    def uses_momentum_encoder(self) -> bool:
        return any(v.encoder == MOMENTUM for v in self.views.values())

    @property
    def fixed_guide(self) -> bool:
        """A frozen guide encoder ("base" or a model folder), built by the module, embeds the batch."""
        return self.guide_name not in (NONE, MOMENTUM_GUIDE)

    # objectives with a "momentum" view set these from their config
    momentum: "MomentumSchedule | None" = None
    key_encoder_dropout = False

    def views_for(self, step: int) -> dict[str, View]:
        """The views of training step ``step`` (``views`` unless they change with the step, as ICoL's do)."""
        return self.views

    def memory_features(self) -> Tensor:
        raise TypeError(f"{type(self).__name__} stores no features (it declares no 'memory' view)")

    def stored_inputs(self, side: str, step: int) -> dict | None:
        """The texts of a "stored_query" / "stored_doc" view at ``step``, tokenized (None: none now)."""
        raise TypeError(f"{type(self).__name__} stores no texts (it declares no {side!r} view)")

    def after_backward(self) -> None:
        """Called once per training batch after its backward pass (enqueue here)."""

    def stats(self, step: int) -> dict[str, float]:
        """What is remembered between steps, for logging (e.g. queue fill and age)."""
        return {}

    # ---- shared pieces
    def mask(self, pos_ids: Tensor, pos_groups: Tensor, cand_ids: Tensor, cand_groups: Tensor,
             guide: tuple[Tensor, Tensor, Tensor] | None = None, own: Pairs | None = None) -> Mask:
        """False negatives among candidates: same document id or group as the positive (if
        masking), and those the guide scores too close to it (``guide``: the guide's anchors,
        positives and candidates). ``own``: each row's own positive in the block, masked too but
        not counted. Counted by rule (what an earlier rule already masked is not counted again)."""
        out, n, counts = own, cand_ids.shape[0], {}
        if self.mask_false_negatives:
            before = 0 if out is None else out[0].numel()
            fn = false_negative_pairs(pos_ids, pos_groups, cand_ids, cand_groups)
            out = fn if out is None else merge_pairs(out, fn, n)
            # a device-side sum: the counts never wait for the device (own pairs match by id)
            counts["id"] = (cand_ids[out[1]] == pos_ids[out[0]]).sum() - before
            counts["group"] = out[0].numel() - before - counts["id"]
        if self.guide is not None and guide is not None:
            before = 0 if out is None else out[0].numel()
            g = self.guide.pairs(*guide)
            out = g if out is None else merge_pairs(out, g, n)
            counts["guide"] = out[0].numel() - before
        return Mask(out, counts)

    def observe(self, global_ids: Tensor | None, ids: Tensor, step: int) -> None:
        """logQ: the global batch's documents were sampled at ``step`` (training forward only).
        ``global_ids``: the batch's ids all-gathered already, or None (gathered here, once)."""
        if self.logq is not None and self.training:
            self.logq.observe(all_gather_no_grad(ids) if global_ids is None else global_ids, step)

    def corrected(self, logits: Tensor, cand_ids: Tensor) -> Tensor:
        """Logits [B, N] (or [B] positives, with ids [B]) minus log q of their documents (logQ on)."""
        if self.logq is None:
            return logits
        lq = self.logq.log_q(cand_ids)
        return logits - (lq if logits.dim() == 1 else lq.unsqueeze(0))

    def batch_block(self, a: Tensor, b_all: Tensor, offset: int, ids: Tensor, groups: Tensor, ids_all: Tensor,
                    groups_all: Tensor, guide: tuple[Tensor, Tensor, Tensor] | None = None) -> Block:
        """Rows ``a`` (already / tau) against all batch rows ``b_all``; row i's own positive,
        ``b_all[offset + i]``, is scored separately and masked here, with its false negatives."""
        mask = self.mask(ids, groups, ids_all, groups_all, guide, own=own_pairs(a.shape[0], offset, a.device))
        return Block(self.corrected(a @ b_all.T, ids_all), mask)

    def info_nce(self, pos: Tensor, blocks: list[Block], tau: Tensor) -> tuple[Tensor, dict]:
        """InfoNCE over ``blocks``; ``masked_by_<rule>`` counts these blocks' masks only, and is
        logged (0) for every rule on even when no block has candidates yet."""
        loss, stats = info_nce(pos, blocks, tau, self.label_smoothing)
        rules = (("id", "group") if self.mask_false_negatives else ()) + (("guide",) if self.guide is not None else ())
        for rule in rules:
            stats.setdefault(f"masked_by_{rule}", 0.0)
        return loss, stats


class MomentumSchedule:
    """The EMA momentum of an objective's key encoder: constant, or cosine from m0 to 1."""

    def __init__(self, m0: float, schedule: str):
        if not 0.0 <= m0 <= 1.0 or math.isnan(m0):
            raise ValueError(f"objective.momentum must be in [0, 1], got {m0}")
        momentum_at(0, 1, m0, schedule)  # validates the schedule's name
        self.m0, self.schedule = float(m0), str(schedule)

    def __call__(self, step: int, total_steps: int) -> float:
        return momentum_at(step, total_steps, self.m0, self.schedule)


__all__ = ["View", "Objective", "MomentumSchedule", "TRAINED", "MOMENTUM", "GUIDE"]
