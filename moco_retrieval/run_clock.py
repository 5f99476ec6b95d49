"""The run's own clock: seconds spent training and validating, summed over every attempt of a
run. A run preempted and resumed (``ckpt_path=last``) counts the time before its checkpoint too,
which neither the process's wall time nor W&B's per-attempt runtime does; what a requeue wasted
after the last checkpoint is not counted, because that work was redone.

:class:`RunClock` carries the sums in the checkpoint (Lightning saves a callback's
``state_dict``), logs them as ``time/train_s`` and ``time/val_s`` with the training metrics (a
dashboard can plot the validation curve against training seconds: the equal-compute view) and
``train.py`` writes them into ``metrics.json``. Training seconds are the wall time of ``fit``
outside validation: steps, data loading and checkpoint writes alike."""
from __future__ import annotations

import time
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn


class RunClock(Callback):
    def __init__(self) -> None:
        self.train_s = 0.0
        self.val_s = 0.0
        self.attempts = 0
        self._train_since: Optional[float] = None  # set while fit trains
        self._val_since: Optional[float] = None  # set while a validation runs

    # -- the totals, counting the spans still running

    def seconds(self) -> dict[str, float]:
        now = time.monotonic()
        train = self.train_s + (now - self._train_since if self._train_since is not None else 0.0)
        val = self.val_s + (now - self._val_since if self._val_since is not None else 0.0)
        return {"time/train_s": train, "time/val_s": val}

    def state_dict(self) -> dict[str, Any]:
        s = self.seconds()
        return {"train_s": s["time/train_s"], "val_s": s["time/val_s"], "attempts": self.attempts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_s, self.val_s = float(state["train_s"]), float(state["val_s"])
        self.attempts = int(state["attempts"])

    # -- the hooks that start and stop the spans

    def on_train_start(self, trainer, pl_module) -> None:
        self.attempts += 1
        self._train_since = time.monotonic()

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop_training()

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self._stop_training()
        self._val_since = time.monotonic()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_since is None:
            return
        self.val_s += time.monotonic() - self._val_since
        self._val_since = None
        if trainer.state.fn == TrainerFn.FITTING and not trainer.should_stop:
            self._train_since = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for key, value in self.seconds().items():
            pl_module.log(key, value, on_step=True, on_epoch=False, sync_dist=False)

    def _stop_training(self) -> None:
        if self._train_since is not None:
            self.train_s += time.monotonic() - self._train_since
            self._train_since = None

    def summary(self) -> str:
        s = self.seconds()
        tries = f", over {self.attempts} attempts" if self.attempts > 1 else ""
        return f"training {s['time/train_s'] / 60:.1f} min, validation {s['time/val_s'] / 60:.1f} min{tries}"
