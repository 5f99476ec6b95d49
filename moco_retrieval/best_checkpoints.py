"""The best-by-validation checkpoints (``best-STEP.ckpt``) across a resume: those written after the
checkpoint a run resumes from are removed (the resumed run redoes those steps and writes them
again), and a run directory that was moved or copied keeps its best-checkpoint tracking."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from moco_retrieval.checkpointing import note

_BEST = re.compile(r"best-(\d+)(?:-v\d+)?\.ckpt")


def remove_best_after(folder: Path, step: int) -> list[Path]:
    """Delete ``best-STEP.ckpt`` files of steps after ``step``, the step a run resumes from: a
    kill between such a write and the next ``last.ckpt`` leaves them untracked by the checkpoint,
    so they would outlive ``trainer.keep_best_checkpoints`` (and the resumed run, which redoes
    those steps, would write ``best-STEP-v1.ckpt`` beside them). Call it while no write can be
    under way (rank 0, the run directory locked, before training)."""
    removed = []
    for p in sorted(folder.glob("best-*.ckpt")) if folder.is_dir() else []:
        m = _BEST.fullmatch(p.name)
        if m and int(m.group(1)) > step:
            p.unlink(missing_ok=True)
            removed.append(p)
    if removed:
        note(f"removed {', '.join(p.name for p in removed)} from {folder}: written after the checkpoint of "
              f"step {step} this run resumes from, which redoes those steps")
    return removed


class RebaseCheckpointPaths(Callback):
    """A run directory moved or copied elsewhere keeps its best-checkpoint tracking on resume.

    ``ModelCheckpoint`` stores absolute paths and its folder, and drops its best score and top-k
    files when the folder differs (Lightning: "The dirpath has changed ..."), so a resumed copy
    would forget its best score and leave the old best file beyond ``keep_best_checkpoints``.
    Before the callbacks' states are loaded, this rewrites every saved checkpoint folder and the
    paths in it to ``dirpath``, the run's checkpoint folder now (paths kept relative to it)."""

    def __init__(self, dirpath: str | os.PathLike):
        self.dirpath = os.path.realpath(dirpath)

    def _rebase(self, state: dict, old: str) -> None:
        def moved(p: Any) -> Any:
            if not isinstance(p, str) or not p or os.path.dirname(p) != old:
                return p
            return os.path.join(self.dirpath, os.path.basename(p))

        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            if key in state:
                state[key] = moved(state[key])
        if isinstance(state.get("best_k_models"), dict):  # (every rank keeps the same entries: same decisions)
            state["best_k_models"] = {moved(p): v for p, v in state["best_k_models"].items()}
        state["dirpath"] = self.dirpath

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        for state in (checkpoint.get("callbacks") or {}).values():
            old = state.get("dirpath") if isinstance(state, dict) else None
            if isinstance(old, str) and old != self.dirpath and os.path.realpath(old) != self.dirpath:
                self._rebase(state, old)


__all__ = ["RebaseCheckpointPaths", "remove_best_after"]
