"""Retrieval metrics of a Matryoshka-trained model at each of its prefix dimensions.

A model trained with ``objective.matryoshka_dims`` is meant to be used truncated: its first d
coordinates (re-normalised when the model normalises; sentence-transformers' ``truncate_dim``) are
an embedding of their own. Validation and ``evaluate`` score the pool again at each such d.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np


def truncate(emb: Any, dim: int, normalize: bool) -> np.ndarray:
    """The first ``dim`` columns of ``emb`` [n, D] (float32), rows re-normalised when ``normalize``."""
    out = np.ascontiguousarray(np.asarray(emb, dtype=np.float32)[:, :dim])
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def metrics_by_dim(doc_ids: Sequence[str], doc_emb: Any, query_ids: Sequence[str], query_emb: Any,
                   qrels: Mapping[str, Mapping[str, int]], cfg: Any, dims: Sequence[int],
                   normalize: bool) -> dict[str, dict[str, float]]:
    """``{str(d): metrics}`` for each prefix ``d`` of ``dims`` shorter than the embeddings (the full
    size is the ordinary evaluation)."""
    from moco_retrieval.evaluation.encode import evaluate_embeddings

    full = np.asarray(doc_emb).shape[1]
    out = {}
    for dim in sorted({int(d) for d in dims if int(d) < full}, reverse=True):
        res = evaluate_embeddings(doc_ids, truncate(doc_emb, dim, normalize), query_ids,
                                  truncate(query_emb, dim, normalize), qrels, cfg, normalize=normalize)
        out[str(dim)] = dict(res.metrics)
    return out


__all__ = ["truncate", "metrics_by_dim"]
