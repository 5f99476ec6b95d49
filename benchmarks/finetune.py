"""B6: do negatives matter in a full fine-tune? Batch sizes, peers and queues at equal data.

all-MiniLM-L6-v2 fine-tuned end to end on the Debian set. Every run sees **the same pairs in the
same order**: the batch sampler's order at batch 32 (seed s), cut to ``--pairs`` pairs (default
18,240 = 570 steps at 32, half an epoch); a run at batch 32 m takes m consecutive batches of 32 as
one. Same optimizer as the main job (AdamW lr 2e-5, 10% warmup then linear decay, weight decay
0.01, clipping 1.0), tau 0.05 (MNRL's scale 20), max lengths 32 / 128 tokens. Runs:

* ours, in-batch negatives at batch 32, 64, 128, 256;
* sentence-transformers (the ``bench`` extra): MNRL at 32, ``CachedMultipleNegativesRankingLoss``
  at 256 (mini-batches of 32), MNRL with GTE-style ``directions`` (q->d, q->q, d->q, d->d) at 32;
* batch 32 + a queue: MoCo (``+experiment=queue65k objective=moco``) and the two-queue objective
  (``+experiment=queue65k``: the main job, m 0.995, keys at most 128 steps old, which at batch 32
  is ``two_queue_m0.995_ib_k4k-32``'s 4,096-key queue; ``two_queue_ib-32`` the main job until
  2026-12-03, m 0.999, every key of K = 65,536: 18,240 queued by the end), and variants of it.
  Every two-queue run names its momentum, age bound and in-batch weight, so a cached run keeps its
  meaning when the main job's defaults move.

Each run is scored on the held-out pool (1,000 queries / 2,400 documents by default, B4's) every
``--eval-every`` pairs and at the end: recall@1, MRR@10, nDCG@10, mean unrelated cosine, against
the training seconds so far (evaluation time not counted), so the curves compare equal compute.

Finished runs are appended to ``benchmarks/results/finetune_runs.jsonl`` (committed): a restarted
or later invocation skips them, and independent runs can go in parallel processes, one thread
each (``--only NAME --seeds 0``). ``--report`` writes finetune.md / finetune.json / finetune_*.png
from the cache alone. ``--quick``: 40 pairs x few steps on a 200 / 400 pool (results to --out).

    python -m benchmarks.finetune --only two_queue_ib-32,inbatch-32 --seeds 0 --threads 1
    python -m benchmarks.finetune --report
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.harness import cli, equal_data
from benchmarks.harness.equal_data import (CANDIDATES, HEADLINE, INBATCH, MAIN_RUN, RETIRED_RUNS, RUNS, add_run_args,
                                           metrics, miss_in_group, pair_batches, runner, trained)
from benchmarks.harness.report import environment, figure, fmt, fmt_recorded, log, med_std, paired
from benchmarks.harness.runs import md_table, read_jsonl, run_selected, write_results
from benchmarks.harness.runs import records as cached_records
from benchmarks.harness.training import compose_cfg

NAME = "finetune"

# ----------------------------------------------------------------------------------- runs


def do_run(bench, pool, name, seed, args) -> dict:
    batches = pair_batches(bench, seed, args.pairs, RUNS[name][1])
    return {"key": run_key(name, seed, args), "name": name,
            **trained(bench, pool, f"B6 {name}", RUNS[name], batches, seed, args.eval_every)}


def run_key(name: str, seed: int, args) -> str:
    return f"{name}|seed={seed}|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}"


# ----------------------------------------------------------------------------------- report


def equal_steps(by: dict, subject: str) -> list[str]:
    """The bar's first line for ``subject``: against in-batch 32 and MNRL 32, by more than 2 std
    (the larger of the two runs' stds) over 3 seeds; the per-seed differences beside it."""
    out, q = [], by.get(subject, [])
    for ref in ("inbatch-32", "mnrl-32"):
        r = by.get(ref, [])
        if not r:
            out.append(f"- vs {ref}: not run yet.")
            continue
        for key in ("recall@1", "ndcg@10"):
            mq, sq = med_std([x["final"][key] for x in q])
            mr, sr = med_std([x["final"][key] for x in r])
            sd = max(v for v in (sq, sr, 0.0) if v == v)
            n = min(len(q), len(r))
            ok = (mq - mr) > 2 * sd if n >= 3 else None
            diffs = " / ".join(f"{d:+.3f}" for d in paired(q, r, key))
            out.append(f"- {key} vs {ref} at equal steps: {mq:.3f} vs {mr:.3f} ({mq - mr:+.3f}, 2 std {2 * sd:.4f}); "
                       + (f"beats by more than 2 std: {'yes' if ok else 'no'}" if ok is not None else f"{n} seed(s): no claim yet")
                       + (f"; seed by seed {diffs}" if diffs else ""))
    return out


def verdict(by: dict, cost: dict | None = None) -> list[str]:
    """The issue's three lines, from what the cache holds."""
    q = by.get(MAIN_RUN, [])
    if not q:
        return [f"No {MAIN_RUN} run is finished yet."]
    out = equal_steps(by, MAIN_RUN)
    for ref in ("inbatch-256", "cmnrl-256"):
        r = by.get(ref, [])
        if not r:
            out.append(f"- vs {ref} at equal data: not run yet.")
            continue
        mq, mr = med_std([x["final"]["recall@1"] for x in q])[0], med_std([x["final"]["recall@1"] for x in r])[0]
        line = f"- vs {ref} at equal data: recall@1 {mq:.3f} vs {mr:.3f}"
        if not cost:  # each run's own clock: comparable only for runs made side by side
            tq, tr = med_std([x["train_s"] for x in q])[0], med_std([x["train_s"] for x in r])[0]
            line += f"; own-clock training seconds {tq:.0f} vs {tr:.0f} (ratio {tq / tr:.2f}; the bar asks for at most 0.5)"
        out.append(line)
    out += cost_lines(by, cost) if cost else time_to_reach(by)
    u = med_std([x["final"]["unrelated_cos_mean"] for x in q])[0]
    out.append(f"- space spread: mean unrelated cosine {u:+.3f} (bar <= +0.10): {'met' if u <= 0.10 else 'not met'}")
    return out


def reached_at(run: dict, target: float, at: str = "train_s") -> float | None:
    """``at`` (training seconds or pairs) of the first evaluation where ``run`` scored recall@1 >= ``target``."""
    return next((p[at] for p in run["curve"] if p["recall@1"] >= target), None)


def time_to_reach(by: dict) -> list[str]:
    """The other reading of "reaches batch 256 in at most half its seconds": when, on the curve, a
    batch-32 run first scores the batch-256 run's final recall@1. In-batch 32 and MNRL 32 as
    controls: what batch 32 alone buys, queue or not. An upper bound at the evaluation grid's
    resolution, and the batch-32 runs are mid-schedule there (their learning rate not yet decayed)."""
    out = []
    for ref in ("inbatch-256", "cmnrl-256"):
        r = by.get(ref, [])
        if not r:
            continue
        target, tr = med_std([x["final"]["recall@1"] for x in r])[0], med_std([x["train_s"] for x in r])[0]
        parts = []
        for name in (MAIN_RUN, "inbatch-32", "mnrl-32"):
            xs = by.get(name, [])
            hit = [t for t in (reached_at(x, target) for x in xs) if t is not None]
            if xs:
                parts.append(f"{name} {len(hit)}/{len(xs)} seed(s)" + (
                    f", median {statistics.median(hit):.0f} s (ratio {statistics.median(hit) / tr:.2f})" if hit else ""))
        out.append(f"- time to reach {ref}'s final recall@1 {target:.3f} ({tr:.0f} s) on the curve: " + "; ".join(parts))
    return out


def cost_lines(by: dict, cost: dict) -> list[str]:
    """The bar's seconds from ``finetune_cost.py``'s side-by-side per-pair costs instead of each
    run's own clock: at equal data the seconds ratio is the per-pair cost ratio; to reach a
    reference's final recall@1, pairs-to-reach (median over seeds) x per-pair cost."""
    per_pair = {r["name"]: r["s_per_1k_pairs"] / 1000 for r in cost["rows"]}
    out = []
    for ref in ("inbatch-256", "cmnrl-256"):
        r = by.get(ref, [])
        if not r or ref not in per_pair or MAIN_RUN not in per_pair:
            continue
        target = med_std([x["final"]["recall@1"] for x in r])[0]
        ref_s = per_pair[ref] * r[0]["pairs"]
        parts = []
        for name in (n for n in (MAIN_RUN, "inbatch-32", "mnrl-32") if n in per_pair and by.get(n)):
            xs = by[name]
            hit = [p for p in (reached_at(x, target, "pairs") for x in xs) if p is not None]
            part = f"{name} {per_pair[name] * xs[0]['pairs'] / ref_s:.2f}x at equal data"
            if len(hit) < len(xs):
                parts.append(f"{part}, reaches it in {len(hit)}/{len(xs)} seeds")
                continue
            pairs = statistics.median(hit)
            parts.append(f"{part}, reaches {target:.3f} after {pairs:,.0f} pairs: {pairs * per_pair[name] / ref_s:.2f}x")
        out.append(f"- {ref}'s training seconds, side by side ({per_pair[ref] * 1000:.0f} s per 1,000 pairs, "
                   f"{cost['threads']} thread(s)): " + "; ".join(parts) + " (bar: at most 0.5x)")
    return out


def seed0(xs: list[dict]) -> dict:
    """The run of seed 0 (else the first): what the curves and the curve table show."""
    return next((x for x in xs if x["seed"] == 0), xs[0])


def curve_table(by: dict) -> list[str]:
    """recall@1 / unrelated cosine of each run's seed 0 at every evaluation, by pairs seen."""
    runs = {n: seed0(xs) for n, xs in by.items() if n != "base"}
    at = sorted({p["pairs"] for r in runs.values() for p in r["curve"]})
    if not at:
        return []
    rows = [[n] + [next((f"{p['recall@1']:.3f} / {p['unrelated_cos_mean']:+.3f}" for p in r["curve"] if p["pairs"] == a), "")
                   for a in at] for n, r in runs.items()]
    return ["recall@1 / mean unrelated cosine after each number of training pairs:", "",
            md_table(["run"] + [f"{a:,} pairs" for a in at], rows)]


def what(name: str) -> str:
    """A run's description in the table; a retired run's says so, and why."""
    return RUNS[name][3] + (f"; {RETIRED_RUNS[name]}" if name in RETIRED_RUNS else "")


def report(records: list[dict], args, out_dir: Path, prefix: str, cut: list[str]) -> None:
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    rows = []
    for name in RUNS:
        xs = by.get(name)
        if not xs:
            continue
        rows.append([name, what(name), xs[0]["batch_size"], len(xs), fmt(xs, "recall@1"), fmt(xs, "mrr@10"), fmt(xs, "ndcg@10"),
                     fmt(xs, "unrelated_cos_mean"), fmt_recorded(xs, "miss_in_group@1"),
                     f"{med_std([x['s_per_step'] for x in xs])[0]:.2f}",
                     f"{med_std([x['train_s'] for x in xs])[0]:.0f}"])
    base = by.get("base", [])
    md = [f"# B6: full fine-tune of all-MiniLM-L6-v2 at equal data ({'quick' if args.quick else 'full'})", "",
          f"Every run: the same {args.pairs:,} training pairs in the same order (half an epoch of the Debian set at the "
          "default), AdamW lr 2e-5, 10% warmup then linear decay, tau 0.05, max lengths 32/128; held-out pool "
          f"{args.max_queries or 'all'} queries / {args.max_docs or 'all'} documents. Median ± std over the seeds run "
          "(no ± with one seed). s/step and training seconds: one thread per run, runs in parallel on a shared 2-core "
          "CPU, so they compare runs made side by side, not absolute speed.", ""]
    if base:
        b = base[0]["final"]
        in_group = f", top-1 of the positive's group {b['miss_in_group@1']:.3f}" if "miss_in_group@1" in b else ""
        md += [f"Untrained all-MiniLM-L6-v2 on this pool: recall@1 {b['recall@1']:.3f}, MRR@10 {b['mrr@10']:.3f}, "
               f"nDCG@10 {b['ndcg@10']:.3f}, unrelated cosine {b['unrelated_cos_mean']:+.3f}{in_group}"
               + (f" (scored once, cached in {base[0]['from']})." if base[0].get("from") else "."), ""]
    md += [md_table(["run", "what", "batch", "seeds", "recall@1", "MRR@10", "nDCG@10", "unrelated cos",
                     "top-1 of the positive's group", "s/step", "train s"], rows), "",
           "Top-1 of the positive's group: share of queries whose first document is wrong but from the positive's "
           "source package: our objectives mask the group in every softmax, so no negative teaches that confusion "
           "(MNRL's random batches rarely hold a group-mate either); blank "
           "for runs cached before it was recorded.", "",
           "## Along the way (seed 0)", "", *curve_table(by), "",
           "## The bar (issue 11)", "", f"For {MAIN_RUN}, `+experiment=queue65k`'s objective:", "",
           *verdict(by, read_cost(out_dir)), ""]
    for name in [n for n in CANDIDATES if n != MAIN_RUN and len(by.get(n, [])) >= 3]:
        md += [f"At equal steps, for {name}:", "", *equal_steps(by, name), ""]
    missing = [f"{n} (seed {s})" for n in RUNS if n not in RETIRED_RUNS for s in range(3 if n in HEADLINE + CANDIDATES else 1)
               if not any(r["seed"] == s for r in by.get(n, []))]
    if missing:
        md += ["## Not run yet", "", "Planned and not in the cache (the cache resumes them): " + ", ".join(missing) + ".", ""]
    if cut:
        md += ["Cut in this invocation: " + ", ".join(cut) + ".", ""]
    write_results(prefix, "\n".join(md), {"benchmark": "B6 fine-tune at equal data", "pairs": args.pairs,
                                          "pool": {"queries": args.max_queries, "docs": args.max_docs},
                                          "runs": records, "environment": environment()}, out_dir)
    plots(by, out_dir, prefix)
    log(f"wrote {out_dir / (prefix + '.md')}")


def read_cost(out_dir: Path) -> dict | None:
    """``finetune_cost.py``'s side-by-side per-pair costs, if measured."""
    path = out_dir / "finetune_cost.json"
    return json.loads(path.read_text()) if path.exists() else None


def negatives_per_query(x: dict) -> float:
    """Negatives in a query's softmax at the last step: logged by ours, the batch's others for peers."""
    return x.get("last_step", {}).get("train/negatives_per_query") or x["batch_size"] - 1


def plots(by: dict, out_dir: Path, prefix: str) -> None:
    fig = figure(10.0, 4.2)
    panels = fig.subplots(1, 2, sharey=True)
    for ax, axis, xlabel in ((panels[0], lambda x: x["batch_size"], "batch size (same pairs, same order)"),
                             (panels[1], negatives_per_query, "negatives per query at the end")):
        for kind, marker, label in (("ours", "o", "ours, in-batch"), ("mnrl", "s", "MNRL"), ("cmnrl", "^", "CachedMNRL")):
            pts = sorted((axis(xs[0]), med_std([x["final"]["recall@1"] for x in xs])[0]) for n, xs in by.items()
                         if xs[0]["kind"] == kind and (kind != "ours" or n.startswith("inbatch")) and "gte" not in n)
            if pts:
                ax.plot(*zip(*pts), marker=marker, label=label)
        for n, xs in by.items():  # queues and GTE directions: one point each, named in the legend
            if n.startswith(("two_queue", "moco")) or "gte" in n:
                ax.scatter([axis(xs[0])], [med_std([x["final"]["recall@1"] for x in xs])[0]],
                           marker="*" if n == MAIN_RUN else "x", s=90 if n == MAIN_RUN else 30, label=n, zorder=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    panels[0].set_ylabel("recall@1")
    panels[1].legend(fontsize=6, loc="center")  # the empty middle: points sit at the edges
    fig.suptitle(f"B6: recall@1 at equal data ({MAIN_RUN}: the main job's objective)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / f"{prefix}_vs_batch.png")
    for x, xlabel, title, suffix in (("train_s", "training seconds (evaluation not counted)", "training time", "seconds"),
                                      ("pairs", "training pairs seen (same pairs, same order)", "data seen", "pairs")):
        curves(by, x, xlabel, f"B6: recall@1 against {title}", out_dir / f"{prefix}_vs_{suffix}.png")


def curves(by: dict, x: str, xlabel: str, title: str, path: Path) -> None:
    fig = figure(6.4, 4.2)
    ax = fig.subplots()
    start = [{x: 0.0, "recall@1": by["base"][0]["final"]["recall@1"]}] if by.get("base") else []
    for n, xs in by.items():
        if n == "base":
            continue
        run = seed0(xs)
        c = start + run["curve"]  # every run starts from the untrained model (when it was scored)
        ax.plot([p[x] for p in c], [p["recall@1"] for p in c], marker=".", label=f"{n} (seed {run['seed']})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("recall@1")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a few steps on a small pool (smoke check; results to --out)")
    add_run_args(ap, default=",".join(HEADLINE), runs=["base", *RUNS], small="quick")
    args = ap.parse_args(argv)
    cli.apply(args)
    q = args.quick
    args.pairs = args.pairs or (256 if q else 18240)
    args.eval_every = args.eval_every or (128 if q else 6080)
    args.max_queries = args.max_queries if args.max_queries is not None else (200 if q else 1000)
    args.max_docs = args.max_docs if args.max_docs is not None else (400 if q else 2400)
    out_dir = cli.out_dir(args)
    prefix = f"{NAME}_quick" if q else (NAME if args.pairs == 18240 else f"{NAME}_{args.pairs}pairs")  # B4's setup: 4800
    cache = out_dir / f"{prefix}_runs.jsonl"
    cut = run_selected(cache, args, ["base", *RUNS], lambda name, seed: run_key(name, seed, args), lambda: runner(args, run_or_base),
                       retired=RETIRED_RUNS)
    # read again: runs finished by parallel processes since belong in the report too
    records = cached_records(cache, f"|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}")
    if not any(r["name"] == "base" for r in records):
        records += base_from_other_caches(out_dir, args)
    report(records, args, out_dir, prefix, cut)
    return 0


def run_or_base(bench, pool, name, seed, args) -> dict:
    return base_record(bench, pool, run_key(name, seed, args), args) if name == "base" else do_run(bench, pool, name, seed, args)


def base_from_other_caches(out_dir: Path, args) -> list[dict]:
    """The untrained model's scores do not depend on --pairs: reuse them from another run cache of
    this folder scored on the same pool (B4's 4,800-pair cache holds one)."""
    pool = f"|pool={args.max_queries}x{args.max_docs}"
    for cache in sorted(out_dir.glob(f"{NAME}*_runs.jsonl")):
        for r in read_jsonl(cache):
            if r["name"] == "base" and r["key"].endswith(pool):
                return [{**r, "from": cache.name}]
    return []


def base_record(bench, pool, key, args) -> dict:
    from moco_retrieval.evaluation.encode import evaluate_encoder
    from moco_retrieval.model.encoder import build_encoder

    cfg = compose_cfg(equal_data.BASE + INBATCH)
    res = evaluate_encoder(build_encoder(cfg.model), pool, cfg.eval, batch_size=64, show_progress=False)
    final = {**metrics(res), "miss_in_group@1": miss_in_group(res.run, pool)}
    return {"key": key, "name": "base", "seed": 0, "kind": "base", "batch_size": 0, "final": final, "curve": []}


if __name__ == "__main__":
    raise SystemExit(main())
