"""The run cache and the result writer.

A run cache is a JSONL file, one finished run per line, each with a ``key``: a run whose key is
there is skipped (the file is read again before each run, so parallel processes share the work),
a run is claimed before it starts (a file in ``<cache>.claims/``, created atomically and removed
when the run ends; a claim whose process is gone is taken over), so two processes given the same
runs do not both train one, a finished one is appended as one whole line, and a run not started
by ``--deadline`` is cut (listed in the report), and a run of a retired option that is not cached
is refused before anything loads (``run_selected``'s ``retired``). ``write_results`` writes a
benchmark's ``<name>.md`` and ``<name>.json``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from benchmarks.harness import cli


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL results cache (none while it does not exist)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def append_jsonl(path: Path, rec: dict) -> None:
    """Appends one record: parallel benchmark processes share a cache file, one whole line each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec, default=json_default) + "\n")


def past_deadline(deadline: Optional[str]) -> bool:
    """Whether the UTC clock has reached ``deadline`` ("HH:MM"; None: never)."""
    return bool(deadline) and time.strftime("%H:%M", time.gmtime()) >= deadline


class RunCache:
    """A run cache file and its records by key; the first record of a key wins (a finished run is
    never redone, so a later line of the same key is a parallel process's duplicate)."""

    def __init__(self, path: Path, fresh: bool = False, key_field: str = "key"):
        if fresh and path.is_file():  # start a new cache; keep the old one aside
            path.replace(path.with_suffix(path.suffix + ".old"))
        self.path, self.key_field = path, key_field
        self.done: dict[str, dict] = {}
        self.reload()

    def reload(self) -> None:
        for rec in read_jsonl(self.path):
            self.done.setdefault(rec[self.key_field], rec)

    def get(self, key: str) -> Optional[dict]:
        """The record of ``key``, reading the file again when it is not known yet (a parallel
        process may have finished it meanwhile)."""
        if key not in self.done:
            self.reload()
        return self.done.get(key)

    def add(self, rec: dict) -> dict:
        self.done.setdefault(rec[self.key_field], rec)
        append_jsonl(self.path, rec)
        return rec


    @contextlib.contextmanager
    def claimed(self, key: str):
        """Yields whether this process holds ``key``'s claim (False: another live process runs it,
        or it finished meanwhile); the claim is released on exit."""
        folder = self.path.with_name(self.path.name + ".claims")
        folder.mkdir(parents=True, exist_ok=True)
        claim = folder / (hashlib.sha1(key.encode()).hexdigest()[:20] + ".json")
        took = _take(claim, key)
        try:
            yield took and self.get(key) is None
        finally:
            if took:
                claim.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only when no other claim is left in it


def _take(claim: Path, key: str) -> bool:
    """Creates ``claim`` (atomically); a claim left by a process of this machine that is gone is
    replaced."""
    for _ in range(2):
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if not _stale(claim):
                return False
            claim.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "pid": os.getpid(), "host": socket.gethostname(),
                       "since_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}, f)
        return True
    return False


def _stale(claim: Path) -> bool:
    try:
        info = json.loads(claim.read_text())
    except (OSError, ValueError):
        return False  # being written, or gone: not ours to take
    if info.get("host") != socket.gethostname():
        return False  # another machine's process: nothing here can tell whether it lives
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError):
        return False
    return False


def cached_keys(path: Path, field: str = "key") -> set[str]:
    return set(RunCache(path, key_field=field).done)


def run_missing(cache: Path, names: Iterable[str], seeds: Sequence[int], deadline: Optional[str],
                key_of: Callable[[str, int], str], run: Callable[[str, int], dict], key_field: str = "key") -> list[str]:
    """Runs every (name, seed) whose ``key_of(name, seed)`` is not in ``cache`` yet (read before
    each: a parallel process may have finished it), appending ``run(name, seed)``'s record;
    returns those ``deadline`` cut, as "name seed s"; a run another live process has claimed is
    left to it. ``key_field``: the records' key (an older cache may key its records by another
    field)."""
    runs = RunCache(cache, key_field=key_field)
    cut: list[str] = []
    for name in names:
        for seed in seeds:
            key = key_of(name, seed)
            if runs.get(key) is not None:
                continue
            if past_deadline(deadline):
                cut.append(f"{name} seed {seed}")
                continue
            with runs.claimed(key) as mine:
                if mine:  # else another process runs it (or has just finished it)
                    runs.add(run(name, seed))
    return cut


def run_selected(cache: Path, args, known: Sequence[str], key_of: Callable[[str, int], str],
                 make_run: Callable[[], Callable[[str, int], dict]], retired: Mapping[str, str] = {}) -> list[str]:
    """The runs ``--only`` x ``--seeds`` (names checked against ``known`` first) through the run
    cache until ``--deadline``; none under ``--report``. ``make_run`` loads what the runs need and
    returns the function that makes one record; it is called only when a run is missing.
    ``retired``: name -> why; such a run is read from the cache, and asking for one that is not
    there exits with the reason before anything loads."""
    if args.report:
        return []
    names, seeds = cli.names(args.only, known), cli.seeds(args.seeds)
    done = cached_keys(cache)
    missing = [(n, s) for n in names for s in seeds if key_of(n, s) not in done]
    if not missing:
        return []
    refuse_retired([n for n, _ in missing], retired, "cached")
    return run_missing(cache, names, seeds, args.deadline, key_of, make_run())


def refuse_retired(names: Iterable[str], retired: Mapping[str, str], kept: str = "cached") -> None:
    """Exits (one message, no traceback) when one of ``names`` is a retired run of ``retired``
    (name -> why); ``kept``: what is left of it to say."""
    gone = list(dict.fromkeys(n for n in names if n in retired))
    if gone:
        raise SystemExit("; ".join(f"{n}: {retired[n]}" for n in gone)
                         + f". A retired run cannot be run again; its {kept} results stay in the report.")


def records(cache: Path, suffix: str) -> list[dict]:
    """The cached records whose key ends with ``suffix`` (the setting the report is about)."""
    return [r for r in read_jsonl(cache) if r["key"].endswith(suffix)]


def json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


def write_results(name: str, markdown: str, data: dict, out_dir: Path) -> tuple[Path, Path]:
    """``out_dir/<name>.md`` (the report) and ``out_dir/<name>.json`` (every run, with its setting)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{name}.md", out_dir / f"{name}.json"
    md.write_text(markdown.rstrip() + "\n", encoding="utf-8")
    js.write_text(json.dumps(data, indent=2, default=json_default) + "\n", encoding="utf-8")
    return md, js


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(map(str, r)) + " |")
    return "\n".join(lines)
