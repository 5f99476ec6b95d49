"""A second real data set, offline on every machine: the docstrings of the installed Python standard
library as a summary-to-description retrieval task (``python -m moco_retrieval.data pydoc``).

Read at build time from the running interpreter's standard library (or ``stdlib=DIR``), never
committed. How the set is built (:func:`build_stdlib_docs`):

1. **Modules.** Every ``.py`` file under the library folder, as a dotted module name
   (``email/mime/text.py`` -> ``email.mime.text``, ``json/__init__.py`` -> ``json``), except test
   suites, ``site-packages``, build configuration and demo folders (:data:`SKIP_DIRS`) and joke
   modules (:data:`SKIP_MODULES`); or the ``modules`` given (each must exist). Files are parsed
   with ``ast``: nothing is imported or run.
2. **Docstrings.** The module's, and those of its public classes and functions and of the public
   methods of its classes (names without a leading underscore), cleaned with
   ``inspect.cleandoc``. query = the summary (:func:`split_summary`: PEP 257's summary line, i.e.
   the first sentence of the first paragraph, its lines joined by one space); document = the rest
   (the first paragraph's remainder, then the other paragraphs, separated by a blank line).
3. **Trivial ones dropped** (:func:`pair_from_docstring`): a summary under
   :data:`MIN_QUERY_WORDS` words or over :data:`MAX_QUERY_CHARS` characters, a summary that is a call
   signature (``name(args) -> result``), a document under :data:`MIN_DOC_WORDS` words.
4. **Duplicates.** In (module, name) order, a pair is kept only when neither its query nor its
   document (NFC, whitespace-collapsed, case-folded) was kept already (``_pyio`` repeats ``io``).
5. **Split.** group = the module's dotted name (its docstrings are each other's false negatives);
   a pair goes to eval iff ``stable_id(top-level package) % 1e6 < eval_fraction * 1e6``
   (:func:`~.debian.is_eval_source`): a package's modules are all on one side (``email.mime.text``
   with ``email.mime.base``), so no group and no package is on both sides, and a package's side
   never changes when others come and go.

Outputs: the layout of the Debian set (:mod:`.debian`): ``train.jsonl`` (``query``, ``positive``,
``query_id`` = ``doc_id`` = ``module:Qualified.name``, ``group``), ``eval/`` in the BEIR layout,
``manifest.json`` (counts, the Python version, a digest of the files read, the rules). Sorted, no
timestamps: the same library gives byte-identical outputs.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from moco_retrieval.data.builders.folder import build_into, check_output_dir
from moco_retrieval.files import sha256_file
from moco_retrieval.data.builders.debian import is_eval_source
from moco_retrieval.data.formats import DataError, write_jsonl, write_qrels
from moco_retrieval.data.ids import normalize_text

BUILDER_VERSION = 1
DEFAULT_EVAL_FRACTION = 0.1
MIN_QUERY_WORDS = 3
MAX_QUERY_CHARS = 300
MIN_DOC_WORDS = 8
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "pydoc_data",
                       "turtledemo", "__phello__"})
SKIP_MODULES = frozenset({"this", "antigravity", "__hello__"})
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)\s*(->.*)?$")
_SENTENCE_END = re.compile(r"(?<![.\s][a-z])[.!?](?=\s+[A-Z(`'\"])")  # not after "e.g" / "i.e"
_SPLIT_MOD = 1_000_000


@dataclass(frozen=True)
class DocPair:
    module: str
    name: str  # qualified name within the module ("" for the module's own docstring)
    query: str
    document: str

    @property
    def id(self) -> str:
        return f"{self.module}:{self.name}" if self.name else self.module

    @property
    def package(self) -> str:
        return self.module.split(".", 1)[0]


# --------------------------------------------------------------------------------- reading


def default_stdlib() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _skipped(rel: Path) -> bool:
    dirs = rel.parts[:-1]
    if any(d in SKIP_DIRS or "-" in d for d in dirs):
        return True
    name = rel.stem
    return (not dirs and name in SKIP_MODULES) or name.startswith("_sysconfigdata") or name == "__main__"


def find_modules(root: Path, modules: Optional[Sequence[str]] = None) -> list[tuple[str, Path]]:
    """``(dotted name, file)`` of the library's modules (sorted by name), or of ``modules``."""
    if not root.is_dir():
        raise DataError(f"{root}: no such directory (expected a Python standard library folder)")
    if modules is not None:
        found = []
        for name in modules:
            base = root.joinpath(*name.split("."))
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
            if path is None:
                raise DataError(f"module {name!r}: no {base.with_suffix('.py')} or {base / '__init__.py'} under {root}")
            found.append((name, path))
        return sorted(set(found))
    files = (p for p in root.rglob("*.py") if not _skipped(p.relative_to(root)))
    return sorted((module_name(p, root), p) for p in files)


def parse_module(path: Path) -> ast.Module:
    """The syntax tree of one file; errors name the file and line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 ({exc.reason})") from None
    try:
        return ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise DataError(f"{path}:{exc.lineno}: cannot parse as Python ({exc.msg})") from None


def docstrings(tree: ast.Module) -> Iterator[tuple[str, str]]:
    """``(qualified name, docstring)``: the module's (name ""), its public classes and functions,
    and the public methods of its public classes (nested classes included)."""
    doc = ast.get_docstring(tree, clean=False)
    if doc:
        yield "", doc
    yield from _defs(tree.body, "")


def _defs(body: Iterable[ast.stmt], prefix: str) -> Iterator[tuple[str, str]]:
    for node in body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        name = prefix + node.name
        doc = ast.get_docstring(node, clean=False)
        if doc:
            yield name, doc
        if isinstance(node, ast.ClassDef):
            yield from _defs(node.body, name + ".")


def split_summary(doc: str) -> tuple[str, str]:
    """``(summary, rest)`` of a cleaned docstring: the first sentence of its first paragraph (the
    whole paragraph when it has one sentence), lines joined by a space; the rest as written."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", inspect.cleandoc(doc)) if p.strip()]
    if not paragraphs:
        return "", ""
    first = " ".join(paragraphs[0].split())
    end = _SENTENCE_END.search(first)
    summary, lead = (first[: end.start() + 1], first[end.end():].strip()) if end else (first, "")
    return summary, "\n\n".join(([lead] if lead else []) + paragraphs[1:])


def pair_from_docstring(doc: str) -> Optional[tuple[str, str]]:
    """``(query, document)`` of a docstring, or None when it is trivial (see the module docstring)."""
    query, document = split_summary(doc)
    if len(query.split()) < MIN_QUERY_WORDS or len(query) > MAX_QUERY_CHARS or _SIGNATURE.match(query):
        return None
    if len(document.split()) < MIN_DOC_WORDS:
        return None
    return query, document


def load_pairs(root: Path, modules: Optional[Sequence[str]] = None) -> tuple[list[DocPair], dict, str]:
    """Every non-trivial pair of the modules (module, name order), counts, and a digest of the files."""
    counts = {"modules": 0, "docstrings": 0, "trivial_dropped": 0}
    digest = hashlib.sha256()
    pairs: list[DocPair] = []
    for name, path in find_modules(root, modules):
        counts["modules"] += 1
        digest.update(f"{name}\0{sha256_file(path)}\n".encode())
        for qual, doc in docstrings(parse_module(path)):
            counts["docstrings"] += 1
            pair = pair_from_docstring(doc)
            if pair is None:
                counts["trivial_dropped"] += 1
                continue
            pairs.append(DocPair(name, qual, *pair))
    return pairs, counts, digest.hexdigest()


def _key(text: str) -> str:
    return normalize_text(text).casefold()


def deduplicate(pairs: Iterable[DocPair]) -> tuple[list[DocPair], dict]:
    """Keep a pair only when neither its query nor its document was kept already ((module, name) order)."""
    seen_q: set[str] = set()
    seen_d: set[str] = set()
    kept: list[DocPair] = []
    dq = dd = 0
    for p in sorted(pairs, key=lambda p: (p.module, p.name)):
        qk, dk = _key(p.query), _key(p.document)
        if qk in seen_q:
            dq += 1
        elif dk in seen_d:
            dd += 1
        else:
            seen_q.add(qk)
            seen_d.add(dk)
            kept.append(p)
    return kept, {"duplicate_query_dropped": dq, "duplicate_document_dropped": dd}


# --------------------------------------------------------------------------------- writing


def is_eval(pair: DocPair, eval_fraction: float) -> bool:
    return is_eval_source(pair.package, eval_fraction)


def write_stdlib_docs(out: Path, pairs: Sequence[DocPair], eval_fraction: float, inputs: dict, counts: dict) -> dict:
    """train.jsonl, eval/ and manifest.json into ``out`` (an existing empty folder)."""
    pairs = sorted(pairs, key=lambda p: (p.module, p.name))
    train = [p for p in pairs if not is_eval(p, eval_fraction)]
    evals = [p for p in pairs if is_eval(p, eval_fraction)]
    write_jsonl(out / "train.jsonl", ({"query": p.query, "positive": p.document, "query_id": p.id, "doc_id": p.id,
                                       "group": p.module} for p in train))
    ev = out / "eval"
    (ev / "qrels").mkdir(parents=True, exist_ok=True)
    write_jsonl(ev / "corpus.jsonl", ({"_id": p.id, "title": "", "text": p.document, "group": p.module} for p in evals))
    write_jsonl(ev / "queries.jsonl", ({"_id": p.id, "text": p.query} for p in evals))
    write_qrels(ev / "qrels" / "test.tsv", {p.id: {p.id: 1} for p in evals})
    train_packages, eval_packages = {p.package for p in train}, {p.package for p in evals}
    assert not train_packages & eval_packages
    counts = dict(counts, pairs=len(pairs), train_pairs=len(train), eval_queries=len(evals), eval_documents=len(evals),
                  train_packages=len(train_packages), eval_packages=len(eval_packages),
                  train_modules=len({p.module for p in train}), eval_modules=len({p.module for p in evals}))
    files = {rel: sha256_file(out / rel)
             for rel in ("train.jsonl", "eval/corpus.jsonl", "eval/queries.jsonl", "eval/qrels/test.tsv")}
    manifest = {
        "dataset": "Python standard library docstrings (query: summary paragraph, document: the rest)",
        "builder_version": BUILDER_VERSION,
        "inputs": inputs,
        "options": {"eval_fraction": eval_fraction},
        "split_rule": (f"eval iff stable_id(package) % {_SPLIT_MOD} < {round(eval_fraction * _SPLIT_MOD)}, where "
                       "package is the module's top-level package and stable_id(s) the first 8 bytes (big-endian, "
                       "top bit cleared) of sha256(NFC, whitespace-collapsed s)"),
        "filter_rule": (f"dropped: a docstring of one paragraph, a summary under {MIN_QUERY_WORDS} words, over "
                        f"{MAX_QUERY_CHARS} characters or a call signature, a document under {MIN_DOC_WORDS} words; "
                        "then, in (module, name) order, a pair whose query or document (NFC, whitespace-collapsed, "
                        "case-folded) was kept already"),
        "ids": "query_id = doc_id = corpus _id = module:Qualified.name (the module alone for its own docstring); "
               "group = module",
        "counts": counts,
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def build_stdlib_docs(
    out: str | Path,
    stdlib: Optional[str | Path] = None,
    modules: Optional[Sequence[str]] = None,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    overwrite: bool = True,
) -> dict:
    """Build the data set into ``out`` atomically (see :mod:`.builds`); returns the manifest.
    ``stdlib``: the library folder (default: this interpreter's); ``modules``: dotted names to
    read instead of every module."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    out = Path(out)
    root = Path(stdlib) if stdlib else default_stdlib()
    check_output_dir(out, overwrite)
    found, counts, digest = load_pairs(root, modules)
    pairs, dcounts = deduplicate(found)
    counts.update(dcounts)
    if not pairs:
        raise DataError(f"{root}: no usable docstrings in {counts['modules']} module(s)")
    held_out = sum(is_eval(p, eval_fraction) for p in pairs)
    if held_out in (0, len(pairs)):
        raise DataError(
            f"{root}: every one of the {len(pairs)} pairs ({len({p.package for p in pairs})} package(s)) falls on the "
            f"{'training' if held_out == 0 else 'evaluation'} side at eval_fraction={eval_fraction}; "
            "read more modules or choose another --eval-fraction")
    inputs = {"stdlib": str(root) if stdlib else f"Python {sys.version.split()[0]}'s",
              "modules": list(modules) if modules is not None else "all", "files_sha256": digest}
    return build_into(out, lambda tmp: write_stdlib_docs(tmp, pairs, eval_fraction, inputs, counts))


__all__ = [
    "BUILDER_VERSION",
    "DEFAULT_EVAL_FRACTION",
    "DocPair",
    "build_stdlib_docs",
    "deduplicate",
    "default_stdlib",
    "docstrings",
    "find_modules",
    "load_pairs",
    "pair_from_docstring",
    "split_summary",
    "parse_module",
    "write_stdlib_docs",
]
