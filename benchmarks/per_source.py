"""B13: one queue per source (issue 34, part 3). Two real training sources, a batch from one.

all-MiniLM-L6-v2 fine-tuned on two sources through ``data.sources`` (round robin, so every other
batch comes from each): the Debian descriptions (capped to the size of the other) and the Python
standard library's docstrings (``python -m moco_retrieval.data pydoc``, built into the cache).
A queue shared by both hands a Debian batch Python docstrings as negatives, which are easy; with
``objective.queue_per_source=true`` each source's batches score against their own source's queues.
Runs (``RUNS``), all at batch 32, tau 0.05, AdamW lr 2e-5, 10% warmup then linear decay, one epoch:

* ``base``: the untrained model;
* ``inbatch-32``: in-batch negatives only (no queue);
* ``shared-32``: the main job's objective (``+experiment=queue65k``: two queues, m 0.995, keys
  at most 128 steps old, in-batch term), one pair of queues for both sources;
* ``per_source-32``: the same with one pair of queues per source.

Each source is scored on its own held-out pool: Debian on B6's (1,000 queries / 2,400 documents),
the docstrings on their build's whole evaluation split. Finished runs go to
``benchmarks/results/per_source_runs.jsonl`` (committed); one thread per run, runs in parallel
processes (``--only NAME --seeds S``) resume from it.

    python -m benchmarks.per_source --only shared-32,per_source-32 --seeds 0 --threads 1
    python -m benchmarks.per_source --report
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import cli, equal_data
from benchmarks.harness.cli import bench_cache
from benchmarks.harness.equal_data import INBATCH, MAIN, add_run_args, metrics
from benchmarks.harness.report import environment, log, med_std
from benchmarks.harness.runs import md_table, run_selected, write_results
from benchmarks.harness.runs import records as cached_records
from benchmarks.harness.steps import step_clock
from benchmarks.harness.training import Bench, compose_cfg, quiet_trainer

import torch

NAME = "per_source"
SOURCES = ("debian", "pydoc")
RUNS: dict[str, tuple[list[str], str]] = {
    "inbatch-32": (INBATCH, "in-batch negatives only"),
    "shared-32": (MAIN, "the main job's two-queue objective, one pair of queues for both sources"),
    "per_source-32": (MAIN + ["objective.queue_per_source=true"], "the same, one pair of queues per source"),
}


def pydoc_folder() -> Path:
    """The standard library's docstring set, built once into the cache (seconds)."""
    out = bench_cache("pydoc")
    if not (out / "manifest.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "moco_retrieval.data", "pydoc", "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def pools(bench: Bench, pydoc: Path, args) -> dict:
    from moco_retrieval.data.formats import read_beir
    from moco_retrieval.data.sources import cap_eval_set

    return {"debian": cap_eval_set(bench.eval_set, args.max_queries or None, args.max_docs or None, seed=0),
            "pydoc": read_beir(pydoc / "eval", "test")}


def train_cfg(name: str, seed: int, pydoc: Path, pairs_per_source: int):
    sources = (f"data.sources=[{{name: debian, kind: debian, max_train_examples: {pairs_per_source}}}, "
               f"{{name: pydoc, train_path: '{pydoc / 'train.jsonl'}', max_train_examples: {pairs_per_source}}}]")
    overrides = RUNS[name][0] if name in RUNS else INBATCH  # base: the untrained encoder of any run
    return compose_cfg(equal_data.BASE + overrides + [sources, "data.source_mode=round_robin", "data.batch_size=32",
                                                 "trainer.max_epochs=1", f"seed={seed}", f"data.seed={seed}"])


def score(encoder, pools: dict, eval_cfg) -> dict:
    from moco_retrieval.evaluation.encode import evaluate_encoder

    encoder.eval()
    out = {}
    for source, pool in pools.items():
        res = evaluate_encoder(encoder, pool, eval_cfg, batch_size=64, show_progress=False)
        out[source] = {**metrics(res), "queries": len(pool.queries), "docs": len(pool.corpus)}
        log(f"  {source}: recall@1 {out[source]['recall@1']:.3f} nDCG@10 {out[source]['ndcg@10']:.3f}")
    return out


def do_run(pools: dict, pydoc: Path, name: str, seed: int, args) -> dict:
    import lightning as L

    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.training.module import RetrievalModule

    cfg = train_cfg(name, seed, pydoc, args.pairs_per_source)
    L.seed_everything(seed, verbose=False)
    module = RetrievalModule.from_config(cfg)
    if name == "base":
        return {"key": run_key(name, seed, args), "name": name, "seed": seed, "final": score(module.encoder, pools, module.eval_cfg)}
    dm = RetrievalDataModule(cfg.data, tokenize=module.encoder.tokenize)
    def progress(trainer, _module) -> None:
        if trainer.global_step % 25 == 0:
            log(f"  step {trainer.global_step}: {statistics.median(clock.times):.1f} s/step")

    clock = step_clock(on_end=progress)
    times = clock.times
    log(f"B13 {name} seed {seed}: {len(dm.batch_sampler)} steps of 32, {torch.get_num_threads()} thread(s)")
    trainer = quiet_trainer(cfg, callbacks=[clock])
    trainer.fit(module, datamodule=dm)
    stats = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
    return {"key": run_key(name, seed, args), "name": name, "seed": seed, "what": RUNS[name][1], "steps": int(trainer.global_step),
            "train_s": sum(times), "s_per_step": statistics.median(times), "final": score(module.encoder, pools, module.eval_cfg),
            "last_step": stats, "threads": torch.get_num_threads(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def run_key(name: str, seed: int, args) -> str:
    return f"{name}|seed={seed}|per_source={args.pairs_per_source}|pool={args.max_queries}x{args.max_docs}"


# ----------------------------------------------------------------------------------- report


def report(records: list[dict], args, out_dir: Path, cut: list[str]) -> None:
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    rows = []
    for name in ["base", *RUNS]:
        xs = by.get(name, [])
        if xs:
            rows.append([name, RUNS[name][1] if name in RUNS else "untrained all-MiniLM-L6-v2", len(xs)]
                        + [cell(xs, s, k) for s in SOURCES for k in ("recall@1", "ndcg@10")]
                        + [f"{statistics.median(x['s_per_step'] for x in xs):.2f}" if name in RUNS else ""])
    first = next(iter(records), {"final": {}})["final"]
    sizes = ", ".join(f"{s} {first[s]['queries']:,} queries / {first[s]['docs']:,} documents" for s in SOURCES if s in first)
    md = ["# B13: one queue per source (issue 34, part 3)", "",
          f"all-MiniLM-L6-v2 on two sources, round robin: {args.pairs_per_source:,} Debian pairs and the standard library's "
          "docstrings (`python -m moco_retrieval.data pydoc`), one epoch at batch 32, tau 0.05, AdamW lr 2e-5. "
          f"Each source scored on its own held-out pool ({sizes}). Median ± std over seeds; s/step: each run's "
          "own clock, one thread, runs side by side with other work.", "",
          md_table(["run", "what", "seeds"] + [f"{s} {k}" for s in SOURCES for k in ("recall@1", "nDCG@10")] + ["s/step"], rows), "",
          "## Per seed, against the shared queue", "", *paired_lines(by), ""]
    missing = [f"{n} seed {s}" for n in RUNS for s in range(3) if not any(x["seed"] == s for x in by.get(n, []))]
    if missing or cut:
        md += ["## Not run yet", "", "Planned and not in the cache (the cache resumes them): "
               + ", ".join(missing + [c for c in cut if c not in missing]) + ".", ""]
    write_results(NAME, "\n".join(md), {"benchmark": "B13 one queue per source", "pairs_per_source": args.pairs_per_source,
                                        "runs": records, "environment": environment()}, out_dir)
    log(f"wrote {out_dir / (NAME + '.md')}")


def cell(xs: list[dict], source: str, key: str) -> str:
    m, s = med_std([x["final"][source][key] for x in xs])
    return f"{m:.3f}" + (f" ± {s:.3f}" if s == s else "")


def paired_lines(by: dict) -> list[str]:
    """Per source, each run's recall@1 minus the shared queue's on the same seed (same batches)."""
    ref = {x["seed"]: x for x in by.get("shared-32", [])}
    out = []
    for name in ("per_source-32", "inbatch-32"):
        xs = sorted((x for x in by.get(name, []) if x["seed"] in ref), key=lambda x: x["seed"])
        for source in SOURCES if xs else ():
            d = [x["final"][source]["recall@1"] - ref[x["seed"]]["final"][source]["recall@1"] for x in xs]
            out.append(f"- {name} - shared-32, {source} recall@1: median {statistics.median(d):+.3f}, "
                       f"per seed {', '.join(f'{v:+.3f}' for v in d)} (seeds {[x['seed'] for x in xs]})")
    return out or ["Not enough runs yet."]


def runner(args, pydoc: Path):
    """Loads both sources' sets and pools once; returns what makes one run's record."""
    the_pools = pools(Bench(), pydoc, args)
    return lambda name, seed: do_run(the_pools, pydoc, name, seed, args)


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    add_run_args(ap, default="base," + ",".join(RUNS), runs=["base", *RUNS], small="--pairs-per-source")
    ap.add_argument("--pairs-per-source", type=int, default=None, help="pairs of each source (default: every docstring pair, as many Debian pairs)")
    args = ap.parse_args(argv)
    cli.apply(args)
    args.max_queries = args.max_queries if args.max_queries is not None else 1000
    args.max_docs = args.max_docs if args.max_docs is not None else 2400
    pydoc = pydoc_folder()
    args.pairs_per_source = args.pairs_per_source or json.loads((pydoc / "manifest.json").read_text())["counts"]["train_pairs"]
    out_dir = cli.out_dir(args)
    cache = out_dir / f"{NAME}_runs.jsonl"
    cut = run_selected(cache, args, ["base", *RUNS], lambda n, s: run_key(n, s, args), lambda: runner(args, pydoc))
    report(cached_records(cache, f"|per_source={args.pairs_per_source}|pool={args.max_queries}x{args.max_docs}"), args, out_dir, cut)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
