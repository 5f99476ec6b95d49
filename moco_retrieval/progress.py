"""Progress for jobs whose output goes to a log file (Docker, SLURM, Kubernetes): a plain line
every N steps, instead of a redrawn bar that a log file shows as one endless line."""
from __future__ import annotations

import sys
import time

from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar


class LogLineProgress(ProgressBar):
    def __init__(self, every: int = 10):
        super().__init__()
        self.every, self._enabled, self._t0 = every, True, None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer, pl_module) -> None:
        # also here: a run resumed mid-epoch gets no on_train_epoch_start for that epoch
        self._t0, self._step0 = time.monotonic(), trainer.global_step

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._t0, self._step0 = time.monotonic(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not self._enabled or not trainer.is_global_zero or step % self.every or self._t0 is None:
            return
        total = trainer.estimated_stepping_batches
        rate = (step - self._step0) / max(time.monotonic() - self._t0, 1e-9)
        eta = (total - step) / rate if rate > 0 else float("nan")
        metrics = " ".join(f"{k}={float(v):.4f}" for k, v in trainer.progress_bar_metrics.items() if k != "v_num")
        print(f"epoch {trainer.current_epoch} step {step}/{total} ({100 * step / max(total, 1):.0f}%) "
              f"{rate:.2f} steps/s eta {eta / 60:.1f} min {metrics}", flush=True)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            print(f"validating at step {trainer.global_step} on the held-out pool", flush=True)


def progress_callback(every: int = 10) -> Callback:
    """A TQDM bar on a terminal, log lines otherwise."""
    return TQDMProgressBar() if sys.stderr.isatty() else LogLineProgress(every)
