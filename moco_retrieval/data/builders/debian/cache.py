"""The Debian set a training run uses: built on first use into the cache (``debian-<key>``, the key
hashing the builder, its options and the inputs) and recorded, so that later commands without
``data.debian_dir`` / ``$MOCO_RETRIEVAL_DEBIAN_DIR`` find the same set. A cached set is used only
while its files match the sha256 in its manifest (folder.check_build); one that does not is built
again from the apt lists, or refused when they are not at hand."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

from moco_retrieval.config import cache_root
from moco_retrieval.errors import UserError
from moco_retrieval.files import atomic_write, discard_dir
from moco_retrieval.data.builders.folder import check_build, temp_dir_beside
from moco_retrieval.data.convert import cache_error
from moco_retrieval.data.formats import DataError
from moco_retrieval.data.builders.debian.apt_lists import ENV_DEBIAN_DIR, resolve_debian_inputs
from moco_retrieval.data.builders.debian.build import BUILDER_VERSION, DEFAULT_EVAL_FRACTION, check_options, inputs_manifest, write_debian
from moco_retrieval.data.builders.debian.records import deduplicate, load_records

RECORD_FILE = "debian-default.json"
_announced: set[str] = set()


def record_build(cache: Path, out: Path, label: str, options: dict) -> None:
    """Remember ``out`` as the cache's default Debian set, so that later commands without
    ``data.debian_dir`` / ``$MOCO_RETRIEVAL_DEBIAN_DIR`` find it (written atomically: ranks race;
    not at all in a cache this process cannot write)."""
    record = {"dir": out.name, "source": label, **options}
    path = cache / RECORD_FILE
    try:
        if json.loads(path.read_text(encoding="utf-8")) == record:
            return
    except (OSError, ValueError):
        pass
    try:
        with atomic_write(path) as tmp:
            tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    except OSError:  # a cache this process cannot write (shared, read-only): the set was found without it
        pass


def recorded_build(cache: Path, options: dict) -> Optional[tuple[Path, str]]:
    """``(folder, where it was built from)`` of the cache's default Debian set, when one was
    recorded with these builder options and is still there; else None."""
    try:
        record = json.loads((cache / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in options.items()):
        return None
    out = cache / str(record.get("dir", ""))
    if not str(record.get("dir", "")).startswith("debian-") or not (out / "manifest.json").is_file():
        return None
    return out, str(record.get("source", "?"))


def _announce_recorded(recorded: tuple[Path, str]) -> None:
    out, source = recorded
    if str(out) in _announced:
        return
    _announced.add(str(out))
    print(f"[moco_retrieval] Debian data set: {out} (built from {source}; data.debian_dir=DIR or "
          f"${ENV_DEBIAN_DIR}=DIR selects other apt lists)", file=sys.stderr)


def _build_in_cache(out: Path, tr: list[Path], pk: list[Path], inputs: dict, eval_fraction: float, dedup: str) -> dict:
    """Build into a temporary folder beside ``out``, then rename it to ``out`` (a concurrent rank
    that renamed first wins; its build is the same). Returns the manifest."""
    records, counts = load_records(tr, pk)
    pairs, dcounts = deduplicate(records, dedup)
    counts.update(dcounts)
    tmp = temp_dir_beside(out.parent, f".{out.name}.tmp-")
    try:
        manifest = write_debian(tmp, pairs, eval_fraction, inputs, counts, dedup)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "manifest.json").is_file():  # not a concurrent build that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def ensure_debian_dataset(
    cfg, eval_fraction: float = DEFAULT_EVAL_FRACTION, dedup: str = "first-paragraph", verbose: bool = True
) -> Path:
    """The built Debian data set for ``cfg`` (a DataConfig), building it on first use.

    Inputs: ``cfg.debian_dir``, else ``$MOCO_RETRIEVAL_DEBIAN_DIR``, else the set this cache last
    built or used (``debian-default.json``: train once with the apt lists pointed at, and every
    later command finds the same set), else ``/var/lib/apt/lists``.

    Cached under ``cfg.cache_dir`` (default ``$MOCO_RETRIEVAL_CACHE`` or ``~/.cache/moco_retrieval``)
    as ``debian-<key>``, the key being a hash of the builder version, the options and the inputs'
    sha256: new apt lists give a new build. Built atomically, so concurrent ranks are safe."""
    check_options(eval_fraction, dedup)
    cache = Path(getattr(cfg, "cache_dir", None) or cache_root()).expanduser()
    options = {"builder_version": BUILDER_VERSION, "eval_fraction": eval_fraction, "dedup": dedup}
    explicit = getattr(cfg, "debian_dir", None) or os.environ.get(ENV_DEBIAN_DIR)
    damaged: Optional[tuple[Path, str]] = None
    if not explicit:
        recorded = recorded_build(cache, options)
        if recorded is not None:
            problem = check_build(recorded[0])
            if problem is None:
                if verbose:
                    _announce_recorded(recorded)
                return recorded[0]
            damaged = (recorded[0], problem)
    try:
        tr, pk, label = resolve_debian_inputs(getattr(cfg, "debian_dir", None))
    except DataError as exc:
        if damaged is None:
            raise
        raise DataError(f"{damaged[0]}: the cached Debian data set cannot be trusted: {damaged[1]}; and it cannot "
                        f"be built again: {exc}") from None
    inputs = inputs_manifest(tr, pk)
    key_src = json.dumps(
        {"builder_version": BUILDER_VERSION, "eval_fraction": eval_fraction, "dedup": dedup, "inputs": inputs},
        sort_keys=True,
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    out = cache / f"debian-{key}"
    if out.exists():
        problem = check_build(out)
        if problem is None:
            record_build(cache, out, label, options)
            return out
        damaged = (out, problem)
    try:
        if damaged is not None:
            if damaged[0] == out:
                discard_dir(out)
            print(f"[moco_retrieval] {damaged[0]}: the cached Debian data set cannot be trusted: {damaged[1]}; "
                  f"building it again from {label}", file=sys.stderr)
        cache.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        manifest = _build_in_cache(out, tr, pk, inputs, eval_fraction, dedup)
    except OSError as e:
        if isinstance(e, UserError):
            raise
        raise cache_error(e, f"build the Debian data set from {label}", cache, damaged and damaged[1]) from None
    record_build(cache, out, label, options)
    if verbose:
        c = manifest["counts"]
        print(
            f"[moco_retrieval] built the Debian data set from {label} into {out} in {time.time() - t0:.1f}s: "
            f"{c['train_pairs']} train pairs, {c['eval_queries']} eval queries / documents",
            file=sys.stderr,
        )
    return out


__all__ = ["RECORD_FILE", "ensure_debian_dataset", "record_build", "recorded_build"]
