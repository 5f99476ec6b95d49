"""Checkpoint files: written atomically (a temporary file in the same folder, then a rename), so a
kill at any moment leaves either the old checkpoint or the new one, never half of one.

``checkpoints/last.ckpt`` also keeps its predecessor, ``last.prev.ckpt`` (a hard link to the old
file, made just before the rename), so that ``ckpt_path=last`` can fall back to it when the newest
cannot be read. Temporaries a killed write left behind (``.last.ckpt.<uuid>.tmp``) are removed at
the next start (:func:`remove_stale_temporaries`). Every checkpoint error names the file
(:class:`~moco_retrieval.errors.CheckpointError`).
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from moco_retrieval.errors import CheckpointError

LAST = "last.ckpt"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _note(msg: str) -> None:
    print(f"[moco_retrieval] {msg}", file=sys.stderr, flush=True)


def previous_of(path: Path) -> Path:
    """Where the predecessor of ``path`` is kept: ``last.ckpt`` -> ``last.prev.ckpt``."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _out_of_space(e: BaseException) -> bool:
    """torch.save reports a full disk as a RuntimeError chained to the OSError(ENOSPC)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        e = e.__cause__ or e.__context__
    return False


def _keep_previous(path: Path) -> None:
    """``path``'s current file becomes ``previous_of(path)`` while ``path`` stays in place."""
    if not path.is_file():
        return
    prev = previous_of(path)
    link = path.parent / f".{prev.name}.{uuid.uuid4().hex}.tmp"
    try:
        os.link(path, link)
        os.replace(link, prev)
    except OSError:  # no hard links here: move it (for a moment there is only the previous one)
        link.unlink(missing_ok=True)
        os.replace(path, prev)


def atomic_torch_save(obj: Any, path: str | os.PathLike, keep_previous: bool = False) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, rename over ``path``.
    ``keep_previous``: the file ``path`` held is kept as :func:`previous_of` ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        # created with mode 0666 so the kernel applies the umask: a checkpoint is as readable as any
        # file (mkstemp would make it 0600; reading the umask means setting it, racing other threads)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous:
            _keep_previous(path)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, Exception) and _out_of_space(e):
            free = shutil.disk_usage(path.parent).free
            kept = f"the previous {path.name} is kept" if path.exists() else "no earlier checkpoint was there"
            raise CheckpointError(
                f"{path}: cannot write the checkpoint: no space left on the device holding {path.parent} "
                f"({_size(free)} free); {kept}. Free some space (or point run_dir elsewhere) and resume with "
                "ckpt_path=last"
            ) from None
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes through :func:`atomic_torch_save`; ``last.ckpt`` keeps
    its predecessor."""

    def save_checkpoint(self, checkpoint: dict, path: str | os.PathLike, storage_options: Optional[Any] = None) -> None:
        atomic_torch_save(checkpoint, path, keep_previous=Path(path).name == LAST)


def read_checkpoint(path: str | os.PathLike, what: str = "checkpoint") -> dict:
    """A checkpoint's contents (tensors and plain containers only, memory-mapped where it can be);
    :class:`CheckpointError` naming the file when it is missing, a folder, empty or not one."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise CheckpointError(f"{what}={path}: is a directory (expected a .ckpt file)")
    if not p.is_file():
        raise CheckpointError(f"{what}={path}: no such file")
    if p.stat().st_size == 0:
        raise CheckpointError(f"{what}={path}: empty file (0 bytes), not a checkpoint; a write was cut short?")
    try:
        try:
            return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(p, map_location="cpu", weights_only=True)  # an old (non-zip) file
    except Exception as e:  # noqa: BLE001 - torch's own advice (weights_only=False) is unsafe on a file of unknown origin
        raise CheckpointError(
            f"{what}={path}: cannot read it as a checkpoint ({p.stat().st_size:,} bytes; damaged, truncated "
            f"or not a torch file: {type(e).__name__})"
        ) from None


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporaries of writes a kill cut short (``.<name>.<uuid>.tmp``); call it only while
    no write can be under way (the run directory is locked, before training starts)."""
    removed = []
    freed = 0
    for tmp in sorted(folder.glob(".*.tmp")) if folder.is_dir() else []:
        try:
            freed += tmp.stat().st_size
            tmp.unlink()
            removed.append(tmp)
        except FileNotFoundError:
            continue
    if removed:
        _note(f"removed {len(removed)} temporary file(s) of interrupted checkpoint writes in {folder} "
              f"({_size(freed)})")
    return removed


def set_aside_unreadable(last: Path) -> None:
    """After a fallback to ``last.prev.ckpt``: move the unreadable ``last.ckpt`` to
    ``last.ckpt.unreadable`` (kept to look at), so that the next write does not make it the
    predecessor."""
    if last.is_file():
        os.replace(last, last.with_name(last.name + ".unreadable"))
        _note(f"moved the unreadable {last.name} to {last.name}.unreadable")


def _first_readable(candidates: Iterable[Path]) -> Optional[str]:
    """The first candidate that reads as a checkpoint; a warning for each one that does not."""
    for i, c in enumerate(candidates):
        if not c.exists():
            continue
        try:
            read_checkpoint(c, "ckpt_path")
        except CheckpointError as e:
            _note(f"warning: {e}")
            continue
        if i:
            _note(f"warning: resuming from the previous checkpoint {c} instead")
        return str(c)
    return None


def resolve_ckpt_path(ckpt_path: Optional[str], run_dir: Path) -> Optional[str]:
    """The checkpoint to resume from, checked readable (:class:`CheckpointError` naming it when not).

    ``last`` means this run directory's ``checkpoints/last.ckpt``, or ``last.prev.ckpt`` (with a
    warning) when that cannot be read; with neither the run starts fresh, and says so. Any other
    value must be a readable checkpoint file."""
    if not ckpt_path:
        return None
    if ckpt_path != "last":
        read_checkpoint(ckpt_path, "ckpt_path")
        return ckpt_path
    last = Path(run_dir) / "checkpoints" / LAST
    prev = previous_of(last)
    found = _first_readable([last, prev])
    if found is None and (last.exists() or prev.exists()):
        raise CheckpointError(f"ckpt_path=last: neither {last} nor {prev} can be read (see above); move them "
                              "away to start from scratch, or give ckpt_path=FILE")
    if found is None:
        _note(f"ckpt_path=last: no checkpoint in {last.parent}: training starts from step 0 "
              f"(if this run should resume, check run_dir={run_dir})")
    return found


# objective options added since checkpoints were first written: the value a checkpoint without
# the option was trained with (the behaviour before the option existed)
OPTIONS_BEFORE_THEY_EXISTED = {"inbatch_weight": 0.0, "queue_max_age": None, "queue_refresh": 0, "matryoshka_dims": [],
                               "matryoshka_weights": []}


def check_same_objective(ckpt_path: str, objective: dict, prompts: Optional[dict] = None) -> None:
    """:class:`CheckpointError` when the checkpoint was trained with another objective, or with
    other options of it: each objective holds its own state (queues, EMA keys), so resuming across
    objectives cannot load, and a resumed run under changed options (a default that moved since,
    e.g. ``inbatch_weight``) would silently train another loss from the middle of the run. The
    message names the overrides that resume it as trained (e.g. ``objective=moco`` for a MoCo run
    of ``+experiment=queue65k`` from before the main job became the two-queue objective).
    ``objective``: this run's objective config as a plain dict. ``prompts``: this run's
    ``data.prompts`` (``{"query", "doc"}``), refused when they differ from the trained ones (none
    for a checkpoint from before prompts existed): the texts the model sees would change mid-run."""
    hparams = read_checkpoint(ckpt_path, "ckpt_path").get("hyper_parameters") or {}
    if prompts is not None:
        _check_same_prompts(ckpt_path, hparams.get("prompts") or {"query": "", "doc": ""}, prompts)
    trained = hparams.get("objective") or {}
    name = trained.get("name") if isinstance(trained, dict) else None
    if not name:
        return
    if name != objective["name"]:
        raise CheckpointError(f"ckpt_path={ckpt_path}: trained with objective={name}, but this run's config has "
                              f"objective={objective['name']}; add objective={name} to resume it (or start a new run_dir)")
    before = {k: trained.get(k, OPTIONS_BEFORE_THEY_EXISTED.get(k)) for k in objective
              if k in trained or k in OPTIONS_BEFORE_THEY_EXISTED}
    changed = [k for k, v in before.items() if v != objective[k]]
    if changed:
        raise CheckpointError(
            f"ckpt_path={ckpt_path}: trained with " + ", ".join(f"objective.{k}={_override(before[k])}" for k in changed)
            + ", but this run's config has " + ", ".join(f"objective.{k}={_override(objective[k])}" for k in changed)
            + "; add the trained values as overrides to resume it as trained (or start a new run_dir)")


def _check_same_prompts(ckpt_path: str, trained: dict, prompts: dict) -> None:
    changed = [k for k in ("query", "doc") if (trained.get(k) or "") != (prompts.get(k) or "")]
    if changed:
        raise CheckpointError(
            f"ckpt_path={ckpt_path}: trained with " + ", ".join(f"data.prompts.{k}={trained.get(k) or ''!r}" for k in changed)
            + ", but this run's config has " + ", ".join(f"data.prompts.{k}={prompts.get(k) or ''!r}" for k in changed)
            + "; set the trained prompts to resume it (or start a new run_dir)")


def _override(value: Any) -> str:
    """A value as a Hydra command-line override spells it."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


__all__ = ["AtomicCheckpointIO", "LAST", "atomic_torch_save", "check_same_objective", "previous_of", "read_checkpoint",
           "remove_stale_temporaries", "resolve_ckpt_path", "set_aside_unreadable"]
