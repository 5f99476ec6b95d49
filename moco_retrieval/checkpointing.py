"""Checkpoint files: written atomically (a temporary file in the same folder, then a rename), so a
kill at any moment leaves either the old checkpoint or the new one, never half of one."""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    # created with mode 0666 so the kernel applies the umask: a checkpoint is as readable as any
    # file (mkstemp would make it 0600; reading the umask means setting it, racing other threads)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes through :func:`atomic_torch_save`."""

    def save_checkpoint(self, checkpoint: dict, path: str | os.PathLike, storage_options: Optional[Any] = None) -> None:
        atomic_torch_save(checkpoint, path)


def resolve_ckpt_path(ckpt_path: Optional[str], run_dir: Path) -> Optional[str]:
    """``last`` means this run directory's ``checkpoints/last.ckpt`` (None when there is none yet,
    so a requeued job that never checkpointed starts fresh); any other value must exist."""
    if not ckpt_path:
        return None
    if ckpt_path == "last":
        last = run_dir / "checkpoints" / "last.ckpt"
        return str(last) if last.exists() else None
    if not Path(ckpt_path).exists():
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such checkpoint file")
    return ckpt_path
