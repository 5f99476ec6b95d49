"""Before a long encoding: what will be encoded and about how long it will take here, measured on
a sample (encoding ~40k Debian descriptions takes a quarter of an hour on a CPU; a user should
know that before waiting, and be pointed at the smaller choices)."""
from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import numpy as np

from moco_retrieval.model.devices import module_device
from moco_retrieval.progress import log_line

SAMPLE = 64  # texts timed; spread over the length order, so long and short ones count
WARM_UP = 4  # texts encoded once before the timing
QUIET_BELOW_S = 20.0  # below this, the forecast is one short line without advice


def sample_for_timing(texts: Sequence[str], n: int = SAMPLE) -> list[str]:
    """``n`` texts spread evenly over the texts sorted by length (all of them when fewer)."""
    if len(texts) <= n:
        return list(texts)
    ordered = sorted(texts, key=len)
    step = len(ordered) / n
    return [ordered[int(i * step)] for i in range(n)]


def estimate_seconds(encoder: Any, texts: Sequence[str], kind: str, batch_size: int) -> float:
    """Seconds to encode ``texts`` as ``kind``, from timing a length-spread sample of them."""
    return _scaled_seconds(encoder, sample_for_timing(texts), len(texts), kind, batch_size)


def _scaled_seconds(encoder: Any, sample: list[str], n: int, kind: str, batch_size: int) -> float:
    from moco_retrieval.evaluation.encode import encode_texts

    if not sample:
        return 0.0
    # untimed: the first call's one-off costs (allocator, thread pool, lazy kernels) would
    # otherwise be scaled up with the sample to every text (forecasts ran several times high)
    encode_texts(encoder, sample[:WARM_UP], kind, WARM_UP, show_progress=False)
    t0 = time.perf_counter()
    encode_texts(encoder, sample, kind, min(batch_size, len(sample)), show_progress=False)
    return (time.perf_counter() - t0) * n / len(sample)


def corpus_timing_sample(corpus: Any, n: int = SAMPLE) -> list[str]:
    """:func:`sample_for_timing` of a corpus view (data/corpus_store.py), chosen from its length array
    (the same texts: both sorts are stable), reading only the ``n`` texts chosen."""
    lengths = np.asarray(corpus.lengths)
    if len(lengths) <= n:
        return corpus.texts(range(len(lengths)))
    ordered = np.argsort(lengths, kind="stable")
    step = len(ordered) / n
    return corpus.texts([int(ordered[int(i * step)]) for i in range(n)])


def announce_corpus(encoder: Any, corpus: Any, what: str, batch_size: int, hint: str = "",
                    queries: Sequence[str] | None = None) -> float:
    """:func:`announce_encoding` of every document of a corpus view (and ``queries``, when given),
    without reading every text."""
    seconds = _scaled_seconds(encoder, corpus_timing_sample(corpus), len(corpus), "doc", batch_size)
    counts = f"{len(corpus):,} documents"
    if queries is not None:
        seconds += estimate_seconds(encoder, queries, "query", batch_size)
        counts += f" + {len(queries):,} queries"
    return _announce(encoder, seconds, counts, what, hint)


def announce_encoding(encoder: Any, jobs: list[tuple[Sequence[str], str]], what: str, batch_size: int,
                      hint: str = "") -> float:
    """One line on stderr before encoding: how many texts of ``what``, on which device, about how
    long (``jobs``: ``(texts, kind)`` pairs); ``hint`` (a smaller choice) when it is long."""
    seconds = sum(estimate_seconds(encoder, texts, kind, batch_size) for texts, kind in jobs)
    counts = " + ".join(f"{len(t):,} {'queries' if k == 'query' else 'documents'}" for t, k in jobs)
    return _announce(encoder, seconds, counts, what, hint)


def _announce(encoder: Any, seconds: float, counts: str, what: str, hint: str) -> float:
    msg = f"encoding {counts} ({what}) on {module_device(encoder) or 'cpu'}: about {_duration(seconds)}"
    if seconds >= QUIET_BELOW_S and hint:
        msg += f"; {hint}"
    log_line(msg, file=sys.stderr)
    return seconds


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


__all__ = ["sample_for_timing", "estimate_seconds", "announce_encoding", "corpus_timing_sample", "announce_corpus"]
