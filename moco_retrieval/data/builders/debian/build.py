"""The Debian set's folder: the split by source, ``train.jsonl``, ``eval/`` and ``manifest.json``
(see the package docstring, step 5 and the outputs), built atomically into a folder."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from moco_retrieval.data.builders.folder import build_into, check_output_dir
from moco_retrieval.files import sha256_file
from moco_retrieval.data.formats import DataError, write_jsonl, write_qrels
from moco_retrieval.data.ids import stable_id
from moco_retrieval.data.builders.debian.apt_lists import APT_UPDATE_HINT
from moco_retrieval.data.builders.debian.records import DEDUP_MODES, DebianPair, deduplicate, load_records

BUILDER_VERSION = 1
# a small fraction of the sources held out: enough eval documents (MIN_EVAL_DOCS) for stable
# retrieval metrics on the Debian lists, most pairs left to train on
DEFAULT_EVAL_FRACTION = 0.08
MIN_EVAL_DOCS = 2400
_SPLIT_MOD = 1_000_000


def is_eval_source(source: str, eval_fraction: float) -> bool:
    """The split rule: eval iff ``stable_id(source) % 1e6 < eval_fraction * 1e6``."""
    return stable_id(source) % _SPLIT_MOD < round(eval_fraction * _SPLIT_MOD)


def split_rule(eval_fraction: float) -> str:
    return (
        f"eval iff stable_id(source) % {_SPLIT_MOD} < {round(eval_fraction * _SPLIT_MOD)}, where stable_id(s) is the "
        "first 8 bytes (big-endian, top bit cleared) of sha256(NFC, whitespace-collapsed s) and source is the "
        "Packages 'Source' without '(version)', or the package name"
    )


def write_debian(
    out: Path,
    pairs: Sequence[DebianPair],
    eval_fraction: float,
    inputs: dict,
    counts: dict,
    dedup: str,
) -> dict:
    """Write train.jsonl, eval/ and manifest.json into ``out`` (an existing empty folder)."""
    pairs = sorted(pairs, key=lambda r: r.package)
    train = [r for r in pairs if not is_eval_source(r.source, eval_fraction)]
    evals = [r for r in pairs if is_eval_source(r.source, eval_fraction)]
    write_jsonl(
        out / "train.jsonl",
        ({"query": r.query, "positive": r.document, "query_id": r.package, "doc_id": r.package, "group": r.source} for r in train),
    )
    ev = out / "eval"
    (ev / "qrels").mkdir(parents=True, exist_ok=True)
    write_jsonl(ev / "corpus.jsonl", ({"_id": r.package, "title": "", "text": r.document, "group": r.source} for r in evals))
    write_jsonl(ev / "queries.jsonl", ({"_id": r.package, "text": r.query} for r in evals))
    write_qrels(ev / "qrels" / "test.tsv", {r.package: {r.package: 1} for r in evals})
    train_sources = {r.source for r in train}
    eval_sources = {r.source for r in evals}
    assert not train_sources & eval_sources
    counts = dict(counts)
    counts.update(
        pairs=len(pairs),
        train_pairs=len(train),
        eval_queries=len(evals),
        eval_documents=len(evals),
        train_sources=len(train_sources),
        eval_sources=len(eval_sources),
    )
    manifest = _manifest(out, eval_fraction, inputs, counts, dedup)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def _manifest(out: Path, eval_fraction: float, inputs: dict, counts: dict, dedup: str) -> dict:
    """What was built from what, by which rules: the written files' sha256, the counts, the options."""
    files = {}
    for rel in ("train.jsonl", "eval/corpus.jsonl", "eval/queries.jsonl", "eval/qrels/test.tsv"):
        files[rel] = sha256_file(out / rel)
    return {
        "dataset": "debian package descriptions (query: short description, document: long description)",
        "builder_version": BUILDER_VERSION,
        "inputs": inputs,
        "options": {"eval_fraction": eval_fraction, "dedup": dedup},
        "split_rule": split_rule(eval_fraction),
        "dedup_rule": (
            "records in package-name order; a record is kept only when neither its query nor its document key "
            "(NFC, whitespace-collapsed, case-folded; "
            + ("the first paragraph of the long description" if dedup == "first-paragraph" else "the whole long description")
            + ") was already kept"
        ),
        "ids": "query_id = doc_id = corpus _id = package name; group = source name",
        "counts": counts,
        "files": files,
    }


def inputs_manifest(translation_files: Sequence[Path], packages_files: Sequence[Path]) -> dict:
    """The input files by name and sha256 (the manifest's ``inputs``, and the cache key)."""
    return {
        "translation": [{"name": p.name, "sha256": sha256_file(p)} for p in translation_files],
        "packages": [{"name": p.name, "sha256": sha256_file(p)} for p in packages_files],
    }


def check_options(eval_fraction: float, dedup: str) -> None:
    """ValueError for an eval fraction outside (0, 1) or an unknown dedup mode."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup must be one of {DEDUP_MODES}, got {dedup!r}")


def build_debian(
    out: os.PathLike | str,
    translation_files: Sequence[os.PathLike | str],
    packages_files: Sequence[os.PathLike | str],
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    dedup: str = "first-paragraph",
    overwrite: bool = True,
) -> dict:
    """Build the data set into ``out`` atomically (a temporary sibling folder, then a rename).

    ``out`` may not exist, be empty, or hold a previous build (a ``manifest.json``), which is
    replaced when ``overwrite``. Returns the manifest."""
    check_options(eval_fraction, dedup)
    out = Path(out)
    tr = sorted({Path(p) for p in translation_files}, key=lambda p: (p.name, str(p)))
    pk = sorted({Path(p) for p in packages_files}, key=lambda p: (p.name, str(p)))
    if not tr or not pk:
        raise DataError(f"need at least one Translation-en and one Packages file; {APT_UPDATE_HINT}")
    check_output_dir(out, overwrite)
    records, counts = load_records(tr, pk)
    pairs, dcounts = deduplicate(records, dedup)
    counts.update(dcounts)
    if not pairs:
        raise DataError(f"no usable pairs from {[str(p) for p in tr]} + {[str(p) for p in pk]} (no translation joined a Packages entry)")
    inputs = inputs_manifest(tr, pk)
    return build_into(out, lambda tmp: write_debian(tmp, pairs, eval_fraction, inputs, counts, dedup))


__all__ = ["BUILDER_VERSION", "DEFAULT_EVAL_FRACTION", "MIN_EVAL_DOCS", "build_debian", "check_options",
           "inputs_manifest", "is_eval_source", "split_rule", "write_debian"]
