"""What the launcher (SLURM, torchrun, Kubernetes, Lightning's own DDP) tells a process through its
environment: the cluster job's id, whether ``srun`` or ``torchrun`` started it, and its rank.

Every function reads the environment (``os.environ`` unless an ``env`` mapping is given, which the
tests use); none imports torch or lightning.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from moco_retrieval.errors import launcher_rank_zero

# Checked in this order; the first one set (and not empty) is the job id.
# MOCO_RETRIEVAL_JOB_ID: explicit, wins over everything.
# PYTORCHJOB_NAME / K8S_JOB_NAME: not set by Kubernetes itself; docker/k8s-pytorchjob.yaml sets
#   PYTORCHJOB_NAME from the pod label training.kubeflow.org/job-name (downward API).
# TORCHELASTIC_RUN_ID: torchrun's --rdzv-id; torchrun sets it to "none" when none was given.
_JOB_ID_VARS = ("MOCO_RETRIEVAL_JOB_ID", "SLURM_JOB_ID", "PYTORCHJOB_NAME", "K8S_JOB_NAME", "TORCHELASTIC_RUN_ID")


def environment(env: Optional[Mapping[str, str]] = None) -> Mapping[str, str]:
    """``env``, or the process's environment when None."""
    return os.environ if env is None else env


def slurm_job_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The SLURM job's id, the one ``scontrol requeue`` takes: ``<array job id>_<task id>`` for an
    array task (so that the tasks of one array are told apart), else ``SLURM_JOB_ID`` (kept across
    ``--requeue``); None outside SLURM."""
    e = environment(env)
    value = (e.get("SLURM_JOB_ID") or "").strip()
    array_job, task = e.get("SLURM_ARRAY_JOB_ID"), e.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return value or None


def job_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The cluster job's id (the first of :data:`_JOB_ID_VARS` set; SLURM's as :func:`slurm_job_id`
    gives it), or None outside a cluster job."""
    e = environment(env)
    for var in _JOB_ID_VARS:
        value = (e.get(var) or "").strip()
        if not value or (var == "TORCHELASTIC_RUN_ID" and value == "none"):
            continue
        return slurm_job_id(e) if var == "SLURM_JOB_ID" else value
    return None


def on_slurm(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when the process was started by ``srun`` in a SLURM job, as Lightning's
    ``SLURMEnvironment`` decides it (``SLURM_NTASKS`` set, the job not named ``bash`` or
    ``interactive``). The entry point turns SLURM auto-requeue on exactly then."""
    e = environment(env)
    if not e.get("SLURM_JOB_ID") or "SLURM_NTASKS" not in e:
        return False
    return e.get("SLURM_JOB_NAME") not in ("bash", "interactive")


# torchrun sets these in every worker (Lightning's TorchElasticEnvironment.detect looks for them)
_TORCHRUN_VARS = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def torchrun_devices(env: Optional[Mapping[str, str]] = None) -> Optional[tuple[int, int]]:
    """``(devices per node, nodes)`` from torchrun's environment, or None outside torchrun: under
    torchrun the launcher decides how many processes run, not ``trainer.devices``."""
    e = environment(env)
    if not all(v in e for v in _TORCHRUN_VARS) or "WORLD_SIZE" not in e:
        return None
    local, world = int(e["LOCAL_WORLD_SIZE"]), int(e["WORLD_SIZE"])
    return local, max(1, world // max(1, local))


def is_rank_zero(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is (or will be) global rank 0, from its launcher's environment: known
    before the process group exists (the run directory's lock is taken before anything else)."""
    return launcher_rank_zero(environment(env))


__all__ = ["environment", "is_rank_zero", "job_id", "on_slurm", "slurm_job_id", "torchrun_devices"]
