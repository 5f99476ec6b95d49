"""The lock of one conversion into a cache that processes, nodes and jobs share (convert.py).

A folder ``<root>/<key>.lock`` made by ``mkdir``, which is atomic on every filesystem, NFS included
(``flock`` may be missing there, or hold only within one node). It holds ``owner.json``: who converts
(host, pid, the process's start time, since when) and a heartbeat, a count the holder rewrites every
``HEARTBEAT_S`` seconds. A process that finds the lock says who holds it, waits and watches for the
store to appear (``ready``). It takes the lock over from a holder that is gone: one on this host whose
process no longer runs, or one whose ``owner.json`` has not changed for ``STALE_S`` seconds as the
waiter's own clock counts them (no clocks are compared across hosts; NFS serves a file's new content
on each open). The lock only saves work: the store is published by an atomic rename, so even two
conversions of the same content (a holder that was slow, not gone) leave one whole store.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from moco_retrieval.files import atomic_write, holder_alive, process_start_time
from moco_retrieval.progress import log_line

HEARTBEAT_S = 10.0  # how often the holder rewrites owner.json
STALE_S = 120.0  # owner.json unchanged this long: its holder is gone (NFS caches attributes up to 60 s)
POLL_S = 1.0  # how often a waiter looks at the lock and the store
OWNER = "owner.json"


def _me() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_time": process_start_time(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": uuid.uuid4().hex}


def _read(lock: Path) -> str:
    try:
        return (lock / OWNER).read_text()
    except OSError:  # not written yet, or being replaced
        return ""


def _holder(text: str) -> dict:
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def describe(holder: dict) -> str:
    if not holder:
        return "another process (it has not said who yet)"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('started', '?')})"


def held(lock: Path) -> bool:
    """Whether ``lock`` is there and not known to be gone (a holder on another host counts as live)."""
    if not lock.is_dir():
        return False
    holder = _holder(_read(lock))
    return not holder or holder_alive(holder)


def _write(lock: Path, me: dict, beat: int) -> None:
    with atomic_write(lock / OWNER) as tmp:
        tmp.write_text(json.dumps({**me, "beat": beat}))


def _take_over(lock: Path, seen: str) -> bool:
    """Move a gone holder's lock aside (one rename: of two waiters, one wins); False when what was
    moved is not what was judged gone (a new holder's: put back)."""
    aside = lock.with_name(f"{lock.name}.gone.{uuid.uuid4().hex[:8]}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return True  # released or taken over meanwhile: try again
    if _read(aside) != seen:
        try:
            os.rename(aside, lock)
        except OSError:
            pass
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def _acquire(lock: Path, what: str, ready: Callable[[], bool]) -> Optional[dict]:
    """Take ``lock`` (its owner record), or None once ``ready()`` while waiting."""
    me, seen, since, said = _me(), None, time.monotonic(), False
    while True:
        try:
            lock.mkdir()
        except FileExistsError:
            if not lock.is_dir():  # an earlier version's flock file: nobody waits on it any more
                lock.unlink(missing_ok=True)
                continue
        else:
            try:
                _write(lock, me, 0)
            except BaseException:
                shutil.rmtree(lock, ignore_errors=True)
                raise
            return me
        if ready():
            return None
        text = _read(lock)
        if text != seen:
            seen, since = text, time.monotonic()
        holder = _holder(text)
        mine = bool(holder) and holder.get("host") == me["host"]
        if (mine and not holder_alive(holder)) or time.monotonic() - since >= STALE_S:
            why = "its process is gone" if mine and not holder_alive(holder) else \
                f"its heartbeat stopped {STALE_S:.0f}s ago"
            if _take_over(lock, text):
                log_line(f"taking over the lock of {what} from {describe(holder)}: {why}", file=sys.stderr)
            continue
        if not said:
            log_line(f"waiting for {describe(holder)}, converting {what} (lock {lock}; a holder that stops is "
                     f"taken over after {STALE_S:.0f}s without a heartbeat)", file=sys.stderr)
            said = True
        time.sleep(POLL_S)


def _heartbeat(lock: Path, me: dict, stop: threading.Event) -> None:
    beat = 0
    while not stop.wait(HEARTBEAT_S):
        beat += 1
        try:
            if _holder(_read(lock)).get("token") != me["token"]:
                raise FileNotFoundError(lock)
            _write(lock, me, beat)
        except OSError:
            log_line(f"lost the lock {lock} (taken over as gone): another process may convert the same "
                     "store; the first finished is kept", file=sys.stderr)
            return


@contextmanager
def cache_lock(lock: Path, what: str, ready: Callable[[], bool]) -> Iterator[bool]:
    """Hold ``lock`` while converting ``what`` (True), or go on without it (False) once ``ready()``
    says another process's result is there."""
    me = _acquire(lock, what, ready)
    if me is None:
        yield False
        return
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(lock, me, stop), daemon=True, name="cache-lock-heartbeat")
    beat.start()
    try:
        yield True
    finally:
        stop.set()
        beat.join()
        if _holder(_read(lock)).get("token") == me["token"]:
            shutil.rmtree(lock, ignore_errors=True)


__all__ = ["HEARTBEAT_S", "STALE_S", "POLL_S", "cache_lock", "held", "describe"]
