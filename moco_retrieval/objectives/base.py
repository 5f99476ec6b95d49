"""The protocol every objective follows, and what they all share.

An objective is called as ``objective(batch: StepInput) -> (loss, stats)``. It says what it needs
through ``views``: which encoder embeds which side of the batch, with or without gradient
(``views_for(step)``: those of one training step, for an objective whose views change, icol.py).
The Lightning module serves those declarations without knowing which objective it holds, and
hands them as one ``StepInput`` (step.py) whose fields are the view names.

An objective is composed of parts, each declaring the views it needs:

* ``scoring`` (scoring.py): temperature, label smoothing, the masking rules, logQ;
* ``guide`` (guided.py): with ``objective.guide`` set, the guide's views ("g_q", "g_k", "g_neg":
  a frozen guide encoder; or "q_key" for the "momentum" guide, whose other embeddings are the EMA
  keys the objective has anyway);
* key memories (memory.py): queues of past keys with their guide embeddings and texts (a
  refreshing memory declares the view of its re-encoded keys).

``forward`` builds its directions (direction.py) from these and sums their losses; it hands each
memory what to enqueue (``hold``), and ``after_backward()`` writes it (the memory logits'
backward needs the memory as it was). ``stats(step)`` reports what is remembered between steps
(queue fill and age) for logging; ``unsynced_state()`` names it all: the state each rank keeps
itself, identical across ranks by construction, which DDP neither synchronises nor checks
(fingerprints.py fingerprints it in every checkpoint).
"""
from __future__ import annotations

import math
from typing import ClassVar

from torch import Tensor, nn

from moco_retrieval.config import ObjectiveConfig
from moco_retrieval.model.momentum import momentum_at
from moco_retrieval.objectives.guided import Guide
from moco_retrieval.objectives.memory import KeyMemory, PerSourceMemory
from moco_retrieval.objectives.scoring import Scoring
from moco_retrieval.objectives.step import GUIDE, MOMENTUM, TRAINED, StepInput, View


class Objective(nn.Module):
    """Base of every objective: see the module docstring for the protocol."""

    VIEWS: ClassVar[dict[str, View]] = {"q": View("query"), "k": View("doc"), "neg": View("neg")}
    momentum_keys: ClassVar[bool] = False  # EMA keys of both sides: guide=momentum works
    unused_parameters: ClassVar[bool] = False  # some trained parameters get no gradient in some steps (DDP must know)
    # state-dict keys of checkpoints written before the objectives were composed -> where they are now
    LEGACY_KEYS: ClassVar[dict[str, str]] = {"temperature.": "scoring.temperature.", "logq.": "scoring.logq."}

    # objectives with a "momentum" view set these from their config
    momentum: "MomentumSchedule | None" = None
    key_encoder_dropout = False

    def __init__(self, cfg: ObjectiveConfig):
        super().__init__()
        self.guide = Guide(cfg.guide, cfg.name, self.momentum_keys)
        self.scoring = Scoring(cfg, guided=self.guide.on)
        self._register_load_state_dict_pre_hook(_rename_legacy_keys, with_module=True)

    def use_momentum_encoder(self, cfg) -> None:
        """An EMA key encoder as ``cfg``'s momentum options set it: its schedule and dropout."""
        self.momentum = MomentumSchedule(cfg.momentum, cfg.momentum_schedule)
        self.key_encoder_dropout = bool(cfg.key_encoder_dropout)

    @classmethod
    def build(cls, cfg: ObjectiveConfig, encoder, guide_dim: int | None, sources: int = 1) -> "Objective":
        """The objective ``cfg`` describes, for ``encoder`` (checks what it needs of the encoder) and
        ``sources`` training sources (``data.sources``; per-source memories need their number)."""
        return cls(cfg)

    # ---- what the module asks
    @property
    def views(self) -> dict[str, View]:
        """The objective's own views and those of its parts (guide, memories)."""
        out = {**self.VIEWS, **self.guide.views}
        for memory in self.memories():
            out.update(memory.views)
        return out

    def views_for(self, step: int) -> dict[str, View]:
        """The views of training step ``step`` (``views`` unless they change with the step, as ICoL's do)."""
        return self.views

    @property
    def uses_momentum_encoder(self) -> bool:
        return any(v.encoder == MOMENTUM for v in self.views.values())

    @property
    def fixed_guide(self) -> bool:
        return self.guide.fixed

    def memories(self) -> list[KeyMemory]:
        """Every key memory, those of each source included."""
        return [m for m in self.modules() if isinstance(m, KeyMemory)]

    def memory_features(self) -> Tensor:
        raise TypeError(f"{type(self).__name__} stores no features (it declares no 'memory' view)")

    def stored_inputs(self, side: str, step: int) -> dict | None:
        """The texts of a "stored_query" / "stored_doc" view at ``step``, tokenized (None: none now)."""
        for memory in self.memories():
            if memory.refresh is not None and side == f"stored_{memory.kind}":
                return memory.stored_inputs(step)
        raise TypeError(f"{type(self).__name__} stores no texts (it declares no {side!r} view)")

    def write_fresh(self, batch: StepInput) -> None:
        """Refreshing memories: write the re-encoded keys the module embedded for this step (before any logits)."""
        for memory in self.memories():
            memory.write_fresh(batch)

    def hold(self, memory: KeyMemory, enqueue) -> None:
        """What ``memory`` writes after backward: a training forward's keys (evaluation writes nothing)."""
        memory.hold(enqueue if self.training else None)

    def after_backward(self) -> None:
        """Called once per training batch after its backward pass: the memories write what they hold."""
        for memory in self.memories():
            memory.commit()

    def stats(self, step: int) -> dict[str, float]:
        """What is remembered between steps, for logging (e.g. queue fill and age)."""
        out: dict[str, float] = {}
        for memory in self.children():
            if isinstance(memory, (KeyMemory, PerSourceMemory)):  # a per-source one names each source's
                out.update(memory.stats(step))
        return out

    def unsynced_state(self) -> dict[str, Tensor]:
        """The state each rank keeps itself (DDP synchronises gradients, not this): every buffer of
        the memories and of the logQ estimator, by state-dict name. Ranks must hold it identical."""
        parts = [(name, m) for name, m in self.named_modules() if isinstance(m, KeyMemory)]
        if self.scoring.logq is not None:
            parts.append(("scoring.logq", self.scoring.logq))
        return {f"{name}.{b}": t for name, m in parts for b, t in m.named_buffers()}


def _rename_legacy_keys(module: Objective, state_dict: dict, prefix: str, *args) -> None:
    """Checkpoints whose objective state uses the older key names (``LEGACY_KEYS``) still load:
    their keys are renamed."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        for old, new in module.LEGACY_KEYS.items():
            if rest.startswith(old):
                state_dict[prefix + new + rest[len(old):]] = state_dict.pop(key)
                break


class MomentumSchedule:
    """The EMA momentum of an objective's key encoder: constant, or cosine from m0 to 1."""

    def __init__(self, m0: float, schedule: str):
        if not 0.0 <= m0 <= 1.0 or math.isnan(m0):
            raise ValueError(f"objective.momentum must be in [0, 1], got {m0}")
        momentum_at(0, 1, m0, schedule)  # validates the schedule's name
        self.m0, self.schedule = float(m0), str(schedule)

    def __call__(self, step: int, total_steps: int) -> float:
        return momentum_at(step, total_steps, self.m0, self.schedule)


__all__ = ["View", "StepInput", "Objective", "MomentumSchedule", "TRAINED", "MOMENTUM", "GUIDE"]
