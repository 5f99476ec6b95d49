"""What a training run prints and draws for a person.

* Progress: a plain, time-stamped line every N steps when the output goes to a log file (a redrawn
  bar shows there as one endless line), Lightning's bar on a terminal; the ETA counts the
  validations still to come (timed once one has run, estimated before).
* After each validation: one time-stamped line (recall@1, nDCG@10, mean unrelated cosine, best
  recall@1 so far), a PNG histogram of positive versus unrelated cosines in the run directory, and
  on W&B the same as histograms plus a table of a fixed sample of queries with their top-5
  documents, each marked relevant or not. With several evaluation sets (``data.eval_dirs``): a line,
  a histogram and a table per set, then a line of their mean; "best" is the monitored metric's
  (``trainer.best_set``).
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Optional

from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.loggers import WandbLogger

from moco_retrieval.evaluation.report import (
    plot_cosine_histograms,
    wandb_cosine_histograms,
    wandb_topk_table,
)
from moco_retrieval.config import MEAN_SET
from moco_retrieval.progress import log_line
from moco_retrieval.training.module import metric_prefix

# Before the first validation has been timed, one is taken to cost the time of this many
# training steps per (pool texts / batch size): forward-only encoding of the pool against
# forward + backward of a batch, calibrated once on the main job (queue65k). Only a first guess:
# from the first validation on, the measured times are used.
VALIDATION_STEPS_PER_POOL_BATCH = 0.27


def validations_left(step: int, total: int, interval: Optional[int]) -> int:
    """Validations still to run after ``step`` of ``total``: every ``interval`` steps, and the
    final one train.py adds when the last step is not a validation point."""
    if total <= step:
        return 0
    if not interval:
        return 1
    left = total // interval - step // interval
    return left + (1 if total % interval else 0)


class LogLineProgress(ProgressBar):
    def __init__(self, every: int = 10):
        super().__init__()
        self.every, self._enabled, self._t0, self._first, self._said_first = every, True, None, None, False
        self._val_seconds: list[float] = []  # each validation of this attempt
        self._val_t0: Optional[float] = None
        self._val_in_window = 0.0  # validation seconds since _t0 (excluded from the training rate)

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _restart_clock(self, trainer) -> None:
        self._end_validation()
        self._t0, self._step0, self._val_in_window = time.monotonic(), trainer.global_step, 0.0
        self._first: Optional[tuple[float, int, float]] = None  # (time, step, validation s) after the first step

    def _end_validation(self) -> None:
        if self._val_t0 is not None:
            seconds = time.monotonic() - self._val_t0
            self._val_seconds.append(seconds)
            self._val_in_window += seconds
            self._val_t0 = None

    def on_train_start(self, trainer, pl_module) -> None:
        # also here: a run resumed mid-epoch gets no on_train_epoch_start for that epoch
        self._restart_clock(trainer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._restart_clock(trainer)

    def validation_seconds(self, trainer, seconds_per_step: float) -> float:
        """One validation's time: the mean of those timed so far, else estimated from the pool."""
        if self._val_seconds:
            return sum(self._val_seconds) / len(self._val_seconds)
        dm = getattr(trainer, "datamodule", None)
        try:
            texts = sum(len(ev.corpus) + len(ev.queries) for ev in dm.eval_sets.values())
            batch = int(dm.cfg.batch_size)
        except (AttributeError, TypeError, ValueError):
            return 0.0
        return VALIDATION_STEPS_PER_POOL_BATCH * texts / max(batch, 1) * seconds_per_step

    def eta_seconds(self, trainer, step: int, total: int, rate: float) -> float:
        if rate <= 0:
            return float("nan")
        interval = None
        if isinstance(trainer.val_check_interval, int) and trainer.check_val_every_n_epoch is None:
            interval = max(1, trainer.val_check_interval // max(1, trainer.accumulate_grad_batches))
        elif trainer.num_training_batches and math.isfinite(trainer.num_training_batches):
            interval = max(1, int(trainer.num_training_batches) // max(1, trainer.accumulate_grad_batches))
        n_val = validations_left(step, total, interval)
        return (total - step) / rate + n_val * self.validation_seconds(trainer, 1.0 / rate)

    def training_rate(self, trainer) -> float:
        """Optimizer steps per second of this attempt since the epoch's start, validations left out;
        from the end of the attempt's first step once a second is done (the first one warms up:
        allocations, kernels, the data loader's start)."""
        if self._t0 is None:
            return 0.0
        t0, step0, val = self._t0, self._step0, self._val_in_window
        if self._first is not None and trainer.global_step > self._first[1]:
            t0, step0, val = self._first[0], self._first[1], self._val_in_window - self._first[2]
        training_time = time.monotonic() - t0 - val
        return (trainer.global_step - step0) / max(training_time, 1e-9)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._first is None and self._t0 is not None and step > self._step0:
            self._first = (time.monotonic(), step, self._val_in_window)
            if self._enabled and trainer.is_global_zero and step % self.every and not self._said_first:  # at once
                log_line(f"epoch {trainer.current_epoch} step {step}/{trainer.estimated_stepping_batches}: the first "
                         f"step of this attempt took {self._first[0] - self._t0:.1f} s (warm-up included); a progress "
                         f"line with an estimate of the time left every {self.every} steps")
                self._said_first = True  # once an attempt (each epoch's first step is left out of the rate)
        if not self._enabled or not trainer.is_global_zero or step % self.every or self._t0 is None:
            return
        total = trainer.estimated_stepping_batches
        rate = self.training_rate(trainer)
        eta = self.eta_seconds(trainer, step, total, rate)
        metrics = " ".join(f"{k}={float(v):.4f}" for k, v in trainer.progress_bar_metrics.items() if k != "v_num")
        log_line(f"epoch {trainer.current_epoch} step {step}/{total} ({100 * step / max(total, 1):.0f}%) "
                 f"{rate:.2f} steps/s eta {eta / 60:.1f} min (validations included) {metrics}")

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self._val_t0 = time.monotonic()
        if trainer.is_global_zero and self._enabled:
            log_line(f"validating at step {trainer.global_step} on the held-out pool")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # a validation ends here, after every callback's after-validation work (checkpoints, plots)
        self._end_validation()


class ResumableBar(TQDMProgressBar):
    """Lightning's terminal bar, right after a resume too: a run resumed mid-epoch gets no
    ``on_train_epoch_start``, so Lightning's bar would show no total and no ETA (``17/?``) and its
    rate would count the batches done before the resume as if done now. Its ``eta`` field is the
    whole run's, validations included (the bar's own time counts this epoch's batches only),
    from a :class:`LogLineProgress` kept silent as its clock."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = LogLineProgress()
        self.clock.disable()

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        rate = self.clock.training_rate(trainer)
        if rate > 0 and trainer.training:
            eta = self.clock.eta_seconds(trainer, trainer.global_step, trainer.estimated_stepping_batches, rate)
            items["eta"] = f"{eta / 60:.1f}min incl. validations"
        return items

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self.clock.on_train_epoch_start(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        super().on_validation_start(trainer, pl_module)
        self.clock.on_validation_start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.clock.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.clock.on_train_start(trainer, pl_module)
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # this epoch's batches before this attempt
        bar = self.train_progress_bar
        bar.reset(total=convert_inf(self.total_train_batches))
        bar.initial = bar.n = bar.last_print_n = done
        bar.set_description(f"Epoch {trainer.current_epoch}")
        bar.refresh()


def progress_callback(every: int = 10) -> Callback:
    """A TQDM bar on a terminal, log lines otherwise."""
    return ResumableBar() if sys.stderr.isatty() else LogLineProgress(every)



def trained_for(trainer) -> str:
    """``"  after N min of training"``: the run clock's total (records.py), over every attempt."""
    seconds = trainer.callback_metrics.get("time/train_s")
    return "" if seconds is None else f"  after {float(seconds) / 60:.1f} min of training"


class ValidationReport(Callback):
    """Args: plots_dir: where ``cosines-step{N}.png`` go (several sets: ``cosines-{set}-step{N}.png``);
    sample_queries: rows of the W&B table (the same queries at every validation); tables: log the
    W&B table at all; monitor: the metric best checkpoints are chosen by (train.py's)."""

    def __init__(self, plots_dir: str | Path, sample_queries: int = 20, tables: bool = True,
                 monitor: str = "val/recall@1"):
        self.plots_dir, self.sample_queries, self.tables = Path(plots_dir), sample_queries, tables
        self.monitor = monitor
        self.best: tuple[float, int] | None = None  # (the monitored metric, step)

    def _update_best(self, trainer, recall: float, step: int) -> tuple[float, int]:
        if self.best is None:  # a resumed run: the checkpoint callback restored the best score
            score = getattr(getattr(trainer, "checkpoint_callback", None), "best_model_score", None)
            if score is not None and float(score) > recall:
                self.best = (float(score), -1)
        if self.best is None or recall > self.best[0]:
            self.best = (recall, step)
        return self.best

    def on_validation_end(self, trainer, pl_module) -> None:
        results = getattr(pl_module, "last_val_results", None)
        if not results or not trainer.is_global_zero or trainer.sanity_checking:
            return
        step = trainer.global_step
        several = len(results) > 1
        best, at = self._update_best(trainer, pl_module.last_val_metrics[self.monitor], step)
        best_text = (f"best {self.monitor[4:]} {best:.4f} ({'before this attempt' if at < 0 else f'step {at}'})"
                     f"{trained_for(trainer)}")
        self.plots_dir.mkdir(parents=True, exist_ok=True)
        for name, result in results.items():
            m, g = result.metrics, result.geometry
            log_line(f"validation at step {step}{f' on {name}' if several else ''}: recall@1 {m['recall@1']:.4f}  "
                     f"ndcg@10 {m['ndcg@10']:.4f}  unrelated cos {g.get('unrelated_cos_mean', float('nan')):+.3f}"
                     + ("" if several else f"  {best_text}"))
            plot_cosine_histograms({f"step {step}": result},
                                   self.plots_dir / (f"cosines-{name}-step{step}.png" if several else f"cosines-step{step}.png"))
            self._log_wandb(trainer, result, trainer.datamodule.eval_sets[name], metric_prefix(len(results), name), step)
        if several:
            mean = {k: pl_module.last_val_metrics[f"val/{MEAN_SET}/{k}"] for k in ("recall@1", "ndcg@10")}
            log_line(f"validation at step {step}, mean of {len(results)} sets: recall@1 {mean['recall@1']:.4f}  "
                     f"ndcg@10 {mean['ndcg@10']:.4f}  {best_text}")

    def _log_wandb(self, trainer, result, ev, prefix: str, step: int) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                payload = dict(wandb_cosine_histograms(result, prefix))
                if self.tables:
                    payload[f"{prefix}top5"] = wandb_topk_table(
                        result.run, ev.qrels, ev.queries, ev.corpus, n=self.sample_queries, k=5
                    )
                # on Lightning's step axis (not wandb's own step counter, which Lightning does not set)
                logger.experiment.log({**payload, "trainer/global_step": step})
