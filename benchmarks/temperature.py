"""B2: temperature. recall@1, mean positive cosine and mean unrelated cosine on the held-out pool
for tau in {0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0}, for two setups (frozen bag-of-wordpieces
backbone + random linear head, the Debian set, the same epochs and lr for every tau):

* in-batch negatives at batch 256 (``+experiment=frozen_inbatch``);
* batch 32 + a 16,384-document queue (``+experiment=frozen_queue objective.queue_size=16384``, the
  B1 winner, by default; ``--queue-variant naive`` uses the plain key queue with an EMA key
  encoder, m 0.99, and writes temperature_naive.*).

The expected shape, to confirm or refute: a recall peak near tau 0.05-0.1; a partial re-collapse at
0.01 (positive and unrelated cosines both high); the positive-unrelated gap growing toward tau = 1
while recall falls.

Writes benchmarks/results/temperature.{md,json} and temperature.png.
``--quick``: a 6,000-pair slice, 1 epoch, tau in {0.01, 0.05, 1.0}.

    python -m benchmarks.temperature [--quick] [--epochs 3] [--seeds 1]
"""
from __future__ import annotations

import time
from pathlib import Path

from benchmarks.harness import cli
from benchmarks.harness.cli import bench_cache
from benchmarks.harness.report import environment, f3, figure, log, median, peak_rss_mb
from benchmarks.harness.runs import md_table, write_results
from benchmarks.harness.training import Bench, Runner


NAME = "temperature"
TAUS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


def setups(variant: str, queue_epochs: int | None) -> dict[str, list[str]]:
    queue = ["+experiment=frozen_queue", "objective.queue_size=16384"]
    if variant == "naive":
        queue += ["objective=moco", "objective.momentum=0.99"]
    if queue_epochs:
        queue += [f"trainer.max_epochs={queue_epochs}"]
    return {
        "in-batch, batch 256": ["+experiment=frozen_inbatch", "data.batch_size=256"],
        "batch 32 + queue 16k": queue,
    }


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--epochs", type=int, default=None, help="epochs of every run (default 3; quick 1)")
    ap.add_argument("--queue-epochs", type=int, default=None, help="epochs of the queue runs (default: --epochs)")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--queue-variant", choices=["preset", "naive"], default="preset")
    ap.add_argument("--taus", type=str, default=None, help="comma-separated temperatures")
    cli.add_fresh(ap)
    cli.add_common(ap)
    args = ap.parse_args(argv)
    cli.apply(args)
    quick = args.quick
    epochs = args.epochs or (1 if quick else 3)
    taus = [float(t) for t in args.taus.split(",")] if args.taus else ([0.01, 0.05, 1.0] if quick else TAUS)
    seeds = list(range(args.seeds))
    t0 = time.time()
    bench = Bench(max_train_examples=6000 if quick else None)
    mode = "quick" if quick else "full"
    runner = Runner(bench, [f"trainer.max_epochs={epochs}"],
                    bench_cache(f"{NAME}-{mode}-e{epochs}-{args.queue_variant}.jsonl"), args.fresh)
    log(f"B2 {mode}: taus {taus}, epochs {epochs}, seeds {seeds}, queue variant {args.queue_variant}")
    results = {setup: {tau: [runner.run(setup, f"tau {tau}", ov + [f"objective.temperature={tau}"], s) for s in seeds]
                       for tau in taus}
               for setup, ov in setups(args.queue_variant, args.queue_epochs).items()}
    setting = {"benchmark": "B2 temperature", "mode": mode, "epochs": epochs, "queue_epochs": args.queue_epochs or epochs,
               "seeds": seeds, "taus": taus, "queue_variant": args.queue_variant}
    prefix = (NAME if not quick else f"{NAME}_quick") + ("" if args.queue_variant == "preset" else f"_{args.queue_variant}")
    report(results, setting, bench, time.time() - t0, cli.out_dir(args), prefix)
    return 0


def summarise(results: dict[str, dict[float, list[dict]]]) -> tuple[dict, list[list]]:
    """Per setup and tau, the medians over seeds; and the table's rows (the best tau in bold)."""
    rows, summary = [], {}
    for setup, by_tau in results.items():
        summary[setup] = {}
        best = max(by_tau, key=lambda t: median([r["metrics"]["recall@1"] for r in by_tau[t]]))
        for tau, recs in by_tau.items():
            s = {
                "recall@1": median([r["metrics"]["recall@1"] for r in recs]),
                "mrr@10": median([r["metrics"]["mrr@10"] for r in recs]),
                "positive_cos_mean": median([r["positive_cos_mean"] for r in recs]),
                "unrelated_cos_mean": median([r["unrelated_cos_mean"] for r in recs]),
                "epochs": recs[0]["epochs"], "steps": recs[0]["steps"],
            }
            s["gap"] = s["positive_cos_mean"] - s["unrelated_cos_mean"]
            summary[setup][str(tau)] = s
            rows.append([setup, tau, recs[0]["epochs"], ("**" + f3(s["recall@1"]) + "**") if tau == best else f3(s["recall@1"]),
                         f3(s["mrr@10"]), f3(s["positive_cos_mean"]), f3(s["unrelated_cos_mean"]), f3(s["gap"])])
    return summary, rows


def report(results: dict, setting: dict, bench: Bench, wall_s: float, out_dir, prefix: str) -> None:
    summary, rows = summarise(results)
    checks = shape_checks(summary)
    data = {
        **setting, "summary": summary, "checks": checks,
        "runs": [r for setup in results.values() for recs in setup.values() for r in recs],
        "train_pairs": len(bench.train_pairs), "eval_docs": len(bench.eval_set.corpus),
        "wall_s": wall_s, "peak_rss_mb": peak_rss_mb(), "environment": environment(),
    }
    variant, seeds = setting["queue_variant"], setting["seeds"]
    md = [f"# B2: temperature ({setting['mode']})", "",
          f"Frozen bag-of-wordpieces + random linear head, Debian set ({data['train_pairs']:,} pairs; pool "
          f"{data['eval_docs']:,} documents). {setting['epochs']} epoch(s) (queue runs: {data['queue_epochs']}), lr and warmup "
          f"of the presets, {len(seeds)} seed(s) (median). Queue: {variant} "
          f"({'re-projected feature queue, keys from the current head with gradient (the B1 winner)' if variant == 'preset' else 'key queue, EMA m 0.99'}). "
          "Cosines are over the held-out pool: positive = (query, its document), unrelated = random (query, other document). "
          "Best recall@1 per setup in bold.", "",
          md_table(["setup", "tau", "epochs", "recall@1", "MRR@10", "mean positive cos", "mean unrelated cos", "gap"], rows), "",
          "## The expected shape", "", md_table(["setup", "claim", "measured", "holds"],
                                                [[c["setup"], c["claim"], c["measured"], "yes" if c["holds"] else "**no**"] for c in checks]),
          "", f"![temperature]({prefix}.png)", "",
          f"Wall time {data['wall_s'] / 60:.1f} min (this invocation), peak RSS {data['peak_rss_mb']:.0f} MB."]
    write_results(prefix, "\n".join(md), data, out_dir)
    plot(summary, out_dir / f"{prefix}.png")
    log(f"wrote {out_dir / (prefix + '.md')}")


def shape_checks(summary: dict) -> list[dict]:
    out = []
    for setup, s in summary.items():
        taus = sorted(float(t) for t in s)
        r = {t: s[str(t)]["recall@1"] for t in taus}
        best = max(r, key=r.get)
        out.append({"setup": setup, "claim": "recall@1 peaks at tau 0.05-0.1", "measured": f"peak at {best} ({r[best]:.3f})",
                    "holds": 0.05 <= best <= 0.1})
        lo, hi = taus[0], taus[-1]
        if lo <= 0.01 and best != lo:
            p, u = s[str(lo)]["positive_cos_mean"], s[str(lo)]["unrelated_cos_mean"]
            pb, ub = s[str(best)]["positive_cos_mean"], s[str(best)]["unrelated_cos_mean"]
            out.append({"setup": setup, "claim": f"partial re-collapse at tau {lo}: both cosines up vs the peak",
                        "measured": f"pos {p:.2f} / unrel {u:.2f} at {lo} vs {pb:.2f} / {ub:.2f} at {best}",
                        "holds": p > pb and u > ub})
        if hi >= 1.0:
            gaps = [s[str(t)]["gap"] for t in taus if t >= best]
            mono = all(b >= a - 1e-3 for a, b in zip(gaps, gaps[1:]))
            out.append({"setup": setup, "claim": "gap grows from the peak toward tau 1 while recall falls",
                        "measured": f"gap {gaps[0]:.2f} -> {gaps[-1]:.2f}, recall {r[best]:.3f} -> {r[hi]:.3f}"
                                    f"{'' if mono else ' (not monotone)'}",
                        "holds": gaps[-1] > gaps[0] and r[hi] < r[best]})
    return out


def plot(summary: dict, path: Path) -> None:
    fig = figure(11, 4.0)
    axes = fig.subplots(1, 2)
    colors = ["#1f77b4", "#d62728"]
    for i, (setup, s) in enumerate(summary.items()):
        taus = sorted(float(t) for t in s)
        axes[0].plot(taus, [s[str(t)]["recall@1"] for t in taus], "o-", color=colors[i % 2], label=setup)
        axes[1].plot(taus, [s[str(t)]["positive_cos_mean"] for t in taus], "o-", color=colors[i % 2], label=f"{setup}: positive")
        axes[1].plot(taus, [s[str(t)]["unrelated_cos_mean"] for t in taus], "s--", color=colors[i % 2], label=f"{setup}: unrelated")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("temperature tau (log scale)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("recall@1 (held-out pool)")
    axes[0].set_title("Recall@1 vs temperature")
    axes[1].set_ylabel("mean cosine")
    axes[1].set_title("Positive and unrelated cosines vs temperature")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
