"""Lightning loggers from ``LoggerConfig``: W&B (offline unless configured online) and CSV.

Lightning's loggers write from rank 0 only. The CSV log and ``metrics.json`` are the local
record that exists whatever W&B does. A run keeps one W&B run id (``wandb/run_id`` in the run
directory): a resumed or requeued attempt continues that W&B run instead of opening a new one.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from moco_retrieval.wandb_policy import wandb_mode, wandb_settings
from moco_retrieval.config import LoggerConfig

RUN_ID_FILE = "run_id"  # under RUN_DIR/wandb/


def csv_version(run_dir: Path) -> str:
    """``csv/metrics.csv`` for a run's first attempt, ``csv/resume-N/metrics.csv`` for the N-th
    resumed one: Lightning's CSV logger would otherwise overwrite the earlier attempt's history."""
    csv_dir = Path(run_dir) / "csv"
    if not (csv_dir / "metrics.csv").exists():
        return ""
    n = 1
    while (csv_dir / f"resume-{n}").exists():
        n += 1
    return f"resume-{n}"


def wandb_run_id(run_dir: Path, resume: bool) -> str:
    """The W&B run id of this run directory: the stored one when resuming, else a new one
    (stored, so that the attempt after a preemption finds it)."""
    path = Path(run_dir) / "wandb" / RUN_ID_FILE
    if resume and path.is_file():
        stored = path.read_text(encoding="utf-8").strip()
        if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", stored):
            return stored
    run_id = os.urandom(6).hex()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RUN_ID_FILE}.{os.getpid()}")
    tmp.write_text(run_id + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return run_id


class QuietWandbLogger(WandbLogger):
    """Lightning passes ``anonymous=None`` to ``wandb.init``, which wandb (>= 0.19) answers with a
    deprecation warning on every run; an unset argument is what we mean."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)


def build_loggers(cfg: LoggerConfig, run_dir: Path, resume: bool = False) -> list[Logger]:
    """CSV and W&B loggers; ``resume``: this attempt continues a checkpoint of ``run_dir``."""
    loggers: list[Logger] = []
    if cfg.csv:
        loggers.append(CSVLogger(save_dir=str(run_dir), name="csv", version=csv_version(run_dir)))
    if cfg.wandb:
        mode, reason = wandb_mode(cfg)
        if mode != "disabled":
            settings = wandb_settings(cfg, str(run_dir))
            # every rank must agree on the id; only rank 0 logs, so only rank 0 reads or writes it
            if rank_zero_only.rank == 0:
                settings["id"] = wandb_run_id(run_dir, resume)
                settings["group"] = settings["group"] or settings["id"]
            print(f"W&B: {mode} ({reason}); {'continuing' if resume else 'run'} {settings.get('id', '')} "
                  f"with files under {run_dir / 'wandb'}")
            loggers.append(QuietWandbLogger(**settings))
    return loggers


def log_config(loggers: list[Logger], cfg: Any) -> None:
    """The whole resolved config (data.*, trainer.*, ... as nested keys) as every logger's
    hyperparameters, so runs can be compared by any of them (W&B config, CSV hparams.yaml)."""
    params = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    for logger in loggers:
        logger.log_hyperparams(params)


def finish_loggers(loggers: list[Logger]) -> None:
    """End the W&B run (Lightning leaves it open): its files are complete, and a later run in
    the same process (a resumed attempt, a benchmark's next run) opens its own instead of reusing it."""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and rank_zero_only.rank == 0 and logger._experiment is not None:
            logger.experiment.finish()
