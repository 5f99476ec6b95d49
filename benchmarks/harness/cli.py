"""The command-line options every benchmark shares, the data and cache locations they set, and the
repository's paths (``ROOT``, ``RESULTS``).

A script builds its parser with ``parser(__doc__)``, adds the shared options it takes with
``add_common`` (always ``--out``, ``--threads``, ``--debian-dir``, ``--cache``), ``add_selection``
(``--only``, ``--seeds``), ``add_report``, ``add_deadline`` and ``add_fresh``, then its own; ``apply(args)`` sets
the locations and the thread count before anything is loaded.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_DEBIAN_DIR = ROOT.parent / "shared" / "data" / "debian-bookworm"


def set_locations(debian_dir: Optional[str] = None, cache: Optional[str] = None) -> None:
    """The apt lists and the cache: a given value wins, then the environment, then the defaults
    (``DEFAULT_DEBIAN_DIR`` when it exists; the package's ``cache_root()``, so nothing is set)."""
    if debian_dir:
        os.environ["MOCO_RETRIEVAL_DEBIAN_DIR"] = str(Path(debian_dir).expanduser().resolve())
    elif not os.environ.get("MOCO_RETRIEVAL_DEBIAN_DIR") and DEFAULT_DEBIAN_DIR.is_dir():
        os.environ["MOCO_RETRIEVAL_DEBIAN_DIR"] = str(DEFAULT_DEBIAN_DIR)
    if cache:
        os.environ["MOCO_RETRIEVAL_CACHE"] = str(Path(cache).expanduser().resolve())


def bench_cache(name: str) -> Path:
    """A benchmark's file or folder under the package cache (``cache_root()/bench/<name>``): finished
    runs and generated data kept outside the results folder."""
    from moco_retrieval.config import cache_root  # here: the package loads only when a script asks

    return cache_root() / "bench" / name


def parser(doc: Optional[str]) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_locations(ap: argparse.ArgumentParser) -> None:
    """``--debian-dir`` and ``--cache``."""
    ap.add_argument("--debian-dir", default=None,
                    help="folder with the apt Packages and Translation-en files (default $MOCO_RETRIEVAL_DEBIAN_DIR, "
                         f"else {DEFAULT_DEBIAN_DIR} when it exists)")
    ap.add_argument("--cache", default=None,
                    help="built data sets, frozen features and finished-run caches (default $MOCO_RETRIEVAL_CACHE, "
                         "else ~/.cache/moco_retrieval)")


def add_out(ap: argparse.ArgumentParser, default: Optional[Path] = None,
            help: str = "results folder (default benchmarks/results)") -> None:
    """``--out``: the results folder (``default`` None: the script picks, e.g. benchmarks/results
    or a temporary folder for a smoke run; ``out_dir`` resolves it)."""
    ap.add_argument("--out", type=Path, default=default, help=help)


def add_threads(ap: argparse.ArgumentParser, default: Optional[int] = None, help: Optional[str] = None) -> None:
    ap.add_argument("--threads", type=int, default=default,
                    help=help or f"torch threads (default {default if default else chr(39).join(['torch', 's'])})")


def add_common(ap: argparse.ArgumentParser, *, out: Optional[Path] = None, threads: Optional[int] = None,
               out_help: str = "results folder (default benchmarks/results)") -> None:
    """What every benchmark on the Debian set takes: ``--out``, ``--threads`` and the locations."""
    add_out(ap, out, out_help)
    add_threads(ap, threads)
    add_locations(ap)


def add_only(ap: argparse.ArgumentParser, runs: Sequence[str], default: Optional[str], help: Optional[str] = None) -> None:
    """``--only``: comma-separated names of ``runs`` (checked by ``names``)."""
    ap.add_argument("--only", default=default, help=help or f"runs to do now, of: {', '.join(runs)}")


def add_seeds(ap: argparse.ArgumentParser, default: Optional[str] = "0", help: str = "comma-separated seeds to run now") -> None:
    """``--seeds``: comma-separated seeds (``seeds`` parses them)."""
    ap.add_argument("--seeds", default=default, help=help)


def add_selection(ap: argparse.ArgumentParser, *, runs: Sequence[str], default: Optional[str], seeds: bool = True) -> None:
    """``--only`` and, with ``seeds``, ``--seeds`` (default 0)."""
    add_only(ap, runs, default)
    if seeds:
        add_seeds(ap)


def add_report(ap: argparse.ArgumentParser, help: str = "only write the report from the cache") -> None:
    ap.add_argument("--report", action="store_true", help=help)


def add_fresh(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--fresh", action="store_true", help="ignore the cache of finished runs (kept aside as .old)")


def add_deadline(ap: argparse.ArgumentParser, what: str = "runs") -> None:
    ap.add_argument("--deadline", default=None, help=f"UTC HH:MM: {what} not started by then are cut")


def apply(args: argparse.Namespace) -> None:
    """The locations and the thread count of ``args`` (options a parser did not add are skipped)."""
    set_locations(getattr(args, "debian_dir", None), getattr(args, "cache", None))
    if getattr(args, "threads", None):
        import torch  # here, not at the top: a measuring child of index_scale.py must not load it

        torch.set_num_threads(args.threads)


def names(arg: str, known: Sequence[str], flag: str = "--only") -> list[str]:
    """The comma-separated names of ``arg``; exits with the known ones when one is unknown."""
    out = [n for n in (arg or "").split(",") if n]
    unknown = [n for n in out if n not in known]
    if unknown:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown)}; expected some of {', '.join(known)}")
    return out


def seeds(arg: str) -> list[int]:
    return [int(s) for s in str(arg).split(",") if s != ""]


def out_dir(args: argparse.Namespace, default: Path = RESULTS) -> Path:
    """``--out`` (else ``default``), created."""
    out = Path(args.out) if getattr(args, "out", None) else default
    out.mkdir(parents=True, exist_ok=True)
    return out
