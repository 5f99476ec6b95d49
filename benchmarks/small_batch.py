"""B11: where the queue must pay. Small per-step batches at equal memory (issue 35).

B6 (``finetune.py``) compared objectives at batch 32 and up, where nobody is short of negatives.
This is its setup (all-MiniLM-L6-v2, the same 18,240 pairs in the same order, the same pool,
AdamW lr 2e-5, 10% warmup then linear decay, tau 0.05) at a per-step batch of 8 (and 4): what a
user whose memory caps the batch gets from each answer. A run at batch b < 32 takes each batch of
B6's batch-32 order and splits it into 32 / b consecutive steps, so every run still sees the same
pairs in the same order, in 32 / b times the steps. Runs (``RUNS``):

* in-batch at 8 and 4;
* the main job's two-queue objective at 8 and 4 (``main-B``): its age bound and momentum scaled
  to the steps, so the queue covers the same pairs and the EMA the same span of data as at batch
  32: ``queue_max_age`` 128 * 32/B (4,096 keys either way) and ``momentum`` 1 - 0.005 * B/32
  (time constant 200 steps at 32, 800 at 8);
* MoCo at 8 (K 65,536, m 0.999: ``+experiment=queue65k objective=moco``);
* GradCache at a global batch of 256 in mini-batches of 8, ours (``model.grad_cache_chunk=8``)
  and sentence-transformers' CachedMNRL as the peer: the same memory as batch 8, the big-batch answer;
* LoRA (r 16, alpha 32, LoRA's usual 10x learning rate 2e-4) at 8 with in-batch and with the main
  objective; the main objective at 8 with gradient checkpointing;
* in-batch 32 and the main job at 32 are read from B6's cache (``finetune_runs.jsonl``), not rerun.

Each run reports recall@1, MRR@10, nDCG@10, the mean unrelated cosine, training seconds, and its
peak memory: the process's peak RSS (CPU; run one run per process for it to be that run's), and
``torch.cuda.max_memory_allocated`` on a GPU (``MR_BENCH_TRAINER=gpu``). Finished runs are appended
to ``benchmarks/results/small_batch_runs.jsonl`` (committed), so later invocations resume; one
thread per run, runs in parallel processes (``--only NAME --seeds S``).

Each run's own clock runs beside whatever else shares the CPU, so its seconds do not compare runs.
``--cost`` times one step of each run in turn on real batches (``harness.side_by_side.measure``, one
process, medians over rounds) and writes ``small_batch_cost.json``; the goal's seconds come from it.
A process's peak RSS covers loading and evaluation too, so ``--memory`` measures each run's steps
alone (``harness.side_by_side.memory``): the MiB resident between steps (weights, gradients, EMA copy,
queues, optimizer state) and the most MiB a step adds at its peak over the steps that train the
first 256 pairs (32 steps at batch 8, one GradCache step), into ``small_batch_memory.json``.

    python -m benchmarks.small_batch --only inbatch-8,main-8 --seeds 0 --threads 1
    python -m benchmarks.small_batch --cost --rounds 5 --threads 1
    python -m benchmarks.small_batch --memory --threads 1
    python -m benchmarks.small_batch --report
    python -m benchmarks.small_batch --dry-run            # the tiny random model, seconds, to a temporary folder
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

import torch

from benchmarks.harness import cli, equal_data, side_by_side
from benchmarks.harness.cli import RESULTS
from benchmarks.harness.equal_data import (INBATCH, MAIN_AT_32, MAIN_RUN, MOCO, add_run_args, batches_of,
                                          main_objective_at, runner, trained)
from benchmarks.harness.report import environment, figure, fmt, log, med_std, paired, peak_rss_mb
from benchmarks.harness.runs import md_table, read_jsonl, run_selected, write_results
from benchmarks.harness.runs import records as cached_records
from benchmarks.harness.training import TRAINER, Bench

NAME = "small_batch"
LORA = ["model.lora.r=16", "model.lora.alpha=32", "optim.lr=2e-4"]
def _main_what(batch: int) -> str:
    scale = 32 // batch
    return (f"the main job's two-queue objective, m {1 - 0.005 / scale:g} (EMA time constant {200 * scale} steps), "
            f"keys at most {128 * scale} steps old ({MAIN_AT_32['keys']:,})")


# name -> (kind, batch, overrides or loss options, what it is); in order of priority
RUNS: dict[str, tuple[str, int, object, str]] = {
    "inbatch-8": ("ours", 8, INBATCH, "ours, in-batch negatives"),
    "main-8": ("ours", 8, main_objective_at(8), _main_what(8)),
    "gradcache-256": ("ours", 256, INBATCH + ["model.grad_cache_chunk=8"], "ours, in-batch 256 by GradCache, chunks of 8"),
    "cmnrl-256": ("cmnrl", 256, {"mini_batch_size": 8}, "sentence-transformers CachedMNRL, mini-batch 8"),
    "moco-8": ("ours", 8, MOCO, "MoCo queue, K 65,536, m 0.999"),
    "lora_inbatch-8": ("ours", 8, INBATCH + LORA, "LoRA r 16 (lr 2e-4), in-batch negatives"),
    "lora_main-8": ("ours", 8, main_objective_at(8, *LORA), "LoRA r 16 (lr 2e-4), " + _main_what(8)),
    "main_gc-8": ("ours", 8, main_objective_at(8, "model.gradient_checkpointing=true"),
                  "main-8 with gradient checkpointing"),
    "inbatch-4": ("ours", 4, INBATCH, "ours, in-batch negatives"),
    "main-4": ("ours", 4, main_objective_at(4), _main_what(4)),
}
SEEDS = {n: (0, 1, 2) for n in ("inbatch-8", "main-8", "gradcache-256", "cmnrl-256")}  # the goal's runs; others seed 0
REFERENCES = {"inbatch-32": "inbatch-32", "main-32": MAIN_RUN}  # our name -> B6's, read from its cache
COST_REF = "inbatch-8"  # the side-by-side cost is per pair relative to it


# ----------------------------------------------------------------------------------- runs


class Memory:
    """Peak memory of one run: the process's peak RSS, and the CUDA allocator's peak when on a GPU."""

    def __init__(self):
        self.cuda = torch.cuda.is_available() and TRAINER == "gpu"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.rss_before = peak_rss_mb()

    def record(self) -> dict:
        out = {"peak_rss_mib": peak_rss_mb(), "peak_rss_before_mib": self.rss_before}
        if self.cuda:
            out["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        return out


def do_run(bench, pool, name: str, seed: int, args) -> dict:
    batches = batches_of(bench, seed, args.pairs, RUNS[name][1])
    mem = Memory()
    rec = trained(bench, pool, f"B11 {name}", RUNS[name], batches, seed, args.eval_every)
    return {"key": run_key(name, seed, args), "name": name, **rec, **mem.record(), "model": args.model}


def run_key(name: str, seed: int, args) -> str:
    return f"{name}|seed={seed}|model={args.model}|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}"


def references(args) -> list[dict]:
    """B6's in-batch 32 and main-job 32 runs on the same pairs and pool, renamed (MiniLM only)."""
    if args.model != "minilm":
        return []
    suffix = f"|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}"
    back = {v: k for k, v in REFERENCES.items()}
    return [{**r, "name": back[r["name"]], "from": "finetune_runs.jsonl"}
            for r in read_jsonl(RESULTS / "finetune_runs.jsonl") if r["name"] in back and r["key"].endswith(suffix)]


# ----------------------------------------------------------------------------------- report


def goal(by: dict, cost: Optional[dict] = None, memory: Optional[dict] = None) -> list[str]:
    """Issue 35's goal: at batch 8 the queue beats in-batch 8 by more than 2 std, and matches
    GradCache-256 in at most half its seconds (side by side when ``cost`` has both), at about its
    memory (``step_memory_mib``, when measured)."""
    q = by.get("main-8", [])
    if not q:
        return ["- main-8 is not run yet."]
    out = []
    r = by.get("inbatch-8", [])
    for key in ("recall@1", "ndcg@10"):
        if not r:
            break
        mq, sq = med_std([x["final"][key] for x in q])
        mr, sr = med_std([x["final"][key] for x in r])
        sd, n = max(v for v in (sq, sr, 0.0) if v == v), min(len(q), len(r))
        diffs = " / ".join(f"{d:+.3f}" for d in paired(q, r, key))
        verdict = (f"beats by more than 2 std: {'yes' if mq - mr > 2 * sd else 'no'}" if n >= 3
                   else f"{n} seed(s): no claim yet")
        out.append(f"- {key}, main-8 vs inbatch-8: {mq:.3f} vs {mr:.3f} ({mq - mr:+.3f}, 2 std {2 * sd:.4f}); {verdict}"
                   + (f"; seed by seed {diffs}" if diffs else ""))
    for ref in ("gradcache-256", "cmnrl-256"):
        g = by.get(ref, [])
        if not g:
            out.append(f"- vs {ref}: not run yet.")
            continue
        mq, mg = med_std([x["final"]["recall@1"] for x in q])[0], med_std([x["final"]["recall@1"] for x in g])
        sd = mg[1] if mg[1] == mg[1] else 0.0
        out.append(f"- vs {ref}: recall@1 {mq:.3f} vs {mg[0]:.3f} (matches within 2 std: {'yes' if mq >= mg[0] - 2 * sd else 'no'}); "
                   + seconds_vs(q, g, ref, cost) + memory_vs(q, g, memory))
    return out


def memory_vs(q: list[dict], g: list[dict], memory: Optional[dict]) -> str:
    mq, mg = (step_memory_mib(xs[0]["name"], xs, memory) for xs in (q, g))
    return "" if mq is None or mg is None else f"; training memory {mq:,.0f} vs {mg:,.0f} MiB ({mq / mg:.2f}x)"


def seconds_vs(q: list[dict], g: list[dict], ref: str, cost: Optional[dict]) -> str:
    """main-8's training seconds over ``ref``'s at equal data: the side-by-side per-pair ratio when
    ``--cost`` measured both, else the runs' own clocks (which only compare runs that shared the CPU alike)."""
    ratio = pair_cost_ratio(cost, "main-8", ref) if cost else None
    if ratio is not None:
        return f"training seconds at equal data, side by side: {ratio:.2f}x {ref}'s (the goal: at most 0.5)"
    tq, tg = med_std([x["train_s"] for x in q])[0], med_std([x["train_s"] for x in g])[0]
    return (f"training seconds {tq:.0f} vs {tg:.0f} by the runs' own clocks (ratio {tq / tg:.2f}; the goal: at most 0.5; "
            "not side by side: `--cost` measures it)")


def pair_cost_ratio(cost: dict, a: str, b: str) -> Optional[float]:
    """a's seconds per pair over b's, side by side (None unless ``cost`` timed both)."""
    rows = {r["name"]: r for r in cost["rows"]}
    if a not in rows or b not in rows:
        return None
    return side_by_side.per_pair_ratio(rows[a]["times"], rows[a]["batch"], rows[b]["times"], rows[b]["batch"])


def cost_lines(cost: Optional[dict]) -> list[str]:
    return side_by_side.table_lines(cost) if cost else ["Not measured yet (`--cost`)."]


def measure_cost(names: list[str], rounds: int, path: Path) -> dict:
    names = [COST_REF, *(n for n in names if n != COST_REF)]
    times = side_by_side.measure(Bench(), names, rounds, 1, runs=RUNS, batches=batches_of)
    cost = {"ref": COST_REF, "rounds": rounds, "threads": torch.get_num_threads(),
            "rows": side_by_side.summarise(times, COST_REF, runs=RUNS), "environment": environment()}
    path.write_text(json.dumps(cost, indent=1))
    log(f"wrote {path}")
    return cost


def measure_memory(names: list[str], path: Path) -> dict:
    memory = {"rows": side_by_side.memory(Bench(), names, runs=RUNS, batches=batches_of), "environment": environment()}
    path.write_text(json.dumps(memory, indent=1))
    log(f"wrote {path}")
    return memory


def memory_row(name: str, memory: Optional[dict]) -> Optional[dict]:
    """``--memory``'s row for ``name``, when it measured a step's peak for it."""
    row = {r["name"]: r for r in memory["rows"]}.get(name) if memory else None
    return row if row is not None and row["step_peak_mib"] is not None else None


def step_memory_mib(name: str, xs: list[dict], memory: Optional[dict]) -> Optional[float]:
    """A run's memory for training: the CUDA allocator's peak when it ran on a GPU, else what
    ``--memory`` measured (resident + a step's peak), else None."""
    cuda = [x["cuda_peak_mib"] for x in xs if "cuda_peak_mib" in x]
    if cuda:
        return statistics.median(cuda)
    row = memory_row(name, memory)
    return None if row is None else row["resident_mib"] + row["step_peak_mib"]


def memory_cells(name: str, xs: list[dict], memory: Optional[dict]) -> list[str]:
    """The table's memory columns: training memory (``step_memory_mib``, with its parts) and the
    process's lifetime peak RSS (loading and evaluation included)."""
    total, row = step_memory_mib(name, xs, memory), memory_row(name, memory)
    if any("cuda_peak_mib" in x for x in xs):
        cell = f"{total:,.0f} (CUDA peak)"
    elif total is not None:
        cell = f"{total:,.0f} ({row['resident_mib']:,.0f} + {row['step_peak_mib']:,.0f})"
    else:
        cell = ""
    rss = [x["peak_rss_mib"] for x in xs if "peak_rss_mib" in x]
    return [cell, f"{statistics.median(rss):,.0f}" if rss else ""]


def report(records: list[dict], args, out_dir: Path, prefix: str, cut: list[str], cost: Optional[dict],
           memory: Optional[dict]) -> None:
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    rows = []
    for name in [*REFERENCES, *RUNS]:
        xs = by.get(name)
        if not xs:
            continue
        what = RUNS[name][3] if name in RUNS else f"B6's {REFERENCES[name]} (from its cache)"
        rows.append([name, what, xs[0]["batch_size"], len(xs), fmt(xs, "recall@1"), fmt(xs, "mrr@10"),
                     fmt(xs, "ndcg@10"), fmt(xs, "unrelated_cos_mean"),
                     f"{med_std([x['s_per_step'] for x in xs])[0]:.2f}",
                     f"{med_std([x['train_s'] for x in xs])[0]:.0f}", *memory_cells(name, xs, memory)])
    md = [f"# B11: small per-step batches at equal memory ({'dry run, tiny random model' if args.dry_run else args.model})", "",
          f"Every run: the same {args.pairs:,} training pairs in the same order (B6's), held-out pool "
          f"{args.max_queries} queries / {args.max_docs} documents; median ± std over the seeds run. Training "
          "memory, MiB: on a GPU the CUDA allocator's peak; on a CPU what `--memory` measured, resident between "
          "steps (weights, gradients, EMA copy, queues, optimizer state) + the most a step adds (activations) "
          "over the steps that train the first 256 pairs. "
          "Process peak: the run's whole process (loading and evaluation included, RSS), MiB.", "",
          md_table(["run", "what", "batch", "seeds", "recall@1", "MRR@10", "nDCG@10", "unrelated cos", "s/step",
                    "train s", "training memory", "process peak"], rows), "",
          "## The goal (issue 35)", "", *goal(by, cost, memory), "", "## Cost, side by side", "", *cost_lines(cost), ""]
    missing = [f"{n} (seed {s})" for n in RUNS for s in SEEDS.get(n, (0,)) if not any(r["seed"] == s for r in by.get(n, []))]
    if missing:
        md += ["## Not run yet", "", "Planned and not in the cache (the cache resumes them): " + ", ".join(missing) + ".", ""]
    if cut:
        md += ["Cut in this invocation: " + ", ".join(cut) + ".", ""]
    write_results(prefix, "\n".join(md), {"benchmark": "B11 small batches at equal memory", "pairs": args.pairs,
                                          "model": args.model, "pool": {"queries": args.max_queries, "docs": args.max_docs},
                                          "runs": records, "cost": cost, "memory": memory, "environment": environment()},
                  out_dir)
    plot(by, cost, memory, out_dir / f"{prefix}.png")
    log(f"wrote {out_dir / (prefix + '.md')}")


def plot(by: dict, cost: Optional[dict], memory: Optional[dict], path: Path) -> None:
    """recall@1 against training memory (``step_memory_mib``, else the process's peak RSS) and
    against training time at equal data, one point per run (median of seeds). Time is the
    side-by-side per-pair cost when ``--cost`` ran (runs it timed only), else each run's own clock;
    B6's references are horizontal lines."""
    per_pair = {r["name"]: r[f"per_pair_vs_{cost['ref']}"] for r in cost["rows"]} if cost else None

    def time(xs: list[dict]) -> list[float]:
        if per_pair is None:
            return [x["train_s"] for x in xs]
        return [per_pair[xs[0]["name"]]] if xs[0]["name"] in per_pair else []

    def mem(xs: list[dict]) -> list[float]:
        if memory is None and not any("cuda_peak_mib" in x for x in xs):
            return [x["peak_rss_mib"] for x in xs if "peak_rss_mib" in x]
        total = step_memory_mib(xs[0]["name"], xs, memory)
        return [] if total is None else [total]

    xs_of = {"memory": mem, "time": time}
    mem_label = "training memory, MiB" if memory else "process peak memory (RSS), MiB"
    time_label = (f"training time at equal data, x {cost['ref']}'s (side by side)" if cost
                  else "training seconds (each run's own clock)")
    fig = figure(10.0, 4.2)
    panels = fig.subplots(1, 2, sharey=True)
    for ax, key, xlabel in ((panels[0], "memory", mem_label), (panels[1], "time", time_label)):
        for name, xs in by.items():
            values = [v for v in xs_of[key](xs) if v is not None]
            if name in REFERENCES:  # B6's batch-32 runs: a level to compare with, not a point here
                ax.axhline(med_std([r["final"]["recall@1"] for r in xs])[0], ls=":" if name.startswith("main") else "--",
                           color="grey", lw=1, label=f"{name} (B6)")
                continue
            if not values:
                continue
            ax.scatter([statistics.median(values)], [med_std([r["final"]["recall@1"] for r in xs])[0]], label=name,
                       zorder=3, marker="*" if name.startswith("main") else "o")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    panels[0].set_ylabel("recall@1")
    fig.suptitle("B11: recall@1 at small per-step batches", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    equal_data.add_dry_run(ap)
    ap.add_argument("--cost", action="store_true", help="time one step of each --only run side by side (no training), then report")
    ap.add_argument("--rounds", type=int, default=5, help="--cost: timed rounds")
    ap.add_argument("--memory", action="store_true",
                    help="measure each --only run's training memory, one run at a time (no training), then report")
    add_run_args(ap, default=",".join(RUNS), runs=list(RUNS), small="dry-run")
    args = ap.parse_args(argv)
    cli.apply(args)
    d = args.dry_run
    out_dir, prefix, cache = equal_data.settle(args, NAME)
    names = cli.names(args.only, list(RUNS))  # before anything loads: a typo exits at once, even with --report
    if (args.cost or args.memory) and d:
        raise SystemExit("--cost and --memory measure MiniLM's real steps; they have no --dry-run (run them without)")
    cost_path, memory_path = out_dir / f"{prefix}_cost.json", out_dir / f"{prefix}_memory.json"
    if args.cost:
        measure_cost(names, args.rounds, cost_path)  # then the report, from the cache
    if args.memory:
        measure_memory(names, memory_path)
    cut = [] if args.cost or args.memory else run_selected(cache, args, list(RUNS), lambda name, seed: run_key(name, seed, args),
                                            lambda: runner(args, do_run))
    records = cached_records(cache, equal_data.protocol_suffix(args)) + references(args)
    cost, memory = (json.loads(p.read_text()) if p.exists() else None for p in (cost_path, memory_path))
    report(records, args, out_dir, prefix, cut, cost, memory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
