"""``python -m moco_retrieval.data debian --out DIR [--lists DIR | --translation FILE --packages FILE]``
``python -m moco_retrieval.data pydoc --out DIR [--stdlib DIR] [--modules a,b.c]``

``python -m moco_retrieval.data prepare data=KIND data.KEY=VALUE ...``: convert a run's training pairs
(each source's, with ``data.sources``) into their store (convert.py) ahead of a cluster job, with the
same ``data.*`` overrides as the run."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

from .debian import (
    DEDUP_MODES,
    DEFAULT_EVAL_FRACTION,
    DEFAULT_LISTS_DIR,
    ENV_DEBIAN_DIR,
    MIN_EVAL_DOCS,
    build_debian,
    find_index_files,
)
from .formats import DataError
from .stdlib_docs import DEFAULT_EVAL_FRACTION as PYDOC_EVAL_FRACTION, build_stdlib_docs


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moco_retrieval.data", description="Build data sets.")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "debian",
        help="Debian package descriptions: query = short description, document = long description",
        description=(
            "Build a title-to-body retrieval set from apt's index files: DIR/train.jsonl, DIR/eval/ (BEIR layout) "
            "and DIR/manifest.json. Deterministic: the same inputs give byte-identical outputs."
        ),
    )
    d.add_argument("--out", required=True, help="output folder (created; a previous build there is replaced)")
    d.add_argument("--lists", default=None,
                   help=f"folder with apt lists (default ${ENV_DEBIAN_DIR}, else {DEFAULT_LISTS_DIR})")
    d.add_argument("--translation", action="append", default=None, help="a Translation-en file (repeatable)")
    d.add_argument("--packages", action="append", default=None, help="a Packages file (repeatable)")
    d.add_argument(
        "--eval-fraction", type=float, default=DEFAULT_EVAL_FRACTION,
        help=f"share of source packages held out for evaluation (default {DEFAULT_EVAL_FRACTION})",
    )
    d.add_argument(
        "--dedup", choices=DEDUP_MODES, default="first-paragraph",
        help="document key for duplicate removal (default first-paragraph)",
    )
    p = sub.add_parser(
        "pydoc",
        help="Python standard library docstrings: query = summary line, document = the rest",
        description=("Build a summary-to-description retrieval set from the installed standard library's docstrings "
                     "(parsed, not imported): DIR/train.jsonl, DIR/eval/ (BEIR layout) and DIR/manifest.json."),
    )
    p.add_argument("--out", required=True, help="output folder (created; a previous build there is replaced)")
    p.add_argument("--stdlib", default=None, help="the library folder (default: this interpreter's)")
    p.add_argument("--modules", default=None, help="comma-separated dotted module names (default: every module)")
    p.add_argument("--eval-fraction", type=float, default=PYDOC_EVAL_FRACTION,
                   help=f"share of top-level packages held out for evaluation (default {PYDOC_EVAL_FRACTION})")
    r = sub.add_parser(
        "prepare",
        help="convert training pairs into the memory-mapped store a run reads (ahead of a cluster job)",
        description=(
            "Convert the training pairs of a data config into the store training opens (Arrow + numpy, keyed by "
            "the input's content; an existing store of the same content is kept). Takes the training command's "
            "data overrides, e.g. data=hf data.path=DIR, or data=jsonl data.train_path=FILE."
        ),
    )
    r.add_argument("overrides", nargs="*", help="data=KIND and data.KEY=VALUE overrides, as for training")
    return ap


def _build_pydoc(args: argparse.Namespace) -> dict:
    modules = [m.strip() for m in args.modules.split(",") if m.strip()] if args.modules else None
    return build_stdlib_docs(args.out, args.stdlib, modules, eval_fraction=args.eval_fraction)


def _build_debian(args: argparse.Namespace) -> dict:
    if args.translation or args.packages:
        if args.lists:
            raise DataError("pass either --lists or --translation/--packages, not both")
        if not (args.translation and args.packages):
            raise DataError("--translation and --packages go together (one or more of each)")
        tr, pk = args.translation, args.packages
    else:
        tr, pk = _lists_files(args.lists)
    return build_debian(args.out, tr, pk, eval_fraction=args.eval_fraction, dedup=args.dedup)


def _data_config(overrides: Sequence[str]):
    from hydra import compose, initialize_config_module

    from moco_retrieval.config import DataConfig, register_configs, to_config

    bad = [o for o in overrides if not (o.startswith("data=") or o.startswith("data."))]
    if bad:
        raise DataError(f"prepare takes data=KIND and data.KEY=VALUE overrides only, got {' '.join(bad)}")
    register_configs()
    with initialize_config_module("moco_retrieval.conf", version_base="1.3"):
        return to_config(DataConfig, compose("train", overrides=list(overrides)).data)


def prepare(overrides: Sequence[str]) -> int:
    """Convert (or find) the store of the configured training pairs; print where it is."""
    from .multisource import has_sources, prepare_sources, source_names
    from .sources import prepare_store

    cfg = _data_config(overrides)
    if has_sources(cfg):  # every source's store (a beir source reads qrels: nothing to convert)
        for name, folder in zip(source_names(cfg), prepare_sources(cfg)):
            _print_store(folder, f"source {name}: ")
        return 0
    if cfg.kind == "beir":
        raise DataError("data=beir: its training pairs come from qrels and need no preparing")
    _print_store(prepare_store(cfg))
    return 0


def _print_store(folder, prefix: str = "") -> None:
    from .convert import folder_bytes
    from .store import read_manifest

    if folder is None:
        print(f"{prefix}beir: training pairs from qrels, nothing to convert")
        return
    m = read_manifest(folder)
    print(f"{prefix}store {folder}: {m['rows']:,} rows of {m['name']}, {folder_bytes(folder) / 1e6:,.1f} MB")


def _lists_files(lists: Optional[str]) -> tuple[list, list]:
    """The index files of ``--lists``, else of ``$MOCO_RETRIEVAL_DEBIAN_DIR`` (as training reads
    it), else of apt's own lists; the error names the folder used and how to give another."""
    env = os.environ.get(ENV_DEBIAN_DIR) or None
    where, label = (lists, "--lists") if lists else (env, f"${ENV_DEBIAN_DIR}") if env else (DEFAULT_LISTS_DIR, "the default")
    try:
        return find_index_files(where)
    except DataError as exc:
        raise DataError(f"{exc}. Used {label} ({where}); give the apt lists with --lists DIR "
                        f"(or ${ENV_DEBIAN_DIR}=DIR)") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "prepare":
        return _reported(prepare, args.overrides)
    t0 = time.time()
    try:
        manifest = _build_pydoc(args) if args.command == "pydoc" else _build_debian(args)
    except (DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    c = manifest["counts"]
    print(json.dumps(c, indent=2, sort_keys=True))
    unit = "sources" if args.command == "debian" else "packages"
    print(
        f"wrote {args.out}: {c['train_pairs']} train pairs ({c['train_' + unit]} {unit}), "
        f"{c['eval_queries']} eval queries / documents ({c['eval_' + unit]} {unit}) in {time.time() - t0:.1f}s"
    )
    if args.command == "debian" and c["eval_documents"] < MIN_EVAL_DOCS:
        print(
            f"warning: the eval pool holds {c['eval_documents']} documents (< {MIN_EVAL_DOCS}); "
            "raise --eval-fraction for a comparable benchmark",
            file=sys.stderr,
        )
    return 0


def _reported(fn, *args) -> int:
    """``fn(*args)``; a user error (bad data, a bad override) as one line on stderr, status 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from moco_retrieval.errors import UserError

    try:
        return fn(*args)
    except (UserError, ValueError, OmegaConfBaseException, HydraException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
