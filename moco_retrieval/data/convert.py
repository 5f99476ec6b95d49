"""Converting training pairs once into a store (:mod:`.store`), keyed by the input's content.

:func:`ensure_store` is the one entry point: it returns the store folder of a :class:`PairSpec`,
converting the input first when no store of that content exists. The key is the sha256 of the
input files' bytes plus how they are read (kind, columns, split, store version): a changed file is
converted again, an unchanged one never. A file's content hash is remembered by its
``(path, size, mtime, ctime, inode)`` so that a warm start does not read gigabytes again (the change
time because users cannot set it: ``touch -r``, ``cp -p``, ``rsync -t`` and tar restore the mtime
of a file rewritten at the same size).

Rows are streamed through the readers of today's formats (formats.iter_pairs_jsonl_located,
tabular, hf_folder), so a bad row stops the conversion with the same ``FILE:LINE: ...`` message,
before any model loads; ``spec.workers`` processes convert parts of the input side by side
(parallel.py). Conversion writes into a temporary folder renamed into place at the end (atomic: a
killed conversion leaves no half store), under a lock that holds across nodes on a shared
filesystem (cache_lock.py): the first process of the job (of any job sharing the cache) converts,
the others wait and open what it wrote (the lock needs no process group, so it also holds before
one exists, and for `python -m moco_retrieval.data prepare` run beside a job).

A store found is opened only when store.check_folder finds it whole (``verify``: every byte); one
that is not is converted again, with one line saying why (its inputs are at hand: they made its
key). A temporary folder is live only while its key's lock is held, so the ones a killed conversion
left are removed on the next start. The cache's own failures (not writable, a full disk) are one
message (DataError) naming the cache and what to do.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from moco_retrieval.errors import UserError
from moco_retrieval.files import atomic_write, discard_dir, human_size, ordinary_mode, out_of_space, sha256_file
from moco_retrieval.progress import log_line, progress_bar

from moco_retrieval.data.cache_lock import cache_lock, held
from moco_retrieval.data.formats import DataError, Pair
from moco_retrieval.data.parallel import Split, split_input, write_parts
from moco_retrieval.data.store import MANIFEST, STORE_VERSION, TABLE, check_folder, seal
from moco_retrieval.data.writer import write_rows


@dataclass
class PairSpec:
    """One input to convert: ``rows()`` yields ``(file index, line or row, Pair)``; ``files`` are
    the location names of the file indices (for messages), ``location`` formats one row's
    (``{file}``, ``{line}``); ``inputs`` are the files whose bytes key the store, ``options`` how they
    are read; ``count()`` estimates the rows (for the progress ETA); ``split(n)`` cuts the input into at
    most ``n`` parts (parallel.py; None: not cut), which ``workers`` processes convert side by side."""

    name: str
    inputs: list[Path]
    options: dict
    files: list[str]
    location: str
    rows: Callable[[], Iterator[tuple[int, int, Pair]]]
    count: Callable[[], int] = field(default=lambda: 0)
    split: Optional[Callable[[int], Split]] = None
    workers: int = 1


# --------------------------------------------------------------------------------- fingerprints


def file_hash(path: Path, memo_dir: Path) -> str:
    """sha256 of ``path``'s bytes, remembered under its (real path, size, mtime, ctime, inode). The
    memo only saves reading: one that cannot be read (another user's) or written (a read-only cache)
    is done without."""
    st = path.stat()
    stamp = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
    memo = memo_dir / hashlib.sha256(stamp.encode()).hexdigest()
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = sha256_file(path)
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        with atomic_write(memo) as tmp:
            tmp.write_text(digest)
    except OSError:
        pass
    return digest


def store_key(spec: Any, memo_dir: Path) -> str:
    """The store's name: what is read (content hashes) and how (options, store version)."""
    what = {"version": STORE_VERSION, "options": spec.options, "inputs": [file_hash(p, memo_dir) for p in spec.inputs]}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


# -------------------------------------------------------------------------------------- writing


def write_store(spec: PairSpec, folder: Path) -> dict:
    """Stream ``spec``'s rows into ``folder`` (Arrow table + numpy arrays); the manifest to seal. With
    ``spec.workers`` > 1, its parts side by side (parallel.py): the same files."""
    t0 = time.monotonic()
    split = split_input(spec, spec.workers)
    bar = progress_bar(spec.count() if split is None else sum(p.count for p in split.parts),
                       f"converting {spec.name}" + (f" ({len(split.parts)} processes)" if split else ""), " rows")
    if split is None:
        arrays = write_rows(spec.rows(), folder / TABLE, lambda chunk: bar.update(len(chunk)))
    else:
        arrays = write_parts(split, folder / TABLE, bar)
    bar.close()
    n = len(arrays["doc_id"])
    if n == 0:
        if split is not None:  # no part has a row: the whole input read as one process reads it says why (an empty file)
            for _ in spec.rows():
                break
        raise DataError(f"{spec.name}: no training pairs")
    for k, v in arrays.items():
        np.save(folder / f"{k}.npy", v)
    np.save(folder / "offsets.npy", np.array([0, n], dtype=np.int64))
    seconds = time.monotonic() - t0
    return {"version": STORE_VERSION, "rows": n, "name": spec.name, "files": spec.files, "location": spec.location,
            "options": spec.options, "converted_s": round(seconds, 3), "rows_per_s": round(n / max(seconds, 1e-9))}


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished store into place; another process's identical store already there wins."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / MANIFEST).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())


def _remove_interrupted(root: Path) -> None:
    """Remove the temporary folders (``.<key>.*``) of conversions killed before they finished: one
    whose key's lock is not held (cache_lock.held: its holder on another host counts as live)."""
    for tmp in root.glob(".*.*"):
        key = tmp.name[1:].split(".", 1)[0]
        if len(key) != 32 or not tmp.is_dir() or held(root / f"{key}.lock"):
            continue
        try:
            size = folder_bytes(tmp) + sum(folder_bytes(d) for d in tmp.iterdir() if d.is_dir())
            shutil.rmtree(tmp)
        except OSError:  # gone meanwhile (published), or not ours to remove
            continue
        log_line(f"removed {tmp}, the temporary folder of an interrupted conversion ({size / 1e6:,.1f} MB)", file=sys.stderr)


def _stamp(path: Path) -> Optional[tuple[int, int]]:
    """Which file ``path`` is (inode, change time), None when absent: a store published anew is another file."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def cache_error(e: OSError, what: str, root: Path, problem: Optional[str] = None) -> Exception:
    """The one message for a cache ``root`` that cannot take what is written into it (``what``: e.g.
    ``convert FILE``) because it is full or not writable (``problem``: why the one there is
    replaced); else ``e`` itself (a bug, or an error of another kind)."""
    fix = "give the cache another folder (data.cache_dir=DIR or $MOCO_RETRIEVAL_CACHE=DIR)"
    again = f" again (the one there cannot be trusted: {problem})" if problem else ""
    if out_of_space(e):
        try:
            free = f" ({human_size(shutil.disk_usage(root).free)} free)"
        except OSError:
            free = ""
        return DataError(f"cannot {what} into {root}{again}: no space left on the device{free}; "
                         f"what was partly written was removed. Free some space, or {fix}")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        if e.filename and not Path(os.path.abspath(e.filename)).is_relative_to(os.path.abspath(root)):
            return DataError(f"{e.filename}: cannot read it ({e.strerror})")
        return DataError(f"cannot {what} into {root}{again}: the cache is not writable "
                         f"({e.strerror}: {e.filename or root}); {fix}, or ask its owner to make it writable")
    return e


def ensure_store(spec: Any, root: Path, write: Optional[Callable[[Any, Path], dict]] = None, verify: bool = False) -> Path:
    """The store of ``spec`` under ``root`` (``root/<key>``), converted first by ``write`` (default :func:`write_store`) when absent
    or not whole (store.check_folder; ``verify``: every file's sha256) (once: the first process
    converts under a lock, the others wait and open its result). ``spec``:
    a :class:`PairSpec`, or any spec with its ``name``, ``inputs`` and ``options`` that ``write``
    turns into a folder and a manifest (``rows``, ``converted_s``, ``rows_per_s``): corpus_store.py."""
    root, problem = Path(root), None
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_interrupted(root)
        final = root / store_key(spec, root / "fingerprints")
        if final.exists() and (problem := check_folder(final, full=verify)) is None:
            return final
        before = _stamp(final / MANIFEST)
        while True:
            # (ready: a store published while waiting, not the one already judged above)
            with cache_lock(root / f"{final.name}.lock", f"{spec.name} into {final}",
                            lambda: _stamp(final / MANIFEST) not in (None, before)) as held_here:
                # (another process may have converted it while this one waited)
                if final.exists() and (problem := check_folder(final, full=verify)) is None:
                    return final
                if not held_here:  # what appeared is not whole: wait for the lock itself
                    before = _stamp(final / MANIFEST)
                    continue
                if final.exists():
                    discard_dir(final)
                    log_line(f"{final}: the store of {spec.name} cannot be trusted: {problem}; converting it again",
                             file=sys.stderr)
                tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
                os.chmod(tmp, ordinary_mode(is_dir=True))  # mkdtemp's 0700 would keep the store from the node's other users
                try:
                    m = seal(tmp, (write or write_store)(spec, tmp))
                    _publish(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                break
    except OSError as e:
        if isinstance(e, UserError):
            raise
        raise cache_error(e, f"convert {spec.name}", root, problem) from None
    log_line(f"converted {spec.name}: {m['rows']:,} rows in {m['converted_s']:.1f}s ({m['rows_per_s']:,} rows/s), "
             f"{folder_bytes(final) / 1e6:,.1f} MB in {final}", file=sys.stderr)
    return final


__all__ = ["PairSpec", "file_hash", "store_key", "write_store", "folder_bytes",
           "cache_error", "ensure_store"]
