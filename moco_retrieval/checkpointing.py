"""The run directory's checkpoints folder: where it is, which checkpoint a resume starts from
(``ckpt_path=last``: ``last.ckpt``, else its predecessor ``last.prev.ckpt``), and what killed writes
left behind (``.last.ckpt.<uuid>.tmp``, removed at the next start). Writing and reading one file:
checkpoint_file.py; the best-by-validation files across a resume: best_checkpoints.py.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable, Optional

from moco_retrieval.checkpoint_file import LAST, human_size, previous_of, read_checkpoint
from moco_retrieval.errors import CheckpointError
from moco_retrieval.launcher import is_rank_zero

CHECKPOINTS = "checkpoints"  # the run directory's folder of checkpoints


def note(msg: str) -> None:
    """A notice from rank 0 only: every rank resolves the same checkpoint, one says so."""
    if is_rank_zero():
        print(f"[moco_retrieval] {msg}", file=sys.stderr, flush=True)


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / CHECKPOINTS


def last_checkpoint(run_dir: str | os.PathLike) -> Path:
    """``<run_dir>/checkpoints/last.ckpt``: the latest state of the run, what ``ckpt_path=last`` resumes."""
    return checkpoints_dir(run_dir) / LAST


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
        note(f"removed {len(removed)} temporary file(s) of interrupted checkpoint writes in {folder} "
              f"({human_size(freed)})")
    return removed


def set_aside_unreadable(last: Path) -> None:
    """After a fallback to ``last.prev.ckpt``: move the unreadable ``last.ckpt`` to
    ``last.ckpt.unreadable`` (kept to look at), so that the next write does not make it the
    predecessor."""
    if last.is_file():
        os.replace(last, last.with_name(last.name + ".unreadable"))
        note(f"moved the unreadable {last.name} to {last.name}.unreadable")


def _first_readable(candidates: Iterable[Path]) -> Optional[str]:
    """The first candidate that reads as a checkpoint; a warning for each one that does not."""
    for i, c in enumerate(candidates):
        if not c.exists():
            continue
        try:
            read_checkpoint(c, "ckpt_path")
        except CheckpointError as e:
            note(f"warning: {e}")
            continue
        if i:
            note(f"warning: resuming from the previous checkpoint {c} instead")
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
    last = last_checkpoint(run_dir)
    prev = previous_of(last)
    found = _first_readable([last, prev])
    if found is None and (last.exists() or prev.exists()):
        raise CheckpointError(f"ckpt_path=last: neither {last} nor {prev} can be read (see above); move them "
                              "away to start from scratch, or give ckpt_path=FILE")
    if found is None:
        note(f"ckpt_path=last: no checkpoint in {last.parent}: {_what_is_there(Path(run_dir))}; "
              "training starts from step 0")
    return found


def _what_is_there(run_dir: Path) -> str:
    """For a resume that found no checkpoint: what the run directory does hold."""
    if not run_dir.is_dir():
        return f"{run_dir} does not exist (if this run should resume, check run_dir)"
    earlier = sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir()
                     if p.name in ("config.yaml", "csv", "wandb", "checkpoints", "plots"))
    if earlier:
        return (f"{run_dir} holds an earlier attempt ({', '.join(earlier)}) that stopped before writing its "
                "first checkpoint")
    return f"{run_dir} holds no earlier attempt (if this run should resume, check run_dir)"


__all__ = ["CHECKPOINTS", "checkpoints_dir", "last_checkpoint", "note", "remove_stale_temporaries", "resolve_ckpt_path",
           "set_aside_unreadable"]
