"""The pairs of the Debian set: translations joined with ``Packages`` (the source package is the
group), descriptions split into query and document, and duplicates dropped (see the package
docstring, steps 1-4)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from moco_retrieval.data.formats import DataError
from moco_retrieval.data.ids import normalize_text
from moco_retrieval.data.builders.debian.apt_lists import parse_control, parse_description, read_index_text, source_name

DEDUP_MODES = ("first-paragraph", "exact")


@dataclass(frozen=True)
class DebianPair:
    package: str
    source: str
    query: str
    document: str


def _read_translations(translation_files: Sequence[Path], counts: dict) -> dict[tuple[str, str], str]:
    """(package, Description-md5) -> Description-en of every translation record (the first one seen)."""
    translations: dict[tuple[str, str], str] = {}
    for path in translation_files:
        for line, f in parse_control(read_index_text(path), path):
            counts["translation_records"] += 1
            for field in ("Package", "Description-md5", "Description-en"):
                if not f.get(field, "").strip():
                    raise DataError(f"{path}:{line}: record without {field!r} (expected Package, Description-md5, Description-en)")
            translations.setdefault((f["Package"], f["Description-md5"]), f["Description-en"])
    return translations


def _read_sources(packages_files: Sequence[Path], counts: dict) -> dict[tuple[str, str], str]:
    """(package, Description-md5) -> source name (the smallest when several), from the Packages stanzas."""
    sources: dict[tuple[str, str], str] = {}
    for path in packages_files:
        for line, f in parse_control(read_index_text(path, strict_utf8=False), path):
            counts["packages_stanzas"] += 1
            if not f.get("Package", "").strip():
                raise DataError(f"{path}:{line}: stanza without 'Package'")
            md5 = f.get("Description-md5", "").strip()
            if not md5 and "\n" in f.get("Description", ""):
                md5 = hashlib.md5((f["Description"] + "\n").encode("utf-8")).hexdigest()
            if not md5:
                continue
            key = (f["Package"], md5)
            src = source_name(f)
            if key not in sources or src < sources[key]:
                sources[key] = src
    return sources


def load_records(translation_files: Sequence[Path], packages_files: Sequence[Path]) -> tuple[list[DebianPair], dict]:
    """Join translations with Packages; return records (package order, non-empty documents) and counts."""
    counts = {"translation_records": 0, "packages_stanzas": 0}
    translations = _read_translations(translation_files, counts)
    sources = _read_sources(packages_files, counts)
    records: list[DebianPair] = []
    seen_packages: set[str] = set()
    unmatched = empty = dup_pkg = 0
    for (pkg, md5) in sorted(translations):
        if (pkg, md5) not in sources:
            unmatched += 1
            continue
        if pkg in seen_packages:
            dup_pkg += 1
            continue
        seen_packages.add(pkg)
        short, long = parse_description(translations[(pkg, md5)])
        if not long.strip() or not short:
            empty += 1
            continue
        records.append(DebianPair(pkg, sources[(pkg, md5)], short, long))
    counts.update(
        translations_without_packages_entry=unmatched,
        duplicate_package_dropped=dup_pkg,
        joined_records=len(records) + empty,
        empty_description_dropped=empty,
    )
    return records, counts


def _key(text: str) -> str:
    return normalize_text(text).casefold()


def deduplicate(records: Iterable[DebianPair], dedup: str = "first-paragraph") -> tuple[list[DebianPair], dict]:
    """Keep a record only when neither its query nor its document key was already kept (package order)."""
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup must be one of {DEDUP_MODES}, got {dedup!r}")
    seen_q: set[str] = set()
    seen_d: set[str] = set()
    kept: list[DebianPair] = []
    dq = dd = 0
    for r in sorted(records, key=lambda r: r.package):
        qk = _key(r.query)
        dk = _key(r.document.split("\n\n", 1)[0] if dedup == "first-paragraph" else r.document)
        if qk in seen_q:
            dq += 1
            continue
        if dk in seen_d:
            dd += 1
            continue
        seen_q.add(qk)
        seen_d.add(dk)
        kept.append(r)
    return kept, {"duplicate_query_dropped": dq, "duplicate_document_dropped": dd}


__all__ = ["DEDUP_MODES", "DebianPair", "deduplicate", "load_records"]
