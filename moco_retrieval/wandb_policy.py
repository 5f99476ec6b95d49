"""The W&B policy: which mode a run logs in, and the settings of its ``WandbLogger``.

* offline by default, so a job without network never hangs on ``wandb.init``;
* online only when the job has ``WANDB_API_KEY`` **and** asks for it, by ``WANDB_MODE=online``
  in the environment or ``logger.mode=online`` in the config;
* ``disabled`` when ``logger.wandb=false`` or the mode says so;
* runs of one cluster job (its ranks, its requeued segments) share ``group`` = ``logger.group``
  or the job id (:func:`moco_retrieval.launcher.job_id`).

Nothing here talks to the network or imports wandb; the environment is ``os.environ`` unless an
``env`` mapping is given (the tests).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from moco_retrieval.launcher import environment, job_id

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


__all__ = ["wandb_mode", "wandb_settings"]
