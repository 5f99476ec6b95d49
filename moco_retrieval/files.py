"""Ordinary file permissions for what the project writes: 0666 / 0777 less the process's umask, as
``open`` and ``mkdir`` give (``mkstemp``/``mkdtemp`` create private 0600 / 0700 entries, which
another user or a serving container cannot read).

Files a command writes for the user: checked before any work, written whole or not at all.

:func:`check_output` refuses, before the command reads data or loads a model: a directory given as a
file; a file that is there already, unless ``overwrite``; and, even with ``overwrite``, a file that
is one of the command's inputs (the same path, a link to it or a hard link). :func:`atomic_write`
writes into a temporary file beside the target and renames it over the target only when the
writing ended without an error, so an interrupted command leaves the old file (or none), never a
half-written one.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from moco_retrieval.errors import ConfigError, OutputExistsError


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


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and Path(b).exists():
        return os.path.samefile(a, b)
    return a.expanduser().resolve() == Path(b).expanduser().resolve()


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


__all__ = ['current_umask', 'ordinary_mode', 'check_output', 'files_under', 'atomic_write']
