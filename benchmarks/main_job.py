"""B9: the main job itself, against the same job with in-batch negatives and the untrained model.

B6 (``finetune.py``) compares objectives at batch 32 inside one process. This runs the commands a
user runs: ``python -m moco_retrieval.train +experiment=queue65k`` and the same command with
``objective=inbatch`` (the same batch, steps, schedule and data), side by side with one thread
each so their training seconds compare, each resuming from its own ``last.ckpt`` when interrupted;
then one ``python -m moco_retrieval.evaluate`` report of both final checkpoints and the base
encoder on the held-out pool. Each finished pair is cached in ``results/main_job_runs.jsonl``
(committed), so ``--report`` rebuilds the table without the runs.

    python -m benchmarks.main_job [--steps N] [--runs DIR] [--threads 1] [--out DIR]
    python -m benchmarks.main_job --report

``--steps N`` passes ``trainer.max_steps=N``: a shorter job whose learning-rate schedule spans N
steps, not the first N steps of the full job. Default: the whole epoch.
Writes benchmarks/results/main_job.{md,json} (``--out DIR``: there instead, with its own run cache;
gpu.sh's short run).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import cli
from benchmarks.harness.cli import RESULTS, ROOT
from benchmarks.harness.report import environment, log
from benchmarks.harness.runs import append_jsonl, md_table, read_jsonl, write_results

NAME = "main_job"
JOBS = {"queue65k": [], "queue65k_inbatch": ["objective=inbatch"]}
METRICS = ("recall@1", "mrr@10", "ndcg@10", "unrelated_cos_mean")


def length(steps: int) -> str:
    return str(steps) if steps > 0 else "epoch"


def key_of(steps: int) -> str:
    return f"steps={length(steps)}"


def job_overrides(name: str, steps: int) -> list[str]:
    """What a user types after ``python -m moco_retrieval.train`` for this job."""
    return ["+experiment=queue65k", *JOBS[name], *([f"trainer.max_steps={steps}"] if steps > 0 else [])]


def train_command(name: str, steps: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "moco_retrieval.train", *job_overrides(name, steps), f"run_dir={run_dir}", "ckpt_path=last"]


def train_side_by_side(dirs: dict[str, Path], steps: int, threads: int) -> None:
    """Start every unfinished job at once, wait for all; a job is finished when metrics.json exists."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    procs = {}
    for name, d in dirs.items():
        if (d / "metrics.json").exists():
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        log(f"{name}: training in {d} (log {d}.log); its progress lines carry the ETA")
        with open(f"{d}.log", "a") as out:  # the child keeps its own handle
            procs[name] = subprocess.Popen(train_command(name, steps, d), cwd=ROOT, env=env,
                                           stdout=out, stderr=subprocess.STDOUT)
    for name, p in procs.items():
        if p.wait() != 0:
            sys.exit(f"main_job: {name} failed (exit {p.returncode}); see {dirs[name]}.log")


def evaluate(dirs: dict[str, Path], out: Path) -> list[dict]:
    """One report: the main job, then in-batch, then the untrained base; their eval.json entries."""
    ckpts = [str(d / "checkpoints" / "last.ckpt") for d in dirs.values()]
    cmd = [sys.executable, "-m", "moco_retrieval.evaluate", f"checkpoint={ckpts[0]}",
           f"compare=[{','.join(ckpts[1:] + ['base'])}]", f"out_dir={out}"]
    if not (out / "eval.json").exists():  # an interrupted benchmark keeps a finished report
        log(f"evaluating {len(ckpts) + 1} models on the held-out pool into {out} (a few minutes each)")
        subprocess.run(cmd, cwd=ROOT, check=True)
    return list(json.loads((out / "eval.json").read_text())["models"].values())


def record(dirs: dict[str, Path], entries: list[dict], steps: int, threads: int) -> dict:
    rec = {"key": key_of(steps), "steps": steps, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
           "threads": threads, "jobs": {}}
    for (name, d), entry in zip([*dirs.items(), ("base", None)], entries):
        scores = {**entry["metrics"], **entry["geometry"]}
        row = {m: scores[m] for m in METRICS}
        if d is not None:
            run = json.loads((d / "metrics.json").read_text())
            row.update(train_s=run["time/train_s"], val_s=run["time/val_s"], attempts=run["attempts"],
                       command=" ".join(["python -m moco_retrieval.train", *job_overrides(name, steps)]))
        rec["jobs"][name] = row
    return rec


def report(recs: list[dict], out_dir: Path = RESULTS) -> None:
    rows = []
    for rec in recs:
        for name, j in rec["jobs"].items():
            what = j.get("command", "all-MiniLM-L6-v2, untrained")
            rows.append([rec["key"], f"`{what}`" if name != "base" else what,
                         *(f"{j[m]:+.3f}" if m == "unrelated_cos_mean" else f"{j[m]:.3f}" for m in METRICS),
                         *(f"{j[t]:,.0f}" if t in j else "-" for t in ("train_s", "val_s")), j.get("attempts", "-")])
    md = [f"# {NAME}: the main job against the same job with in-batch negatives",
          "", "Produced by `python -m benchmarks.main_job`. One seed per run; the two trainings ran side by side,",
          "one thread each, so their seconds compare with each other only. Metrics: "
          "`python -m moco_retrieval.evaluate` on the held-out pool (3,283 queries and documents).", "",
          md_table(["length", "run", "recall@1", "MRR@10", "nDCG@10", "mean unrelated cos", "training s", "validation s", "attempts"],
                   rows)]
    write_results(NAME, "\n".join(md), {"runs": recs, "environment": environment()}, out_dir)
    log(f"wrote {out_dir / NAME}.md")


def main() -> None:
    ap = cli.parser(__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=0, help="trainer.max_steps for both jobs (0: the whole epoch)")
    ap.add_argument("--runs", type=Path, default=ROOT / "outputs" / NAME, help="where the run directories go")
    cli.add_report(ap, "only rebuild the report from the cache")
    cli.add_common(ap, threads=1, out=RESULTS, out_help="results folder, with its run cache (default benchmarks/results)")
    args = ap.parse_args()
    cli.apply(args)
    runs = args.out / f"{NAME}_runs.jsonl"
    recs = read_jsonl(runs)
    if not args.report and key_of(args.steps) not in {r["key"] for r in recs}:
        dirs = {name: args.runs / f"{name}-{length(args.steps)}" for name in JOBS}
        train_side_by_side(dirs, args.steps, args.threads)
        entries = evaluate(dirs, args.runs / f"eval-{length(args.steps)}")
        rec = record(dirs, entries, args.steps, args.threads)
        args.out.mkdir(parents=True, exist_ok=True)
        append_jsonl(runs, rec)
        recs.append(rec)
    report(recs, args.out)


if __name__ == "__main__":
    main()
