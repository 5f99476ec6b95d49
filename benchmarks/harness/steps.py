"""One training step of our module, and one sentence-transformers peer trainer, outside Lightning.

``OurStep`` does what Lightning's loop does for ``RetrievalModule`` per step, in the module's
order: forward (``shared_step``), zero the gradients, backward, ``on_after_backward`` (the
objective enqueues this step's keys there: the queue logits' backward needed the queue as it
was), clip, optimizer step, EMA update of the key encoder (the module's ``optimizer_step``).

``PeerTrainer`` is sentence-transformers' model and loss (MNRL, CachedMNRL, MatryoshkaLoss) with
the main job's optimizer (AdamW over ``decay_groups``, clipping 1.0, optionally the linear
warmup-then-decay schedule): tokenise a batch (``features``; timed or not, as the caller
chooses), take a step (``step``), copy its weights into our encoder for scoring (``copy_into``).

``step_clock`` times each step of a Lightning run of our module (batch start to batch end).
"""
from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, Optional, Sequence

import torch


class OurStep:
    """One training step of a ``RetrievalModule`` with ``optimizer``; ``clip``: the gradient norm
    bound (None: no clipping); ``amp``: the autocast dtype of the forward (None: none)."""

    def __init__(self, module, optimizer: torch.optim.Optimizer, clip: Optional[float] = None,
                 amp: Optional[torch.dtype] = None):
        self.m, self.opt, self.clip, self.amp = module, optimizer, clip, amp
        self.params = [p for g in optimizer.param_groups for p in g["params"]]

    def __call__(self, batch: dict) -> torch.Tensor:
        loss, _ = self.forward(batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.m.on_after_backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        if self.m.key_encoder is not None:
            self.m.key_encoder.update(self.m.encoder, self.m.momentum())
        return loss.detach()

    def forward(self, batch: dict):
        device = next(self.m.parameters()).device
        ctx = torch.autocast(device.type, dtype=self.amp) if self.amp is not None else contextlib.nullcontext()
        with ctx:
            return self.m.shared_step(batch)


DISTILL_LOSSES = ("st_kl", "st_margin_mse")  # kinds whose rows carry hard negatives and the teacher's scores


def peer_loss(model, kind: str, options: dict):
    """sentence-transformers' MNRL (``mnrl``), CachedMNRL (``cmnrl``) or ``MatryoshkaLoss`` around
    MNRL (``mnrl_mrl``, options ``matryoshka_dims``) at their defaults: scale 20 = 1 / 0.05,
    cosine similarity; or a distillation loss on (query, positive, negatives...) with the teacher's
    scores as labels: ``DistillKLDivLoss`` (``st_kl``) or ``MarginMSELoss`` (``st_margin_mse``),
    both on the cosine (as our objective's scores are)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import losses
        from sentence_transformers.util import pairwise_cos_sim

    if kind in DISTILL_LOSSES:
        cls = losses.DistillKLDivLoss if kind == "st_kl" else losses.MarginMSELoss
        return cls(model, similarity_fct=pairwise_cos_sim, **options)
    if kind == "mnrl_mrl":
        return losses.MatryoshkaLoss(model, losses.MultipleNegativesRankingLoss(model), **options)
    cls = losses.CachedMultipleNegativesRankingLoss if kind == "cmnrl" else losses.MultipleNegativesRankingLoss
    return cls(model, **options)


class PeerTrainer:
    """sentence-transformers' model at ``path`` trained with ``peer_loss(kind, options)``, AdamW
    (``lr``, ``weight_decay`` over ``decay_groups``), clipping 1.0 and, when ``steps`` is given,
    the linear schedule with ``warmup`` steps; queries and documents cut at ``lengths``."""

    def __init__(self, path: str, kind: str, options: dict, *, lr: float, weight_decay: float,
                 lengths: tuple[int, int], steps: Optional[int] = None, warmup: int = 0, device: str = "cpu"):
        from sentence_transformers import SentenceTransformer

        from moco_retrieval.training.module import decay_groups, lr_lambda

        self.model = SentenceTransformer(path, device=device)
        self.model.train()
        self.loss_fn = peer_loss(self.model, kind, options)
        self.opt = torch.optim.AdamW(decay_groups(self.model.named_parameters(), weight_decay), lr=lr)
        self.sched = (torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda("linear", warmup, steps))
                      if steps is not None else None)
        self.lengths, self.device = lengths, device

    @property
    def temperature(self) -> float:
        loss = getattr(self.loss_fn, "loss", self.loss_fn)  # MatryoshkaLoss wraps MNRL
        if hasattr(loss, "scale"):
            return 1 / loss.scale
        return getattr(loss, "student_temperature", None)  # DistillKLDivLoss; MarginMSELoss has none

    def features(self, queries: Sequence[str], docs: Sequence[str], *more_docs: Sequence[str]) -> list[dict]:
        """Both sides tokenised at their own maximum length, on the model's device; ``more_docs``:
        further document columns (a distillation loss's hard negatives, one column each)."""
        out = []
        for length, texts in zip((self.lengths[0], *[self.lengths[1]] * (1 + len(more_docs))), (queries, docs, *more_docs)):
            self.model.max_seq_length = length
            out.append({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in self.model.tokenize(list(texts)).items()})
        return out

    def step(self, features: list[dict], labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One step; ``labels``: a distillation loss's teacher scores, [batch, columns - 1]."""
        loss = self.loss_fn(features, torch.empty(0) if labels is None else labels.to(self.device))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        return loss.detach()

    def copy_into(self, encoder) -> None:
        """The peer's transformer weights into our encoder (same mean pooling + L2 normalisation),
        so both are scored by the same code; only the unused pooler may be missing."""
        missing, _ = encoder.tower.backbone.load_state_dict(self.model[0].auto_model.state_dict(), strict=False)
        assert not [k for k in missing if "pooler" not in k], missing


def step_clock(on_start: Optional[Callable[[], None]] = None, on_end: Optional[Callable[..., None]] = None):
    """A Lightning callback whose ``times`` are the seconds of every training step (batch start to
    batch end); ``on_start()`` runs as a step starts, ``on_end(trainer, module)`` after it ends."""
    from lightning.pytorch.callbacks import Callback  # here: the hand-written steps need no Lightning

    class StepClock(Callback):
        def __init__(self):
            self.times: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if on_start is not None:
                on_start()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._t)
            if on_end is not None:
                on_end(trainer, pl_module)

    return StepClock()
