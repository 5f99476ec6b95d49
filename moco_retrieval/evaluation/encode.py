"""Encode an evaluation pool and score it: one code path for the commands and for validation.

``evaluate_encoder`` encodes the corpus and the queries of an ``EvalSet`` (anything with
``corpus: dict[id, text]``, ``queries: dict[id, text]``, ``qrels: dict[qid, dict[docid, grade]]``)
and hands the embeddings to ``evaluate_embeddings``, which the training validation loop calls
directly with the embeddings it accumulated. Scores are inner products of the embeddings as the
encoder returns them (cosine when it normalizes, raw dot product when it does not).

Retrieval metrics of a Matryoshka-trained model at each of its prefix dimensions.

A model trained with ``objective.matryoshka_dims`` is meant to be used truncated: its first d
coordinates (re-normalised when the model normalises; sentence-transformers' ``truncate_dim``) are
an embedding of their own. Validation and ``evaluate`` score the pool again at each such d.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from moco_retrieval.data.corpus_store import as_corpus
from moco_retrieval.data.prompts import NO_PROMPTS
from moco_retrieval.distributed import all_gather_rows, rank, shard_range, world_size
from moco_retrieval.evaluation.geometry import compute_geometry
from moco_retrieval.evaluation.index import (
    build_index_from_config,
    rerank_exact,
    results_to_run,
    search,
)
from moco_retrieval.evaluation.metrics import evaluate_run, recall_curve
from moco_retrieval.model.devices import module_device

NOUNS = {"query": "queries", "doc": "documents"}  # the kinds of text, as progress lines name them


@dataclass
class EvalResult:
    metrics: dict[str, float]  # "recall@1", "recall@5", "recall@10", "recall@100", "mrr@10", "ndcg@10", "map@100"
    per_query: dict[str, dict[str, float]]
    geometry: dict[str, float]
    positive_cosines: np.ndarray
    unrelated_cosines: np.ndarray
    run: dict[str, dict[str, float]]  # top-k of every query: {qid: {docid: score}}
    recall_curve: list[float]  # mean recall@k for k = 1..top_k
    timings: dict[str, float]  # seconds: encode_docs, encode_queries, encode, index, search, geometry
    info: dict[str, Any] = field(default_factory=dict)  # pool sizes, dim, index, similarity
    # Matryoshka models: the metrics at each shorter prefix dimension, by str(dim) (matryoshka.py)
    metrics_by_dim: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """JSON-ready dict of everything but the run, per-query values and raw cosines."""
        return {
            "metrics": dict(self.metrics),
            "geometry": dict(self.geometry),
            "timings": dict(self.timings),
            "info": dict(self.info),
            "recall_curve": list(self.recall_curve),
            **({"metrics_by_dim": {d: dict(m) for d, m in self.metrics_by_dim.items()}} if self.metrics_by_dim else {}),
        }


def _to_device(side: dict, device: torch.device | None) -> dict:
    if device is None:
        return side
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in side.items()}


def embedding_file(path: str | os.PathLike, n: int, dim: int) -> np.ndarray:
    """A new ``.npy`` file of ``[n, dim]`` float32 rows, memory-mapped for writing: pass it as
    ``out=`` and the embeddings stream to disk instead of being held (``np.load(path,
    mmap_mode="r")`` reads it back; FAISS indexes read it in chunks)."""
    return np.lib.format.open_memmap(os.fspath(path), mode="w+", dtype=np.float32, shape=(int(n), int(dim)))


def encode_texts(
    encoder: Any,
    texts: Sequence[str],
    kind: str,
    batch_size: int = 256,
    show_progress: bool = True,
    *,
    description: str | None = None,
    sort_by_length: bool = True,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Embeddings ``float32 [len(texts), d]`` of ``texts`` as ``kind`` ("query" or "doc"), in this process.

    Batched, under ``torch.no_grad`` with the encoder in eval mode (its mode is restored after).
    The encoder's ``prompts`` (data/prompts.py; none when it has no such attribute) go before
    each text first. The side dict is ``{"texts": ..., **encoder.tokenize(texts, kind)}`` when
    ``encoder.needs_tokens``, else ``{"texts": ...}``. Texts are encoded longest first, so each
    batch pads to similar lengths, and returned in the order given. Each batch's rows are written
    into ``out`` (``[len(texts), d]``, e.g. :func:`embedding_file`'s memory map; it is returned)
    as they come, so nothing but one batch is held; without ``out`` a new array receives them.
    """
    if kind not in NOUNS:
        raise ValueError(f"kind must be 'query' or 'doc', got {kind!r}")
    texts = getattr(encoder, "prompts", NO_PROMPTS).apply(texts, kind)
    n = len(texts)
    order = sorted(range(n), key=lambda i: -len(texts[i])) if sort_by_length else list(range(n))
    return _encode_in_order(encoder, n, order, lambda idx: [texts[i] for i in idx], kind, batch_size, show_progress,
                            description, out)


def encode_corpus(
    encoder: Any,
    corpus: Any,
    batch_size: int = 256,
    show_progress: bool = True,
    *,
    description: str | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """:func:`encode_texts` of every document of ``corpus`` (data/corpus_store.py: a CorpusStore or
    CorpusDict), reading one batch's texts at a time. The batches are those of :func:`encode_texts`
    (longest first, from the corpus's length array; a prompt adds the same length to every text, and
    both sorts are stable), so the embeddings are the same, without every text in memory at once."""
    prompts = getattr(encoder, "prompts", NO_PROMPTS)
    order = np.argsort(-np.asarray(corpus.lengths), kind="stable")
    return _encode_in_order(encoder, len(corpus), order, lambda idx: prompts.apply(corpus.texts(idx), "doc"), "doc",
                            batch_size, show_progress, description, out)


def _encode_in_order(encoder: Any, n: int, order: Sequence[int], fetch: Any, kind: str, batch_size: int,
                     show_progress: bool, description: str | None, out: np.ndarray | None) -> np.ndarray:
    """Encode ``n`` texts ``batch_size`` at a time in ``order``; ``fetch(indices)`` gives a batch's texts
    (prompted); row ``i`` of the result is text ``i``."""
    needs_tokens = bool(getattr(encoder, "needs_tokens", False))
    device = module_device(encoder)
    was_training = getattr(encoder, "training", None)
    if hasattr(encoder, "eval"):
        encoder.eval()
    desc = description or f"encoding {n:,} {NOUNS[kind]}"
    bar = None
    if show_progress:
        from moco_retrieval.progress import (
            progress_bar,  # tqdm on a terminal, plain lines in a log file
        )

        bar = progress_bar(n, desc, " texts" if kind == "doc" else " queries")
    _check_rows(out, n)
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                batch = fetch(idx)
                side: dict[str, Any] = {"texts": batch}
                if needs_tokens:
                    side.update(encoder.tokenize(batch, kind))
                emb = encoder(_to_device(side, device), kind).detach().float().cpu().numpy()
                if out is None:
                    out = np.empty((n, emb.shape[1]), np.float32)
                out[np.asarray(idx, dtype=np.int64)] = emb
                if bar is not None:
                    bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
        if was_training and hasattr(encoder, "train"):
            encoder.train(True)
    if out is None:  # no texts
        return np.zeros((0, int(getattr(encoder, "dim", 0) or 0)), np.float32)
    return out


def encode_texts_sharded(encoder: Any, texts: Sequence[str], kind: str, batch_size: int = 256,
                         show_progress: bool = True, *, description: str | None = None,
                         out: np.ndarray | None = None, **options: Any) -> np.ndarray:
    """:func:`encode_texts` with the work split across the ranks of the process group, not the
    result: each rank encodes its contiguous block (``distributed.shard_range``: 1/N of the texts)
    and the blocks are all-gathered in rank order, so every rank returns every row in the order
    given, as one process would (up to float rounding: batches pad differently). Every rank must
    pass the same texts. ``out`` is this rank's destination for every row (an
    :func:`embedding_file` keeps the pool on disk: the block is encoded straight into it and the
    others' rows are written as they arrive). ``options``: :func:`encode_texts`'s. One process:
    :func:`encode_texts` itself."""
    world, me = world_size(), rank()
    if world == 1:
        return encode_texts(encoder, texts, kind, batch_size, show_progress, description=description, out=out,
                            **options)
    texts = list(texts)
    start, stop = shard_range(len(texts), me, world)
    _check_rows(out, len(texts))
    desc = description or f"encoding {stop - start:,} of {len(texts):,} {NOUNS[kind]} (rank {me} of {world})"
    local = encode_texts(encoder, texts[start:stop], kind, batch_size, show_progress, description=desc,
                         out=None if out is None else out[start:stop], **options)
    return all_gather_rows(local, out=out)


def _check_rows(out: np.ndarray | None, n: int) -> None:
    if out is not None and len(out) != n:
        raise ValueError(f"out has {len(out)} rows for {n} texts")


def evaluate_embeddings(
    doc_ids: Sequence[str],
    doc_emb: Any,
    query_ids: Sequence[str],
    query_emb: Any,
    qrels: Mapping[str, Mapping[str, int]],
    cfg: Any,
    *,
    normalize: bool | None = None,
    geometry_seed: int = 0,
) -> EvalResult:
    """Index ``doc_emb`` (as given: no normalization here), search ``cfg.top_k`` per query,
    score the run against ``qrels`` and measure the geometry of the pool. With ``ivfpq`` the
    ``top_k`` candidates are re-scored exactly with ``doc_emb`` (which may be a memory map), so
    the run holds true scores and only documents outside the candidates are missed.

    ``cfg`` is an ``EvalConfig`` (index, nlist, nprobe, hnsw_m, ef_search, top_k). recall@100
    and map@100 only see the ``top_k`` retrieved documents. ``normalize``: whether the model
    normalizes (recorded in ``info``; guessed from the norms when None).
    """
    doc_ids = [str(d) for d in doc_ids]
    query_ids = [str(q) for q in query_ids]
    if len(set(doc_ids)) != len(doc_ids):
        raise ValueError("doc_ids contain duplicates")
    d_emb = _np32(doc_emb)
    q_emb = _np32(query_emb)
    if len(d_emb) != len(doc_ids) or len(q_emb) != len(query_ids):
        raise ValueError(
            f"ids and embeddings differ in length: {len(doc_ids)} doc ids / {len(d_emb)} rows, "
            f"{len(query_ids)} query ids / {len(q_emb)} rows"
        )
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    index = build_index_from_config(d_emb, cfg)
    timings["index"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    scores, indices = search(index, q_emb, cfg.top_k)
    if cfg.index == "ivfpq":  # PQ scores are the quantized vectors': re-score the candidates with the real ones
        scores, indices = rerank_exact(q_emb, indices, d_emb, indices.shape[1])
    timings["search"] = time.perf_counter() - t0
    run = results_to_run(scores, indices, query_ids, doc_ids)
    # score only the queries of the pool (qrels may cover more than was encoded)
    pool_qrels = {q: qrels[q] for q in query_ids if q in qrels}
    res = evaluate_run(run, pool_qrels)
    curve = recall_curve(run, pool_qrels, max_k=max(int(cfg.top_k), 1))
    t0 = time.perf_counter()
    geo = compute_geometry(q_emb, d_emb, query_ids, doc_ids, pool_qrels, seed=geometry_seed)
    timings["geometry"] = time.perf_counter() - t0
    norms = np.linalg.norm(d_emb, axis=1) if len(d_emb) else np.zeros(0)
    normalized = bool(len(norms)) and bool(np.allclose(norms, 1.0, atol=1e-3))
    if normalize is not None:
        normalized = bool(normalize)
    info = {
        "num_docs": len(doc_ids),
        "num_queries": len(query_ids),
        "num_scored_queries": res.num_queries,
        "num_queries_without_relevant": res.num_without_relevant,
        "dim": int(d_emb.shape[1]) if d_emb.ndim == 2 else 0,
        "index": cfg.index,
        "top_k": int(cfg.top_k),
        "similarity": "cosine" if normalized else "dot",
        "normalize": normalized,
    }
    return EvalResult(
        metrics=res.mean,
        per_query=res.per_query,
        geometry=geo.stats,
        positive_cosines=geo.positive_cosines,
        unrelated_cosines=geo.unrelated_cosines,
        run=run,
        recall_curve=curve,
        timings=timings,
        info=info,
    )


def _np32(x: Any) -> np.ndarray:
    if torch.is_tensor(x):
        x = x.detach().float().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def _encode_docs(encoder: Any, corpus: Any, batch_size: int, show_progress: bool, out: np.ndarray | None) -> np.ndarray:
    """One process: :func:`encode_corpus` (a batch of texts at a time); several: each rank's block
    through :func:`encode_texts_sharded` (which takes the texts as a list)."""
    if world_size() == 1:
        return encode_corpus(encoder, corpus, batch_size, show_progress, out=out)
    return encode_texts_sharded(encoder, corpus.texts(range(len(corpus))), "doc", batch_size, show_progress, out=out)


def evaluate_encoder(
    encoder: Any,
    evalset: Any,
    cfg: Any,
    batch_size: int = 256,
    *,
    show_progress: bool = True,
    doc_out: np.ndarray | None = None,
    dims: Sequence[int] = (),
) -> EvalResult:
    """Encode ``evalset.corpus`` (a dict or a corpus store: data/corpus_store.py) and
    ``evalset.queries`` with ``encoder`` and evaluate.

    Under a process group each rank encodes 1/N of each and the blocks are gathered
    (:func:`encode_texts_sharded`); every rank gets the same result. ``doc_out``: where the
    document embeddings go (:func:`embedding_file` keeps them on disk). Timings hold
    ``encode_docs``, ``encode_queries`` and ``encode`` (their sum) next to ``index`` and
    ``search``: evaluation time is mostly encoding.
    """
    corpus = as_corpus(evalset.corpus)
    doc_ids = list(corpus.doc_ids)
    query_ids = list(evalset.queries.keys())
    t0 = time.perf_counter()
    doc_emb = _encode_docs(encoder, corpus, batch_size, show_progress, doc_out)
    t_docs = time.perf_counter() - t0
    t0 = time.perf_counter()
    query_emb = encode_texts_sharded(encoder, [evalset.queries[q] for q in query_ids], "query", batch_size,
                                     show_progress)
    t_queries = time.perf_counter() - t0
    normalize = getattr(encoder, "normalize", None)
    result = evaluate_embeddings(
        doc_ids, doc_emb, query_ids, query_emb, evalset.qrels, cfg,
        normalize=None if normalize is None else bool(normalize),
    )
    if dims:

        result.metrics_by_dim = metrics_by_dim(doc_ids, doc_emb, query_ids, query_emb, evalset.qrels, cfg, dims,
                                               normalize=bool(normalize) if normalize is not None else True)
    result.timings = {
        "encode_docs": t_docs,
        "encode_queries": t_queries,
        "encode": t_docs + t_queries,
        **result.timings,
    }
    return result


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

    full = np.asarray(doc_emb).shape[1]
    out = {}
    for dim in sorted({int(d) for d in dims if int(d) < full}, reverse=True):
        res = evaluate_embeddings(doc_ids, truncate(doc_emb, dim, normalize), query_ids,
                                  truncate(query_emb, dim, normalize), qrels, cfg, normalize=normalize)
        out[str(dim)] = dict(res.metrics)
    return out


__all__ = ['EvalResult', 'embedding_file', 'encode_texts', 'encode_corpus', 'encode_texts_sharded', 'evaluate_embeddings', 'evaluate_encoder', 'truncate', 'metrics_by_dim']
