"""The protocol every objective follows, and what every objective shares.

    loss, stats = objective(batch, embed)

``batch`` is the collated batch (docs/design.md: the positives' ``doc_id`` and ``group``, the hard
negatives' ``neg_id`` and ``neg_group``, the ``source``, the tokenized sides). ``embed`` is the
Lightning module's service (training/module.py), the one way an objective gets embeddings:

    embed(side, encoder="trained", grad=True)   the batch's "query", "doc" or "neg" texts (None: no
                                                such side) by the trained encoder, its EMA copy
                                                ("momentum", never with gradient) or a frozen guide
                                                ("guide"); asked twice, a side is embedded once
    embed.step                                  the optimizer step

An objective builds its InfoNCE ``directions`` (infonce.py) from what it asks for and combines
their losses (``total``); it hands each key memory (memory.py) the keys to write after backward,
when the module calls ``after_backward()``. Options wrap or plug into this: the guide and logQ
plug into the ``Scoring`` every direction scores with, Matryoshka re-scores the directions at each
prefix (matryoshka.py), the refresh lives in a memory (refresh.py), distillation adds a teacher's
scores on the main direction (distill.py). The module never asks which
objective it holds: it builds an EMA key encoder when ``momentum`` is set and a guide encoder
when ``guide.fixed``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Protocol

from omegaconf import MISSING
from torch import Tensor, nn

from moco_retrieval.config import (AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, PROPER_FRACTION, ConfigError, Distill, Range,
                                   RangeChecked, setting)
from moco_retrieval.objectives.distill import build_distillation
from moco_retrieval.objectives.guided import Guide
from moco_retrieval.objectives.infonce import Direction, Keys, Scoring
from moco_retrieval.objectives.logq import StreamingFrequency
from moco_retrieval.objectives.memory import KeyMemory, KeySource, MomentumOptions, PerSourceMemory

TRAINED, MOMENTUM, GUIDE = "trained", "momentum", "guide"


@dataclass
class ObjectiveConfig(RangeChecked):
    """What every objective shares: InfoNCE's temperature, label smoothing and false-negative masking."""

    name: str = MISSING
    temperature: float = setting(0.05, POSITIVE)  # InfoNCE's tau: logits are cosine (or dot) / temperature
    learn_temperature: bool = False  # train the temperature too, clamped to [temperature_min, temperature_max]
    temperature_min: float = setting(0.01, POSITIVE)  # lower clamp of a learned temperature
    temperature_max: float = setting(1.0, POSITIVE)  # upper clamp of a learned temperature
    label_smoothing: float = setting(0.0, PROPER_FRACTION)  # cross-entropy label smoothing of every InfoNCE loss
    mask_false_negatives: bool = True  # mask candidates sharing the positive's document id or group
    # guided false-negative masking (objectives/guided.py): "none"; "momentum" (the EMA key
    # encoder's own keys: moco, two_queue); "base" (the run's backbone, untrained, frozen); or a
    # backbone name / local model folder, frozen. A candidate the guide scores above the positive's
    # guide score minus `guide_margin`, or above `guide_threshold` (a cosine), is masked.
    guide: str = "none"
    guide_margin: float = setting(0.0, Range(-2, 2))  # masked: guide score > the positive's guide score - guide_margin
    guide_threshold: Optional[float] = setting(None, Range(-1, 1))  # masked: guide score > this cosine (null: the margin rule only)
    # logQ correction of the sampling bias (objectives/logq.py): subtract log q(d) from batch and
    # queue logits, q estimated in a stream from hashed per-document intervals between sightings
    logq_correction: bool = False
    logq_alpha: float = setting(0.01, Range(0, 1, lo_open=True))  # the estimator's learning rate (Yi et al. 2019)
    logq_buckets: int = setting(1 << 20, AT_LEAST_ONE)  # hash buckets of the estimator (collisions merge documents)
    # Matryoshka embeddings (objectives/matryoshka.py): the loss summed over these prefixes of every
    # embedding (e.g. [384, 256, 128, 64]), weighted by matryoshka_weights (empty: 1 each); empty: off
    matryoshka_dims: list[int] = setting(factory=list)
    matryoshka_weights: list[float] = setting(factory=list)  # one weight per matryoshka_dims entry
    # distillation (objectives/distill.py): learn a teacher's scores of each row's positive and hard
    # negatives (the data's positive_score and negative scores): kl (the teacher's softmax over
    # [positive, hard negatives]) or margin_mse (its positive - negative margins); none: off
    distill: Distill = Distill.none
    distill_weight: float = setting(1.0, POSITIVE)  # loss = contrastive_weight * contrastive + distill_weight * distillation
    distill_temperature: float = setting(1.0, POSITIVE)  # kl: both softmaxes' logits / this, the loss * its square
    contrastive_weight: float = setting(1.0, NON_NEGATIVE)  # 0: the distillation term alone (the queues still fill)

    SECTION: ClassVar[str] = "objective"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.learn_temperature and not self.temperature_min <= self.temperature <= self.temperature_max:
            raise ConfigError(
                f"objective.temperature={self.temperature}: must be in [objective.temperature_min, "
                f"objective.temperature_max] = [{self.temperature_min}, {self.temperature_max}] "
                "when objective.learn_temperature=true")
        if self.guide == "momentum" and not isinstance(self, MomentumOptions):
            raise ConfigError(f"objective.guide=momentum needs the keys of both sides (objective=moco or two_queue); "
                              f"objective={self.name} has none: use guide=base or a model folder")
        self._check_distill()
        dims, weights = self.matryoshka_dims, self.matryoshka_weights
        if len(set(dims)) != len(dims) or min(dims, default=1) < 1:
            raise ConfigError(f"objective.matryoshka_dims={list(dims)}: must be distinct dimensions >= 1")
        if weights and (len(weights) != len(dims) or min(weights) < 0):
            raise ConfigError(f"objective.matryoshka_weights={list(weights)}: must be one weight >= 0 per dimension "
                              f"of objective.matryoshka_dims={list(dims)}")


    def _check_distill(self) -> None:
        """The distillation options only where they act (each rule once, here)."""
        if self.distill == Distill.none:
            for key, default in (("distill_weight", 1.0), ("distill_temperature", 1.0), ("contrastive_weight", 1.0)):
                if getattr(self, key) != default:
                    raise ConfigError(f"objective.{key}={getattr(self, key)} weighs the distillation term, which is "
                                      "off: set objective.distill=kl or margin_mse (or leave it out)")
            return
        if self.distill == Distill.margin_mse and self.distill_temperature != 1.0:
            raise ConfigError(f"objective.distill_temperature={self.distill_temperature} softens the softmaxes of "
                              "objective.distill=kl; margin_mse compares score margins and has none")


class Embed(Protocol):
    """What the module serves an objective for one step (see the module docstring)."""

    step: int

    def __call__(self, side: str, encoder: str = TRAINED, grad: bool = True) -> Tensor | None: ...

    def tokens(self, side: dict, kind: str, encoder: str = MOMENTUM) -> Tensor:
        """Stored texts (a tokenized side) by ``encoder``, without gradient (refresh.py)."""

    def features(self, side: str) -> Tensor:
        """The frozen backbone's features of the batch's ``side``, without gradient (feature_memory.py)."""

    def project(self, features: Tensor) -> Tensor:
        """Backbone features through the trained encoder's head now, with gradient (feature_memory.py)."""


def hard_keys(batch: dict, embed, encoder: str = MOMENTUM, grad: bool = False) -> Keys | None:
    """The batch's hard negatives as keys by ``encoder``, with gradient or not, or None."""
    neg = embed("neg", encoder, grad=grad)
    return None if neg is None else Keys(neg, batch["neg_id"], batch["neg_group"])


class Objective(nn.Module):
    """Base of every objective: see the module docstring for the protocol."""

    momentum: Optional[float] = None  # an EMA key encoder's momentum (None: the objective needs none)
    key_encoder_dropout: bool = False

    def __init__(self, cfg: ObjectiveConfig):
        super().__init__()
        self.keys = TRAINED  # the encoder whose detached embeddings are the queued keys
        if isinstance(cfg, MomentumOptions) and cfg.keys == KeySource.momentum:  # an EMA key encoder makes them
            self.keys, self.momentum, self.key_encoder_dropout = MOMENTUM, float(cfg.momentum), bool(cfg.key_encoder_dropout)
        self.guide = Guide(cfg.guide, cfg.guide_margin, cfg.guide_threshold, keys=self.keys)
        logq = StreamingFrequency(cfg.logq_buckets, cfg.logq_alpha) if cfg.logq_correction else None
        self.scoring = Scoring(cfg, guide=self.guide.rule, logq=logq)
        self.distill = build_distillation(cfg)  # None: no teacher scores learnt

    @classmethod
    def build(cls, cfg: ObjectiveConfig, encoder, guide_dim: int | None, sources: int = 1) -> "Objective":
        """The objective ``cfg`` describes, for ``encoder`` (checks what it needs of it), a fixed
        guide's ``guide_dim`` and ``sources`` training sources (per-source memories need their number)."""
        return cls(cfg)

    def forward(self, batch: dict, embed: Embed) -> tuple[Tensor, dict]:
        return self.scored(self.directions(batch, embed), batch)

    def scored(self, directions: dict[str, Direction], batch: dict, view=None) -> tuple[Tensor, dict]:
        """The loss and stats of this step's directions (``view``: a Matryoshka prefix), with the
        distillation term on the main direction when ``objective.distill`` is on."""
        loss, stats = self.combine({name: d.loss(view) for name, d in directions.items()})
        if self.distill is None:
            return loss, stats
        return self.distill.add(loss, stats, next(iter(directions.values())), batch, view)

    def directions(self, batch: dict, embed: Embed) -> dict[str, Direction]:
        """This step's InfoNCE directions by name, the main one first; memories hold their keys."""
        raise NotImplementedError

    def total(self, losses: dict[str, Tensor]) -> Tensor:
        """The objective's loss from its directions' (default: its one direction's)."""
        (loss,) = losses.values()
        return loss

    def combine(self, scored: dict[str, tuple[Tensor, dict]]) -> tuple[Tensor, dict]:
        """The total loss and the stats: the main direction's, and each direction's loss, accuracy and
        masks per query by name when there are several."""
        loss = self.total({name: s[0] for name, s in scored.items()})
        names = list(scored)
        stats = dict(scored[names[0]][1])
        for i, name in enumerate(names if len(names) > 1 else []):
            stats[f"loss_{name}"] = scored[name][0].detach()
            if i:
                stats.update({f"{k}_{name}": scored[name][1][k] for k in ("accuracy", "masked_per_query")})
        stats["loss"] = loss.detach()
        return loss, stats

    # ---- memories
    def memories(self) -> list[KeyMemory]:
        """Every key memory, those of each source included."""
        return [m for m in self.modules() if isinstance(m, KeyMemory)]

    def hold(self, memory: KeyMemory, *args, **kwargs) -> None:
        """What ``memory`` writes after backward (a training forward's keys; evaluation writes nothing)."""
        memory.hold(*args, **kwargs) if self.training else memory.hold(None)

    def after_backward(self) -> None:
        """Once per training batch, after its backward pass: the memories write what they hold."""
        for memory in self.memories():
            memory.commit()

    def stats(self, step: int) -> dict[str, float]:
        """What is remembered between steps, for logging (e.g. queue fill and age)."""
        out: dict[str, float] = {}
        for memory in self.children():
            if isinstance(memory, (KeyMemory, PerSourceMemory)):
                out.update(memory.stats(step))
        return out

    def unsynced_state(self) -> dict[str, Tensor]:
        """The state each rank keeps itself (DDP synchronises gradients, not this): every buffer of
        the memories and of the logQ estimator, by state-dict name. Ranks must hold it identical."""
        parts = [(name, m) for name, m in self.named_modules() if isinstance(m, KeyMemory)]
        if self.scoring.logq is not None:
            parts.append(("scoring.logq", self.scoring.logq))
        return {f"{name}.{b}": t for name, m in parts for b, t in m.named_buffers()}


__all__ = ["ObjectiveConfig", "Objective", "Embed", "hard_keys", "TRAINED", "MOMENTUM", "GUIDE"]
