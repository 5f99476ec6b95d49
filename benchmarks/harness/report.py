"""What the reports share: medians and spreads over seeds, the table cells built from them, the
environment a result was measured in, peak memory, plots and the log line.

* ``median``, ``std``, ``mean``: over the values that exist (None skipped);
* ``med_std``: median and sample std (nan when not defined); ``fmt`` / ``fmt_recorded``: a table
  cell "median ± std" of a metric of each run's ``final`` scores; ``paired``: per-seed differences
  of two runs on the same batches; ``f3``: three decimals or "n/a";
* ``environment()``: versions, threads, machine and date; ``peak_rss_mb()``;
* ``figure(w, h)``: a Matplotlib figure without a display; ``log(msg)``: a timestamped line.

Loads no torch at import (``environment`` does when it is called).
"""
from __future__ import annotations

import math
import os
import platform
import resource
import statistics
import sys
import time
from typing import Optional, Sequence


def median(xs: Sequence[float]) -> float:
    xs = [float(x) for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else float("nan")


def std(xs: Sequence[float]) -> float:
    xs = [float(x) for x in xs if x is not None]
    return float(statistics.stdev(xs)) if len(xs) > 1 else 0.0


def mean(xs: Sequence[float]) -> float:
    xs = [float(x) for x in xs if x is not None]
    return float(statistics.fmean(xs)) if xs else float("nan")


def med_std(xs):
    """Median and sample std of the values that exist; (nan, nan) without any, std nan with one."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return float("nan"), float("nan")
    return statistics.median(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def fmt(xs, key) -> str:
    """"median ± std" of ``final[key]`` over the runs ``xs`` (no ± with one run)."""
    m, s = med_std([r["final"][key] for r in xs])
    return f"{m:.3f}" + (f" ± {s:.3f}" if s == s else "")


def fmt_recorded(xs, key) -> str:
    """``fmt`` over the runs that recorded ``key`` (blank when none did), with how many did."""
    have = [x for x in xs if key in x["final"]]
    return "" if not have else fmt(have, key) + ("" if len(have) == len(xs) else f" ({len(have)} seed(s))")


def paired(q: list[dict], r: list[dict], key: str) -> list[float]:
    """Per-seed differences q - r in ``key``, over the seeds both ran (a seed fixes the batches)."""
    ref = {x["seed"]: x["final"][key] for x in r}
    return [x["final"][key] - ref[x["seed"]] for x in sorted(q, key=lambda x: x["seed"]) if x["seed"] in ref]


def f3(x: Optional[float]) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3f}"


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def environment() -> dict:
    import lightning
    import torch
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def figure(w: float = 6.4, h: float = 4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
