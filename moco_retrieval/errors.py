"""Known errors and how a command reports them.

A :class:`UserError` is a problem with what the user gave (data, config, a checkpoint file, a
model folder, the run directory, the disk), not a bug: its message says what is wrong and where.
:func:`reports_user_errors` wraps each command's task function (under ``@hydra.main``) so that
such an error prints its message alone, wrapped to be read, and exits with status 2; anything
else is a bug and keeps Hydra's traceback. ``HYDRA_FULL_ERROR=1`` shows the full traceback of a
known error too. Ctrl-C (a ``KeyboardInterrupt`` that reaches it) is one line and status 130, the
status a shell gives a command SIGINT ended (training itself stops at a step with a checkpoint
first: preemption.py). Under a launcher of several processes (torchrun, srun) each rank meets the
same bad input: rank 0 prints the message, the others exit with the same status silently
(:func:`launcher_rank_zero`, which training/cluster.py uses too).

The subclasses also derive from the matching built-in exception (``ValueError``, ``OSError``), so
code that catches the built-in one catches them too.
"""
from __future__ import annotations

import functools
import os
import sys
import textwrap
from typing import Any, Callable, Mapping, Optional

USER_ERROR_STATUS = 2  # as argparse and most Unix tools exit on a usage error
INTERRUPTED_STATUS = 130  # 128 + SIGINT
WIDTH = 100


class UserError(Exception):
    """Bad input the user can fix; the message names the file, line or key and what was expected."""


class ConfigError(UserError, ValueError):
    """A config value out of its range, contradicting another, or missing."""


class CheckpointError(UserError, OSError):
    """A checkpoint that cannot be read or written (names the file)."""


class ModelLoadError(UserError, OSError):
    """A model folder that cannot be loaded (names the folder and the key that chose it)."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """A model folder or file that is not there."""


class OutputExistsError(UserError, FileExistsError):
    """An output the command would write is there already, or is one of its inputs (names the key)."""


def wrap_message(message: str, width: int = WIDTH) -> str:
    """Each line of ``message`` wrapped at ``width`` (paths and ids never broken)."""
    out = []
    for line in str(message).splitlines() or [""]:
        indent = line[: len(line) - len(line.lstrip())]
        out.append(textwrap.fill(line, width=width, subsequent_indent=indent + "  ", break_long_words=False,
                                 break_on_hyphens=False) if line.strip() else line)
    return "\n".join(out)


# a process's rank by launcher: torchrun, srun, Lightning's own DDP children (LOCAL_RANK, NODE_RANK)
_RANK_VARS = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK")


def launcher_rank_zero(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is (or will be) global rank 0, from its launcher's environment (``env``,
    else the process's): known before any process group exists."""
    e = os.environ if env is None else env
    return all(int((e.get(v) or "0").strip() or 0) == 0 for v in _RANK_VARS)


def say(text: str) -> None:
    """A known error's message on stderr, once per job: on rank 0 alone."""
    if launcher_rank_zero():
        print(text, file=sys.stderr, flush=True)


def report(error: UserError, command: str) -> str:
    return wrap_message(f"{command}: error: {error}")


def reports_user_errors(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a command's task function, placed under ``@hydra.main``:
    a :class:`UserError` prints its message and exits with status 2 (see the module docstring)."""

    def decorate(task: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(task)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return task(*args, **kwargs)
            except UserError as e:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                say(report(e, command))
                raise SystemExit(USER_ERROR_STATUS) from None
            except KeyboardInterrupt:
                say(f"{command}: interrupted (Ctrl-C) before it finished")
                raise SystemExit(INTERRUPTED_STATUS) from None

        return run

    return decorate


__all__ = ["UserError", "ConfigError", "CheckpointError", "ModelLoadError", "ModelNotFoundError",
           "OutputExistsError", "INTERRUPTED_STATUS", "USER_ERROR_STATUS", "launcher_rank_zero", "report", "say",
           "reports_user_errors", "wrap_message"]
