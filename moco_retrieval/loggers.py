"""Lightning loggers from ``LoggerConfig``: W&B (offline unless configured online) and CSV.

Lightning's loggers write from rank 0 only. The CSV log and ``metrics.json`` are the local
record that exists whatever W&B does.
"""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, Logger

from moco_retrieval.cluster import wandb_mode, wandb_settings
from moco_retrieval.config import LoggerConfig


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


def build_loggers(cfg: LoggerConfig, run_dir: Path) -> list[Logger]:
    loggers: list[Logger] = []
    if cfg.csv:
        loggers.append(CSVLogger(save_dir=str(run_dir), name="csv", version=csv_version(run_dir)))
    if cfg.wandb:
        mode, reason = wandb_mode(cfg)
        if mode != "disabled":
            from lightning.pytorch.loggers import WandbLogger

            settings = wandb_settings(cfg, str(run_dir))
            print(f"W&B: {mode} ({reason}); files under {run_dir / 'wandb'}")
            loggers.append(WandbLogger(**settings))
    return loggers
