"""What a run records over all its attempts: its clock and its metrics file.

The run's own clock (:class:`RunClock`): seconds spent training and validating, summed over every attempt of a
run. A run preempted and resumed (``ckpt_path=last``) counts the time before its checkpoint too,
which neither the process's wall time nor W&B's per-attempt runtime does; what a requeue wasted
after the last checkpoint is not counted, because that work was redone.

:class:`RunClock` carries the sums in the checkpoint (Lightning saves a callback's
``state_dict``), logs them as ``time/train_s`` and ``time/val_s`` with the training metrics (a
dashboard can plot the validation curve against training seconds: the equal-compute view) and
``train.py`` writes them into ``metrics.json``. Training seconds are the wall time of ``fit``
outside validation: steps, data loading and checkpoint writes alike.

One metrics file per run, ``RUN/metrics.csv``, over all its attempts.

Lightning's CSV logger writes each attempt apart (``csv/metrics.csv`` for the first,
``csv/resume-N/metrics.csv`` for the N-th resumed one: loggers.csv_version), and an attempt that
was stopped logged steps past the checkpoint the next attempt resumed from: steps the next attempt
trains again. :func:`write_merged_metrics` joins them into one table a reader can plot: every
attempt's rows in step order, an ``attempt`` column (the run clock's count, as ``metrics.json``
says it: 1 = the first), and the rows an attempt logged after the step its successor resumed from
left out (that history was thrown away with the state that made it). Each attempt records its number
and the step it resumed from in its CSV folder (:class:`RecordAttempt`), and the merged file is
rewritten at the end of every attempt. The logged step is the optimizer steps completed, as on the
console, after a resume too (:class:`RecordAttempt` keeps Lightning's logging counter to it).
"""
from __future__ import annotations

import csv
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger
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


MERGED = "metrics.csv"  # under the run directory
RECORD = "attempt.json"  # under each attempt's CSV folder: {"attempt": N, "resumed_from_step": S}
_RESUME = re.compile(r"resume-(\d+)")


def attempt_folders(run_dir: Path) -> list[Path]:
    """Each attempt's CSV folder, in order: ``csv/``, then ``csv/resume-1/``, ``csv/resume-2/``, ..."""
    base = Path(run_dir) / "csv"
    if not base.is_dir():
        return []
    resumed = sorted((int(m.group(1)), p) for p in base.iterdir() if (m := _RESUME.fullmatch(p.name)) and p.is_dir())
    return [base] + [p for _, p in resumed]


class RecordAttempt(Callback):
    """Writes, into this attempt's CSV folder, its number (the :class:`RunClock`'s count, which the
    checkpoint carries) and the step it starts from (0: a fresh start; after a resume, the
    checkpoint's step, which Lightning has restored by ``on_train_start``).

    It also keeps Lightning's count of logged steps (``_batches_that_stepped``, which picks the
    batches that log every ``log_every_n_steps`` and steps the epoch's rows) equal to the optimizer
    steps completed: restored from a checkpoint that a validation wrote at an epoch's last batch,
    it is one short, and the CSV would log steps 24, 29 where the console says 25, 30."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero:
            return
        clock = next((c for c in trainer.callbacks if isinstance(c, RunClock)), None)
        record = {"attempt": clock.attempts if clock is not None else None,
                  "resumed_from_step": int(trainer.global_step)}
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                folder = Path(logger.log_dir)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / RECORD).write_text(json.dumps(record) + "\n")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        # (one optimizer: a batch that steps is an optimizer step; set here, after the epoch loop's reset)
        trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step


def _record(folder: Path) -> dict:
    try:
        record = json.loads((folder / RECORD).read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _resumed_from(folder: Path) -> Optional[int]:
    try:
        return int(_record(folder)["resumed_from_step"])
    except (KeyError, TypeError, ValueError):
        return None


def _attempt(folder: Path, position: int) -> int:
    """The attempt's number as the run clock counted it, else its position among the folders."""
    try:
        return int(_record(folder)["attempt"])
    except (KeyError, TypeError, ValueError):
        return position


def _rows(folder: Path) -> tuple[list[str], list[dict[str, Any]]]:
    path = folder / "metrics.csv"
    if not path.is_file():
        return [], []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _step(row: dict) -> int:
    try:
        return int(float(row.get("step") or 0))
    except ValueError:
        return 0


def merged_metrics(run_dir: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows) of every attempt, as :func:`write_merged_metrics` writes them."""
    folders = attempt_folders(run_dir)
    columns: list[str] = ["attempt"]
    rows: list[dict[str, Any]] = []
    for n, folder in enumerate(folders, start=1):
        names, attempt_rows = _rows(folder)
        columns += [c for c in names if c not in columns]
        # the steps this attempt logged past the checkpoint its successor resumed from are redone there
        later = [_resumed_from(f) for f in folders[n:]]
        limit = min((s for s in later if s is not None), default=None)
        attempt = _attempt(folder, n)
        rows += [{**r, "attempt": attempt} for r in attempt_rows if limit is None or _step(r) <= limit]
    rows.sort(key=lambda r: (_step(r), r["attempt"]))  # (stable: each attempt's own order within a step)
    return columns, rows


def write_merged_metrics(run_dir: Path) -> Optional[Path]:
    """Write ``RUN/metrics.csv`` (atomically); None when the run has no CSV log."""
    columns, rows = merged_metrics(run_dir)
    if not rows:
        return None
    out = Path(run_dir) / MERGED
    tmp = out.with_name(f".{MERGED}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, out)
    return out


def flush_and_merge(loggers: Iterable[Logger], run_dir: Path) -> Optional[Path]:
    """At the end of an attempt: the CSV logger's rows on disk, then the merged file."""
    loggers = list(loggers)
    csv_loggers = [lg for lg in loggers if isinstance(lg, CSVLogger)]
    for logger in csv_loggers:
        logger.save()
    return write_merged_metrics(run_dir) if csv_loggers else None


__all__ = ['MERGED', 'attempt_folders', 'flush_and_merge', 'merged_metrics', 'RecordAttempt', 'write_merged_metrics']
