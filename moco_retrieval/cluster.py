"""Cluster helpers for the entry points: job id, SLURM and torchrun detection, rank, W&B settings.

Nothing here talks to the network or imports wandb/lightning; every function reads the
environment (``os.environ`` unless an ``env`` mapping is given, which the tests use).

W&B policy (see the README's cluster section):

* offline by default, so a job without network never hangs on ``wandb.init``;
* online only when the job has ``WANDB_API_KEY`` **and** asks for it, by ``WANDB_MODE=online``
  in the environment or ``logger.mode=online`` in the config;
* ``disabled`` when ``logger.wandb=false`` or the mode says so;
* runs of one cluster job (its ranks, its requeued segments) share ``group`` = ``logger.group``
  or the job id.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

# Checked in this order; the first one set (and not empty) is the job id.
# MOCO_RETRIEVAL_JOB_ID: explicit, wins over everything.
# PYTORCHJOB_NAME / K8S_JOB_NAME: not set by Kubernetes itself; docker/k8s-pytorchjob.yaml sets
#   PYTORCHJOB_NAME from the pod label training.kubeflow.org/job-name (downward API).
# TORCHELASTIC_RUN_ID: torchrun's --rdzv-id; torchrun sets it to "none" when none was given.
_JOB_ID_VARS = ("MOCO_RETRIEVAL_JOB_ID", "SLURM_JOB_ID", "PYTORCHJOB_NAME", "K8S_JOB_NAME", "TORCHELASTIC_RUN_ID")

_ONLINE = {"online", "run"}
_OFFLINE = {"offline", "dryrun"}
_DISABLED = {"disabled", "disable", "off", "false", "0"}


def _env(env: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if env is None else env


def job_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The cluster job's id, or None outside a cluster job.

    SLURM array tasks give ``<array job id>_<task id>`` so that the tasks of one array are told
    apart; a plain SLURM job gives ``SLURM_JOB_ID`` (kept across ``--requeue``).
    """
    e = _env(env)
    for var in _JOB_ID_VARS:
        value = (e.get(var) or "").strip()
        if not value or (var == "TORCHELASTIC_RUN_ID" and value == "none"):
            continue
        if var == "SLURM_JOB_ID":
            array_job, task = e.get("SLURM_ARRAY_JOB_ID"), e.get("SLURM_ARRAY_TASK_ID")
            if array_job and task:
                return f"{array_job}_{task}"
        return value
    return None


def on_slurm(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when the process was started by ``srun`` in a SLURM job, as Lightning's
    ``SLURMEnvironment`` decides it (``SLURM_NTASKS`` set, the job not named ``bash`` or
    ``interactive``). The entry point turns SLURM auto-requeue on exactly then."""
    e = _env(env)
    if not e.get("SLURM_JOB_ID") or "SLURM_NTASKS" not in e:
        return False
    return e.get("SLURM_JOB_NAME") not in ("bash", "interactive")


# torchrun sets these in every worker (Lightning's TorchElasticEnvironment.detect looks for them)
_TORCHRUN_VARS = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# a process's rank by launcher: torchrun, srun, Lightning's own DDP children (LOCAL_RANK, NODE_RANK)
_RANK_VARS = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK")


def torchrun_devices(env: Optional[Mapping[str, str]] = None) -> Optional[tuple[int, int]]:
    """``(devices per node, nodes)`` from torchrun's environment, or None outside torchrun: under
    torchrun the launcher decides how many processes run, not ``trainer.devices``."""
    e = _env(env)
    if not all(v in e for v in _TORCHRUN_VARS) or "WORLD_SIZE" not in e:
        return None
    local, world = int(e["LOCAL_WORLD_SIZE"]), int(e["WORLD_SIZE"])
    return local, max(1, world // max(1, local))


def is_rank_zero(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is (or will be) global rank 0, from its launcher's environment: known
    before the process group exists (the run directory's lock is taken before anything else)."""
    e = _env(env)
    return all(int((e.get(v) or "0").strip() or 0) == 0 for v in _RANK_VARS)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def wandb_mode(logger_cfg: Any = None, env: Optional[Mapping[str, str]] = None) -> tuple[str, str]:
    """``(mode, reason)`` with mode in ``online | offline | disabled``."""
    e = _env(env)
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
        "project": _get(logger_cfg, "project") or _env(env).get("WANDB_PROJECT") or "moco-retrieval",
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


__all__ = ["is_rank_zero", "job_id", "on_slurm", "torchrun_devices", "wandb_mode", "wandb_settings"]
