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

``--help`` of every command (:func:`help_text`): what it does (its module's docstring, less its
references to the project's files), its option groups and presets, its main options (the command's
own keys and :data:`MAIN_KEYS`). A command module calls :func:`exit_after_help` before its heavy
imports (Lightning, transformers: seconds), so that the page comes at once. Hydra's own page lists the structured-config schemas among a
group's options and says nothing of the command; it stays behind ``--hydra-help``; ``--cfg job``
prints every key. ``register_configs`` puts everything the commands compose in Hydra's config
store: the command schemas and the objectives' group.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from moco_retrieval.config import check_known_keys, choice_message, register_command_schemas, unknown_key
from moco_retrieval.errors import USER_ERROR_STATUS, report, reports_user_errors, say
from moco_retrieval.objectives import registry as objectives

# Every command loads towers kept in eval mode on purpose (the EMA key encoder: no dropout in keys)
# and FAISS, which announces each CPU instruction set it tries; neither is news to a user.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
logging.getLogger("faiss.loader").setLevel(logging.WARNING)

CONFIG_PATH = "pkg://moco_retrieval.conf"
FULL_ERROR = "HYDRA_FULL_ERROR"
Task = Callable[[DictConfig], Any]


def register_configs() -> None:
    """Everything a command composes, in Hydra's config store: the command schemas and the
    ``objective`` group (idempotent)."""
    register_command_schemas()
    objectives.register()


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
                finally:  # a refused start, or a run whose files went to run_dir / out_dir elsewhere
                    remove_unused_output_dir()

            try:
                with guard:
                    hydra.main(config_path=CONFIG_PATH, config_name=name, version_base="1.3")(hydra_task)()
            except (HydraException, OmegaConfBaseException) as e:
                if guard.started or guard.user_setting == "1":
                    raise
                say(report(composition_message(e), name))
                raise SystemExit(USER_ERROR_STATUS) from None

        main.__wrapped__ = run_task  # type: ignore[attr-defined]
        return main

    return decorate


def remove_unused_output_dir() -> Optional[Path]:
    """After a command: Hydra's new folder (``outputs/DATE/TIME``), when it holds nothing but Hydra's
    own ``.hydra/`` record (and empty log files): a start refused for bad input, or a run that wrote
    into its ``run_dir`` / ``out_dir``; and its date folder and ``outputs/`` when they hold nothing else. A folder
    holding anything else (a run without ``run_dir``), or the working directory, is kept."""
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
    for parent in (folder.parent, folder.parent.parent):  # outputs/DATE, then outputs (only when empty)
        if parent == Path.cwd().resolve():
            break
        try:
            parent.rmdir()
        except OSError:
            break
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
    choice = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", str(getattr(cause, "msg", "")))
    if isinstance(cause, ValidationError) and cause.full_key and choice:  # an Enum option: as the ranges say it
        return choice_message(cause.full_key, choice.group(1), choice.group(2).split(", "))
    lines = str(error).splitlines()
    bare = re.fullmatch(r"Error parsing override '([^'=]+)'", lines[0]) if lines else None
    if bare:  # a path given alone (`export RUN/last.ckpt`): Hydra's grammar error says nothing of keys
        word = bare.group(1)
        hint = (f"; a checkpoint is checkpoint={word} (train: ckpt_path={word})" if word.endswith(".ckpt") else "")
        return f"{word!r} is not key=value: every argument sets a key (key=value, group=option){hint}; --help lists the keys"
    if isinstance(cause, OmegaConfBaseException):
        lines += str(cause).splitlines()
    return "\n".join(line for line in lines
                     if not line.startswith("To append to your config use") and not line.strip().endswith("_schema"))


SCHEMA_SUFFIX = "_schema"  # ConfigStore names of the command schemas (config.register_command_schemas)
PRESETS = "experiment"  # the group of presets, added with a +


def asks_for_help(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def exit_after_help(name: str, doc: Optional[str]) -> None:
    """``--help`` (or ``-h``) on the command line: print ``name``'s page and exit 0. Called from a
    command module's top, under ``if __name__ == "__main__"``, before its heavy imports."""
    if asks_for_help(sys.argv[1:]):
        print(help_text(name, doc))
        raise SystemExit(0)


# a reference to one of the project's files in a docstring: "(training/run_lock.py)", "(see
# config.py)", or a paren's last words ": training/records.py" (a user reads the page, not the code)
_FILE_REFERENCE = re.compile(r"\s*\((?:see )?[\w./]+\.py\)|[:;,]?\s*(?:see )?[\w./]+\.py(?=\))")


def summary(doc: Optional[str]) -> str:
    """The docstring's first paragraph and the example lines right after it, without references
    to the project's files."""
    paragraphs = textwrap.dedent((doc or "").strip("\n")).split("\n\n")
    # (a one-line first paragraph is a usage line: the next one says what the command does)
    kept = paragraphs[:1] + [p for p in paragraphs[1:2] if p.startswith("    ") or "\n" not in paragraphs[0]]
    kept = [p if p.startswith("    ") else textwrap.fill(" ".join(_FILE_REFERENCE.sub("", p).split()), 100)
            for p in kept]  # (prose wrapped again: the references left gaps; example lines as written)
    return "\n\n".join(kept).replace("``", "`").strip()


# The keys of a command's sections that its help lists beside its own top-level keys: what a new
# user sets first (data.train_path / eval_dir: data=jsonl, csv, parquet; data.path: hf, documents)
MAIN_KEYS: dict[str, tuple[str, ...]] = {
    "train": ("trainer.max_steps", "trainer.max_epochs", "trainer.val_check_interval", "trainer.devices",
              "data.train_path", "data.eval_dir", "data.eval_dirs", "data.path", "data.batch_size", "data.max_train_examples",
              "data.n_negatives", "optim.lr"),
}


def groups_and_options(name: str) -> tuple[dict[str, list[str]], list[tuple[str, object]]]:
    """({group: options, schemas left out}, [(top-level key, default)]) of ``conf/<name>.yaml``."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_configs()  # (--help can come before the command's decorator has run)
    module = CONFIG_PATH.removeprefix("pkg://")
    GlobalHydra.instance().clear()
    with initialize_config_module(module, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        cfg = compose(name)
        used = set(cfg.keys()) | {PRESETS}
        groups = {g: [o for o in loader.get_group_options(g) if not o.endswith(SCHEMA_SUFFIX)]
                  for g in loader.list_groups("") if g in used}
    values = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False, enum_to_str=True)
    main = [(k, v) for k, v in values.items() if not isinstance(v, dict)]
    main += [(k, OmegaConf.select(cfg, k, throw_on_missing=False)) for k in MAIN_KEYS.get(name, ())]
    return {g: o for g, o in groups.items() if o}, [(k, "(required)" if v == "???" else v) for k, v in main]


def help_text(name: str, doc: Optional[str]) -> str:
    groups, main = groups_and_options(name)
    lines = [f"python -m moco_retrieval.{name} [group=option ...] [key=value ...]", "", summary(doc), ""]
    presets = groups.pop(PRESETS, None)
    if presets and name == "train":  # (the presets are the main job's)
        lines += ["Presets (+experiment=NAME, first on the line):", "  " + ", ".join(presets), ""]
    if groups:
        lines += ["Option groups (group=option; then group.key=value sets one key):"]
        lines += [f"  {g}: {', '.join(o)}" for g, o in groups.items()]
        lines.append("")
    if main:
        lines += ["Main options (key=value; defaults shown):"]
        lines += [f"  {k}={'null' if v is None else v}" for k, v in main]
        lines.append("")
    lines += [f"Every key and its value: python -m moco_retrieval.{name} --cfg job [overrides]. "
              "A key that does not exist is an error.", "Hydra's own options: --hydra-help."]
    return "\n".join(lines)


__all__ = ['command', 'composition_message', 'CONFIG_PATH', 'asks_for_help', 'exit_after_help', 'help_text', 'MAIN_KEYS',
           'summary']
