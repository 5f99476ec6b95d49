"""Evaluation: encoding, FAISS search, trec_eval metrics, embedding geometry, reports.

The report module (matplotlib) is imported on first use of its names.
"""
from .encode import EvalResult, encode_texts, evaluate_embeddings, evaluate_encoder
from .geometry import GeometryResult, alignment, compute_geometry, l2_normalize, uniformity
from .index import build_index, build_index_from_config, load_index, results_to_run, save_index, search
from .metrics import (
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

_REPORT_NAMES = {
    "write_report",
    "eval_json_dict",
    "render_markdown",
    "plot_cosine_histograms",
    "plot_recall_curves",
    "sample_query_ids",
    "wandb_cosine_histograms",
    "wandb_topk_table",
}


def __getattr__(name: str):
    if name in _REPORT_NAMES:
        from . import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    *sorted(_REPORT_NAMES),
]
