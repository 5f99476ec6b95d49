"""Evaluation: encoding, FAISS search, trec_eval metrics, embedding geometry.

Reports and plots live in ``evaluation.report`` (it imports matplotlib): import them from there.
"""
from moco_retrieval.evaluation.encode import EvalResult, encode_texts, evaluate_embeddings, evaluate_encoder
from moco_retrieval.evaluation.geometry import GeometryResult, alignment, compute_geometry, l2_normalize, uniformity
from moco_retrieval.evaluation.index import build_index, build_index_from_config, load_index, results_to_run, save_index, search
from moco_retrieval.evaluation.metrics import (
    METRIC_NAMES,
    MetricsResult,
    evaluate_run,
    rank_documents,
    read_trec_qrels,
    read_trec_run,
    recall_curve,
    write_trec_qrels,
    write_trec_run,
)

__all__ = [
    "EvalResult",
    "encode_texts",
    "evaluate_embeddings",
    "evaluate_encoder",
    "GeometryResult",
    "alignment",
    "compute_geometry",
    "l2_normalize",
    "uniformity",
    "build_index",
    "build_index_from_config",
    "load_index",
    "results_to_run",
    "save_index",
    "search",
    "METRIC_NAMES",
    "MetricsResult",
    "evaluate_run",
    "rank_documents",
    "read_trec_qrels",
    "read_trec_run",
    "recall_curve",
    "write_trec_qrels",
    "write_trec_run",
]
