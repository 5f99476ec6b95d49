"""How a stopped run ends: the signals that stop it, the exception that ends it after the
preemption checkpoint, and its exit status (``128 + signal``: 143 for SIGTERM, 138 for SIGUSR1,
130 for SIGINT, the status of a process the signal killed, which requeue machinery treats as
retryable; see preemption.py)."""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

from lightning.pytorch.utilities.exceptions import SIGTERMException

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



__all__ = ["Preempted", "STOP_SIGNALS", "exit_code", "sigterm_exit_status"]
