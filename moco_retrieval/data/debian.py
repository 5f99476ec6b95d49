"""The built-in data set: Debian package descriptions as a title-to-body retrieval task.

Inputs are apt's index files (what ``apt-get update`` stores under ``/var/lib/apt/lists``):
``Translation-en`` (``Package``, ``Description-md5``, ``Description-en``) and ``Packages``
(``Package``, ``Source``, ``Description-md5``, ...), plain or compressed (xz, gz, bz2, lz4; the
compression is detected from the file's magic bytes; lz4 needs ``pip install lz4``).

How the set is built (:func:`build_debian`):

1. **Join.** A translation record joins a ``Packages`` stanza on (``Package``, ``Description-md5``)
   (the md5 is that of the full ``Description-en`` value plus a newline; a ``Packages`` stanza
   without ``Description-md5`` but with a full multi-line ``Description`` gets it computed).
   Translation records of packages absent from the ``Packages`` files (other architectures) are
   dropped: their source is unknown. When one package name joins more than once (several suites),
   the record with the smallest md5 is kept.
2. **Source (group).** ``Source`` without its optional ``(version)``; absent means the package name.
   When one (package, md5) appears with several sources, the smallest name is used.
3. **Texts.** query = the short description (first line of ``Description-en``); document = the long
   description: continuation lines with their leading space removed and trailing spaces stripped,
   lines of a paragraph joined by ``"\\n"``, paragraphs (separated by `` .`` lines) joined by
   ``"\\n\\n"``. Records with an empty long description are dropped.
4. **Duplicates.** Records are visited in package-name order and a record is kept only when
   neither its query nor its document key was already kept (so the alphabetically first package
   wins). Keys are compared after NFC, whitespace collapsing and case folding. With
   ``dedup="first-paragraph"`` (default) the document key is the first paragraph of the long
   description: binary packages of one source usually repeat it verbatim and add only a line
   such as "This package contains the data files", so those near-duplicates are dropped as
   well (about 40k pairs remain from bookworm's 64k records). ``dedup="exact"`` keys on the whole
   document and keeps about 59k pairs.
5. **Split.** A source goes to eval iff ``stable_id(source) % 1_000_000 < eval_fraction * 1_000_000``
   (``stable_id``: first 8 bytes of the sha256 of the name, see :mod:`.ids`), so every source is on
   exactly one side and the split of a source never changes when other packages come and go.

Outputs (:func:`write_debian`): ``train.jsonl`` (``query``, ``positive``, ``query_id`` = ``doc_id`` =
package name, ``group`` = source name), ``eval/`` in the BEIR layout (``corpus.jsonl`` with
``_id`` = package name, ``title`` empty, ``text``, ``group`` = source name; ``queries.jsonl`` with
``_id`` = package name; ``qrels/test.tsv``: each query's one relevant document is its own
package's), and ``manifest.json`` (counts, the inputs' sha256, the rules). Every file is sorted by
package name and written without timestamps: the same inputs give byte-identical outputs.
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from ..config import cache_root
from .builds import build_into, check_output_dir, sha256_file, temp_dir_beside
from .formats import DataError, write_jsonl, write_qrels
from .ids import normalize_text, stable_id

BUILDER_VERSION = 1
DEFAULT_LISTS_DIR = "/var/lib/apt/lists"
ENV_DEBIAN_DIR = "MOCO_RETRIEVAL_DEBIAN_DIR"
# 8% of sources: on bookworm 3,283 of the 39,796 pairs go to eval (>= 2,400 with a margin) and
# 36,513 train pairs make about 570 steps at batch 64.
DEFAULT_EVAL_FRACTION = 0.08
MIN_EVAL_DOCS = 2400
DEDUP_MODES = ("first-paragraph", "exact")
_SPLIT_MOD = 1_000_000

APT_UPDATE_HINT = (
    "run `sudo apt-get update -o Acquire::Languages=en` (container images often disable the download of "
    "translations, which hold the English descriptions), or pass --translation FILE --packages FILE "
    "(training: data.debian_dir=DIR or $" + ENV_DEBIAN_DIR + ")"
)


# --------------------------------------------------------------------------------------- reading


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
            try:
                import lz4.frame  # type: ignore[import-not-found]
            except ImportError:
                raise DataError(
                    f"{p}: lz4-compressed (apt's default); reading it needs the lz4 package: `pip install lz4` "
                    "(or decompress it first with `lz4 -d`)"
                ) from None
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


# ------------------------------------------------------------------------------------- building


@dataclass(frozen=True)
class DebianPair:
    package: str
    source: str
    query: str
    document: str


def load_records(translation_files: Sequence[Path], packages_files: Sequence[Path]) -> tuple[list[DebianPair], dict]:
    """Join translations with Packages; return records (package order, non-empty documents) and counts."""
    counts = {"translation_records": 0, "packages_stanzas": 0}
    translations: dict[tuple[str, str], str] = {}
    for path in translation_files:
        for line, f in parse_control(read_index_text(path), path):
            counts["translation_records"] += 1
            for field in ("Package", "Description-md5", "Description-en"):
                if not f.get(field, "").strip():
                    raise DataError(f"{path}:{line}: record without {field!r} (expected Package, Description-md5, Description-en)")
            translations.setdefault((f["Package"], f["Description-md5"]), f["Description-en"])
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
    files = {}
    for rel in ("train.jsonl", "eval/corpus.jsonl", "eval/queries.jsonl", "eval/qrels/test.tsv"):
        files[rel] = sha256_file(out / rel)
    manifest = {
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
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def _inputs_manifest(translation_files: Sequence[Path], packages_files: Sequence[Path]) -> dict:
    return {
        "translation": [{"name": p.name, "sha256": sha256_file(p)} for p in translation_files],
        "packages": [{"name": p.name, "sha256": sha256_file(p)} for p in packages_files],
    }


def _check_options(eval_fraction: float, dedup: str) -> None:
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
    _check_options(eval_fraction, dedup)
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
    inputs = _inputs_manifest(tr, pk)
    return build_into(out, lambda tmp: write_debian(tmp, pairs, eval_fraction, inputs, counts, dedup))


# ----------------------------------------------------------------------------- training: cache


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


RECORD_FILE = "debian-default.json"
_announced: set[str] = set()


def record_build(cache: Path, out: Path, label: str, options: dict) -> None:
    """Remember ``out`` as the cache's default Debian set, so that later commands without
    ``data.debian_dir`` / ``$MOCO_RETRIEVAL_DEBIAN_DIR`` find it (written atomically: ranks race)."""
    record = {"dir": out.name, "source": label, **options}
    path = cache / RECORD_FILE
    try:
        if json.loads(path.read_text(encoding="utf-8")) == record:
            return
    except (OSError, ValueError):
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{RECORD_FILE}.", dir=cache)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


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


def _umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


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
    _check_options(eval_fraction, dedup)
    cache = Path(getattr(cfg, "cache_dir", None) or cache_root()).expanduser()
    options = {"builder_version": BUILDER_VERSION, "eval_fraction": eval_fraction, "dedup": dedup}
    explicit = getattr(cfg, "debian_dir", None) or os.environ.get(ENV_DEBIAN_DIR)
    if not explicit:
        recorded = recorded_build(cache, options)
        if recorded is not None:
            if verbose:
                _announce_recorded(recorded)
            return recorded[0]
    tr, pk, label = resolve_debian_inputs(getattr(cfg, "debian_dir", None))
    inputs = _inputs_manifest(tr, pk)
    key_src = json.dumps(
        {"builder_version": BUILDER_VERSION, "eval_fraction": eval_fraction, "dedup": dedup, "inputs": inputs},
        sort_keys=True,
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    out = cache / f"debian-{key}"
    if (out / "manifest.json").is_file():
        record_build(cache, out, label, options)
        return out
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    records, counts = load_records(tr, pk)
    pairs, dcounts = deduplicate(records, dedup)
    counts.update(dcounts)
    tmp = temp_dir_beside(cache, f".debian-{key}.tmp-")
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
    record_build(cache, out, label, options)
    if verbose:
        c = manifest["counts"]
        print(
            f"[moco_retrieval] built the Debian data set from {label} into {out} in {time.time() - t0:.1f}s: "
            f"{c['train_pairs']} train pairs, {c['eval_queries']} eval queries / documents",
            file=sys.stderr,
        )
    return out


__all__ = [
    "BUILDER_VERSION",
    "DEFAULT_EVAL_FRACTION",
    "DEFAULT_LISTS_DIR",
    "DEDUP_MODES",
    "MIN_EVAL_DOCS",
    "DebianPair",
    "read_index_text",
    "parse_control",
    "parse_description",
    "source_name",
    "find_index_files",
    "load_records",
    "deduplicate",
    "is_eval_source",
    "split_rule",
    "build_debian",
    "write_debian",
    "resolve_debian_inputs",
    "ensure_debian_dataset",
    "record_build",
    "recorded_build",
]
