"""B12: Matryoshka embeddings on B6's setup (issue 34, part 2).

all-MiniLM-L6-v2 fine-tuned on B6's pairs (``finetune.py``: the same 18,240 Debian pairs in the
same order, AdamW lr 2e-5, 10% warmup then linear decay, tau 0.05, batch 32), then scored on B6's
pool (1,000 queries / 2,400 documents) at every prefix of ``DIMS``: the first d coordinates,
re-normalised (sentence-transformers' ``truncate_dim``). Runs (``RUNS``):

* ``base``: the untrained model;
* ``inbatch-32``: ours, in-batch negatives, trained at full size only: what truncating a model that
  was not trained for it costs;
* ``inbatch_mrl-32``: the same with ``objective.matryoshka_dims`` = ``DIMS`` (weights 1);
* ``mnrl_mrl-32``: sentence-transformers' ``MatryoshkaLoss`` around MNRL with the same dims, at
  equal steps on the same batches: the peer.

In-batch is the objective here because MNRL is its peer; the queue objectives take the same option
(tests/test_matryoshka*.py hold them to loop references). The issue's goal: at 64 dimensions,
within 2 points of the full-size model trained without it, while the full size loses at most 0.5.

Finished runs go to ``benchmarks/results/matryoshka_runs.jsonl`` (committed), so later invocations
resume; one thread per run, runs in parallel processes. ``--cost`` times one step of each run in
turn on real batches (``harness.side_by_side.measure``) and writes the side-by-side seconds the report reads.

    python -m benchmarks.matryoshka --only inbatch_mrl-32 --seeds 0 --threads 1
    python -m benchmarks.matryoshka --cost --rounds 10
    python -m benchmarks.matryoshka --report
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.harness import cli, equal_data, side_by_side
from benchmarks.harness.equal_data import INBATCH, Evaluator, add_run_args, pair_batches, runner, trained
from benchmarks.harness.report import environment, log, med_std
from benchmarks.harness.runs import md_table, run_selected, write_results
from benchmarks.harness.runs import records as cached_records
from benchmarks.harness.side_by_side import table_lines as cost_table_lines
from benchmarks.harness.training import Bench, compose_cfg

import torch

NAME = "matryoshka"
DIMS = (384, 256, 128, 64)
MRL = [f"objective.matryoshka_dims=[{','.join(map(str, DIMS))}]"]

# name -> (kind, batch, overrides or loss options, what it is), as equal_data.RUNS
RUNS: dict[str, tuple[str, int, object, str]] = {
    "inbatch-32": ("ours", 32, INBATCH, "ours, in-batch negatives, trained at full size"),
    "inbatch_mrl-32": ("ours", 32, INBATCH + MRL, f"ours, in-batch negatives + Matryoshka {list(DIMS)}"),
    "mnrl_mrl-32": ("mnrl_mrl", 32, {"matryoshka_dims": list(DIMS)}, f"sentence-transformers MatryoshkaLoss(MNRL), {list(DIMS)}"),
}
REFERENCE = "inbatch-32"


def base_record(pool, args) -> dict:
    """The untrained model at every prefix: what truncation costs before any training."""
    from moco_retrieval.model.encoder import build_encoder

    cfg = compose_cfg(equal_data.BASE + INBATCH)
    final = Evaluator(pool, cfg.eval, 1, 1, 0, dims=DIMS).score(build_encoder(cfg.model), 0)
    return {"key": run_key("base", 0, args), "name": "base", "seed": 0, "kind": "base", "final": final}


def do_run(bench, pool, name: str, seed: int, args) -> dict:
    if name == "base":
        return base_record(pool, args)
    batches = pair_batches(bench, seed, args.pairs, RUNS[name][1])
    rec = trained(bench, pool, f"B12 {name}", RUNS[name], batches, seed, args.eval_every, dims=DIMS)
    rec.pop("curve")  # scored once, at the end: the curve is its final point
    return {"key": run_key(name, seed, args), "name": name, **rec}


def run_key(name: str, seed: int, args) -> str:
    return f"{name}|seed={seed}|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}"


# ----------------------------------------------------------------------------------- report


def at_dim(x: dict, dim: int, key: str) -> float:
    """``key`` at the prefix ``dim``; the full size is the ordinary evaluation."""
    return x["final"]["by_dim"].get(str(dim), x["final"])[key]


def cell(xs: list[dict], dim: int, key: str) -> str:
    m, s = med_std([at_dim(x, dim, key) for x in xs])
    return f"{m:.3f}" + (f" ± {s:.3f}" if s == s else "")


def goal_lines(by: dict) -> list[str]:
    """The issue's goal, per seed against the reference of the same seed (same batches)."""
    ref = {x["seed"]: x for x in by.get(REFERENCE, [])}
    out = []
    for name in ("inbatch_mrl-32", "mnrl_mrl-32"):
        xs = [x for x in by.get(name, []) if x["seed"] in ref]
        if not xs:
            continue
        for key in ("recall@1", "ndcg@10"):
            small = [at_dim(x, DIMS[-1], key) - at_dim(ref[x["seed"]], DIMS[0], key) for x in xs]
            full = [at_dim(x, DIMS[0], key) - at_dim(ref[x["seed"]], DIMS[0], key) for x in xs]
            out.append(f"- {name}, {key}: at {DIMS[-1]} dims {_signed(small)} against {REFERENCE} at {DIMS[0]} "
                       f"(goal: above -0.020: {'met' if min(small) > -0.020 else 'not met'}); at {DIMS[0]} {_signed(full)} "
                       f"(goal: above -0.005: {'met' if min(full) > -0.005 else 'not met'}); seeds {[x['seed'] for x in xs]}")
    return out


def peer_lines(by: dict) -> list[str]:
    """Ours against the peer, seed by seed (the same batches), at each prefix."""
    peer = {x["seed"]: x for x in by.get("mnrl_mrl-32", [])}
    ours = [x for x in by.get("inbatch_mrl-32", []) if x["seed"] in peer]
    if not ours:
        return []
    return [f"- inbatch_mrl-32 minus mnrl_mrl-32, {key} at {d} dims: "
            + _signed([at_dim(x, d, key) - at_dim(peer[x["seed"]], d, key) for x in ours])
            for key in ("recall@1", "ndcg@10") for d in DIMS]


def _signed(xs: list[float]) -> str:
    return "median " + f"{statistics.median(xs):+.3f}" + " (per seed " + ", ".join(f"{x:+.3f}" for x in xs) + ")"


def cost_table(out_dir: Path) -> list[str]:
    path = out_dir / f"{NAME}_cost.json"
    return cost_table_lines(json.loads(path.read_text())) if path.exists() else ["Cost not measured yet (`--cost`)."]


def report(records: list[dict], args, out_dir: Path, cut: list[str]) -> None:
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    rows = []
    for name, xs in ((n, by[n]) for n in ("base", *RUNS) if n in by):
        for key in ("recall@1", "ndcg@10"):
            rows.append([name, key, len(xs)] + [cell(xs, d, key) for d in DIMS]
                        + [f"{statistics.median(x['train_s'] for x in xs):.0f}" if name != "base" else ""])
    md = ["# B12: Matryoshka embeddings on B6's setup (issue 34, part 2)", "",
          f"all-MiniLM-L6-v2, the same {args.pairs:,} Debian pairs in the same order as B6, batch 32, AdamW lr 2e-5, "
          f"tau 0.05; scored on B6's pool ({args.max_queries:,} queries / {args.max_docs:,} documents) at each prefix, "
          "re-normalised. Median ± std over seeds. Training seconds: each run's own clock, one thread, runs two or three "
          "at a time on two cores, so only the side-by-side cost below compares runs.", "",
          md_table(["run", "metric", "seeds"] + [f"{d} dims" for d in DIMS] + ["train s"], rows), "",
          "## The goal (issue 34)", "", *goal_lines(by), "", "## Ours against sentence-transformers' MatryoshkaLoss",
          "", *(peer_lines(by) or ["Not run yet."]), "", "## Cost", "", *cost_table(out_dir), ""]
    missing = [f"{n} seed {s}" for n in RUNS for s in range(3) if not any(x["seed"] == s for x in by.get(n, []))]
    if missing or cut:
        md += ["## Not run yet", "", "Planned and not in the cache (the cache resumes them): "
               + ", ".join(missing + [c for c in cut if c not in missing]) + ".", ""]
    write_results(NAME, "\n".join(md), {"benchmark": "B12 Matryoshka", "dims": list(DIMS), "pairs": args.pairs,
                                        "runs": records, "environment": environment()}, out_dir)
    log(f"wrote {out_dir / (NAME + '.md')}")


def measure_cost(args, out_dir: Path) -> None:
    names = list(RUNS)
    times = side_by_side.measure(Bench(), names, args.rounds, 1, runs=RUNS)
    rows = side_by_side.summarise(times, REFERENCE, runs=RUNS)
    (out_dir / f"{NAME}_cost.json").write_text(json.dumps({"ref": REFERENCE, "rounds": args.rounds,
                                                           "threads": torch.get_num_threads(), "rows": rows}, indent=1))


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--cost", action="store_true", help="time the runs' steps side by side, then report")
    ap.add_argument("--rounds", type=int, default=10, help="--cost: timed rounds")
    add_run_args(ap, default="base," + ",".join(RUNS), runs=["base", *RUNS], small="--pairs")
    args = ap.parse_args(argv)
    cli.apply(args)
    args.pairs = args.pairs or 18240
    args.eval_every = args.eval_every or args.pairs  # scored once, at the end
    args.max_queries = args.max_queries if args.max_queries is not None else 1000
    args.max_docs = args.max_docs if args.max_docs is not None else 2400
    out_dir = cli.out_dir(args)
    cache = out_dir / f"{NAME}_runs.jsonl"
    if args.cost:
        measure_cost(args, out_dir)  # then the report, from the cache
    cut = [] if args.cost else run_selected(cache, args, ["base", *RUNS], lambda n, s: run_key(n, s, args), lambda: runner(args, do_run))
    report(cached_records(cache, f"|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}"), args, out_dir, cut)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
