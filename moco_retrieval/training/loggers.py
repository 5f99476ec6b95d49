"""Lightning loggers from ``LoggerConfig``: W&B (offline unless configured online) and CSV.

Lightning's loggers write from rank 0 only. The CSV log and ``metrics.json`` are the local record
that exists whatever W&B does. A run keeps one W&B run id (``wandb/run_id`` in the run directory): a
resumed or requeued attempt continues that W&B run instead of opening a new one.

The W&B policy (``wandb_mode``, ``wandb_settings``):

* offline by default, so a job without network never hangs on ``wandb.init``;
* online only when the job has ``WANDB_API_KEY`` **and** asks for it, by ``WANDB_MODE=online``
  in the environment or ``logger.mode=online`` in the config;
* ``disabled`` when ``logger.wandb=false`` or the mode says so;
* runs of one cluster job (its ranks, its requeued segments) share ``group`` = ``logger.group``
  or the job id (:func:`moco_retrieval.training.cluster.job_id`).

The policy talks to no network and imports no wandb; the environment is ``os.environ`` unless an
``env`` mapping is given (the tests).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from moco_retrieval.config import LoggerConfig
from moco_retrieval.training.cluster import environment, job_id

_ONLINE = {"online", "run"}
_OFFLINE = {"offline", "dryrun"}
_DISABLED = {"disabled", "disable", "off", "false", "0"}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def wandb_mode(logger_cfg: Any = None, env: Optional[Mapping[str, str]] = None) -> tuple[str, str]:
    """``(mode, reason)`` with mode in ``online | offline | disabled``."""
    e = environment(env)
    if logger_cfg is not None and not _get(logger_cfg, "wandb", True):
        return "disabled", "logger.wandb=false"
    cfg_mode = _get(logger_cfg, "mode")
    if cfg_mode:
        requested, source = str(cfg_mode).strip().lower(), "logger.mode"
    elif e.get("WANDB_MODE"):
        requested, source = e["WANDB_MODE"].strip().lower(), "WANDB_MODE"
    else:
        return "offline", "default (set WANDB_MODE=online and WANDB_API_KEY to log online)"
    if requested in _DISABLED:
        return "disabled", f"{source}={requested}"
    if requested in _OFFLINE:
        return "offline", f"{source}={requested}"
    if requested in _ONLINE:
        if (e.get("WANDB_API_KEY") or "").strip():
            return "online", f"{source}={requested} and WANDB_API_KEY set"
        return "offline", f"{source}={requested} but WANDB_API_KEY is not set"
    raise ValueError(f"unknown W&B mode {requested!r} from {source}; use online, offline or disabled")


def wandb_settings(
    logger_cfg: Any = None,
    run_dir: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
) -> dict[str, Any]:
    """Keyword arguments for ``lightning.pytorch.loggers.WandbLogger``.

    ``mode`` goes on to ``wandb.init`` (an init argument beats the ``WANDB_MODE`` variable);
    ``offline`` is the logger's own flag; the dict passes straight through:
    ``WandbLogger(**wandb_settings(cfg.logger, run_dir))``. When ``mode == "disabled"`` the caller
    should not build a W&B logger at all; ``wandb_mode()`` also returns the reason, to log. With
    ``run_dir`` the W&B files, including the ``wandb/offline-run-*`` folders to ``wandb sync``
    later, go under the run directory.
    """
    mode, _ = wandb_mode(logger_cfg, env)
    group = _get(logger_cfg, "group") or job_id(env)
    settings: dict[str, Any] = {
        "project": _get(logger_cfg, "project") or environment(env).get("WANDB_PROJECT") or "moco-retrieval",
        "entity": _get(logger_cfg, "entity"),
        "name": _get(logger_cfg, "name"),
        "group": group,
        "tags": list(_get(logger_cfg, "tags") or []),
        "mode": mode,
        "offline": mode != "online",
    }
    if run_dir is not None:
        settings["save_dir"] = str(run_dir)
    return settings


RUN_ID_FILE = "run_id"  # under RUN_DIR/wandb/


def csv_version(run_dir: Path) -> str:
    """``csv/metrics.csv`` for a run's first attempt, ``csv/resume-N/metrics.csv`` for the N-th
    resumed one: Lightning's CSV logger would otherwise overwrite the earlier attempt's history.
    An attempt that logged no row yet (stopped before ``log_every_n_steps``) still left its
    folder and its record (records.RecordAttempt): the next attempt is not the first."""
    csv_dir = Path(run_dir) / "csv"
    if not csv_dir.is_dir() or not any(csv_dir.iterdir()):
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
    params = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    for logger in loggers:
        logger.log_hyperparams(params)


def finish_loggers(loggers: list[Logger]) -> None:
    """End the W&B run (Lightning leaves it open): its files are complete, and a later run in
    the same process (a resumed attempt, a benchmark's next run) opens its own instead of reusing it."""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and rank_zero_only.rank == 0 and logger._experiment is not None:
            logger.experiment.finish()


__all__ = ['wandb_mode', 'wandb_settings']
