"""Every command's entry point: ``@command("train")`` on its task function ``task(cfg: DictConfig)``.

It is ``hydra.main`` on ``conf/<name>.yaml``, the same for train, evaluate, export, search and mine,
with the project's promises kept around it:

* strict keys: a key the schema lacks is an error, given with a ``+`` or not (config.check_known_keys);
* a known error (errors.UserError) ends the command with one message and status 2
  (errors.reports_user_errors);
* so does an error of Hydra's own composition (an unknown key or group option, a bad override, a
  missing config), which Hydra would print and end with status 1;
* a start refused that way leaves no Hydra folder behind (``outputs/DATE/TIME`` holding only
  ``.hydra/``): :func:`remove_unused_output_dir`.

``HYDRA_FULL_ERROR=1`` shows the traceback of either. ``main(cfg)`` with a composed config
runs the task at once (as ``hydra.main``'s function does); ``main.__wrapped__`` is the checked task.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from moco_retrieval.command_help import asks_for_help, help_text
from moco_retrieval.config import check_known_keys, register_configs, unknown_key
from moco_retrieval.errors import USER_ERROR_STATUS, report, reports_user_errors

# Every command loads towers kept in eval mode on purpose (the EMA key encoder: no dropout in keys)
# and FAISS, which announces each CPU instruction set it tries; neither is news to a user.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
logging.getLogger("faiss.loader").setLevel(logging.WARNING)

CONFIG_PATH = "pkg://moco_retrieval.conf"
FULL_ERROR = "HYDRA_FULL_ERROR"
Task = Callable[[DictConfig], Any]


def command(name: str) -> Callable[[Task], Callable[..., Any]]:
    """Decorator: the command ``python -m moco_retrieval.<name>`` (see the module docstring)."""
    register_configs()

    def decorate(task: Task) -> Callable[..., Any]:
        run_task = reports_user_errors(name)(_strict(task))

        @functools.wraps(task)
        def main(cfg_passthrough: Optional[DictConfig] = None) -> Any:
            if cfg_passthrough is not None:
                return run_task(cfg_passthrough)
            if asks_for_help(sys.argv[1:]):
                print(help_text(name, sys.modules[task.__module__].__doc__))
                return None
            guard = _ComposeErrors()

            @functools.wraps(task)  # (Hydra names the job and its log file after the task's module)
            def hydra_task(cfg: DictConfig) -> Any:
                guard.task_starts()
                try:
                    return run_task(cfg)
                except SystemExit as stop:
                    if stop.code == USER_ERROR_STATUS:
                        remove_unused_output_dir()
                    raise

            try:
                with guard:
                    hydra.main(config_path=CONFIG_PATH, config_name=name, version_base="1.3")(hydra_task)()
            except (HydraException, OmegaConfBaseException) as e:
                if guard.started or guard.user_setting == "1":
                    raise
                print(report(composition_message(e), name), file=sys.stderr, flush=True)
                raise SystemExit(USER_ERROR_STATUS) from None

        main.__wrapped__ = run_task  # type: ignore[attr-defined]
        return main

    return decorate


def remove_unused_output_dir() -> Optional[Path]:
    """After a start refused for bad input: Hydra's new folder (``outputs/DATE/TIME``), when it holds
    nothing but Hydra's own ``.hydra/`` record (and empty log files), and its date folder when that
    was its only run. A folder holding anything else, or the working directory, is kept."""
    try:
        folder = Path(HydraConfig.get().runtime.output_dir).resolve()
    except ValueError:  # not started by Hydra
        return None
    if not folder.is_dir() or folder == Path.cwd().resolve() or not (folder / ".hydra").is_dir():
        return None
    if not all(p.name == ".hydra" or (p.suffix == ".log" and p.is_file() and p.stat().st_size == 0)
               for p in folder.iterdir()):
        return None
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.rmdir()  # (only when empty)
    except OSError:
        pass
    return folder


def _strict(task: Task) -> Task:
    @functools.wraps(task)
    def checked(cfg: DictConfig) -> Any:
        check_known_keys(cfg)
        return task(cfg)

    return checked


class _ComposeErrors:
    """Until the task starts, ``HYDRA_FULL_ERROR=1``: Hydra then raises its composition errors to
    ``main`` instead of printing them and exiting 1. From the task's start on, the user's own setting
    (a bug in the task keeps Hydra's usual report)."""

    def __init__(self) -> None:
        self.user_setting = os.environ.get(FULL_ERROR)
        self.started = False

    def __enter__(self) -> "_ComposeErrors":
        os.environ[FULL_ERROR] = "1"
        return self

    def task_starts(self) -> None:
        self.started = True
        self._restore()

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        if self.user_setting is None:
            os.environ.pop(FULL_ERROR, None)
        else:
            os.environ[FULL_ERROR] = self.user_setting


def composition_message(error: Exception) -> str:
    """One message for an error of Hydra's composition: an unknown key names the closest one (not
    Hydra's hint to add it with a +, which the strict check refuses); the rest is Hydra's own text
    with its cause, less the schemas' internal names among a group's options."""
    cause = error.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key and isinstance(cause.object_type, type):
        return str(unknown_key(cause.full_key, cause.object_type, added=False))
    lines = str(error).splitlines()
    if isinstance(cause, OmegaConfBaseException):
        lines += str(cause).splitlines()
    return "\n".join(line for line in lines
                     if not line.startswith("To append to your config use") and not line.strip().endswith("_schema"))


__all__ = ["command", "composition_message", "CONFIG_PATH"]
