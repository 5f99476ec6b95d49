"""Stable 63-bit ids for documents and groups.

``doc_id_for_text(text)`` is the first 8 bytes (big-endian) of the sha256 of the NFC-normalized,
whitespace-collapsed, stripped text, with the top bit cleared: a non-negative int63 that is the
same on every machine, process and Python version (unlike ``hash()``). The same text therefore
always has the same id, which is what false-negative masking keys on.

``stable_id(s)`` hashes a given id or group string the same way. ``group_id(s)`` is
``stable_id`` with ``-1`` for "no group" (``None`` or an empty string).
"""
from __future__ import annotations

import hashlib
import unicodedata
from typing import Optional

NO_GROUP = -1
_MASK63 = (1 << 63) - 1


def _already_normal(text: str) -> bool:
    """ASCII (NFC leaves it as is) whose only whitespace is single inner spaces (every other ASCII
    whitespace character is unprintable): split-and-join would give it back unchanged."""
    return text.isascii() and text.isprintable() and "  " not in text and text[:1] != " " and text[-1:] != " "


def normalize_text(text: str) -> str:
    """NFC-normalize, collapse every run of whitespace to one space, strip."""
    if _already_normal(text):  # most texts; saves the split and join when converting millions of rows
        return text
    return " ".join(unicodedata.normalize("NFC", text).split())


def _hash63(s: str) -> int:
    digest = hashlib.sha256(normalize_text(s).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & _MASK63


def doc_id_for_text(text: str) -> int:
    """Stable non-negative int63 id of a document text."""
    if not isinstance(text, str):
        raise TypeError(f"doc_id_for_text expects a str, got {type(text).__name__}")
    return _hash63(text)


def stable_id(s: str) -> int:
    """Stable non-negative int63 id of a given id or group string (the same hash as texts)."""
    if not isinstance(s, str):
        raise TypeError(f"stable_id expects a str, got {type(s).__name__}")
    return _hash63(s)


def group_id(s: Optional[str]) -> int:
    """``stable_id(s)``, or ``-1`` (no group) for ``None`` or an empty/blank string."""
    if s is None or not normalize_text(s):
        return NO_GROUP
    return stable_id(s)


__all__ = ["NO_GROUP", "normalize_text", "doc_id_for_text", "stable_id", "group_id"]
