"""``python -m moco_retrieval.evaluate``: retrieval metrics, geometry and plots for one model or
several side by side.

    python -m moco_retrieval.evaluate                                   # the untrained base encoder (model group)
    python -m moco_retrieval.evaluate checkpoint=RUN/checkpoints/last.ckpt
    python -m moco_retrieval.evaluate model_dir=EXPORTED_DIR
    python -m moco_retrieval.evaluate checkpoint=CKPT compare=[base]    # side by side, one report
    python -m moco_retrieval.evaluate data=beir data.dir=BEIR_DIR       # any BEIR-layout folder
    python -m moco_retrieval.evaluate data.eval_dirs=[DIR_A,DIR_B]       # several sets, and their mean

The pool is the data group's evaluation split (Debian held-out pool by default; ``data=beir`` reads
only ``qrels/<data.eval_split>.tsv``), capped by ``data.max_eval_queries`` / ``data.max_eval_docs``.
Writes into ``out_dir`` (default: Hydra's run folder; a folder with other content is refused, an
earlier evaluation there is replaced with ``overwrite=true``): ``eval.json``, ``run.trec`` (one model) or
``run.<name>.trec``, ``report.md``, ``cosine_hist.png`` and ``recall_at_k.png``; see
``moco_retrieval/evaluation/report.py``. With several ``data.eval_dirs`` (each set named by its folder):
those files per set in ``out_dir/<set>/``, and at the top ``eval.json`` and ``report.md`` with each
model's metrics per set and their unweighted mean. Index and top-k come from ``eval.*`` (EvalConfig).

Keys: EvaluateConfig in config.py (``conf/evaluate.yaml``). ``compare`` entries are ``base`` (untrained: the
``checkpoint``'s own model before training, else the ``model`` group's encoder), a checkpoint file or a
model directory; the report's columns are the main model then ``compare`` in order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from moco_retrieval.command import command
from moco_retrieval.config import EvalConfig, ModelConfig, to_config
from moco_retrieval.model.devices import pick_device
from moco_retrieval.errors import ConfigError
from moco_retrieval.evaluation.report import earlier_report
from moco_retrieval.files import claim_output_dir, remove_entries
from moco_retrieval.model.loading import describe_spec, load_encoder



# --------------------------------------------------------------------------- pool


def load_eval_sets(data: Any) -> dict[str, tuple[Any, dict]]:
    """The evaluation sets of a data config by name (one pool, or each of ``data.eval_dirs``), without
    reading training data: ``{name: (EvalSet, description)}``; each corpus is a memory-mapped store
    (data/corpus_store.py), encoded a batch of texts at a time."""
    from moco_retrieval.data.sources import load_eval_pools

    return {name: (pool.eval_set, pool.description) for name, pool in load_eval_pools(data, mapped=True).items()}


def base_of(cfg: Any) -> ModelConfig:
    """What ``compare=[base]`` means: with ``checkpoint=``, that checkpoint's own model untrained (its
    ``model.*`` as trained: a tiny random run compares with its random start, not with MiniLM); else
    the ``model`` group's encoder."""
    if cfg.checkpoint:
        from moco_retrieval.files import read_checkpoint

        hp = read_checkpoint(cfg.checkpoint, "checkpoint", verify=False).get("hyper_parameters") or {}
        if isinstance(hp.get("model"), dict):
            return to_config(ModelConfig, hp["model"])
    return to_config(ModelConfig, cfg.model)


def _model_name(spec_kwargs: dict, desc: dict, given: Optional[str]) -> str:
    if given:
        return given
    if desc.get("source") == "base":
        return "base"
    p = Path(spec_kwargs.get("checkpoint") or spec_kwargs.get("model_dir") or "model")
    if p.suffix == ".ckpt":
        run = p.parent.parent.name if p.parent.name == "checkpoints" else p.parent.name
        name = f"{run}-{p.stem}" if run else p.stem
    else:
        name = p.name
    if desc.get("encoder") == "key":
        name += "-key"
    return name


def _unique(name: str, taken: set[str]) -> str:
    out, i = name, 2
    while out in taken:
        out, i = f"{name}-{i}", i + 1
    taken.add(out)
    return out


# --------------------------------------------------------------------------- command


def run_evaluate(cfg: Any, out_dir: str | Path, replace: Sequence[str] = ()) -> dict[str, Path]:
    """Evaluate the configured model(s) on the pool and write the report files into ``out_dir``, first
    removing ``replace`` there (an earlier evaluation's files: main()), so a failed run keeps them."""
    from moco_retrieval.evaluation.encode import evaluate_encoder
    from moco_retrieval.data.corpus_store import as_corpus
    from moco_retrieval.evaluation.forecast import announce_corpus
    from moco_retrieval.evaluation.report import mean_over_sets, write_report, write_sets_report

    sets = load_eval_sets(cfg.data)
    several = len(sets) > 1
    eval_cfg = to_config(EvalConfig, cfg.eval)
    base_model = to_config(ModelConfig, cfg.model)
    device = pick_device(cfg.device)
    batch_size = int(cfg.batch_size or cfg.data.eval_batch_size)
    specs: list[tuple[dict, str, Optional[str]]] = []
    main_kwargs = {k: v for k, v in (("checkpoint", cfg.checkpoint), ("model_dir", cfg.model_dir)) if v}
    specs.append((main_kwargs, cfg.encoder, cfg.name))
    for spec in cfg.compare:
        specs.append((describe_spec(str(spec)), "query", None))
    untrained = base_of(cfg) if any(not kwargs for kwargs, _, _ in specs[1:]) else base_model  # compare=[base]
    for name, (_, dataset) in sets.items():
        print(
            f"pool{f' {name}' if several else ''}: {dataset['queries']:,} queries, {dataset['documents']:,} documents "
            f"({dataset['kind']}, {dataset['dir']}); index {eval_cfg.index}, top {eval_cfg.top_k}; device {device}"
        )
    results: dict[str, dict] = {name: {} for name in sets}  # by set, then by model
    models, taken = {}, set()
    for i, (kwargs, which, given) in enumerate(specs):
        model = untrained if i and not kwargs else base_model
        enc, desc = load_encoder(model=model, encoder=which, prompts=cfg.data.prompts, **kwargs)
        name = _unique(_model_name(kwargs, desc, given), taken)
        enc.to(device)
        desc["parameters"] = int(sum(p.numel() for p in enc.parameters()))
        models[name] = desc
        for set_name, (evalset, _) in sets.items():
            label = f"{name} on {set_name}" if several else name
            announce_corpus(enc, as_corpus(evalset.corpus), f"the pool{f' {set_name}' if several else ''}, model {name}",
                            batch_size, queries=list(evalset.queries.values()))
            res = evaluate_encoder(enc, evalset, eval_cfg, batch_size, show_progress=bool(cfg.progress),
                                   dims=desc.get("matryoshka_dims") or ())
            results[set_name][name] = res
            m = res.metrics
            print(
                f"{label}: recall@1 {m['recall@1']:.4f}  recall@10 {m['recall@10']:.4f}  mrr@10 {m['mrr@10']:.4f}  "
                f"ndcg@10 {m['ndcg@10']:.4f}  anisotropy {res.geometry['anisotropy']:+.3f}  "
                f"(encode {res.timings['encode']:.1f}s, search {res.timings['search']:.2f}s)"
            )
            for dim, dm in res.metrics_by_dim.items():  # a Matryoshka model, truncated to each trained prefix
                print(f"{label} at {dim} dimensions: recall@1 {dm['recall@1']:.4f}  ndcg@10 {dm['ndcg@10']:.4f}")
        if several:
            m = mean_over_sets({s: {name: r[name]} for s, r in results.items()})[name]
            print(f"{name}, mean of {len(sets)} sets: recall@1 {m['recall@1']:.4f}  recall@10 {m['recall@10']:.4f}  "
                  f"mrr@10 {m['mrr@10']:.4f}  ndcg@10 {m['ndcg@10']:.4f}")
        del enc
        if device.type == "cuda":
            torch.cuda.empty_cache()
    remove_entries(Path(out_dir), replace)
    if several:
        files = write_sets_report(out_dir, results, models=models, datasets={n: d for n, (_, d) in sets.items()},
                                  plots=bool(cfg.plots))
    else:
        (only, (_, dataset)), = sets.items()
        files = write_report(out_dir, results[only], models=models, dataset=dataset, plots=bool(cfg.plots))
    print(f"report: {files['report_md']}")
    return files


@command("evaluate")
def main(cfg: DictConfig) -> None:
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if k != "data.train_path")  # not read here
    if missing:
        raise ConfigError("missing required config values: " + ", ".join(missing))
    out_dir = Path(cfg.out_dir or HydraConfig.get().runtime.output_dir).expanduser()
    # export's rule (files.py): an empty or new folder, or an earlier evaluation that overwrite=true replaces
    replace = claim_output_dir(out_dir, "out_dir", bool(cfg.overwrite), earlier_report, "evaluation")
    run_evaluate(cfg, out_dir, replace)


if __name__ == "__main__":
    main()
