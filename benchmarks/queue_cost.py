"""B14: the queue at in-batch's price. Keys without a second encoder pass (issue 44).

The main job's queue bought a point of recall@1 at batch 8 (B11) and half a point at batch 32 (B6),
for about 1.3x in-batch's compute per pair: every step encodes both sides twice, once with gradient
and once more by the EMA key encoder. With ``objective.keys=online`` the keys are the trained pass's
own embeddings, detached: no second pass and no EMA copy (cross-batch memory, XBM; ContAccum's dual
bank of queries and documents). This is B6's setup (all-MiniLM-L6-v2, the same 18,240 pairs in the
same order, the same pool) at batch 32 and B11's at batch 8 (B6's batches split in four), so B6's and
B11's runs of in-batch negatives and of the main job are this table's references, read from their
caches, not rerun. Runs (``RUNS``):

* ``online-32`` / ``online-8``: the main job's two-queue objective with online keys, in-batch term
  included (ContAccum's dual bank plus the in-batch term); at 8 with B11's age bound for batch 8;
* ``online_noib-32``: the dual bank without the in-batch term.

Each reports recall@1, MRR@10, nDCG@10 and the mean unrelated cosine; ``--cost`` times one step of
each run and of the references in turn on real batches (one process, medians over rounds) and gives
each one's seconds per pair against in-batch at the same batch. ``--ema`` takes the main job's step
apart where EMA keys stay (issue 44, part 2): per round, a whole step, the key encoder's two passes
under ``no_grad`` (as the module runs them) and under ``inference_mode``, and the EMA update (fused
``torch._foreach`` ops already), side by side at batch 32 and 8. Finished runs are appended to
``benchmarks/results/queue_cost_runs.jsonl`` (committed), so later invocations resume; one thread
per run, runs in parallel processes (``--only NAME --seeds S``).

    python -m benchmarks.queue_cost --only online-32 --seeds 0 --threads 1
    python -m benchmarks.queue_cost --cost --rounds 5 --threads 1
    python -m benchmarks.queue_cost --ema --rounds 5 --threads 1
    python -m benchmarks.queue_cost --report
    python -m benchmarks.queue_cost --dry-run            # the tiny random model, seconds, to a temporary folder
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

import torch

from benchmarks.harness import cli, equal_data, side_by_side
from benchmarks.harness.cli import RESULTS
from benchmarks.harness.equal_data import (INBATCH, MAIN, MAIN_RUN, RUNS as B6_RUNS, add_run_args, batches_of,
                                          main_objective, main_objective_at, runner, trained, two_queue)
from benchmarks.harness.report import environment, fmt, log, med_std, paired
from benchmarks.harness.runs import md_table, read_jsonl, run_selected, write_results
from benchmarks.harness.runs import records as cached_records
from benchmarks.harness.training import Bench

NAME = "queue_cost"
ONLINE = "objective.keys=online"

# name -> (kind, batch, overrides, what it is); in order of priority
RUNS: dict[str, tuple[str, int, object, str]] = {
    "online-32": ("ours", 32, main_objective(ONLINE), "the main job's objective with online keys (ContAccum's dual "
                                                      "bank + the in-batch term), keys at most 128 steps old"),
    "online-8": ("ours", 8, main_objective_at(8, ONLINE), "the same at batch 8, keys at most 512 steps old"),
    "online_noib-32": ("ours", 32, two_queue("objective.momentum=0.995", "objective.queue_size=4096", ONLINE,
                                             inbatch=0.0), "the dual bank with online keys, no in-batch term"),
    # XBM (Wang et al. 2020): one memory of the trained encoder's detached document embeddings beside the batch
    "xbm-32": ("ours", 32, MAIN + ["objective=moco", ONLINE, "objective.queue_size=4096"],
               "one document bank of online keys and the batch (XBM), keys at most 128 steps old"),
}
SEEDS = {"online-32": (0, 1, 2), "online-8": (0, 1, 2)}  # the headline rows; the others seed 0
# the references, read from B6's and B11's caches (our name -> (cache, its name there, batch))
REFERENCES = {"inbatch-32": ("finetune_runs.jsonl", "inbatch-32", 32), "main-32": ("finetune_runs.jsonl", MAIN_RUN, 32),
              "inbatch-8": ("small_batch_runs.jsonl", "inbatch-8", 8), "main-8": ("small_batch_runs.jsonl", "main-8", 8)}
# what --cost times beside the runs: the references' configurations
COSTED = {"inbatch-32": B6_RUNS["inbatch-32"], "main-32": B6_RUNS[MAIN_RUN],
          "inbatch-8": ("ours", 8, INBATCH, "ours, in-batch negatives"),
          "main-8": ("ours", 8, main_objective_at(8), "the main job's objective at batch 8 (B11)"), **RUNS}


def do_run(bench, pool, name: str, seed: int, args) -> dict:
    batches = batches_of(bench, seed, args.pairs, RUNS[name][1])
    rec = trained(bench, pool, f"B14 {name}", RUNS[name], batches, seed, args.eval_every)
    return {"key": run_key(name, seed, args), "name": name, **rec, "model": args.model}


def run_key(name: str, seed: int, args) -> str:
    return f"{name}|seed={seed}|model={args.model}|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}"


def references(args) -> list[dict]:
    """B6's and B11's runs of in-batch negatives and of the main job on the same pairs and pool."""
    if args.model != "minilm":
        return []
    suffix = f"|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}"
    out = []
    for ours, (cache, theirs, _) in REFERENCES.items():
        out += [{**r, "name": ours, "from": cache} for r in read_jsonl(RESULTS / cache)
                if r["name"] == theirs and r["key"].endswith(suffix)]
    return out


# ----------------------------------------------------------------------------------- report


def goal(by: dict, cost: Optional[dict]) -> list[str]:
    """Issue 44's goal: online keys reach the main job's recall at no more than 1.05x in-batch's cost
    per pair, at both batches and on every seed."""
    out = []
    for b in (32, 8):
        online, main, inbatch = by.get(f"online-{b}", []), by.get(f"main-{b}", []), by.get(f"inbatch-{b}", [])
        if not online:
            out.append(f"- batch {b}: online-{b} is not run yet.")
            continue
        for ref, xs in ((f"main-{b}", main), (f"inbatch-{b}", inbatch)):
            if not xs:
                continue
            mo, mr = med_std([x["final"]["recall@1"] for x in online])[0], med_std([x["final"]["recall@1"] for x in xs])[0]
            diffs = paired(online, xs, "recall@1")
            out.append(f"- batch {b}, recall@1 online-{b} vs {ref}: {mo:.3f} vs {mr:.3f} ({mo - mr:+.3f}); seed by seed "
                       + (" / ".join(f"{d:+.3f}" for d in diffs) if diffs else "(no common seed yet)"))
        ratio = pair_cost_ratio(cost, f"online-{b}", f"inbatch-{b}") if cost else None
        out.append(f"- batch {b}, cost per pair online-{b} / inbatch-{b}, side by side: "
                   + (f"{ratio:.2f}x (the goal: at most 1.05x)" if ratio is not None else "not measured yet (`--cost`)"))
    return out


def pair_cost_ratio(cost: dict, a: str, b: str) -> Optional[float]:
    rows = {r["name"]: r for r in cost["rows"]}
    if a not in rows or b not in rows:
        return None
    return side_by_side.per_pair_ratio(rows[a]["times"], rows[a]["batch"], rows[b]["times"], rows[b]["batch"])


def measure_cost(names: list[str], rounds: int, path: Path) -> dict:
    names = [n for n in COSTED if n in names or n in REFERENCES]
    times = side_by_side.measure(Bench(), names, rounds, 1, runs=COSTED, batches=batches_of)
    cost = {"ref": "inbatch-32", "rounds": rounds, "threads": torch.get_num_threads(),
            "rows": side_by_side.summarise(times, "inbatch-32", runs=COSTED), "environment": environment()}
    path.write_text(json.dumps(cost, indent=1))
    log(f"wrote {path}")
    return cost


def measure_ema(rounds: int, path: Path) -> dict:
    """The main job's step at 32 and 8 taken apart (see the module docstring): medians over
    ``rounds`` after one warm-up, each part timed on the same batch in the same round."""
    import time

    bench = Bench()
    out = {"rounds": rounds, "threads": torch.get_num_threads(), "rows": [], "environment": environment()}
    for name in ("main-32", "main-8"):
        step, order = side_by_side.make_step(bench, name, COSTED), batches_of(bench, 0, 18240, COSTED[name][1])
        m = step.m
        parts: dict[str, list[float]] = {"step": [], "keys_no_grad": [], "keys_inference_mode": [], "ema_update": []}

        def keys(batch, mode):
            with mode():
                k = m.key_encoder(batch["doc"], "doc")
                q = m.key_encoder(batch["query"], "query")
            return k.clone(), q.clone()  # inference tensors cannot be saved for backward: the module would copy them

        for r in range(rounds + 1):
            batch = step.prepare(order[r % len(order)])
            timed = {"step": lambda: step(batch), "keys_no_grad": lambda: keys(batch, torch.no_grad),
                     "keys_inference_mode": lambda: keys(batch, torch.inference_mode),
                     "ema_update": lambda: m.key_encoder.update(m.encoder, m.momentum())}
            for part, fn in timed.items():
                t0 = time.perf_counter()
                fn()
                if r:
                    parts[part].append(time.perf_counter() - t0)
            log(f"  {name} round {r + 1}/{rounds + 1}")
        med = {p: statistics.median(v) for p, v in parts.items()}
        out["rows"].append({"name": name, "batch": COSTED[name][1], "median_s": med, "times": parts})
    path.write_text(json.dumps(out, indent=1))
    log(f"wrote {path}")
    return out


def ema_lines(ema: Optional[dict]) -> list[str]:
    if not ema:
        return ["Not measured yet (`--ema`)."]
    rows = []
    for r in ema["rows"]:
        m = r["median_s"]
        rows.append([r["name"], f"{m['step']:.3f}", f"{m['keys_no_grad']:.3f} ({m['keys_no_grad'] / m['step']:.0%})",
                     f"{m['keys_inference_mode']:.3f} ({m['keys_inference_mode'] / m['keys_no_grad']:.2f}x)",
                     f"{m['ema_update'] * 1000:.1f} ms ({m['ema_update'] / m['step']:.1%})"])
    return [md_table(["run", "step s", "key passes, no_grad s (share of the step)",
                      "key passes, inference_mode s (x no_grad)", "EMA update (share of the step)"], rows), "",
            f"Medians of {ema['rounds']} rounds after one warm-up, {ema['threads']} thread(s), every part on the same "
            "batch in the same round."]


def report(records: list[dict], args, out_dir: Path, prefix: str, cut: list[str], cost: Optional[dict],
           ema: Optional[dict] = None) -> None:
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    rows = []
    for name in [*REFERENCES, *RUNS]:
        xs = by.get(name)
        if not xs:
            continue
        what = RUNS[name][3] if name in RUNS else f"{REFERENCES[name][1]} (from {REFERENCES[name][0]})"
        rows.append([name, what, xs[0]["batch_size"], len(xs), fmt(xs, "recall@1"), fmt(xs, "mrr@10"),
                     fmt(xs, "ndcg@10"), fmt(xs, "unrelated_cos_mean"), f"{med_std([x['train_s'] for x in xs])[0]:.0f}"])
    md = [f"# B14: the queue at in-batch's price ({'dry run, tiny random model' if args.dry_run else args.model})", "",
          f"Every run: the same {args.pairs:,} training pairs in the same order (B6's), held-out pool "
          f"{args.max_queries} queries / {args.max_docs} documents; median ± std over the seeds run. The training "
          "seconds are each run's own clock (runs made at different times on a shared CPU compare only roughly); "
          "the cost section is side by side.", "",
          md_table(["run", "what", "batch", "seeds", "recall@1", "MRR@10", "nDCG@10", "unrelated cos", "train s"], rows),
          "", "## The goal (issue 44)", "", *goal(by, cost), "", "## Cost, side by side", "",
          *(side_by_side.table_lines(cost) if cost else ["Not measured yet (`--cost`)."]), "",
          "## The EMA pass, taken apart (issue 44, part 2)", "", *ema_lines(ema), ""]
    missing = [f"{n} (seed {s})" for n in RUNS for s in SEEDS.get(n, (0,)) if not any(r["seed"] == s for r in by.get(n, []))]
    if missing:
        md += ["## Not run yet", "", "Planned and not in the cache (the cache resumes them): " + ", ".join(missing) + ".", ""]
    if cut:
        md += ["Cut in this invocation: " + ", ".join(cut) + ".", ""]
    write_results(prefix, "\n".join(md), {"benchmark": "B14 the queue at in-batch's price", "pairs": args.pairs,
                                          "model": args.model, "pool": {"queries": args.max_queries, "docs": args.max_docs},
                                          "runs": records, "cost": cost, "ema": ema, "environment": environment()},
                  out_dir)
    log(f"wrote {out_dir / (prefix + '.md')}")


# ----------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    equal_data.add_dry_run(ap)
    ap.add_argument("--cost", action="store_true", help="time one step of each run and reference side by side, then report")
    ap.add_argument("--ema", action="store_true", help="take the main job's step apart at 32 and 8 (no training), then report")
    ap.add_argument("--rounds", type=int, default=5, help="--cost, --ema: timed rounds")
    add_run_args(ap, default=",".join(RUNS), runs=list(RUNS), small="dry-run")
    args = ap.parse_args(argv)
    cli.apply(args)
    d = args.dry_run
    out_dir, prefix, cache = equal_data.settle(args, NAME)
    names = cli.names(args.only, list(RUNS))  # before anything loads: a typo exits at once
    cost_path, ema_path = out_dir / f"{prefix}_cost.json", out_dir / f"{prefix}_ema.json"
    if (args.cost or args.ema) and d:
        raise SystemExit("--cost and --ema measure MiniLM's real steps; they have no --dry-run")
    if args.cost:
        measure_cost(names, args.rounds, cost_path)
    if args.ema:
        measure_ema(args.rounds, ema_path)
    cut = [] if args.cost or args.ema else run_selected(cache, args, list(RUNS), lambda name, seed: run_key(name, seed, args),
                                            lambda: runner(args, do_run))
    records = cached_records(cache, equal_data.protocol_suffix(args)) + references(args)
    cost, ema = (json.loads(p.read_text()) if p.exists() else None for p in (cost_path, ema_path))
    report(records, args, out_dir, prefix, cut, cost, ema)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
