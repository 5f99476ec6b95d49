"""B6's cost side: training seconds per pair of each headline run, measured side by side.

B6's own clocks (``benchmarks.finetune``) time each run in its own process, hours apart, under whatever
else shared the CPU then, so their seconds do not compare across runs. This measures the cost the
issue's bar needs ("at equal data, in at most half their training seconds") the way the brief
asks: every configuration in one process, one step of each in turn, repeat after repeat, so
machine noise hits all alike; medians of the repeats, and the median of each round's ratio.

One step = forward of both sides + loss + backward + clipping + AdamW + (ours) EMA update and
enqueue, on real B6 batches (same pairs, same order, so real token lengths); tokenisation is done
before the clock starts, for ours and the peers alike. The two-queue objective's queues are
pre-filled with 9,120 keys each, their mean fill over a B6 run (18,240 keys queued by its end);
a queue with ``queue_refresh`` also holds real training texts for them, so its re-encodings cost
what they cost in training. The measuring lives in the harness (``benchmarks.harness.cost``),
which small_batch.py and matryoshka.py use too.

    python -m benchmarks.finetune_cost [--rounds 5] [--threads 1]
Writes benchmarks/results/finetune_cost.{md,json}; ``finetune.py --report`` reads the JSON.
"""
from __future__ import annotations

from benchmarks.harness import cli
from benchmarks.harness.equal_data import HEADLINE, RETIRED_RUNS, RUNS
from benchmarks.harness.report import environment, log
from benchmarks.harness.runs import refuse_retired, write_results
from benchmarks.harness.side_by_side import measure, summarise, table_lines
from benchmarks.harness.training import Bench

NAME = "finetune_cost"


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (one step of each run per round)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--runs", default=",".join(HEADLINE), help=f"of: {', '.join(RUNS)}")
    cli.add_common(ap, threads=1)  # B6's runs used 1
    args = ap.parse_args(argv)
    cli.apply(args)
    names = cli.names(args.runs, list(RUNS), "--runs")
    refuse_retired(names, RETIRED_RUNS, "measured")  # before anything loads
    ref = "inbatch-32" if "inbatch-32" in names else names[0]
    log(f"B6 cost: {', '.join(names)}; {args.warmup} + {args.rounds} rounds, {args.threads} thread(s)")
    cost = {"ref": ref, "rounds": args.rounds, "threads": args.threads,
            "rows": summarise(measure(Bench(), names, args.rounds, args.warmup), ref)}
    md = "\n".join([f"# B6 cost: seconds per training pair, side by side ({args.threads} thread(s))", "",
                    *table_lines(cost), ""])
    write_results(NAME, md, {**cost, "env": environment()}, cli.out_dir(args))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
