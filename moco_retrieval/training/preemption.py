"""Preemption-safe training: stop at a step boundary on SIGTERM, SIGUSR1 or SIGINT (Ctrl-C),
write ``checkpoints/last.ckpt``, exit with a status a requeue understands.

Ctrl-C is a stop like SIGTERM (exit 130, ``train.py`` prints the command that resumes); a second
Ctrl-C while the step finishes aborts at once, without that checkpoint.

How clusters warn a job before killing it:

* Kubernetes (eviction, preemption, ``kubectl delete``): SIGTERM to the container's main process,
  SIGKILL after ``terminationGracePeriodSeconds`` (30 s by default). ``torchrun`` passes the
  SIGTERM on to its workers.
* SLURM: ``#SBATCH --signal=SIGUSR1@90`` sends SIGUSR1 to every task 90 s before the time limit;
  preemption, ``scancel`` and ``scontrol requeue`` send SIGTERM, SIGKILL after ``KillWait`` /
  ``GraceTime``.

What :class:`PreemptionCheckpoint` does (one per trainer, added by ``train.build``):

1. The signal handler only records the signal: no IO and no collective in a signal handler.
   (Lightning's own SLURM handler saves its ``hpc_ckpt_*.ckpt`` inside the handler, at any point
   of a step, and its SIGTERM handler broadcasts inside the handler; see Lightning issue #21406.
   Ours replace both while ``fit`` trains, and Lightning's come back afterwards.)
2. At the end of every optimizer step the ranks agree on the flag with one all-reduce (MAX) of a
   single number, so every rank stops after the same step even when only one node was signalled.
3. Then every rank takes part in ``trainer.save_checkpoint(checkpoints/last.ckpt)``: rank 0 writes
   it through the atomic checkpoint IO (checkpoints.py). The checkpoint is the one Lightning
   writes at ``on_train_batch_end``, with this step's keys already in the queue: model, key
   encoder, queue, optimizer, scheduler, step, RNG states, the position in the epoch, and each
   rank's fingerprint of its unsynced state. The run goes on to log the step's metrics and stops at
   the next hook (before a validation, the next batch or the epoch's end).
4. Under SLURM with ``SLURMEnvironment(auto_requeue=True)`` and the requeue signal (SIGUSR1, the
   time-limit warning) rank 0 runs ``scontrol requeue <job>`` (``slurm_requeue``), as Lightning's
   auto-requeue does. A SIGTERM is not requeued from here: SLURM requeues preempted jobs itself,
   and ``scancel`` means stop.
5. :class:`Preempted` (a ``SystemExit``) ends the run with status ``128 + signal``: 143 for
   SIGTERM, 138 for SIGUSR1, 130 for SIGINT, the status of a process the signal killed. Requeue
   machinery treats that as retryable: Kubeflow's ``restartPolicy: ExitCode`` retries 128-255 and
   fails 1-127; ``restartPolicy: OnFailure`` and Job ``backoffLimit`` retry any non-zero status;
   ``docker/slurm.sbatch`` requeues a run that stopped unfinished with a status above 128. No final
   validation runs and ``metrics.json`` is not written (the sign of an unfinished run). Under
   ``torchrun`` the workers exit 143 but torchrun itself exits 1: with torchrun, use a restart
   policy that retries any failure (``OnFailure``, as docker/k8s-pytorchjob.yaml does). A SIGTERM
   that Lightning handles itself (outside the training steps, e.g. during the final validation)
   raises its ``SIGTERMException``, status 0; ``train.main`` turns that into 143
   (:func:`sigterm_exit_status`).

Resume: the same command line with ``ckpt_path=last`` and the same ``run_dir`` (with no
``last.ckpt`` yet the run starts fresh). A validation that was due at the preempted step is
skipped, as Lightning does for any checkpoint saved at ``on_train_batch_end``.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from moco_retrieval.distributed import world_size
from moco_retrieval.training.checkpoints import rank_fingerprints
from moco_retrieval.training.cluster import slurm_job_id

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The status of a run stopped by ``signum``: 128 + the signal number (143 for SIGTERM)."""
    return 128 + int(signum)


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; its ``code`` is the process status."""

    def __init__(self, signum: int, ckpt_path: str, step: int):
        super().__init__(exit_code(signum))
        self.signum, self.ckpt_path, self.step = int(signum), str(ckpt_path), int(step)

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} after step {self.step}; "
                f"checkpoint {self.ckpt_path}; exit status {self.code}")


@contextmanager
def sigterm_exit_status() -> Iterator[None]:
    """Lightning's own ``SIGTERMException`` (a SIGTERM outside the training steps, e.g. during the
    final validation, or one Lightning saw before ``on_train_start``) is a ``SystemExit`` with
    status 0, which a scheduler takes for success; make it 143 like :class:`Preempted`."""
    try:
        yield
    except SIGTERMException as e:
        raise SystemExit(exit_code(signal.SIGTERM)) from e


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


class PreemptionCheckpoint(Callback):
    """See the module docstring.

    Args:
        ckpt_path: where the preemption checkpoint goes (``<run_dir>/checkpoints/last.ckpt``).
        requeue_signal: the signal on which rank 0 also runs ``scontrol requeue`` (None: never);
            ``train.build`` passes SIGUSR1 under SLURM.
        signals: the signals that stop the run.
        save_at_end: also write ``ckpt_path`` when training ends, so that it always holds the
            final state (a requeue of a run that finished training only validates).
    """

    def __init__(self, ckpt_path: str | os.PathLike, requeue_signal: Optional[int] = None,
                 signals: Sequence[int] = STOP_SIGNALS, save_at_end: bool = True):
        self.ckpt_path = Path(ckpt_path)
        self.save_at_end = save_at_end
        self.requeue_signal = requeue_signal
        self.signals = tuple(signals)
        self.received: Optional[int] = None  # the first stop signal this process got
        self._stop: Optional[Preempted] = None  # set once the preemption checkpoint is written
        self._saved_handlers: dict[int, Any] = {}

    # ---- signals --------------------------------------------------------------------------
    def _handler(self, signum: int, frame: Any) -> None:
        # os.write: no buffered IO inside a signal handler
        if self.received is None:
            self.received = signum
            again = "; Ctrl-C again aborts at once, without it" if signum == signal.SIGINT else ""
            os.write(2, f"[moco_retrieval] got {signal.Signals(signum).name}: stopping after this step, then "
                        f"writing {self.ckpt_path.name}{again}\n".encode())
        elif signum == signal.SIGINT:  # a second Ctrl-C: the user will not wait for the step
            os.write(2, b"[moco_retrieval] got SIGINT again: aborting now, without a checkpoint of this step\n")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            raise KeyboardInterrupt

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
                continue  # started with Ctrl-C ignored (nohup, a background job of a script): keep it so
            previous = signal.signal(s, self._handler)
            self._saved_handlers.setdefault(s, previous)

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s, handler in self._saved_handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._saved_handlers = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.received, self._stop = None, None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning registered its handlers just before; ours replace them while training runs, and
        # go before Lightning's teardown puts back the handlers the process had before fit.
        if trainer.received_sigterm and self.received is None:  # came through Lightning's handler
            self.received = signal.SIGTERM
        self._install()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()  # (normally done already, in on_train_end)

    # ---- the step boundary ----------------------------------------------------------------
    def _agreed_signal(self, trainer: L.Trainer) -> int:
        """The largest signal number any rank received (0: none), the same on every rank."""
        local = int(self.received or 0)
        if world_size() == 1:
            return local
        flag = torch.tensor([local], dtype=torch.int32, device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        acc = max(1, int(trainer.accumulate_grad_batches))
        if acc > 1 and (batch_idx + 1) % acc and not trainer.is_last_batch:
            return  # mid-accumulation: gradients are not in a checkpoint; stop at the optimizer step
        signum = self._agreed_signal(trainer)
        if not signum:
            return
        # the step's keys are already in the queue: the module enqueues them in on_after_backward
        trainer.save_checkpoint(self.ckpt_path)  # every rank; rank 0 writes; ends with a barrier
        self._stop = Preempted(signum, str(self.ckpt_path), trainer.global_step)
        if trainer.is_global_zero:
            print(f"[moco_retrieval] {self._stop}", file=sys.stderr, flush=True)
            if self.requeue_signal is not None and signum == int(self.requeue_signal):
                slurm_requeue()
        # The exit comes at the next hook, so that this step's metrics still reach the loggers;
        # a validation that would start now does not run (no time for it in a grace period).

    def _exit_if_stopped(self) -> None:
        if self._stop is not None:
            stop, self._stop = self._stop, None
            raise stop

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._exit_if_stopped()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._exit_if_stopped()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._exit_if_stopped()  # runs before ModelCheckpoint's (Lightning orders checkpoint callbacks last)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._exit_if_stopped()
        if self.save_at_end:
            # The final state (the ModelCheckpoints write at validations only).
            trainer.save_checkpoint(self.ckpt_path)
        self._restore()

    # ---- every checkpoint: each rank's fingerprint ----------------------------------------
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # trainer.save_checkpoint runs this on every rank (only rank 0 writes the file), so the
        # gather is matched on all ranks.
        mine = rank_fingerprints(pl_module)
        if world_size() > 1:
            everyone: list = [None] * world_size()
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        checkpoint["rank_fingerprints"] = everyone


__all__ = ['Preempted', 'STOP_SIGNALS', 'exit_code', 'sigterm_exit_status', 'slurm_requeue', 'PreemptionCheckpoint']
