"""Stop a run whose loss or weights stop being finite, before a checkpoint records them.

A learning rate too high (or a bad batch) turns the loss into inf or NaN, and from then on every
weight; left alone, the run trains NaN to its end and exits 0. :class:`FiniteGuard` keeps, on the
device, the first step whose loss was not finite (no host sync per step: a ``torch.where`` on a
device scalar) and looks at it every ``trainer.log_every_n_steps`` steps (the progress line syncs
there anyway), before each validation and before every checkpoint write (where the weights are
checked too). Weights can stay finite yet overflow the forward pass (1e29 after one step of a huge
learning rate): each validation of fit also checks that the pool's embeddings were finite (the
geometry metrics computed from them), before its checkpoints are written. Then the run stops with
:class:`NonFiniteError` naming the step; no checkpoint is written after it, so ``last.ckpt`` stays
the last good state. Under DDP the ranks agree with one
all-reduce at those points, so they all stop at the same one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from moco_retrieval.distributed import world_size
from moco_retrieval.errors import CheckpointError, UserError
from moco_retrieval.training.checkpoints import LAST
from moco_retrieval.files import checkpoint_step, read_checkpoint

NONE = 2**62  # "no bad step yet"; the ranks agree with a MIN
# computed from every validation embedding (evaluation/geometry.py): NaN when any embedding is
EMBEDDING_METRICS = ("val/anisotropy", "val/positive_cos_mean", "val/uniformity")


class NonFiniteError(UserError):
    """The loss or the weights became inf or NaN."""


def _last_good(folder: Path) -> str:
    last = folder / LAST
    try:
        return f"{last} (step {checkpoint_step(read_checkpoint(last, verify=False))}) is the last good checkpoint, kept"
    except CheckpointError:
        return f"no checkpoint was written before it in {folder}"


class FiniteGuard(Callback):
    """See the module docstring. ``every``: the steps between looks at the loss flag;
    ``checkpoints``: the run's checkpoint folder (named in the message)."""

    def __init__(self, every: int, checkpoints: str | Path):
        self.every = max(1, int(every))
        self.checkpoints = Path(checkpoints)
        self._first_bad: Optional[torch.Tensor] = None  # device scalar: the first step with a non-finite loss

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        acc = max(1, int(trainer.accumulate_grad_batches))
        at_step = (batch_idx + 1) % acc == 0 or trainer.is_last_batch
        step = trainer.global_step if at_step else trainer.global_step + 1  # the step this batch belongs to
        if self._first_bad is None or self._first_bad.device != loss.device:
            self._first_bad = torch.full((), NONE, dtype=torch.long, device=loss.device)
        bad = ~torch.isfinite(loss.detach()).all()
        self._first_bad = torch.where(bad & (self._first_bad == NONE), torch.full_like(self._first_bad, step),
                                      self._first_bad)
        if at_step and trainer.global_step % self.every == 0:
            self._check(trainer, pl_module, weights=False)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:  # (not the validation after fit)
            self._check(trainer, pl_module, weights=True)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Before the checkpoints of this validation (Lightning runs ModelCheckpoint's hooks last);
        every rank holds the same metrics (the whole pool), so the ranks stop together."""
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        bad = {k: float(trainer.callback_metrics[k]) for k in EMBEDDING_METRICS if k in trainer.callback_metrics
               and not torch.isfinite(torch.as_tensor(trainer.callback_metrics[k])).all()}
        if bad:
            raise NonFiniteError(
                f"the validation embeddings were not finite (inf or NaN: " + ", ".join(f"{k}={v}" for k, v in bad.items())
                + f") after step {trainer.global_step}, though the weights are: they overflow the forward pass; "
                f"training stopped without writing a checkpoint of this step: {_last_good(self.checkpoints)}. "
                "The usual cause is a learning rate too high (optim.lr); start again with other values.")

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        self._check(trainer, pl_module, weights=True)  # every rank builds the checkpoint: the all-reduce matches

    def _check(self, trainer: Any, pl_module: Any, weights: bool) -> None:
        device = pl_module.device
        loss_step = self._first_bad.to(device) if self._first_bad is not None else torch.tensor(NONE, device=device)
        weight_step = torch.tensor(NONE, device=device)
        if weights:
            finite = torch.stack([torch.isfinite(p).all() for p in pl_module.parameters()]).all()
            weight_step = torch.where(finite, weight_step, torch.full_like(weight_step, trainer.global_step))
        found = torch.stack([loss_step, weight_step])
        if world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MIN)
        loss_at, weights_at = (int(v) for v in found.tolist())  # the one host sync
        if loss_at == NONE and weights_at == NONE:
            return
        what = (f"the training loss was not finite (inf or NaN) at step {loss_at}" if loss_at != NONE
                else f"the weights were not finite (inf or NaN) after step {weights_at}")
        raise NonFiniteError(
            f"{what}; training stopped at step {trainer.global_step} without writing a checkpoint after it: "
            f"{_last_good(self.checkpoints)}. The usual cause is a learning rate too high for this model and "
            "batch (optim.lr), or a temperature too low (objective.temperature); start again with other values.")


__all__ = ["FiniteGuard", "NonFiniteError"]
