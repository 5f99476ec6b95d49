"""One training job per run directory: ``<run_dir>/.lock``, held by rank 0 for the job's life.

The lock is an ``flock`` on that file (the kernel, or NFS's lock manager, drops it when the holder
dies, however it dies) and the file says who holds it (host, pid, job id, start time). A second
job on the same run directory stops with :class:`RunDirLocked` naming the holder, before it reads
data or builds a model. What is recognised:

* a lock left by a process that is gone: the ``flock`` is free, the lock is taken over (noted);
* where ``flock`` is not supported (some network filesystems): the holder is gone when it ran on
  this host and its pid no longer runs (or runs another program, same pid reused);
* an attempt of the same cluster job (``launcher.job_id``: a SLURM requeue keeps the job id)
  takes the lock over from a holder on another node, which it cannot see die: the scheduler has
  ended the previous attempt (a holder of the same job alive on this host still refuses it).

:func:`writable_run_dir` comes first: a read-only run directory (a new run or a resume) is one
message (:class:`RunDirNotWritable`), not a traceback from the lock file's creation. Then
:func:`claim_run_dir`: a training that does not continue the run directory's own run starts only in
a missing or empty folder, or replaces an earlier run there with ``overwrite=true`` (files.py's rule
for every output folder): a forgotten ``ckpt_path=last`` never destroys a run, and a folder of the
user's files is never written into.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from moco_retrieval.errors import UserError
from moco_retrieval.files import claim_output_dir, holder_alive, process_start_time, remove_entries
from moco_retrieval.training.cluster import job_id

LOCK_NAME = ".lock"
# what a training writes into its run directory: an earlier run's, replaced by overwrite=true
RUN_ENTRIES = ["checkpoints", "csv", "wandb", "plots", "metrics.csv", "metrics.json", "config.yaml"]


class RunDirLocked(UserError):
    """Another live job holds the run directory."""


class RunDirNotWritable(UserError):
    """The run directory cannot be created or written (read-only, no permission)."""


def writable_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` and check that files can be made in it, before anything else happens."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test.{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise RunDirNotWritable(
            f"run_dir={run_dir}: cannot write there ({os.strerror(e.errno).lower()}); a training writes "
            "its checkpoints, logs and config.yaml into its run directory: give a writable run_dir (to resume a run "
            "from a read-only copy, copy it somewhere writable first)") from None


def claim_run_dir(run_dir: Path, continues: bool, overwrite: bool) -> list[str]:
    """Before a training writes into ``run_dir``: unless it ``continues`` the run there (``ckpt_path=last``,
    or a checkpoint of that run), the folder must be missing or empty, or (``overwrite``) hold an
    earlier run, whose entries are removed; returns them (files.claim_output_dir refuses the rest)."""
    if continues:
        return []

    def earlier_run(folder: Path):
        return RUN_ENTRIES if (folder / "checkpoints").is_dir() or (folder / "csv").is_dir() else None

    replaced = claim_output_dir(run_dir, "run_dir", overwrite, earlier_run, "training run",
                                advice="ckpt_path=last resumes the run there, ")
    if replaced:
        remove_entries(run_dir, replaced)
        print(f"[moco_retrieval] overwrite=true: removed the earlier run's {', '.join(replaced)} from {run_dir}",
              file=sys.stderr, flush=True)
    return replaced


def _describe(holder: dict) -> str:
    job = f", job {holder['job_id']}" if holder.get("job_id") else ""
    since = f", since {holder['started']}" if holder.get("started") else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{job}{since}"


def _note(msg: str) -> None:
    print(f"[moco_retrieval] {msg}", file=sys.stderr, flush=True)


class RunLock:
    """``with RunLock(run_dir): ...`` (or :meth:`acquire` / :meth:`release`)."""

    def __init__(self, run_dir: str | os.PathLike, env: Optional[dict] = None):
        self.path = Path(run_dir) / LOCK_NAME
        self.env = env
        self._fd: Optional[int] = None

    def _me(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "job_id": job_id(self.env), "start_time": process_start_time(pid),
                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def _read(self, fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            return json.loads(os.read(fd, 65536).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def _refuse_unless_same_job(self, holder: dict, me: dict) -> None:
        seen_alive = holder.get("host") == me["host"] and holder_alive(holder)  # (two launches within one job)
        if me["job_id"] and holder.get("job_id") == me["job_id"] and not seen_alive:
            _note(f"{self.path}: taking the lock over from an earlier attempt of job {me['job_id']} "
                  f"({_describe(holder)})")
            return
        raise RunDirLocked(
            f"run_dir={self.path.parent} is in use by another training ({_describe(holder)}; lock file {self.path}). "
            "Two trainings in one run directory would overwrite each other's checkpoints and logs: give this one "
            f"another run_dir, or stop that one. If it is certainly not running any more, delete {self.path}."
        )

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = self._me()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flock_ok = True
            except BlockingIOError:
                flock_ok = False
            except OSError as e:  # ENOLCK / EOPNOTSUPP: a filesystem without flock; the file alone decides
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    os.close(fd)
                    raise
                flock_ok = None
            holder = self._read(fd)
            if flock_ok is False or (flock_ok is None and holder and holder_alive(holder)):
                os.close(fd)
                self._refuse_unless_same_job(holder, me)
                fd = os.open(self.path, os.O_RDWR)  # same job: proceed without the flock it still holds
            elif self._replaced(fd):  # a releasing holder unlinked the file after we opened it: retry
                os.close(fd)
                continue
            elif holder.get("pid"):
                _note(f"{self.path}: taking over the lock of a training that is gone ({_describe(holder)})")
            break
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def _replaced(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino != os.stat(self.path).st_ino
        except FileNotFoundError:
            return True

    def release(self) -> None:
        """Remove the lock file (a clean end leaves nothing to take over) and drop the flock."""
        if self._fd is None:
            return
        try:
            if not self._replaced(self._fd) and self._read(self._fd).get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["RunLock", "RunDirLocked", "RunDirNotWritable", "LOCK_NAME", "writable_run_dir"]
