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

INDEX_KINDS = ("flat", "ivf", "hnsw")


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
    hnsw_m: int = 32,
    ef_search: int = 128,
    ef_construction: int = 80,
    seed: int = 0,
) -> faiss.Index:
    """An inner-product index of ``embeddings`` (float32 ``[n, d]``, used as given).

    ``ivf`` raises ``ValueError`` when there are fewer than ``nlist`` points to train on.
    """
    x = _as_float32(embeddings)
    n, d = x.shape
    if kind == "flat":
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
        index.train(x)
        index.nprobe = min(nprobe, nlist)  # the wrapper keeps `quantizer` alive (referenced_objects)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
        index.hnsw.efSearch = ef_search
    else:
        raise ValueError(f"unknown index kind {kind!r}; expected one of {INDEX_KINDS}")
    if n:
        index.add(x)
    return index


def build_index_from_config(embeddings: Any, cfg: Any) -> faiss.Index:
    """:func:`build_index` with the parameters of an ``EvalConfig``."""
    return build_index(
        embeddings,
        cfg.index,
        nlist=cfg.nlist,
        nprobe=cfg.nprobe,
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
    "INDEX_KINDS",
    "build_index",
    "build_index_from_config",
    "search",
    "results_to_run",
    "save_index",
    "load_index",
]
