"""The run's checkpoints: how one is written and read, which one a resume starts from, and what else
a run keeps about them.

* One file (``atomic_torch_save``, ``AtomicCheckpointIO``, ``read_checkpoint``): written atomically
  (a temporary file in the same folder, then a rename), so a kill at any moment leaves the old
  checkpoint or the new one, never half of one. Every checkpoint carries a sha256 of its tensors
  (``tensors_sha256``), checked when it is read: bytes changed on disk or in a copy make it
  unreadable instead of training on damaged weights. ``last.ckpt`` also keeps its predecessor,
  ``last.prev.ckpt`` (a hard link to the old file, made just before the rename). Every error names
  the file (``CheckpointError``); a full disk says what is kept and how to resume.
* The folder (``checkpoints_dir``, ``resolve_ckpt_path``): ``ckpt_path=last`` is ``last.ckpt``, else
  its predecessor; what killed writes left behind (``.last.ckpt.<uuid>.tmp``) is removed at the
  next start.
* The best-by-validation files (``best-STEP.ckpt``) across a resume: those written after the
  checkpoint a run resumes from are removed (the resumed run redoes those steps), and a run
  directory that was moved or copied keeps its best-checkpoint tracking.
* ``ckpt_path=last`` without ``run_dir`` (``latest_run``): a run started without ``run_dir`` gets a
  new Hydra folder per start (``outputs/DATE/TIME``), so "resume" means the newest run of the same
  experiment there: a folder two levels under the outputs folder holding a checkpoint, its
  experiment the one Hydra recorded in ``.hydra/hydra.yaml``, the newest by its checkpoint's time.
* Each rank's fingerprint (``rank_fingerprints``) of the state DDP does not sync (the objective's
  ``unsynced_state()``: queues, logQ; and the key encoder): every checkpoint records one per rank
  (preemption.py writes it), so ranks that drifted apart show it.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import OmegaConf
from torch import nn

from moco_retrieval.errors import CheckpointError, ConfigError
from moco_retrieval.files import (CHECKSUM, atomic_torch_save, checkpoint_step, human_size, previous_of, read_checkpoint,
                                  tensors_sha256)
from moco_retrieval.model.lora import base_fingerprint
from moco_retrieval.training.cluster import is_rank_zero


LAST = "last.ckpt"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes through :func:`atomic_torch_save`; ``last.ckpt`` keeps
    its predecessor."""

    def save_checkpoint(self, checkpoint: dict, path: str | os.PathLike, storage_options: Optional[Any] = None) -> None:
        atomic_torch_save(checkpoint, path, keep_previous=Path(path).name == LAST)


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


NO_EXPERIMENT = "(none)"


def experiment_of(run_dir: Path) -> Optional[str]:
    """The ``+experiment=NAME`` a Hydra run folder was started with (None: none, or not a Hydra folder)."""
    record = Path(run_dir) / ".hydra" / "hydra.yaml"
    if not record.is_file():
        return None
    try:
        choices = OmegaConf.select(OmegaConf.load(record), "hydra.runtime.choices", default=None) or {}
    except Exception:  # noqa: BLE001 - a damaged record: not a run we can match
        return None
    return choices.get("experiment")


def _checkpoint_time(run_dir: Path) -> Optional[float]:
    last = last_checkpoint(run_dir)
    times = [p.stat().st_mtime for p in (last, previous_of(last)) if p.is_file()]
    return max(times) if times else None


def latest_run(outputs: Path, experiment: Optional[str], exclude: Optional[Path] = None) -> Path:
    """The run folder under ``outputs`` (``outputs/*/*``) of ``experiment`` whose checkpoint was
    written last; a ConfigError saying where it looked when there is none."""
    outputs = Path(outputs)
    found = []
    for folder in outputs.glob("*/*") if outputs.is_dir() else []:
        if exclude is not None and folder.resolve() == Path(exclude).resolve():
            continue
        when = _checkpoint_time(folder)
        if when is not None and experiment_of(folder) == experiment:
            found.append((when, str(folder), folder))
    if not found:
        raise ConfigError(
            f"ckpt_path=last without run_dir: no run of experiment {experiment or NO_EXPERIMENT} under "
            f"{outputs.resolve()}/*/* holds checkpoints/{LAST}; give run_dir=DIR (the run directory to resume, "
            "printed at its start) or leave ckpt_path unset to start a new run")
    return max(found)[2]


def rank_fingerprints(pl_module: L.LightningModule) -> dict[str, str]:
    """sha256 of this rank's objective state (``objective.unsynced_state()``: queues, guide queues,
    refresh buffers, logQ estimates, ...) and key-encoder weights: the state DDP does not sync."""
    out = {}
    objective = getattr(pl_module, "objective", None)
    state = objective.unsynced_state() if objective is not None else {}
    if state:
        out["objective"] = tensors_sha256(sorted(state.items()))
    key_encoder = getattr(pl_module, "key_encoder", None)
    if key_encoder is not None:
        out["key_encoder"] = key_encoder_fingerprint(key_encoder, getattr(pl_module, "encoder", None))
    return out


def key_encoder_fingerprint(key_encoder: nn.Module, encoder: nn.Module | None) -> str:
    """sha256 of the tensors the key encoder owns (its EMA parameters: with LoRA, the adapters and
    the head; its buffers), and of :func:`base_fingerprint` for a LoRA base it shares with
    ``encoder``: hashing a 7B base's bytes at every checkpoint would take minutes and find nothing,
    since the trained encoder (synced by DDP) holds the same tensors and they never change."""
    named = sorted(_owned_tensors(key_encoder, encoder))
    base = base_fingerprint(key_encoder)
    if base is not None:
        named.append(("lora_base", torch.tensor(list(base.encode()), dtype=torch.uint8)))
    return tensors_sha256(named)


def _owned_tensors(key_encoder: nn.Module, encoder: nn.Module | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``key_encoder``'s parameters and buffers, less the parameters it shares with ``encoder``
    (``copy_sharing_frozen``: the frozen weights)."""
    shared = {id(p) for p in encoder.parameters()} if encoder is not None else set()
    for name, p in key_encoder.named_parameters():
        if id(p) not in shared:
            yield f"p/{name}", p.detach()
    for name, b in key_encoder.named_buffers():
        yield f"b/{name}", b


__all__ = ['named_tensors', 'tensors_sha256', 'AtomicCheckpointIO', 'CHECKSUM', 'LAST', 'atomic_torch_save', 'checkpoint_step', 'human_size', 'previous_of', 'read_checkpoint', 'tensor_checksum', 'CHECKPOINTS', 'checkpoints_dir', 'last_checkpoint', 'note', 'remove_stale_temporaries', 'resolve_ckpt_path', 'set_aside_unreadable', 'RebaseCheckpointPaths', 'remove_best_after', 'experiment_of', 'latest_run', 'key_encoder_fingerprint', 'rank_fingerprints']
