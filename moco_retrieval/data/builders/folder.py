"""Writing a built data set's folder atomically (the builders: debian/, stdlib_docs.py).

A build is written into a temporary sibling folder and renamed into place, so a reader never sees
half a build and an interrupted one leaves the old build intact. An existing ``out`` is replaced
only when it holds a previous build (a ``manifest.json``): a folder a user filled is not touched.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

from moco_retrieval.files import ordinary_mode, sha256_file
from moco_retrieval.data.formats import DataError


def temp_dir_beside(parent: Path, prefix: str) -> Path:
    """A temporary build folder next to the target, with ordinary permissions (mkdtemp gives 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, ordinary_mode(is_dir=True))
    return tmp


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``, replacing a previous ``out`` (moved aside first, then removed)."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "d")
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def check_output_dir(out: Path, overwrite: bool = True) -> None:
    """``out`` may not exist, be empty, or hold a previous build (replaced when ``overwrite``)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    if any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise DataError(f"{out}: not empty and not a previous build (no manifest.json); refusing to overwrite")
    if (out / "manifest.json").is_file() and not overwrite:
        raise DataError(f"{out}: already holds a build")


def check_build(out: Path) -> Optional[str]:
    """What makes the built folder ``out`` untrustworthy, naming the file (None: every file is as the
    sha256 its manifest.json records). Reads every file: a built set is tens of MB."""
    try:
        files = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return "manifest.json is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"manifest.json is not a build's manifest ({type(e).__name__})"
    if not isinstance(files, dict) or not files:
        return "manifest.json lists no files"
    for rel, digest in files.items():
        if not (out / rel).is_file():
            return f"{rel} is missing"
        if sha256_file(out / rel) != digest:
            return f"{rel} differs from its sha256 in manifest.json (changed on disk)"
    return None


def build_into(out: Path, write: Callable[[Path], dict]) -> dict:
    """``write(folder) -> manifest`` into a temporary sibling of ``out``, then renamed to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_beside(out.parent, f".{out.name}.tmp-")
    try:
        manifest = write(tmp)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


__all__ = ["build_into", "check_build", "check_output_dir", "replace_dir", "temp_dir_beside"]
