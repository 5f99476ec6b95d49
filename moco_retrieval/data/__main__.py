"""``python -m moco_retrieval.data debian --out DIR [--lists DIR | --translation FILE --packages FILE]``"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, Sequence

from .debian import (
    DEDUP_MODES,
    DEFAULT_EVAL_FRACTION,
    DEFAULT_LISTS_DIR,
    MIN_EVAL_DOCS,
    build_debian,
    find_index_files,
)
from .formats import DataError


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
    d.add_argument("--lists", default=None, help=f"folder with apt lists (default {DEFAULT_LISTS_DIR})")
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
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.translation or args.packages:
            if args.lists:
                raise DataError("pass either --lists or --translation/--packages, not both")
            if not (args.translation and args.packages):
                raise DataError("--translation and --packages go together (one or more of each)")
            tr, pk = args.translation, args.packages
        else:
            tr, pk = find_index_files(args.lists or DEFAULT_LISTS_DIR)
        t0 = time.time()
        manifest = build_debian(args.out, tr, pk, eval_fraction=args.eval_fraction, dedup=args.dedup)
    except (DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    c = manifest["counts"]
    print(json.dumps(c, indent=2, sort_keys=True))
    print(
        f"wrote {args.out}: {c['train_pairs']} train pairs ({c['train_sources']} sources), "
        f"{c['eval_queries']} eval queries / documents ({c['eval_sources']} sources) in {time.time() - t0:.1f}s"
    )
    if c["eval_documents"] < MIN_EVAL_DOCS:
        print(
            f"warning: the eval pool holds {c['eval_documents']} documents (< {MIN_EVAL_DOCS}); "
            "raise --eval-fraction for a comparable benchmark",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
