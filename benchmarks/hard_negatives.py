"""Measured effect of mined hard negatives on the Debian set, with and without the false-negative
filters, for the frozen-head model (bag-of-wordpieces MiniLM features + a trained linear head).

    python -m benchmarks.hard_negatives [--quick] [--seeds 3] [--epochs 2] [--objective inbatch] \\
        [--debian-dir DIR] [--cache DIR]

The apt lists and the cache come from ``--debian-dir`` / ``--cache``, else ``$MOCO_RETRIEVAL_DEBIAN_DIR``
/ ``$MOCO_RETRIEVAL_CACHE``, else ``../shared/data/debian-bookworm`` next to the repository and the
package's cache (``benchmarks.harness.cli``).

Steps (all through the Python API, one process):

1. (a) train without hard negatives (``train.train`` on a config composed with Hydra's compose
   API: ``model=frozen_head``); held-out recall@1 on the Debian eval pool, which shares no source
   package with the training pairs.
2. Mine the training pairs with (a)'s first checkpoint (``mining.mine_from_embeddings``; the corpus
   is the training positives; the eval pool is never searched), three ways:
   * ``unfiltered``: only the query's own positive is removed (``relative_margin=null``,
     ``drop_group=false``);
   * ``filtered``: the query's positive *and its group* (same source package) removed, and the
     relative margin r=0.05 (keep iff score <= 0.95 * score(positive)).
3. Train from scratch on each mined file (same seeds, epochs, batch): (b) unfiltered, trained with
   the trainer's id/group mask off (no false-negative protection at all); (b') the same file with
   the trainer's mask on (same-group negatives are masked in the loss: the slots are wasted, not
   harmful); (c) filtered, mask on.

Writes benchmarks/results/hard_negatives.md and .json. ``--quick``: a 6,000-pair slice, one seed,
one epoch, written into the work folder (a smoke test of the script, not a measurement).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks.harness import cli
from benchmarks.harness.cli import RESULTS
from benchmarks.harness.training import compose_cfg
from moco_retrieval.training.checkpoints import last_checkpoint

METRICS = ["recall@1", "recall@10", "mrr@10", "ndcg@10"]


def train_run(overrides: list[str], run_dir: Path) -> dict:
    from moco_retrieval.train import train

    cfg = compose_cfg(overrides)
    t0 = time.perf_counter()
    metrics = train(cfg, run_dir)
    return {"metrics": {m: metrics.get(f"val/{m}") for m in METRICS}, "seconds": time.perf_counter() - t0}


def mine_variants(ckpt: Path, pairs, out_dir: Path, variants: dict, n_negatives: int, range_max: int) -> dict:
    """Encode once with the checkpoint's encoder, mine each variant; then keep the rows that every
    variant could give negatives (so all runs but (a) train on the same rows) and write each
    variant's JSONL and stats."""
    from moco_retrieval.evaluation.encode import encode_texts
    from moco_retrieval.model.loading import load_checkpoint_encoder
    from moco_retrieval.mining import MiningFilters, MiningOptions, build_corpus, mine_from_embeddings, stats_path_for, write_mined

    enc, _ = load_checkpoint_encoder(ckpt)
    corpus = build_corpus(pairs)
    d_emb = encode_texts(enc, corpus.texts, "doc", 1024, show_progress=False)
    q_emb = encode_texts(enc, [p.query for p in pairs], "query", 1024, show_progress=False)
    results = {}
    for name, kw in variants.items():
        res = mine_from_embeddings(pairs, corpus, q_emb, d_emb, MiningFilters(range_max=range_max, **kw),
                                   MiningOptions(n_negatives=n_negatives, progress=False))
        results[name] = res
        c = res.stats["candidates"]
        print(f"[mine {name}] rows {res.stats['rows_written']:,}, removed {c['removed']}, "
              f"mean neg score {res.stats['mean_negative_score']:.3f} vs pos {res.stats['mean_positive_score']:.3f}",
              flush=True)
    common = set.intersection(*({(p.query, p.doc_id) for p in r.pairs} for r in results.values()))
    out = {"common_rows": len(common)}
    for name, res in results.items():
        keep = [i for i, p in enumerate(res.pairs) if (p.query, p.doc_id) in common]
        res.pairs, res.ranks = [res.pairs[i] for i in keep], [res.ranks[i] for i in keep]
        path = out_dir / f"mined-{name}.jsonl"
        write_mined(path, res)
        stats_path_for(path).write_text(json.dumps(res.stats, indent=2) + "\n")
        out[name] = {"path": str(path), "stats": res.stats}
    out["common_keys"] = common
    return out


def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


# the mined files' filters: name -> mine_variants' options
VARIANTS = {
    "unfiltered": {"relative_margin": None, "drop_group": False},
    "group_only": {"relative_margin": None, "drop_group": True},
    "filtered": {"relative_margin": 0.05, "drop_group": True},
}
# the runs (a_none on every row; the others on the rows every mined file could give negatives)
LABELS = {
    "a_none": "(a) no hard negatives, all rows",
    "a_none_common": "(a) no hard negatives, common rows",
    "b_unfiltered": "(b) mined, no false-negative filter (only the positive removed; trainer mask off)",
    "b_group_only": "(b+) mined, same-group documents removed, no relative margin",
    "c_filtered": "(c) mined with the filter: group removed + relative margin 0.05",
}


def summarise(runs: dict[str, list], all_rows: int, common_rows: int) -> list[dict]:
    """Per run: mean ± std of each metric over seeds, its rows and its mean training seconds."""
    table = []
    for name, rs in runs.items():
        row = {"run": name, "label": LABELS[name], "seeds": len(rs)}
        for m in METRICS:
            mu, sd = mean_std([r["metrics"][m] for r in rs])
            row[m] = {"mean": mu, "std": sd, "per_seed": [r["metrics"][m] for r in rs]}
        row["rows"] = all_rows if name == "a_none" else common_rows
        row["train_seconds_mean"] = statistics.mean(r["seconds"] for r in rs)
        table.append(row)
    return table


def shared_overrides(args, eval_dir: Path) -> list[str]:
    """Every run's training overrides (the runs add their data and seed)."""
    common = [
        "model=frozen_head", f"objective={args.objective}", "trainer=cpu", "logger=none", "data=jsonl",
        f"data.eval_dir={eval_dir}", f"data.batch_size={args.batch_size}", f"trainer.max_epochs={args.epochs}",
        "trainer.val_check_interval=null", "trainer.enable_progress_bar=false", f"optim.lr={args.lr}",
        "optim.warmup_ratio=0.05", "data.eval_batch_size=1024",
    ]
    if args.objective == "moco":
        common += ["objective.queue_size=4096", "objective.momentum=0.99"]
    return common


def main() -> None:
    ap = cli.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small slice, one seed, one epoch")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--objective", default="inbatch", choices=["inbatch", "moco"])
    ap.add_argument("--n-negatives", type=int, default=4)
    ap.add_argument("--range-max", type=int, default=50)
    ap.add_argument("--work-dir", default=None, help="runs and mined files (default: a temporary folder)")
    cli.add_common(ap, threads=1, out=RESULTS)
    args = ap.parse_args()
    cli.apply(args)
    if args.quick:
        args.seeds, args.epochs = 1, 1

    os.environ.setdefault("WANDB_MODE", "disabled")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import torch

    from moco_retrieval.config import DataConfig
    from moco_retrieval.data.sources import load

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hardneg-"))
    work.mkdir(parents=True, exist_ok=True)
    train, pool = load(DataConfig(kind="debian", max_train_examples=6000 if args.quick else None))
    pairs = train.pairs
    eval_dir = train.folder / "eval"
    train_file = work / "train.jsonl"
    from moco_retrieval.data.formats import write_pairs_jsonl

    write_pairs_jsonl(train_file, pairs)  # (a) reads the same rows through the same path as (b), (c)
    print(f"{len(pairs):,} training pairs, eval pool {len(pool.eval_set.queries):,} queries / "
          f"{len(pool.eval_set.corpus):,} documents; work dir {work}", flush=True)

    common = shared_overrides(args, eval_dir)
    seeds = list(range(args.seeds))
    runs: dict[str, list] = {}

    def run(name: str, extra: list[str], seed: int) -> dict:
        r = train_run(common + extra + [f"seed={seed}", f"data.seed={seed}"], work / f"{name}-s{seed}")
        print(f"[{name} seed {seed}] " + ", ".join(f"{k}={v:.4f}" for k, v in r["metrics"].items() if v is not None)
              + f" ({r['seconds']:.0f}s)", flush=True)
        runs.setdefault(name, []).append({"seed": seed, **r})
        return r

    t_start = time.perf_counter()
    for s in seeds:
        run("a_none", [f"data.train_path={train_file}"], s)

    t0 = time.perf_counter()
    mined = mine_variants(last_checkpoint(work / "a_none-s0"), pairs, work, VARIANTS,
                          args.n_negatives, args.range_max)
    mine_seconds = time.perf_counter() - t0
    common_keys = mined.pop("common_keys")
    subset_file = work / "train-common.jsonl"
    write_pairs_jsonl(subset_file, [p for p in pairs if (p.query, p.doc_id) in common_keys])
    n = f"data.n_negatives={args.n_negatives}"
    plan = {
        "a_none_common": [f"data.train_path={subset_file}"],
        "b_unfiltered": [f"data.train_path={mined['unfiltered']['path']}", n, "objective.mask_false_negatives=false"],
        "b_group_only": [f"data.train_path={mined['group_only']['path']}", n],
        "c_filtered": [f"data.train_path={mined['filtered']['path']}", n],
    }
    for name, extra in plan.items():
        for s in seeds:
            run(name, extra, s)

    table = summarise(runs, len(pairs), mined["common_rows"])

    setup = {
        "quick": args.quick, "seeds": seeds, "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
        "objective": args.objective, "model": "frozen_head (bag_of_wordpieces MiniLM embeddings + linear head 384)",
        "n_negatives": args.n_negatives, "rank_window": [0, args.range_max], "sampling": "top",
        "mining_model": "(a) seed 0, last checkpoint", "train_pairs": len(pairs), "common_rows": mined["common_rows"],
        "eval_queries": len(pool.eval_set.queries), "eval_docs": len(pool.eval_set.corpus),
        "mine_seconds": mine_seconds, "total_seconds": time.perf_counter() - t_start,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
    }
    mining = {k: {kk: v["stats"][kk] for kk in ("candidates", "rows_written", "queries_without_negatives",
                                                 "mean_positive_score", "mean_negative_score", "mean_negative_rank")}
              for k, v in mined.items() if k != "common_rows"}
    out = work if (args.quick and args.out == RESULTS) else Path(args.out)  # a smoke test is not a result
    out.mkdir(parents=True, exist_ok=True)
    (out / "hard_negatives.json").write_text(json.dumps({"setup": setup, "results": table, "mining": mining}, indent=2) + "\n")
    (out / "hard_negatives.md").write_text(render(setup, table, mining))
    print(render(setup, table, mining))


def render(setup: dict, table: list, mining: dict) -> str:
    def cell(v):
        if v["mean"] is None:
            return "n/a"
        return f"{100 * v['mean']:.2f} ± {100 * v['std']:.2f}" if setup["seeds"] and len(setup["seeds"]) > 1 else f"{100 * v['mean']:.2f}"

    lines = [
        "# Hard negatives on the Debian set (generated by `python -m benchmarks.hard_negatives`"
        + (" --quick: a smoke test, not a measurement" if setup["quick"] else "") + ")",
        "",
        f"Model: {setup['model']}; objective `{setup['objective']}`, batch {setup['batch_size']}, lr {setup['lr']}, "
        f"{setup['epochs']} epoch(s), {setup['train_pairs']:,} training pairs; held-out pool: "
        f"{setup['eval_queries']:,} queries, {setup['eval_docs']:,} documents (no source package shared with training). "
        f"Hard negatives: {setup['n_negatives']} per query, the best-ranked in ranks {setup['rank_window']} that pass, "
        f"mined by {setup['mining_model']}. Mean ± std over seeds {setup['seeds']} (percent).",
        "",
        "| run | training rows | " + " | ".join(METRICS) + " |",
        "|---|---:|" + "---:|" * len(METRICS),
    ]
    for r in table:
        lines.append(f"| {r['label']} | {r['rows']:,} | " + " | ".join(cell(r[m]) for m in METRICS) + " |")
    lines += ["", "## What the mining filters removed (candidates in the rank window)", "",
              "| mined file | positive | group | relative margin | passed | queries left without negatives | mean score neg / pos |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for k, v in mining.items():
        c = v["candidates"]
        lines.append(f"| {k} | {c['removed']['positive']:,} | {c['removed']['group']:,} | {c['removed']['relative_margin']:,} | "
                     f"{c['passed']:,} | {v['queries_without_negatives']:,} | {v['mean_negative_score']:.3f} / {v['mean_positive_score']:.3f} |")
    lines += ["", f"All runs but the first train on the {setup['common_rows']:,} rows that every mined file could give "
              "negatives (a query whose whole window lies within 5% of its positive's score gets none under the filter), "
              "so the rows differ only in their negatives."]
    lines += ["", f"Machine: {setup['machine']}; mining {setup['mine_seconds']:.0f} s, everything {setup['total_seconds'] / 60:.1f} min.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
