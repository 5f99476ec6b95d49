"""Geometry of the embedding space, measured on an evaluation pool.

All figures use cosine, i.e. they L2-normalize the embeddings first, whatever the model's own
scoring: they describe the directions of the space.

* ``anisotropy``: the mean cosine of *unrelated* (query, document) pairs, i.e. pairs whose
  document is not judged for the query, sampled uniformly; with its 5th and 95th percentiles.
  A plain pretrained encoder sits around +0.8 (everything points the same way); a contrastively
  trained one near 0.
* ``positive_cos_mean``: the mean cosine of (query, relevant document) pairs; ``cos_gap`` =
  positive mean - unrelated mean, the margin retrieval lives on.
* ``alignment`` (Wang & Isola, 2020, alpha = 2): E ||f(q) - f(d+)||^2 over positive pairs
  (0 is perfect; it equals 2 - 2 * cosine).
* ``uniformity`` (Wang & Isola, 2020, t = 2): log E exp(-2 ||f(x) - f(y)||^2) over distinct pairs
  of one side, reported per side (``uniformity_query``, ``uniformity_doc``) and as their mean
  (``uniformity``), as in the paper's loss. Lower is more uniform: 0 when all points coincide,
  about -4 for points spread uniformly over a high-dimensional sphere (squared distances near 2),
  -8 for two antipodal points. Each side is subsampled to ``max_uniformity_points`` points
  (seeded), and all their distinct pairs are used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch


@dataclass
class GeometryResult:
    stats: dict[str, float]
    positive_cosines: np.ndarray  # one per (query, relevant doc) pair in the pool
    unrelated_cosines: np.ndarray  # the sampled unrelated pairs


def l2_normalize(x: Any, eps: float = 1e-12) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, eps)


def alignment(x: np.ndarray, y: np.ndarray, alpha: float = 2.0) -> float:
    """E ||x_i - y_i||^alpha over paired rows (rows normalized first)."""
    if len(x) == 0:
        return float("nan")
    x, y = l2_normalize(x), l2_normalize(y)
    return float(np.mean(np.linalg.norm(x - y, axis=1) ** alpha))


def uniformity(x: np.ndarray, t: float = 2.0, max_points: int | None = 2048, seed: int = 0) -> float:
    """log E_{i<j} exp(-t ||x_i - x_j||^2) over distinct pairs (rows normalized first)."""
    x = l2_normalize(x)
    if max_points is not None and len(x) > max_points:
        rng = np.random.default_rng(seed)
        x = x[np.sort(rng.choice(len(x), max_points, replace=False))]
    if len(x) < 2:
        return float("nan")
    xt = torch.from_numpy(x).double()
    sq = torch.pdist(xt, p=2).pow(2)
    return float(torch.logsumexp(-t * sq, dim=0) - np.log(sq.numel()))


def _sample_unrelated(
    query_ids: Sequence[str],
    doc_ids: Sequence[str],
    qrels: Mapping[str, Mapping[str, int]],
    num_pairs: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    nq, nd = len(query_ids), len(doc_ids)
    if nq == 0 or nd == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    total = nq * nd
    if total <= num_pairs:  # small pool: every unrelated pair
        qi, di = np.divmod(np.arange(total), nd)
    else:
        qi = rng.integers(0, nq, size=num_pairs * 2)
        di = rng.integers(0, nd, size=num_pairs * 2)
    keep = np.array(
        [doc_ids[d] not in qrels.get(query_ids[q], ()) for q, d in zip(qi.tolist(), di.tolist())], dtype=bool
    )
    qi, di = qi[keep][:num_pairs], di[keep][:num_pairs]
    return qi, di


def compute_geometry(
    query_emb: Any,
    doc_emb: Any,
    query_ids: Sequence[str],
    doc_ids: Sequence[str],
    qrels: Mapping[str, Mapping[str, int]],
    *,
    num_unrelated: int = 20000,
    max_uniformity_points: int | None = 2048,
    seed: int = 0,
) -> GeometryResult:
    """Anisotropy, positive/unrelated cosines, alignment and uniformity of a pool.

    Unrelated pairs: up to ``num_unrelated`` (query, document) pairs drawn uniformly (every pair
    when the pool is smaller), excluding any document judged for the query. Positive pairs: every
    (query, document) with grade > 0 where both are in the pool. Sampling is seeded: the same
    pool gives the same pairs at every validation.
    """
    q = l2_normalize(query_emb)
    d = l2_normalize(doc_emb)
    rng = np.random.default_rng(seed)
    doc_pos = {did: i for i, did in enumerate(doc_ids)}
    pq, pd = [], []
    for i, qid in enumerate(query_ids):
        for did, grade in qrels.get(qid, {}).items():
            j = doc_pos.get(did)
            if j is not None and int(grade) > 0:
                pq.append(i)
                pd.append(j)
    pq_a, pd_a = np.asarray(pq, np.int64), np.asarray(pd, np.int64)
    pos = np.einsum("ij,ij->i", q[pq_a], d[pd_a]) if len(pq_a) else np.zeros(0, np.float32)
    uq, ud = _sample_unrelated(query_ids, doc_ids, qrels, num_unrelated, rng)
    unrel = np.einsum("ij,ij->i", q[uq], d[ud]) if len(uq) else np.zeros(0, np.float32)

    def stat(fn, a):
        return float(fn(a)) if len(a) else float("nan")

    u_q = uniformity(q, max_points=max_uniformity_points, seed=seed)
    u_d = uniformity(d, max_points=max_uniformity_points, seed=seed + 1)
    stats = {
        "anisotropy": stat(np.mean, unrel),
        "unrelated_cos_mean": stat(np.mean, unrel),
        "unrelated_cos_p05": stat(lambda a: np.percentile(a, 5), unrel),
        "unrelated_cos_p95": stat(lambda a: np.percentile(a, 95), unrel),
        "positive_cos_mean": stat(np.mean, pos),
        "positive_cos_p05": stat(lambda a: np.percentile(a, 5), pos),
        "positive_cos_p95": stat(lambda a: np.percentile(a, 95), pos),
        "cos_gap": stat(np.mean, pos) - stat(np.mean, unrel),
        "alignment": alignment(q[pq_a], d[pd_a]) if len(pq_a) else float("nan"),
        "uniformity_query": u_q,
        "uniformity_doc": u_d,
        "uniformity": float(np.nanmean([u_q, u_d])) if not (np.isnan(u_q) and np.isnan(u_d)) else float("nan"),
        "num_positive_pairs": float(len(pos)),
        "num_unrelated_pairs": float(len(unrel)),
    }
    return GeometryResult(stats, pos.astype(np.float32), unrel.astype(np.float32))


__all__ = ["GeometryResult", "l2_normalize", "alignment", "uniformity", "compute_geometry"]
