"""``scontrol requeue`` of this SLURM job, as Lightning's auto-requeue does (preemption.py runs it on
rank 0 on the requeue signal, SIGUSR1, the time-limit warning)."""
from __future__ import annotations

import logging
import subprocess
from typing import Optional

from moco_retrieval.launcher import slurm_job_id

log = logging.getLogger(__name__)


def slurm_requeue(job: Optional[str] = None) -> bool:
    """``scontrol requeue <job>``; False (with the reason logged) when it cannot be done here."""
    job = job or slurm_job_id()
    if not job:
        log.warning("requeue: no SLURM job id in the environment")
        return False
    try:
        rc = subprocess.call(["scontrol", "requeue", job])
    except FileNotFoundError:
        log.warning("requeue: scontrol is not available here (a container?); the batch script has to "
                    "requeue job %s (docker/slurm.sbatch does, on an exit status above 128)", job)
        return False
    if rc != 0:
        log.warning("requeue: `scontrol requeue %s` failed with status %s", job, rc)
        return False
    log.info("requeued SLURM job %s", job)
    return True


__all__ = ["slurm_requeue"]
