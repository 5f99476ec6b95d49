"""Evaluation outputs: eval.json, run.trec, report.md, PNG plots, and W&B objects.

One model or several (compared side by side): pass an ``EvalResult`` or ``{name: EvalResult}``.

Files written by :func:`write_report` into ``out_dir``:

* ``eval.json``: metrics, geometry figures, timings, pool info and recall@k for k = 1..top_k,
  with the model description. One model: those keys at the top level. Several: under
  ``"models": {name: {...}}``, in the order given.
* ``run.trec`` (one model) or ``run.<name>.trec`` (several): the top-k ranking of every query,
  ``qid Q0 docid rank score tag``, re-scorable with trec_eval, ranx or pytrec_eval.
* ``report.md``: tables a person reads (one column per model).
* ``cosine_hist.png`` (positive versus unrelated cosines, one panel per model) and
  ``recall_at_k.png`` (one curve per model).

Several evaluation sets (:func:`write_sets_report`): each set's files as above in ``out_dir/<set>/``,
and at the top ``eval.json`` (each model's metrics per set and their unweighted mean) and
``report.md`` (a table per model: a row per set, then the mean).

Plots use matplotlib's Agg canvas directly, so no display and no global backend switch.
``wandb`` is imported only by the W&B helpers.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from moco_retrieval.evaluation.encode import EvalResult
from moco_retrieval.evaluation.metrics import METRIC_NAMES, rank_documents, write_trec_run

GEOMETRY_ROWS: tuple[tuple[str, str], ...] = (
    ("anisotropy", "anisotropy: mean cosine, unrelated pairs (p5 to p95)"),
    ("positive_cos_mean", "mean cosine, positive pairs (p5 to p95)"),
    ("cos_gap", "gap (positive - unrelated)"),
    ("alignment", "alignment (lower is better)"),
    ("uniformity", "uniformity (lower is more uniform)"),
    ("uniformity_query", "uniformity, queries"),
    ("uniformity_doc", "uniformity, documents"),
)
TIMING_ROWS: tuple[tuple[str, str], ...] = (
    ("encode_docs", "encode documents"),
    ("encode_queries", "encode queries"),
    ("index", "build index"),
    ("search", "search"),
    ("geometry", "geometry"),
)

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _as_mapping(
    results: EvalResult | Mapping[str, EvalResult], models: Mapping[str, Any] | None = None
) -> tuple[dict[str, EvalResult], bool]:
    if isinstance(results, EvalResult):
        name = next(iter(models)) if models and len(models) == 1 else "model"
        return {str(name): results}, True
    results = dict(results)
    if not results:
        raise ValueError("no results to report")
    return results, len(results) == 1


def _slug(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")
    return s or "model"


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if math.isfinite(v) else None
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def run_file_name(name: str, single: bool) -> str:
    return "run.trec" if single else f"run.{_slug(name)}.trec"


REPORT_FILES = ["eval.json", "report.md", "cosine_hist.png", "recall_at_k.png"]


def earlier_report(folder: Path) -> Optional[list[str]]:
    """What an earlier :func:`write_report` or :func:`write_sets_report` wrote into ``folder`` (its
    eval.json marks it), else None: a set's folder only when it holds a report of its own."""
    if not (folder / "eval.json").is_file():
        return None
    try:
        sets = json.loads((folder / "eval.json").read_text(encoding="utf-8")).get("sets") or {}
    except (OSError, ValueError, AttributeError):
        sets = {}
    own = [n for n in sets if isinstance(n, str) and n not in ("", ".", "..") and "/" not in n and "\\" not in n
           and (folder / n / "eval.json").is_file()]
    return REPORT_FILES + sorted(p.name for p in folder.glob("run*.trec")) + sorted(own)


def eval_json_dict(
    results: EvalResult | Mapping[str, EvalResult],
    models: Mapping[str, Mapping[str, Any]] | None = None,
    dataset: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The content of eval.json. ``models``: ``{name: description}`` (one model: a single
    entry is used whatever its name)."""
    res, single = _as_mapping(results, models)
    entries = {}
    for name, r in res.items():
        entries[name] = {
            "model": _describe(models, name, single),
            **r.summary(),
            "run_file": run_file_name(name, single),
        }
    out: dict[str, Any] = {"dataset": dict(dataset or {})}
    if single:
        name, entry = next(iter(entries.items()))
        out["name"] = name
        out.update(entry)
    else:
        out["models"] = entries
    return _json_safe(out)


def _describe(models: Mapping[str, Mapping[str, Any]] | None, name: str, single: bool) -> dict[str, Any]:
    models = dict(models or {})
    if name in models:
        return dict(models[name])
    if single and len(models) == 1:
        return dict(next(iter(models.values())))
    return {}


# --------------------------------------------------------------------------- markdown


def _fmt(v: float | None, signed: bool = False, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def render_markdown(
    results: EvalResult | Mapping[str, EvalResult],
    models: Mapping[str, Mapping[str, Any]] | None = None,
    dataset: Mapping[str, Any] | None = None,
    plot_files: Sequence[str] = (),
) -> str:
    res, single = _as_mapping(results, models)
    names = list(res)
    lines: list[str] = ["# Retrieval evaluation", ""]
    if dataset:
        lines.append("Pool: " + ", ".join(f"{k} = {v}" for k, v in dataset.items()))
    info = next(iter(res.values())).info
    if {"num_queries", "num_scored_queries", "num_docs", "index", "top_k"} <= set(info):
        lines.append(
            f"{info['num_queries']:,} queries ({info['num_scored_queries']:,} with a relevant document) "
            f"against {info['num_docs']:,} documents; index `{info['index']}`, top {info['top_k']}."
        )
    lines.append("")
    if models:
        lines += ["## Models", ""]
        for name in names:
            desc = _describe(models, name, single)
            lines.append(f"- **{name}**: " + (", ".join(f"{k}={v}" for k, v in desc.items()) or "(no description)"))
        lines.append("")
    header = "| | " + " | ".join(names) + " |"
    sep = "|---|" + "---:|" * len(names)

    lines += ["## Retrieval", "", header, sep]
    for m in METRIC_NAMES:
        vals = [r.metrics.get(m) for r in res.values()]
        best = max((v for v in vals if v is not None), default=None)
        cells = []
        for v in vals:
            cell = _fmt(v)
            if len(names) > 1 and v is not None and best is not None and v == best:
                cell = f"**{cell}**"
            cells.append(cell)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")

    lines += ["## Geometry (cosine)", "", header, sep]
    for key, label in GEOMETRY_ROWS:
        cells = []
        for r in res.values():
            g = r.geometry
            if key == "anisotropy":
                cells.append(f"{_fmt(g.get(key), True, 2)} ({_fmt(g.get('unrelated_cos_p05'), True, 2)} to "
                             f"{_fmt(g.get('unrelated_cos_p95'), True, 2)})")
            elif key == "positive_cos_mean":
                cells.append(f"{_fmt(g.get(key), True, 2)} ({_fmt(g.get('positive_cos_p05'), True, 2)} to "
                             f"{_fmt(g.get('positive_cos_p95'), True, 2)})")
            elif key == "cos_gap":
                cells.append(_fmt(g.get(key), True, 2))
            else:
                cells.append(_fmt(g.get(key)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")

    lines += ["## Time (seconds)", "", header, sep]
    for key, label in TIMING_ROWS:
        lines.append(f"| {label} | " + " | ".join(_fmt(r.timings.get(key), digits=2) for r in res.values()) + " |")
    lines.append("")
    lines.append(
        "Scores are inner products of the model's own outputs (cosine when it normalizes). "
        "Metrics follow trec_eval: relevant = grade > 0, nDCG with linear gains, MAP@100 over all "
        "relevant documents, ties broken by document id descending; `run*.trec` re-scores with trec_eval."
    )
    lines.append("")
    if plot_files:
        lines += ["## Plots", ""]
        for p in plot_files:
            lines.append(f"![{Path(p).stem}]({Path(p).name})")
            lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def plot_cosine_histograms(
    results: EvalResult | Mapping[str, EvalResult], path: str | os.PathLike, bins: int = 60
) -> Path:
    """Positive versus unrelated cosine histograms (densities), one panel per model, shared x."""
    res, _ = _as_mapping(results)
    arrays = [a for r in res.values() for a in (r.positive_cosines, r.unrelated_cosines) if len(a)]
    lo = min((float(a.min()) for a in arrays), default=-1.0)
    hi = max((float(a.max()) for a in arrays), default=1.0)
    pad = max(0.02, 0.03 * (hi - lo))
    lo, hi = max(-1.0, lo - pad), min(1.0, hi + pad)
    if hi <= lo:
        lo, hi = lo - 0.05, hi + 0.05
    edges = np.linspace(lo, hi, bins + 1)
    n = len(res)
    fig = _figure(7.0, 2.6 * n + 0.6)
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, r) in zip(axes, res.items()):
        g = r.geometry
        peak = 0.0
        if len(r.unrelated_cosines):
            heights, *_ = ax.hist(r.unrelated_cosines, bins=edges, density=True, alpha=0.55, color="#7f7f7f",
                                  label=f"unrelated, {len(r.unrelated_cosines):,} pairs (mean {_fmt(g.get('unrelated_cos_mean'), True, 2)})")
            peak = max(peak, float(np.max(heights)))
        if len(r.positive_cosines):
            heights, *_ = ax.hist(r.positive_cosines, bins=edges, density=True, alpha=0.55, color="#1f77b4",
                                  label=f"positive, {len(r.positive_cosines):,} pairs (mean {_fmt(g.get('positive_cos_mean'), True, 2)})")
            peak = max(peak, float(np.max(heights)))
        for key, color in (("unrelated_cos_mean", "#404040"), ("positive_cos_mean", "#0b4f8a")):
            v = g.get(key)
            if v is not None and math.isfinite(v):
                ax.axvline(v, color=color, linestyle="--", linewidth=1)
        ax.set_title(f"{name}: gap {_fmt(g.get('cos_gap'), True, 2)}", fontsize=10)
        ax.set_ylabel("density")
        # headroom above both peaks for the legend, so it covers neither histogram
        if peak > 0:
            ax.set_ylim(0, peak * 1.45)
        ax.legend(fontsize=8, loc="upper left", ncol=2, frameon=False)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("cosine similarity (query, document)")
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    return Path(path)


def plot_recall_curves(results: EvalResult | Mapping[str, EvalResult], path: str | os.PathLike) -> Path:
    """Mean recall@k for k = 1..top_k, one curve per model, log-scaled k."""
    res, _ = _as_mapping(results)
    fig = _figure(6.4, 4.2)
    ax = fig.subplots()
    for i, (name, r) in enumerate(res.items()):
        curve = list(r.recall_curve)
        if not curve:
            continue
        ks = np.arange(1, len(curve) + 1)
        label = f"{name} (R@1 {curve[0]:.2f}, R@10 {curve[min(9, len(curve) - 1)]:.2f}, R@{len(curve)} {curve[-1]:.2f})"
        ax.plot(ks, curve, color=_COLORS[i % len(_COLORS)], linewidth=1.8, label=label)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    top = max((len(r.recall_curve) for r in res.values()), default=100)
    ax.set_xscale("log")
    ax.set_xlim(1, max(top, 2))
    ax.set_xticks([t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if t <= max(top, 2)])
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    # from just below the lowest recall@1, not from 0: the curves differ in a narrow band near 1
    firsts = [r.recall_curve[0] for r in res.values() if len(r.recall_curve)]
    floor = max(0.0, math.floor((min(firsts, default=0.0) - 0.03) * 20) / 20)
    ax.set_ylim(floor, 1.005)
    ax.set_xlabel("k (log scale)")
    ax.set_ylabel("recall@k" + (f" (axis from {floor:.2f})" if floor > 0 else ""))
    ax.set_title("Recall at k")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    return Path(path)


# --------------------------------------------------------------------------- all files


def write_report(
    out_dir: str | os.PathLike,
    results: EvalResult | Mapping[str, EvalResult],
    *,
    models: Mapping[str, Mapping[str, Any]] | None = None,
    dataset: Mapping[str, Any] | None = None,
    plots: bool = True,
    run_tag: str | None = None,
) -> dict[str, Path]:
    """Write eval.json, the run file(s), report.md and the PNG plots; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res, single = _as_mapping(results, models)
    slugs = [run_file_name(n, single) for n in res]
    if len(set(slugs)) != len(slugs):
        raise ValueError(f"model names {list(res)} give the same run file names {slugs}; rename them")
    files: dict[str, Path] = {}
    for name, r in res.items():
        p = out / run_file_name(name, single)
        write_trec_run(p, r.run, tag=run_tag or _slug(name))
        files["run" if single else f"run:{name}"] = p
    plot_files: list[str] = []
    if plots:
        files["cosine_hist"] = plot_cosine_histograms(res, out / "cosine_hist.png")
        files["recall_at_k"] = plot_recall_curves(res, out / "recall_at_k.png")
        plot_files = [files["cosine_hist"].name, files["recall_at_k"].name]
    data = eval_json_dict(res, models, dataset)
    data["plots"] = plot_files
    p = out / "eval.json"
    p.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    files["eval_json"] = p
    p = out / "report.md"
    p.write_text(render_markdown(res, models, dataset, plot_files), encoding="utf-8")
    files["report_md"] = p
    return files


def mean_over_sets(results: Mapping[str, Mapping[str, EvalResult]]) -> dict[str, dict[str, float]]:
    """Each model's retrieval metrics averaged over the sets, unweighted: ``{model: {metric: mean}}``."""
    sets = list(results.values())
    return {model: {m: float(np.mean([float(s[model].metrics[m]) for s in sets])) for m in METRIC_NAMES
                    if all(m in s[model].metrics for s in sets)} for model in sets[0]}


def write_sets_report(
    out_dir: str | os.PathLike,
    results: Mapping[str, Mapping[str, EvalResult]],
    *,
    models: Mapping[str, Mapping[str, Any]] | None = None,
    datasets: Mapping[str, Mapping[str, Any]],
    plots: bool = True,
) -> dict[str, Path]:
    """Several evaluation sets: ``results[set][model]``. Each set's report (:func:`write_report`) in
    ``out_dir/<set>/``; ``eval.json`` (``sets``: each set's pool and each model's metrics; ``mean``:
    each model's unweighted mean over the sets) and ``report.md`` at the top. Returns the paths
    (a set's as ``<set>:<key>``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for name, res in results.items():
        files.update({f"{name}:{k}": v for k, v in
                      write_report(out / name, res, models=models, dataset=datasets[name], plots=plots).items()})
    mean = mean_over_sets(results)
    data = {"sets": {name: {"dataset": dict(datasets[name]), "report": f"{name}/report.md",
                            "metrics": {model: r.metrics for model, r in res.items()}} for name, res in results.items()},
            "mean": mean, "models": {name: dict((models or {}).get(name) or {}) for name in mean}}
    p = out / "eval.json"
    p.write_text(json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    files["eval_json"] = p
    lines = ["# Retrieval evaluation", "",
             f"{len(results)} sets; the mean is unweighted (each set counts once, whatever its size). "
             "Each set's own report: " + ", ".join(f"[{n}]({n}/report.md)" for n in results) + ".", ""]
    shown = [m for m in METRIC_NAMES if m in next(iter(mean.values()))]
    for model in mean:
        lines += [f"## {model}", "", "| set | queries | documents | " + " | ".join(shown) + " |",
                  "|---|---:|---:|" + "---:|" * len(shown)]
        for name, res in results.items():
            d = datasets[name]
            lines.append(f"| {name} | {d['queries']:,} | {d['documents']:,} | "
                         + " | ".join(_fmt(res[model].metrics.get(m)) for m in shown) + " |")
        lines += [f"| **mean** | | | " + " | ".join(f"**{_fmt(mean[model][m])}**" for m in shown) + " |", ""]
    p = out / "report.md"
    p.write_text("\n".join(lines), encoding="utf-8")
    files["report_md"] = p
    return files


# --------------------------------------------------------------------------- W&B


def sample_query_ids(
    query_ids: Sequence[str], n: int, seed: int = 0, qrels: Mapping[str, Mapping[str, int]] | None = None
) -> list[str]:
    """A fixed sample of ``n`` query ids (the same at every call on the same pool): drawn with
    ``seed`` from the sorted ids, restricted to queries with a relevant document when ``qrels``
    is given; returned sorted."""
    ids = sorted(set(map(str, query_ids)))
    if qrels is not None:
        ids = [q for q in ids if any(int(g) > 0 for g in qrels.get(q, {}).values())]
    if len(ids) <= n:
        return ids
    rng = np.random.default_rng(seed)
    return sorted(ids[i] for i in rng.choice(len(ids), n, replace=False))


def wandb_cosine_histograms(result: EvalResult, prefix: str = "val/") -> dict[str, Any]:
    """``{prefix + "cos_positive": wandb.Histogram, prefix + "cos_unrelated": ...}``."""
    import wandb

    return {
        f"{prefix}cos_positive": wandb.Histogram(np.asarray(result.positive_cosines, dtype=np.float64)),
        f"{prefix}cos_unrelated": wandb.Histogram(np.asarray(result.unrelated_cosines, dtype=np.float64)),
    }


def topk_rows(
    run: Mapping[str, Mapping[str, float]],
    qrels: Mapping[str, Mapping[str, int]],
    queries: Mapping[str, str],
    corpus: Mapping[str, str],
    query_ids: Sequence[str],
    k: int = 5,
    max_chars: int = 200,
) -> list[list[Any]]:
    """Rows ``[qid, query, rank, doc_id, document, score, relevant, first_relevant_rank]``: the
    top ``k`` of each query in ``query_ids``; ``first_relevant_rank`` is the rank of the first
    relevant document in the whole run (0 when none was retrieved)."""

    def cut(t: str) -> str:
        t = " ".join(str(t).split())
        return t if len(t) <= max_chars else t[: max_chars - 1] + "…"

    rows: list[list[Any]] = []
    for qid in query_ids:
        grades = qrels.get(qid, {})
        ranked = rank_documents(run.get(qid, {}))
        first = next((i + 1 for i, (d, _) in enumerate(ranked) if int(grades.get(d, 0)) > 0), 0)
        for rank, (docid, score) in enumerate(ranked[:k], start=1):
            rows.append([
                qid, cut(queries.get(qid, "")), rank, docid, cut(corpus.get(docid, "")),
                round(float(score), 4), int(grades.get(docid, 0)) > 0, first,
            ])
    return rows


TABLE_COLUMNS = ["qid", "query", "rank", "doc_id", "document", "score", "relevant", "first_relevant_rank"]


def wandb_topk_table(
    run: Mapping[str, Mapping[str, float]],
    qrels: Mapping[str, Mapping[str, int]],
    queries: Mapping[str, str],
    corpus: Mapping[str, str],
    *,
    n: int = 20,
    k: int = 5,
    seed: int = 0,
    query_ids: Sequence[str] | None = None,
) -> Any:
    """A ``wandb.Table`` of a fixed sample of ``n`` queries with their top ``k`` documents,
    each marked relevant or not."""
    import wandb

    ids = list(query_ids) if query_ids is not None else sample_query_ids(list(run), n, seed, qrels)
    return wandb.Table(columns=TABLE_COLUMNS, data=topk_rows(run, qrels, queries, corpus, ids, k))


__all__ = [
    "REPORT_FILES",
    "earlier_report",
    "eval_json_dict",
    "render_markdown",
    "plot_cosine_histograms",
    "plot_recall_curves",
    "write_report",
    "write_sets_report",
    "mean_over_sets",
    "run_file_name",
    "sample_query_ids",
    "topk_rows",
    "TABLE_COLUMNS",
    "wandb_cosine_histograms",
    "wandb_topk_table",
]
