"""One sha256 over named tensors (place, dtype, shape and bytes, in order): the checksum a
checkpoint carries (checkpoint_file.py) and the per-rank fingerprints of unsynced state
(fingerprints.py).

One checkpoint file: written atomically (a temporary file in the same folder, then a rename), so a
kill at any moment leaves either the old checkpoint or the new one, never half of one, and read
back checked.

``last.ckpt`` also keeps its predecessor, ``last.prev.ckpt`` (a hard link to the old file, made
just before the rename), so that ``ckpt_path=last`` can fall back to it when the newest cannot be
read (checkpointing.py). Every checkpoint written here carries a sha256 of its tensors
(``tensor_sha256``), checked when it is read: bytes changed on disk or in a copy make it unreadable
instead of training on damaged weights. Every error names the file
(:class:`~moco_retrieval.errors.CheckpointError`); a full disk says what is kept and how to resume.

The run directory's checkpoints folder: where it is, which checkpoint a resume starts from
(``ckpt_path=last``: ``last.ckpt``, else its predecessor ``last.prev.ckpt``), and what killed writes
left behind (``.last.ckpt.<uuid>.tmp``, removed at the next start). Writing and reading one file:
checkpoint_file.py; the best-by-validation files across a resume: best_checkpoints.py.

The best-by-validation checkpoints (``best-STEP.ckpt``) across a resume: those written after the
checkpoint a run resumes from are removed (the resumed run redoes those steps and writes them
again), and a run directory that was moved or copied keeps its best-checkpoint tracking.

``ckpt_path=last`` without ``run_dir``: the newest run of the same experiment in Hydra's outputs folder.

A run started without ``run_dir`` gets a new Hydra folder at each start (``outputs/DATE/TIME``),
so "resume" has to mean "the run I started last". A run is a folder two
levels under the outputs folder holding ``checkpoints/last.ckpt`` (or its ``last.prev.ckpt``);
its experiment is the ``experiment`` choice Hydra recorded in its ``.hydra/hydra.yaml``. The newest
is the one whose checkpoint was written last.

Each rank's fingerprint of the state DDP does not sync (the objective's queues and all else it
declares in ``unsynced_state()``, and the key encoder): every checkpoint records one per rank
(``checkpoint["rank_fingerprints"]``, preemption.py), so that ranks that drifted apart show it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import OmegaConf
from torch import nn

from moco_retrieval.errors import CheckpointError, ConfigError
from moco_retrieval.model.lora import base_fingerprint
from moco_retrieval.training.cluster import is_rank_zero


def named_tensors(obj: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts, lists and tuples, with its place (``/key/0/...``), in order."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from named_tensors(v, f"{where}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from named_tensors(v, f"{where}/{i}")


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 (hex) over ``(name, tensor)`` pairs: each name, dtype, shape and the tensor's bytes."""
    h = hashlib.sha256()
    for where, t in named:
        h.update(f"{where}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


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
