"""What the project writes for the user: checked before any work (an output folder: new, empty, or
an earlier output of the same command), written whole or not at all, with ordinary permissions;
checkpoint files too, read back checked.

:func:`check_output` refuses, before the command reads data or loads a model: a directory given as a
file; a file that is there already, unless ``overwrite``; and, even with ``overwrite``, a file that
is one of the command's inputs (the same path, a link to it or a hard link). :func:`claim_output_dir`
is the same rule for a folder (a training's run directory, an evaluation's or an export's out_dir):
missing or empty, or holding an earlier output of the same command that ``overwrite`` replaces; a
folder of anything else is never written into. :func:`atomic_write`
writes into a temporary file beside the target and renames it over the target only when the
writing ended without an error, so an interrupted command leaves the old file (or none), never a
half-written one. :func:`ordinary_mode`: 0666 / 0777 less the process's umask, as ``open`` and
``mkdir`` give (``mkstemp``/``mkdtemp`` create private 0600 / 0700 entries, which another user or a
serving container cannot read).

A checkpoint file (:func:`atomic_torch_save`, :func:`read_checkpoint`) is written the same way, with a
sha256 of its tensors (:func:`tensors_sha256`) checked when it is read, with the zip's CRC of each
entry (the pickled rest: learning rates, steps, options): bytes changed on disk or in a copy make it
unreadable instead of training on damaged weights or settings; ``keep_previous`` keeps the file it
replaces as ``<name>.prev.ckpt`` (a hard link made just before the rename). Every error names the
file (``CheckpointError``); a full disk says what is kept and how to resume.
"""
from __future__ import annotations

import errno
import json
import hashlib
import os
import shutil
import socket
import tempfile
import uuid
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch

from moco_retrieval.errors import CheckpointError, ConfigError, OutputExistsError

CHECKSUM = "tensor_sha256"  # a checkpoint's key holding tensor_checksum() of the rest
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def current_umask() -> int:
    """The process's umask (reading it means setting it: it is set back at once)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def ordinary_mode(is_dir: bool) -> int:
    """0777 (a folder) or 0666 (a file) less the umask."""
    return (0o777 if is_dir else 0o666) & ~current_umask()


def check_output(path: Path, key: str, overwrite: bool, inputs: Mapping[str, Iterable[Path]]) -> None:
    """Refuse writing ``path`` (given as ``key=...``) when it is a directory, there already (without
    ``overwrite``), or one of ``inputs`` (``{key: files it names}``, even with ``overwrite``)."""
    if path.is_dir():
        raise ConfigError(f"{key}={path}: a directory; expected the path of the file to write "
                          f"(e.g. {key}={path / 'mined.jsonl'})")
    if path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(f"{key}={path}: {path.parent} is a file, not a directory")
    for input_key, files in inputs.items():
        for f in files:
            if _same_file(path, f):
                where = "" if Path(f) == Path(path) else f" ({f})"
                raise OutputExistsError(
                    f"{key}={path} is {input_key}{where}, an input of this command: it never writes over its "
                    f"input, overwrite=true or not; give {key} another file")
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{key}={path} exists; overwrite=true replaces it (or give {key} another file)")


# Hydra's record of the command and a training's lock: made by the command itself, not content
NOT_CONTENT = (".hydra", ".lock")


def claim_output_dir(out: Path, key: str, overwrite: bool, earlier: Callable[[Path], Optional[list[str]]],
                     what: str, advice: str = "") -> list[str]:
    """The entries of the folder ``out`` (given as ``key=...``) that a command writing ``what`` must
    replace: none when it is missing or empty (:data:`NOT_CONTENT` aside). Refused, before any work
    (:class:`OutputExistsError` naming the key): a file; a folder with content, without ``overwrite``
    (``advice``: what else the user may mean); with ``overwrite``, a folder holding no earlier ``what``
    (``earlier(out)``: the entries one wrote there, None when there is none), so that nothing of the
    user's is ever deleted."""
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{key}={out}: a file; expected a folder for {what}")
    if not out.is_dir() or not any(p.name not in NOT_CONTENT for p in out.iterdir()):
        return []
    if not overwrite:
        raise OutputExistsError(f"{key}={out} exists and is not empty: {advice or ''}overwrite=true replaces an "
                                f"earlier {what} there; or choose another {key}")
    ours = earlier(out)
    if ours is None:
        raise OutputExistsError(
            f"{key}={out} holds files but no {what} of this project, so overwrite=true does not touch it (it "
            f"replaces only what an earlier {what} wrote). Choose another {key}, or empty this one")
    return [name for name in ours if (out / name).exists() or (out / name).is_symlink()]


def remove_entries(folder: Path, names: Iterable[str]) -> None:
    """Delete ``folder/name`` for each name (a folder with what it holds)."""
    for name in names:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and Path(b).exists():
        return os.path.samefile(a, b)
    return a.expanduser().resolve() == Path(b).expanduser().resolve()


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file's bytes, read a MB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def discard_dir(folder: Path) -> None:
    """Delete ``folder`` after moving it aside under a temporary name beside it (``.<name>.*``): a
    reader never finds half of it under its own name, and a kill leaves only the temporary one."""
    aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        os.rename(folder, aside / folder.name)
    except FileNotFoundError:  # another process discarded it first
        pass
    shutil.rmtree(aside, ignore_errors=True)


def json_object(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when it is missing, unreadable or not an object (a folder's
    optional metadata file, read to recognise what kind of folder it is)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def files_under(path: str | os.PathLike | None) -> list[Path]:
    """``path`` when it is a file; every file below it when it is a folder; nothing when unset or absent."""
    if not path:
        return []
    p = Path(path).expanduser()
    if p.is_dir():
        return [f for f in p.rglob("*") if f.is_file()]
    return [p] if p.exists() else []


@contextmanager
def atomic_write(path: Path) -> Iterator[Path]:
    """``with atomic_write(path) as tmp:`` write ``tmp``; on a clean exit it replaces ``path``
    (with the umask's permissions), on an error it is removed and ``path`` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, ordinary_mode(is_dir=False))  # (mkstemp's files are private)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# ---- lock holders: the process a lock file names (training/run_lock.py, data/cache_lock.py)


def process_start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holder_alive(holder: dict) -> bool:
    """Whether the holder a lock file records (``host``, ``pid``, ``start_time``) still runs (only
    decidable on its own host; a pid reused by another program is not the holder)."""
    if holder.get("host") != socket.gethostname():
        return True  # cannot tell from here: assume it runs
    pid = int(holder.get("pid") or 0)
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = holder.get("start_time")
    return started is None or process_start_time(pid) in (None, started)


# ---- checkpoint files: written atomically with a checksum of their tensors, read back checked

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


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` is, or was caused by, a full disk or quota (torch.save reports one as a RuntimeError
    chained to the OSError(ENOSPC))."""
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
        if isinstance(e, Exception) and out_of_space(e):
            free = shutil.disk_usage(path.parent).free
            kept = _kept_checkpoints(path.parent, path)
            raise CheckpointError(
                f"{path}: cannot write the checkpoint: no space left on the device holding {path.parent} "
                f"({human_size(free)} free); {kept}. Free some space (or point run_dir elsewhere) and resume with "
                "ckpt_path=last"
            ) from None
        raise


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
    if verify:  # the zip's own CRCs cover what the tensor checksum does not: the pickled rest (lr, steps, options)
        try:
            bad = zipfile.ZipFile(p).testzip() if zipfile.is_zipfile(p) else None
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            bad = f"({type(e).__name__})"
        if bad is not None:
            raise CheckpointError(f"{what}={path}: damaged: {bad} does not match the CRC the zip holds for it "
                                  f"({p.stat().st_size:,} bytes; changed on disk or in a copy)")
    return ckpt


def checkpoint_step(ckpt: dict) -> int:
    return int(ckpt.get("global_step", 0))


__all__ = ['current_umask', 'ordinary_mode', 'check_output', 'NOT_CONTENT', 'claim_output_dir', 'remove_entries',
           'sha256_file', 'discard_dir', 'json_object', 'files_under', 'atomic_write', 'CHECKSUM', 'named_tensors',
           'tensors_sha256', 'tensor_checksum', 'previous_of', 'human_size', 'out_of_space', 'atomic_torch_save', 'read_checkpoint',
           'checkpoint_step']
