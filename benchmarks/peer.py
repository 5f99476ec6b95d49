"""B4: full fine-tune of all-MiniLM-L6-v2 against the peer, side by side in one process.

Three runs from the same all-MiniLM-L6-v2 weights, over the same batches of the Debian training set
(our batch sampler, seed 0: same pairs, same order), same batch size, steps, lr schedule (AdamW,
linear warmup 10% then linear decay), weight decay 0.01, gradient clipping 1.0, temperature 0.05
(= MNRL's default scale 20) and max lengths (queries 32, documents 128 tokens):

* ours, MoCo queue (``+experiment=queue65k objective=moco``: K = 65,536, m 0.999, batch negatives on);
* ours, in-batch negatives (``+experiment=inbatch256`` at the same batch);
* sentence-transformers' ``MultipleNegativesRankingLoss`` (in-batch negatives, the tool our users
  would otherwise pick), trained with a plain PyTorch loop over the same batches.

Each model is then scored on the held-out pool with the same code (``evaluate_encoder``; the
peer's transformer weights are loaded into our encoder, whose mean pooling + L2 normalisation is
the same as the peer's model). Seconds per step: median over the steps after the first 3 (forward,
backward, optimizer step; our runs through Lightning, so its per-step overhead is included).

CPU budget: batch 32, 150 steps each by default (``--steps``, ``--batch-size``): a short budget, far
from convergence; the 65,536-key queue holds at most steps x batch keys (4,800 at 150 x 32).
Pool: 1,000 held-out queries against 2,400 documents (every relevant one kept) by default
(``--max-queries 0 --max-docs 0``: all 3,283 / 3,283). ``--quick``: 12 steps, 200 / 400.

    python -m benchmarks.peer [--quick] [--steps 150] [--batch-size 32]
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks.harness import cli
from benchmarks.harness.cli import bench_cache
from benchmarks.harness.report import environment, f3, figure, log, peak_rss_mb
from benchmarks.harness.runs import md_table, read_jsonl, run_missing, write_results
from benchmarks.harness.steps import PeerTrainer, step_clock
from benchmarks.harness.training import TRAINER, Bench, compose_cfg

import torch

NAME = "peer"

BASE = [f"trainer={TRAINER}", "logger=none", "data=debian"]


def run_ours(bench: Bench, preset: str, steps: int, batch: int, pool, extra=()) -> dict:
    from moco_retrieval.evaluation.encode import evaluate_encoder

    cfg = compose_cfg(BASE + [f"+experiment={preset}", f"data.batch_size={batch}", f"trainer.max_steps={steps}",
                              "trainer.max_epochs=-1", "trainer.val_check_interval=null", "seed=0", "data.seed=0", *extra])
    clock = step_clock()
    run = bench.fit_eval(cfg, callbacks=[clock], evaluate=False)
    module = run["module"]
    res = evaluate_encoder(module.encoder, pool, module.eval_cfg, batch_size=64, show_progress=False)
    info = {"steps": run["steps"], "train_s": run["train_s"], "step_times": clock.times, "metrics": res.metrics,
            "geometry": res.geometry, "preset": preset, "lr": cfg.optim.lr, "temperature": cfg.objective.temperature}
    if "queue_fill" in run:
        info["queue_fill"] = run["queue_fill"]
        info["queue_size"] = cfg.objective.queue_size
    return info


def run_peer(bench: Bench, steps: int, batch: int, pool, lr: float, warmup_ratio: float, q_len: int, d_len: int) -> dict:
    """sentence-transformers MNRL over our sampler's batches (same pairs, same order)."""
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.evaluation.encode import evaluate_encoder
    from moco_retrieval.model.backbone import resolve_backbone_path
    from moco_retrieval.model.encoder import build_encoder

    torch.manual_seed(0)
    peer = PeerTrainer(str(resolve_backbone_path(ModelConfig(backbone="minilm"))), "mnrl", {}, lr=lr, weight_decay=0.01,
                       lengths=(q_len, d_len), steps=steps, warmup=int(warmup_ratio * steps))
    cfg = compose_cfg(BASE + ["+experiment=inbatch256", f"data.batch_size={batch}", "seed=0", "data.seed=0"])
    sampler = bench.datamodule(cfg).batch_sampler
    pairs = bench.train_pairs
    times, step, epoch = [], 0, 0
    t_all = time.perf_counter()
    while step < steps:
        sampler.set_epoch(epoch)
        for idx in sampler:
            if step >= steps:
                break
            t = time.perf_counter()
            peer.step(peer.features([pairs[i].query for i in idx], [pairs[i].positive for i in idx]))
            times.append(time.perf_counter() - t)
            step += 1
        epoch += 1
    train_s = time.perf_counter() - t_all
    # score with our encoder code path: same mean pooling + normalisation, the peer's weights
    enc = build_encoder(ModelConfig(backbone="minilm", head="none", query_max_len=q_len, doc_max_len=d_len))
    peer.copy_into(enc)
    res = evaluate_encoder(enc, pool, cfg.eval, batch_size=64, show_progress=False)
    return {"steps": step, "train_s": train_s, "step_times": times, "metrics": res.metrics, "geometry": res.geometry,
            "lr": lr, "temperature": peer.temperature}


# --only name -> the run's name in the cache and the report
RUNS = {"moco": "ours: MoCo queue K=65,536", "inbatch": "ours: in-batch negatives", "mnrl": "sentence-transformers MNRL",
        "base": "base"}


def do_run(short: str, bench: Bench, pool, setting: dict) -> dict:
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.evaluation.encode import evaluate_encoder
    from moco_retrieval.model.encoder import build_encoder

    steps, batch = setting["steps"], setting["batch"]
    if short == "moco":
        return run_ours(bench, "queue65k", steps, batch, pool, ["objective=moco"])
    if short == "inbatch":
        return run_ours(bench, "inbatch256", steps, batch, pool)
    if short == "mnrl":
        return run_peer(bench, steps, batch, pool, setting["lr"], setting["warmup_ratio"], setting["q_len"], setting["d_len"])
    return {"metrics": evaluate_encoder(build_encoder(ModelConfig(backbone="minilm", head="none")), pool,
                                        setting["eval"], batch_size=64, show_progress=False).metrics}


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 150; quick 12)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-queries", type=int, default=1000, help="queries of the pool (0: all 3,283); quick 200")
    ap.add_argument("--max-docs", type=int, default=2400, help="documents of the pool (0: all; every relevant one kept); quick 400")
    cli.add_only(ap, list(RUNS), ",".join(RUNS))
    cli.add_common(ap)
    args = ap.parse_args(argv)
    cli.apply(args)
    from moco_retrieval.data.sources import cap_eval_set

    quick = args.quick
    steps = args.steps or (12 if quick else 150)
    mq = (200 if quick else args.max_queries) or None
    md_ = (400 if quick else args.max_docs) or None
    only = cli.names(args.only, list(RUNS))
    t0 = time.time()
    bench = Bench()
    pool = cap_eval_set(bench.eval_set, mq, md_, seed=0)
    base = compose_cfg(BASE + ["+experiment=queue65k"])
    setting = {"steps": steps, "batch": args.batch_size, "lr": base.optim.lr, "warmup_ratio": base.optim.warmup_ratio,
               "q_len": base.model.query_max_len, "d_len": base.model.doc_max_len, "eval": base.eval}
    log(f"B4: {steps} steps at batch {args.batch_size}, lr {setting['lr']}, max lengths {setting['q_len']}/{setting['d_len']}, "
        f"pool {len(pool.corpus):,} docs")
    # finished runs are cached (JSONL, keyed by the run's name), so the runs can go in parallel
    # processes (--only) and a last invocation writes the report from all of them
    cache = bench_cache(f"peer-{'quick' if quick else 'full'}-s{steps}-b{args.batch_size}-q{mq}-d{md_}.jsonl")

    def run(name: str, seed: int) -> dict:
        short = next(k for k, v in RUNS.items() if v == name)
        rec = {"name": name, "run": do_run(short, bench, pool, setting)}
        log(f"{name}: recall@1 {rec['run']['metrics']['recall@1']:.3f}")
        return rec

    run_missing(cache, [RUNS[k] for k in RUNS if k in only], [0], None, lambda name, seed: name, run, key_field="name")
    done = {rec["name"]: rec["run"] for rec in read_jsonl(cache)}
    report(done, setting, pool, quick, time.time() - t0, cli.out_dir(args))
    return 0


def report(done: dict, setting: dict, pool, quick: bool, wall_s: float, out_dir: Path) -> None:
    runs = {RUNS[k]: done[RUNS[k]] for k in ("moco", "inbatch", "mnrl") if RUNS[k] in done}
    base_metrics = done.get("base", {}).get("metrics")
    for r in runs.values():
        ts = r["step_times"][3:] or r["step_times"]
        r["s_per_step_median"] = statistics.median(ts)
    rows = []
    if base_metrics is not None:
        m = base_metrics
        rows.append(["all-MiniLM-L6-v2, not fine-tuned", "-", f3(m["recall@1"]), f3(m["mrr@10"]), f3(m["ndcg@10"]), "-", "-"])
    ref = runs.get(RUNS["mnrl"], {}).get("s_per_step_median")
    for name, r in runs.items():
        m = r["metrics"]
        rows.append([name, r["steps"], f3(m["recall@1"]), f3(m["mrr@10"]), f3(m["ndcg@10"]), f"{r['s_per_step_median']:.3f}",
                     f"{r['s_per_step_median'] / ref:.2f}" if ref else "-"])
    steps, batch, lr, warm = setting["steps"], setting["batch"], setting["lr"], setting["warmup_ratio"]
    q_len, d_len = setting["q_len"], setting["d_len"]
    data = {
        "benchmark": "B4 full fine-tune vs peer", "mode": "quick" if quick else "full", "steps": steps, "batch_size": batch,
        "lr": lr, "warmup_ratio": warm, "temperature": 0.05, "query_max_len": q_len, "doc_max_len": d_len,
        "pool": {"docs": len(pool.corpus), "queries": len(pool.queries)},
        "base_model": base_metrics,
        "runs": runs, "wall_s": wall_s, "peak_rss_mb": peak_rss_mb(), "environment": environment(),
    }
    prefix = NAME if not quick else f"{NAME}_quick"
    md = [f"# B4: full fine-tune of all-MiniLM-L6-v2 vs sentence-transformers ({data['mode']})", "",
          f"Same start weights, same batches (pairs and order), batch {batch}, {steps} steps, AdamW lr {lr} with "
          f"{int(warm * 100)}% linear warmup then linear decay, weight decay 0.01, clipping 1.0, tau 0.05 (MNRL scale 20), "
          f"max lengths {q_len}/{d_len} tokens. Held-out pool: {len(pool.corpus):,} documents, {len(pool.queries):,} queries, "
          "all scored by the same code. **A short CPU budget**: far from convergence, the numbers compare the "
          f"methods at equal cost, not their final quality; the K=65,536 queue holds at most {steps * batch:,} keys here.", "",
          md_table(["run", "steps", "recall@1", "MRR@10", "nDCG@10", "s/step (median)", "vs MNRL s/step"], rows), "",
          f"Threads: {torch.get_num_threads()}; seconds per step are the median after 3 warm-up steps, on a shared "
          f"CPU. Wall time {data['wall_s'] / 60:.1f} min, peak RSS {data['peak_rss_mb']:.0f} MB."]
    write_results(prefix, "\n".join(md), data, out_dir)
    fig = figure(6.4, 3.8)
    ax = fig.subplots()
    for name, r in runs.items():
        ax.plot(range(1, len(r["step_times"]) + 1), r["step_times"], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Seconds per training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / f"{prefix}_step_times.png")
    log(f"wrote {out_dir / (prefix + '.md')}")


if __name__ == "__main__":
    raise SystemExit(main())
