"""One checkpoint file: written atomically (a temporary file in the same folder, then a rename), so a
kill at any moment leaves either the old checkpoint or the new one, never half of one, and read
back checked.

``last.ckpt`` also keeps its predecessor, ``last.prev.ckpt`` (a hard link to the old file, made
just before the rename), so that ``ckpt_path=last`` can fall back to it when the newest cannot be
read (checkpointing.py). Every checkpoint written here carries a sha256 of its tensors
(``tensor_sha256``), checked when it is read: bytes changed on disk or in a copy make it unreadable
instead of training on damaged weights. Every error names the file
(:class:`~moco_retrieval.errors.CheckpointError`); a full disk says what is kept and how to resume.
"""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from moco_retrieval.errors import CheckpointError
from moco_retrieval.tensor_digest import named_tensors, tensors_sha256

LAST = "last.ckpt"
CHECKSUM = "tensor_sha256"  # the checkpoint key holding tensor_checksum() of the rest
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def tensor_checksum(checkpoint: dict) -> str:
    """sha256 over every tensor of ``checkpoint`` (its place, dtype, shape and bytes), in order;
    the key :data:`CHECKSUM` itself left out."""
    return tensors_sha256(named_tensors({k: v for k, v in checkpoint.items() if k != CHECKSUM}))


def previous_of(path: Path) -> Path:
    """Where the predecessor of ``path`` is kept: ``last.ckpt`` -> ``last.prev.ckpt``."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def human_size(n: float) -> str:
    """``n`` bytes as a short text: ``512 B``, ``1.5 MB``."""
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


def _kept_checkpoints(folder: Path, writing: Path) -> str:
    """What a failed write of ``writing`` leaves: the checkpoints already in ``folder``."""
    names = sorted(p.name for p in folder.glob("*.ckpt") if p.is_file()) if folder.is_dir() else []
    if not names:
        return f"no checkpoint was in {folder} before"
    kept = ", ".join(names)
    return (f"the previous {writing.name} is kept" if writing.name in names else f"{writing.name} was not written") + \
        f" (checkpoints in {folder}: {kept})"


def atomic_torch_save(obj: Any, path: str | os.PathLike, keep_previous: bool = False) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, rename over ``path``; a dict
    gets its :func:`tensor_checksum` under :data:`CHECKSUM`.
    ``keep_previous``: the file ``path`` held is kept as :func:`previous_of` ``path``."""
    if isinstance(obj, dict):
        obj = {**obj, CHECKSUM: tensor_checksum(obj)}
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
            kept = _kept_checkpoints(path.parent, path)
            raise CheckpointError(
                f"{path}: cannot write the checkpoint: no space left on the device holding {path.parent} "
                f"({human_size(free)} free); {kept}. Free some space (or point run_dir elsewhere) and resume with "
                "ckpt_path=last"
            ) from None
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes through :func:`atomic_torch_save`; ``last.ckpt`` keeps
    its predecessor."""

    def save_checkpoint(self, checkpoint: dict, path: str | os.PathLike, storage_options: Optional[Any] = None) -> None:
        atomic_torch_save(checkpoint, path, keep_previous=Path(path).name == LAST)


def read_checkpoint(path: str | os.PathLike, what: str = "checkpoint", verify: bool = True) -> dict:
    """A checkpoint's contents (tensors and plain containers only, memory-mapped where it can be);
    :class:`CheckpointError` naming the file when it is missing, a folder, empty or not one, or
    (``verify``) when its tensors do not match the checksum written with them."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise CheckpointError(f"{what}={path}: is a directory (expected a .ckpt file)")
    if not p.is_file():
        raise CheckpointError(f"{what}={path}: no such file")
    if p.stat().st_size == 0:
        raise CheckpointError(f"{what}={path}: empty file (0 bytes), not a checkpoint; a write was cut short?")
    try:
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            ckpt = torch.load(p, map_location="cpu", weights_only=True)  # an old (non-zip) file
    except Exception as e:  # noqa: BLE001 - torch's own advice (weights_only=False) is unsafe on a file of unknown origin
        raise CheckpointError(
            f"{what}={path}: cannot read it as a checkpoint ({p.stat().st_size:,} bytes; damaged, truncated "
            f"or not a torch file: {type(e).__name__})"
        ) from None
    if verify and isinstance(ckpt, dict) and CHECKSUM in ckpt and tensor_checksum(ckpt) != ckpt[CHECKSUM]:
        raise CheckpointError(f"{what}={path}: damaged: its tensors do not match the checksum written with them "
                              f"({p.stat().st_size:,} bytes; changed on disk or in a copy)")
    return ckpt


def checkpoint_step(ckpt: dict) -> int:
    return int(ckpt.get("global_step", 0))


__all__ = ["AtomicCheckpointIO", "CHECKSUM", "LAST", "atomic_torch_save", "checkpoint_step", "human_size",
           "previous_of", "read_checkpoint", "tensor_checksum"]
