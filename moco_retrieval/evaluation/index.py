"""FAISS indexes over document embeddings, all ranking by inner product.

The score is the training metric. The index never normalizes: a model that L2-normalizes its
outputs hands in unit vectors, so inner product is cosine; a model trained without
normalization is ranked by its raw dot product, as it was trained. Normalizing here would rank
such a model by a similarity it never learned.

Kinds:

* ``flat`` (``IndexFlatIP``, the default): exact brute-force search. Memory is the raw vectors
  (4 * d bytes per document); time is linear in the corpus. The right choice up to a few
  million documents on a CPU, and always the reference.
* ``ivf`` (``IndexIVFFlat``): k-means splits the corpus into ``nlist`` cells; a query scans only
  the ``nprobe`` cells whose centroids score highest. Trades exactness for speed: a relevant
  document in a cell that is not probed is missed (recall drops as ``nprobe / nlist`` falls;
  ``nprobe == nlist`` is exact search again). Needs a training pass: at least ``nlist`` points
  (FAISS wants ~39 * nlist for good centroids), and cells learned on one corpus suit it only.
  Memory is the same as flat, plus the centroids.
* ``ivfpq`` (``IndexIVFPQ``): IVF cells as above, and each document stored as ``pq_m`` bytes
  (product quantization of its residual to its cell's centroid: ``pq_m`` sub-vectors of
  ``d / pq_m`` dimensions, 256 codewords each) instead of ``4 * d``: 1,536 -> 48 bytes at d=384,
  pq_m=48, so tens of millions of documents fit in a few GB. Scores are approximate (the
  quantized vectors'), so recall is below ``ivf``'s at the same ``nprobe`` even when every cell is
  probed (benchmarks/results/index_scale.md). Trained on a seeded sample of at most
  ``max(64 * nlist, 65536)`` documents; ``d`` must be a multiple of ``pq_m``.
* ``hnsw`` (``IndexHNSWFlat``): a navigable small-world graph with ``M`` links per node; search
  explores ``efSearch`` candidates greedily. Trades exactness and memory for speed: approximate
  results (recall rises with ``efSearch``), extra memory for the graph (about ``M * 2 * 4``
  bytes per document beyond the vectors), slow construction, and no removal of documents. No
  training pass.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

import faiss

from moco_retrieval.config import IndexKind

PQ_BITS = 8  # bits per sub-vector code: 256 codewords, one byte (FAISS's well-trodden setting)
ADD_CHUNK = 65_536  # documents converted and added at a time: a memory-mapped corpus is never copied whole


def _check_2d(x: Any) -> Any:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().float().cpu().numpy()
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"expected a 2-D array [n, d] of embeddings, got shape {getattr(x, 'shape', None)}")
    return x


def _training_sample(x: Any, size: int, seed: int) -> np.ndarray:
    """``size`` rows of ``x`` drawn without replacement (seeded, read in row order), as float32."""
    n = len(x)
    if size >= n:
        return _as_float32(x[0:n])
    rows = np.sort(np.random.default_rng(seed).choice(n, size, replace=False))
    return _as_float32(x[rows])


def _add_in_chunks(index: faiss.Index, x: Any) -> None:
    for start in range(0, len(x), ADD_CHUNK):
        index.add(_as_float32(x[start : start + ADD_CHUNK]))


def _as_float32(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().float().cpu().numpy()
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array [n, d] of embeddings, got shape {x.shape}")
    return x


def build_index(
    embeddings: Any,
    kind: str = "flat",
    *,
    nlist: int = 1024,
    nprobe: int = 32,
    pq_m: int = 48,
    hnsw_m: int = 32,
    ef_search: int = 128,
    ef_construction: int = 80,
    seed: int = 0,
) -> faiss.Index:
    """An inner-product index of ``embeddings`` (``[n, d]``, used as given: an array, a tensor or a
    ``np.memmap``, which is read ``ADD_CHUNK`` rows at a time, never copied whole).

    ``ivf`` and ``ivfpq`` raise ``ValueError`` when there are too few points to train on;
    ``ivfpq`` also when ``pq_m`` does not divide ``d``.
    """
    x = _check_2d(embeddings)
    n, d = x.shape
    if kind == "ivfpq":
        index = _ivfpq(x, nlist=nlist, nprobe=nprobe, pq_m=pq_m, seed=seed)
    elif kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif kind == "ivf":
        if n < nlist:
            raise ValueError(
                f"IVF with nlist={nlist} needs at least {nlist} training points, got {n}; "
                f"lower eval.nlist (about sqrt(n) to 4*sqrt(n)) or use eval.index=flat"
            )
        if n < 39 * nlist:
            warnings.warn(
                f"IVF: {n} points for nlist={nlist} (FAISS suggests >= {39 * nlist}); centroids may be poor",
                stacklevel=2,
            )
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = seed
        index.cp.verbose = False
        index.train(_training_sample(x, 256 * nlist, seed))  # FAISS's own cap: 256 points per centroid
        index.nprobe = min(nprobe, nlist)  # the wrapper keeps `quantizer` alive (referenced_objects)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
        index.hnsw.efSearch = ef_search
    else:
        raise ValueError(f"unknown index kind {kind!r}; expected one of {', '.join(IndexKind)}")
    if n:
        _add_in_chunks(index, x)
    return index


def ivfpq_train_size(nlist: int) -> int:
    """Documents ``ivfpq`` trains on: enough for ``nlist`` centroids (64 each) and for the PQ
    codebooks (256 codewords x 256), far below a large corpus."""
    return max(64 * nlist, 65_536)


def _ivfpq(x: Any, *, nlist: int, nprobe: int, pq_m: int, seed: int) -> faiss.Index:
    """A trained, empty ``IndexIVFPQ`` (inner product) for ``x`` ``[n, d]``."""
    n, d = x.shape
    if pq_m < 1 or d % pq_m:
        raise ValueError(
            f"IVF-PQ: eval.pq_m={pq_m} must divide the embedding dimension {d} "
            f"(e.g. {', '.join(str(m) for m in _divisors(d) if 4 <= m <= 96) or 1})"
        )
    need = max(nlist, 2**PQ_BITS)
    if n < need:
        raise ValueError(
            f"IVF-PQ with nlist={nlist} needs at least {need} training points (nlist and the "
            f"{2**PQ_BITS} PQ codewords), got {n}; lower eval.nlist or use eval.index=flat"
        )
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFPQ(quantizer, d, nlist, pq_m, PQ_BITS, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    index.cp.verbose = False
    index.pq.cp.seed = seed
    index.train(_training_sample(x, ivfpq_train_size(nlist), seed))
    index.nprobe = min(nprobe, nlist)
    return index


def _divisors(d: int) -> list[int]:
    return [m for m in range(1, d + 1) if d % m == 0]


def build_index_from_config(embeddings: Any, cfg: Any) -> faiss.Index:
    """:func:`build_index` with the parameters of an ``EvalConfig``."""
    return build_index(
        embeddings,
        cfg.index,
        nlist=cfg.nlist,
        nprobe=cfg.nprobe,
        pq_m=cfg.pq_m,
        hnsw_m=cfg.hnsw_m,
        ef_search=cfg.ef_search,
    )


def search(index: faiss.Index, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` by inner product: ``(scores [q, k] float32, indices [q, k] int64)``.

    ``k`` is clipped to the index size. An index position of -1 means no result (IVF when the
    probed cells hold fewer than k documents); its score is meaningless.
    """
    q = _as_float32(queries)
    if q.shape[1] != index.d:
        raise ValueError(f"queries have dimension {q.shape[1]}, the index {index.d}")
    k = min(int(k), int(index.ntotal))
    if k <= 0 or q.shape[0] == 0:
        return np.zeros((q.shape[0], max(k, 0)), np.float32), np.zeros((q.shape[0], max(k, 0)), np.int64)
    hnsw = _hnsw_of(index)
    if hnsw is not None and hnsw.efSearch < k:
        hnsw.efSearch = k  # fewer candidates than k would truncate the result list
    scores, indices = index.search(q, k)
    return scores, indices


def rerank_exact(queries: Any, candidates: np.ndarray, vectors: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Re-score each query's ``candidates`` (``[q, c]`` row positions from :func:`search`, -1 for
    none) by the exact inner product with their stored ``vectors`` (an array or a ``np.memmap``:
    only the candidate rows are read, in file order) and keep the top ``k``: ``(scores, indices)``
    as :func:`search` returns them. IVF-PQ's scores are the quantized vectors'; re-ranking a
    deeper candidate list with the real ones recovers most of the recall that quantization lost."""
    q = _as_float32(queries)
    cand = np.asarray(candidates, dtype=np.int64)
    rows = np.unique(cand[cand >= 0])
    stored = _as_float32(vectors[rows]) if len(rows) else np.zeros((0, q.shape[1]), np.float32)
    scores = np.full((len(q), k), -np.inf, np.float32)
    indices = np.full((len(q), k), -1, np.int64)
    for qi in range(len(q)):
        mine = np.unique(cand[qi][cand[qi] >= 0])
        s = stored[np.searchsorted(rows, mine)] @ q[qi]
        top = np.argsort(-s, kind="stable")[:k]
        scores[qi, : len(top)], indices[qi, : len(top)] = s[top], mine[top]
    return scores, indices


def _hnsw_of(index: faiss.Index):
    try:
        return faiss.downcast_index(index).hnsw
    except AttributeError:
        return None


def results_to_run(
    scores: np.ndarray, indices: np.ndarray, query_ids: list[str], doc_ids: list[str]
) -> dict[str, dict[str, float]]:
    """``{qid: {docid: score}}`` from :func:`search` output (positions of -1 dropped)."""
    run: dict[str, dict[str, float]] = {}
    for qi, qid in enumerate(query_ids):
        row: dict[str, float] = {}
        for s, j in zip(scores[qi].tolist(), indices[qi].tolist()):
            if j >= 0:
                row[doc_ids[j]] = float(s)
        run[qid] = row
    return run


def save_index(index: faiss.Index, path: str | os.PathLike) -> None:
    """Write the index (vectors and, for IVF/HNSW, their structure) to ``path``."""
    faiss.write_index(index, os.fspath(path))


def load_index(path: str | os.PathLike, *, nprobe: int | None = None, ef_search: int | None = None) -> faiss.Index:
    """Read an index written by :func:`save_index`; optionally reset its search parameters."""
    index = faiss.read_index(os.fspath(path))
    if nprobe is not None:
        try:
            ivf = faiss.extract_index_ivf(index)
            ivf.nprobe = min(nprobe, ivf.nlist)
        except RuntimeError:
            pass
    if ef_search is not None:
        hnsw = _hnsw_of(index)
        if hnsw is not None:
            hnsw.efSearch = ef_search
    return index


__all__ = [
    "build_index",
    "build_index_from_config",
    "ivfpq_train_size",
    "search",
    "rerank_exact",
    "results_to_run",
    "save_index",
    "load_index",
]
