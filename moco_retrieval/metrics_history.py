"""One metrics file per run, ``RUN/metrics.csv``, over all its attempts.

Lightning's CSV logger writes each attempt apart (``csv/metrics.csv`` for the first,
``csv/resume-N/metrics.csv`` for the N-th resumed one: loggers.csv_version), and an attempt that
was stopped logged steps past the checkpoint the next attempt resumed from: steps the next attempt
trains again. :func:`write_merged_metrics` joins them into one table a reader can plot: every
attempt's rows in step order, an ``attempt`` column (1 = the first), and the rows an attempt
logged after the step its successor resumed from left out (that history was thrown away with the
state that made it). Each attempt records the step it resumed from in its CSV folder
(:class:`RecordAttempt`), and the merged file is rewritten at the end of every attempt.
"""
from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger

MERGED = "metrics.csv"  # under the run directory
RECORD = "attempt.json"  # under each attempt's CSV folder: {"resumed_from_step": S}
_RESUME = re.compile(r"resume-(\d+)")


def attempt_folders(run_dir: Path) -> list[Path]:
    """Each attempt's CSV folder, in order: ``csv/``, then ``csv/resume-1/``, ``csv/resume-2/``, ..."""
    base = Path(run_dir) / "csv"
    if not base.is_dir():
        return []
    resumed = sorted((int(m.group(1)), p) for p in base.iterdir() if (m := _RESUME.fullmatch(p.name)) and p.is_dir())
    return [base] + [p for _, p in resumed]


class RecordAttempt(Callback):
    """Writes, into this attempt's CSV folder, the step it starts from (0: a fresh start; after a
    resume, the checkpoint's step, which Lightning has restored by ``on_train_start``)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                folder = Path(logger.log_dir)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / RECORD).write_text(json.dumps({"resumed_from_step": int(trainer.global_step)}) + "\n")


def _resumed_from(folder: Path) -> Optional[int]:
    try:
        return int(json.loads((folder / RECORD).read_text())["resumed_from_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
        rows += [{**r, "attempt": n} for r in attempt_rows if limit is None or _step(r) <= limit]
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


__all__ = ["MERGED", "attempt_folders", "flush_and_merge", "merged_metrics", "RecordAttempt", "write_merged_metrics"]
