"""Build and prepare data: ``python -m moco_retrieval.data debian|pydoc|prepare ...``.

    python -m moco_retrieval.data debian --out DIR [--lists DIR | --translation FILE --packages FILE]
    python -m moco_retrieval.data pydoc --out DIR [--stdlib DIR] [--modules a,b.c]
    python -m moco_retrieval.data prepare data=KIND data.KEY=VALUE ... [workers=N] [--verify]
    python -m moco_retrieval.data prepare ... data.stream=true data.stream_dir=DIR [workers=N]

``debian`` and ``pydoc`` build a retrieval set (``DIR/train.jsonl``, ``DIR/eval/`` in the BEIR layout,
``DIR/manifest.json``); ``prepare`` converts a run's training pairs (each source's, with
``data.sources``) into their store (convert.py) ahead of a cluster job, with the same ``data.*``
overrides as the run, in ``workers=N`` processes (``data.prepare_workers``; ``data.stream=true``: the
store, then its chunks in ``data.stream_dir``, stream.py); ``--verify`` checks every byte of a store already there against its manifest
(every open checks sizes, row counts and the numeric arrays) and converts one that differs again.

Not a Hydra command: its subcommands take files and flags (docs/design.md, Layout). It shares
the commands' error reporting (errors.reports_user_errors: a known error is one message and status
2, Ctrl-C status 130, ``HYDRA_FULL_ERROR=1`` the traceback), ``prepare`` their report of a bad
override (command.composition_message), and ``--help`` is built from this docstring as theirs is.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional, Sequence

from moco_retrieval.command import asks_for_help, summary
from moco_retrieval.errors import ConfigError, reports_user_errors

from moco_retrieval.data.builders.debian import (
    DEDUP_MODES,
    DEFAULT_EVAL_FRACTION,
    DEFAULT_LISTS_DIR,
    ENV_DEBIAN_DIR,
    MIN_EVAL_DOCS,
    build_debian,
    find_index_files,
)
from moco_retrieval.data.formats import DataError
from moco_retrieval.data.builders.stdlib_docs import DEFAULT_EVAL_FRACTION as PYDOC_EVAL_FRACTION, build_stdlib_docs

PROG = "python -m moco_retrieval.data"


def fraction(text: str) -> float:
    """``--eval-fraction``: a number strictly between 0 and 1 (argparse reports anything else)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text}")
    return value


def _parser(prepare_help: bool = False) -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog=PROG, description=summary(__doc__), formatter_class=raw)
    sub = ap.add_subparsers(dest="command", required=True)
    out_help = "output folder (created; a previous build there is replaced)"
    d = sub.add_parser(
        "debian", formatter_class=raw,
        help="Debian package descriptions: query = short description, document = long description",
        description=(
            "Build a title-to-body retrieval set from apt's index files: DIR/train.jsonl, DIR/eval/ (BEIR layout)\n"
            "and DIR/manifest.json. Deterministic: the same inputs give byte-identical outputs."
        ),
    )
    d.add_argument("--out", required=True, metavar="DIR", help=out_help)
    d.add_argument("--lists", default=None, metavar="DIR",
                   help=f"folder with apt lists (default ${ENV_DEBIAN_DIR}, else {DEFAULT_LISTS_DIR})")
    d.add_argument("--translation", action="append", default=None, metavar="FILE",
                   help="a Translation-en file (repeatable)")
    d.add_argument("--packages", action="append", default=None, metavar="FILE", help="a Packages file (repeatable)")
    d.add_argument("--eval-fraction", type=fraction, default=DEFAULT_EVAL_FRACTION,
                   help=f"share of source packages held out for evaluation (default {DEFAULT_EVAL_FRACTION})")
    d.add_argument("--dedup", choices=DEDUP_MODES, default="first-paragraph",
                   help="document key for duplicate removal (default first-paragraph)")
    p = sub.add_parser(
        "pydoc", formatter_class=raw,
        help="Python standard library docstrings: query = summary line, document = the rest",
        description=("Build a summary-to-description retrieval set from the installed standard library's docstrings\n"
                     "(parsed, not imported): DIR/train.jsonl, DIR/eval/ (BEIR layout) and DIR/manifest.json."),
    )
    p.add_argument("--out", required=True, metavar="DIR", help=out_help)
    p.add_argument("--stdlib", default=None, metavar="DIR", help="the library folder (default: this interpreter's)")
    p.add_argument("--modules", default=None, help="comma-separated dotted module names (default: every module)")
    p.add_argument("--eval-fraction", type=fraction, default=PYDOC_EVAL_FRACTION,
                   help=f"share of top-level packages held out for evaluation (default {PYDOC_EVAL_FRACTION})")
    r = sub.add_parser(
        "prepare", formatter_class=raw,
        help="convert training pairs into the memory-mapped store a run reads (ahead of a cluster job)",
        description=(
            "Convert the training pairs of a data config into the store training opens (Arrow + numpy, keyed by\n"
            "the input's content; an existing store of the same content is kept). Takes the training command's\n"
            "data overrides, e.g. data=hf data.path=DIR, or data=jsonl data.train_path=FILE; workers=N converts in N\n"
            "processes (data.prepare_workers: JSONL and Parquet files, folders of Parquet shards)."
        ),
        epilog=_data_options() if prepare_help else None,
    )
    r.add_argument("--verify", action="store_true",
                   help="check the sha256 of every file of a store already there (texts too; each open checks "
                        "sizes, row counts and the numeric arrays) and convert one that differs again")
    r.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                   help="data=KIND and data.KEY=VALUE overrides, as for training; workers=N")
    return ap


def _data_options() -> str:
    """``prepare --help``'s list of data kinds, as the commands' ``--help`` lists a group's options."""
    from moco_retrieval.command import groups_and_options, register_configs

    register_configs()
    kinds = groups_and_options("train")[0].get("data", [])
    return (f"Data kinds (data=KIND; then data.KEY=VALUE sets one key):\n  data: {', '.join(kinds)}\n\n"
            "Every data key and its value: python -m moco_retrieval.train --cfg job data=KIND. "
            "A key that does not exist is an error.")


def build_pydoc(args: argparse.Namespace) -> int:
    modules = [m.strip() for m in args.modules.split(",") if m.strip()] if args.modules else None
    t0 = time.time()
    manifest = build_stdlib_docs(args.out, args.stdlib, modules, eval_fraction=args.eval_fraction)
    _print_counts(args.out, manifest["counts"], "packages", time.time() - t0)
    return 0


def build_debian_set(args: argparse.Namespace) -> int:
    if args.translation or args.packages:
        if args.lists:
            raise DataError("pass either --lists or --translation/--packages, not both")
        if not (args.translation and args.packages):
            raise DataError("--translation and --packages go together (one or more of each)")
        tr, pk = args.translation, args.packages
    else:
        tr, pk = _lists_files(args.lists)
    t0 = time.time()
    manifest = build_debian(args.out, tr, pk, eval_fraction=args.eval_fraction, dedup=args.dedup)
    counts = manifest["counts"]
    _print_counts(args.out, counts, "sources", time.time() - t0)
    if counts["eval_documents"] < MIN_EVAL_DOCS:
        print(f"warning: the eval pool holds {counts['eval_documents']} documents (< {MIN_EVAL_DOCS}); "
              "raise --eval-fraction for a comparable benchmark", file=sys.stderr)
    return 0


def _print_counts(out: str, c: dict, unit: str, seconds: float) -> None:
    print(json.dumps(c, indent=2, sort_keys=True))
    print(f"wrote {out}: {c['train_pairs']} train pairs ({c['train_' + unit]} {unit}), "
          f"{c['eval_queries']} eval queries / documents ({c['eval_' + unit]} {unit}) in {seconds:.1f}s")


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


def _data_config(overrides: Sequence[str]):
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from moco_retrieval.command import composition_message, register_configs
    from moco_retrieval.config import DataConfig, to_config

    bad = [o for o in overrides if not (o.startswith(("data=", "data.", "workers=")))]
    if bad:
        raise ConfigError(f"prepare takes data=KIND, data.KEY=VALUE and workers=N overrides only, got {' '.join(bad)}")
    # workers=N is data.prepare_workers=N, the key a training run converts with (its range is checked there)
    overrides = [f"data.prepare_{o}" if o.startswith("workers=") else o for o in overrides]
    register_configs()
    with initialize_config_module("moco_retrieval.conf", version_base="1.3"):
        try:
            composed = compose("train", overrides=list(overrides))
        except (HydraException, OmegaConfBaseException) as e:
            raise ConfigError(composition_message(e)) from e
    return to_config(DataConfig, composed.data)


def prepare(args: argparse.Namespace) -> int:
    """Convert (or find) the store of the configured training pairs; print where it is."""
    from moco_retrieval.data.multisource import has_sources, prepare_sources, source_names
    from moco_retrieval.data.sources import prepare_store

    cfg = _data_config(args.overrides)
    if cfg.stream:  # the chunks of data.stream_dir (stream.py), written by data.prepare_workers processes
        from moco_retrieval.data.stream import prepare_stream

        m = prepare_stream(cfg, cfg.prepare_workers)
        print(f"stream {cfg.stream_dir}: {m['rows']:,} rows of {', '.join(m['sources'])}")
        return 0
    if has_sources(cfg):  # every source's store (a beir source reads qrels: nothing to convert)
        for name, folder in zip(source_names(cfg), prepare_sources(cfg, args.verify)):
            _print_store(folder, args.verify, f"source {name}: ")
        return 0
    if cfg.kind == "beir":
        raise DataError("data=beir: its training pairs come from qrels and need no preparing")
    _print_store(prepare_store(cfg, verify=args.verify), args.verify)
    return 0


def _print_store(folder, verified: bool, prefix: str = "") -> None:
    from moco_retrieval.data.convert import folder_bytes
    from moco_retrieval.data.store import read_manifest

    if folder is None:
        print(f"{prefix}beir: training pairs from qrels, nothing to convert")
        return
    m = read_manifest(folder)
    print(f"{prefix}store {folder}: {m['rows']:,} rows of {m['name']}, {folder_bytes(folder) / 1e6:,.1f} MB"
          + (", verified: every file matches the sha256 in its manifest" if verified else ""))


SUBCOMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "debian": build_debian_set, "pydoc": build_pydoc, "prepare": prepare}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs one subcommand; 0 when done. Bad input ends it as every command ends: argparse's usage
    errors and a known error (errors.UserError: one message) with ``SystemExit(2)``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(prepare_help=asks_for_help(argv) and "prepare" in argv).parse_args(argv)
    return reports_user_errors(f"data {args.command}")(SUBCOMMANDS[args.command])(args)


if __name__ == "__main__":
    sys.exit(main())
