"""apt's index files: where they are (``data.debian_dir``, ``$MOCO_RETRIEVAL_DEBIAN_DIR``, apt's own
lists), reading them (plain or compressed: xz, gz, bz2, lz4 by magic bytes; lz4 needs ``pip install
lz4``) and parsing their stanzas and descriptions."""
from __future__ import annotations

import bz2
import gzip
import lzma
import os
from pathlib import Path
from typing import Iterator, Optional

from moco_retrieval.data.formats import DataError

DEFAULT_LISTS_DIR = "/var/lib/apt/lists"
ENV_DEBIAN_DIR = "MOCO_RETRIEVAL_DEBIAN_DIR"

APT_UPDATE_HINT = (
    "run `sudo apt-get update -o Acquire::Languages=en` (container images often disable the download of "
    "translations, which hold the English descriptions), or pass --translation FILE --packages FILE "
    "(training: data.debian_dir=DIR or $" + ENV_DEBIAN_DIR + ")"
)


def read_index_text(path: os.PathLike | str, strict_utf8: bool = True) -> str:
    """The text of an apt index file, decompressing xz / gz / bz2 / lz4 by magic bytes."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such file (expected an apt index file)")
    with open(p, "rb") as fh:
        head = fh.read(6)
    try:
        if head.startswith(b"\xfd7zXZ\x00"):
            data = lzma.open(p).read()
        elif head.startswith(b"\x1f\x8b"):
            data = gzip.open(p).read()
        elif head.startswith(b"BZh"):
            data = bz2.open(p).read()
        elif head.startswith(b"\x04\x22\x4d\x18"):
            import lz4.frame

            data = lz4.frame.open(p).read()
        elif head.startswith(b"\x28\xb5\x2f\xfd"):
            raise DataError(f"{p}: zstd-compressed, which is not supported; decompress it first (`zstd -d`)")
        else:
            data = p.read_bytes()
    except DataError:
        raise
    except (OSError, EOFError, lzma.LZMAError, RuntimeError) as exc:
        raise DataError(f"{p}: cannot decompress ({exc})") from None
    try:
        return data.decode("utf-8", errors="strict" if strict_utf8 else "replace")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataError(f"{p}:{line}: not valid UTF-8 ({exc.reason})") from None


def parse_control(text: str, path: os.PathLike | str = "<control>") -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(first_line, fields)`` per stanza of a Debian control file.

    A field's value is the text after ``Field:`` (stripped) plus, for each continuation line, a
    ``"\\n"`` and the line as is (with its leading space)."""
    cur: dict[str, str] = {}
    start = 0
    key: Optional[str] = None
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.endswith("\r"):
            line = line[:-1]
        if not line.strip():
            if cur:
                yield start, cur
            cur, key = {}, None
            continue
        if line[0] in " \t":
            if key is None:
                raise DataError(f"{path}:{lineno}: continuation line outside a field (expected 'Field: value')")
            cur[key] += "\n" + line
            continue
        if line.startswith("#"):
            continue
        k, sep, v = line.partition(":")
        if not sep or not k.strip() or " " in k.strip():
            raise DataError(
                f"{path}:{lineno}: expected 'Field: value' or a continuation line starting with a space, got {line[:60]!r}"
            )
        if not cur:
            start = lineno
        key = k.strip()
        cur.setdefault(key, v.strip())
    if cur:
        yield start, cur


def parse_description(desc: str) -> tuple[str, str]:
    """``Description-en`` value -> (short description, long description)."""
    lines = desc.split("\n")
    short = " ".join(lines[0].split())
    paragraphs: list[list[str]] = []
    cur: list[str] = []
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            line = line[1:]
        line = line.rstrip()
        if line.strip() == ".":
            if cur:
                paragraphs.append(cur)
            cur = []
        elif line.strip():
            cur.append(line)
    if cur:
        paragraphs.append(cur)
    return short, "\n\n".join("\n".join(p) for p in paragraphs)


def source_name(fields: dict[str, str]) -> str:
    """``Source`` without its ``(version)``; the package name when absent or empty."""
    src = fields.get("Source", "").split("(", 1)[0].strip()
    return src or fields["Package"]


def _is_index_file(p: Path) -> bool:
    n = p.name
    return p.is_file() and not any(x in n for x in (".diff", "IndexDiff", ".gpg", "Release"))


def find_index_files(lists_dir: os.PathLike | str) -> tuple[list[Path], list[Path]]:
    """(translation files, packages files) in a folder: apt's ``*_i18n_Translation-en*`` and
    ``*_Packages*`` (every component: Debian's main, contrib; Ubuntu's main, universe, ...), else
    plain ``Translation-en*`` and ``Packages*``. Raises DataError when either kind is missing."""
    d = Path(lists_dir)
    if not d.is_dir():
        raise DataError(f"{d}: no such directory (expected apt lists with Translation-en and Packages files); {APT_UPDATE_HINT}")
    tr = sorted(p for p in d.glob("*_i18n_Translation-en*") if _is_index_file(p))
    tr = tr or sorted(p for p in d.glob("Translation-en*") if _is_index_file(p))
    pk = sorted(p for p in d.glob("*_Packages*") if _is_index_file(p))
    pk = pk or sorted(p for p in d.glob("Packages*") if _is_index_file(p))
    missing = []
    if not tr:
        missing.append("no *_i18n_Translation-en* (or Translation-en*) file")
    if not pk:
        missing.append("no *_Packages* (or Packages*) file")
    if missing:
        raise DataError(f"{d}: {' and '.join(missing)}; {APT_UPDATE_HINT}")
    return tr, pk


def resolve_debian_inputs(debian_dir: Optional[str]) -> tuple[list[Path], list[Path], str]:
    """Where the apt index files come from: ``data.debian_dir``, else ``$MOCO_RETRIEVAL_DEBIAN_DIR``,
    else ``/var/lib/apt/lists``. An explicit setting is used alone (no silent fallback)."""
    env = os.environ.get(ENV_DEBIAN_DIR) or None
    if debian_dir:
        where, label = debian_dir, f"data.debian_dir={debian_dir}"
    elif env:
        where, label = env, f"${ENV_DEBIAN_DIR}={env}"
    else:
        where, label = DEFAULT_LISTS_DIR, DEFAULT_LISTS_DIR
    try:
        tr, pk = find_index_files(where)
    except DataError as exc:
        tried = [
            f"data.debian_dir={debian_dir}" if debian_dir else "data.debian_dir (not set)",
            f"${ENV_DEBIAN_DIR}={env}" + ("" if not debian_dir else " (not used: data.debian_dir is set)")
            if env
            else f"${ENV_DEBIAN_DIR} (not set)",
            DEFAULT_LISTS_DIR + ("" if where == DEFAULT_LISTS_DIR else " (not used: a setting above wins)"),
        ]
        raise DataError(
            f"cannot build the Debian data set: {exc}. Locations in order: {'; '.join(tried)}. "
            f"Used: {label}. Set data.debian_dir=DIR or ${ENV_DEBIAN_DIR}=DIR to a folder with Packages and "
            "Translation-en files (e.g. ../shared/data/debian-bookworm), or use data=jsonl / data=beir."
        ) from None
    return tr, pk, label


__all__ = ["APT_UPDATE_HINT", "DEFAULT_LISTS_DIR", "ENV_DEBIAN_DIR", "find_index_files", "parse_control",
           "parse_description", "read_index_text", "resolve_debian_inputs", "source_name"]
