"""Ordinary file permissions for what the project writes: 0666 / 0777 less the process's umask, as
``open`` and ``mkdir`` give (``mkstemp``/``mkdtemp`` create private 0600 / 0700 entries, which
another user or a serving container cannot read)."""
from __future__ import annotations

import os


def current_umask() -> int:
    """The process's umask (reading it means setting it: it is set back at once)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def ordinary_mode(is_dir: bool) -> int:
    """0777 (a folder) or 0666 (a file) less the umask."""
    return (0o777 if is_dir else 0o666) & ~current_umask()


__all__ = ["current_umask", "ordinary_mode"]
