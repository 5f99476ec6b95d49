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

    python benchmarks/finetune.py --only two_queue_ib-32,inbatch-32 --seeds 0 --threads 1
    python benchmarks/finetune.py --report
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.harness.training import TRAINER, Bench, compose_cfg, quiet_trainer
from benchmarks.harness.report import environment, figure, log
from benchmarks.harness import cli
from benchmarks.harness.runs import md_table, read_jsonl, run_selected, write_results
from benchmarks.harness.runs import records as cached_records
from benchmarks.harness.steps import PeerTrainer, step_clock

import torch

NAME = "finetune"
BASE = [f"trainer={TRAINER}", "logger=none", "data=debian", "trainer.val_check_interval=null"]
INBATCH = ["+experiment=inbatch256"]
MAIN = ["+experiment=queue65k"]
MOCO = MAIN + ["objective=moco"]  # the main job before B6
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


# the two-queue options B6's runs were first made at; every run names them, so a cached run keeps
# its meaning when the objective's defaults move
TWO_QUEUE_PINNED = {"objective.momentum": "0.999", "objective.queue_max_age": "null"}


def two_queue(*extra: str, inbatch: float = 0.0) -> list[str]:
    """The main job with the two-queue objective at ``TWO_QUEUE_PINNED``, the in-batch weight
    ``inbatch``, and ``extra`` overrides (``key=value``, replacing a pinned one)."""
    options = {**TWO_QUEUE_PINNED, "objective.inbatch_weight": str(inbatch)}
    options.update(e.split("=", 1) for e in extra)
    return MAIN + [f"{k}={v}" for k, v in options.items()]


TWO_QUEUE = two_queue()  # the two-queue objective alone (false_negatives.py builds on it)


def main_objective(*extra: str) -> list[str]:
    """``+experiment=queue65k``'s objective as B6 runs it at batch 32 (m 0.995, in-batch term, a
    4,096-key queue each: the keys its ``queue_max_age`` 128 keeps), plus ``extra``."""
    return two_queue("objective.momentum=0.995", "objective.queue_size=4096", *extra, inbatch=1.0)


# name -> (kind, batch, overrides or loss options, what it is); in order of priority
RUNS: dict[str, tuple[str, int, object, str]] = {
    "two_queue-32": ("ours", 32, TWO_QUEUE, "two-queue momentum, K 65,536 each, m 0.999, no in-batch term"),
    "two_queue_ib-32": ("ours", 32, two_queue(inbatch=1.0), "two-queue, m 0.999 + in-batch term (weight 1): queue65k's objective 2026-12-02 to 12-03"),
    "inbatch-32": ("ours", 32, INBATCH, "ours, in-batch negatives"),
    "mnrl-32": ("mnrl", 32, {}, "sentence-transformers MNRL"),
    "moco-32": ("ours", 32, MOCO, "MoCo queue, K 65,536, m 0.999 (queue65k before B6)"),
    "inbatch-256": ("ours", 256, INBATCH, "ours, in-batch negatives"),
    "cmnrl-256": ("cmnrl", 256, {"mini_batch_size": 32}, "sentence-transformers CachedMNRL, mini-batch 32"),
    "inbatch-64": ("ours", 64, INBATCH, "ours, in-batch negatives"),
    "inbatch-128": ("ours", 128, INBATCH, "ours, in-batch negatives"),
    "mnrl_gte-32": ("mnrl", 32, {"directions": GTE}, "MNRL, directions q->d, q->q, d->q, d->d"),
    "two_queue_m0.995-32": ("ours", 32, two_queue("objective.momentum=0.995"), "two-queue, m 0.995 (ALBEF)"),
    "two_queue_m0.995_ib-32": ("ours", 32, two_queue("objective.momentum=0.995", inbatch=1.0),
                               "two-queue, m 0.995 + in-batch term (weight 1)"),
    "two_queue_m0.995_ib_k4k-32": ("ours", 32, main_objective(),
                                   "two-queue, m 0.995 + in-batch term, K 4,096 (keys at most 128 steps old: no cone); at batch 32 "
                                   "the same training as queue65k's queue_max_age 128 (tests/test_two_queue.py)"),
    "two_queue_cosine-32": ("ours", 32, two_queue("objective.momentum=0.99", "objective.momentum_schedule=cosine"),
                            "two-queue, m cosine 0.99 -> 1"),
    "two_queue_k16k-32": ("ours", 32, two_queue("objective.queue_size=16384"), "two-queue, K 16,384"),
    # each change on its own, against the main job's objective (MAIN_RUN, 3 seeds)
    "two_queue_m0.995_ib_k4k_sameside-32": ("ours", 32, main_objective("objective.same_side_negatives=true"),
                                            "queue65k's objective + q->q and d->d negatives (GTE)"),
    "two_queue_m0.995_ib_k4k_dq0.5-32": ("ours", 32, main_objective("objective.doc_to_query_weight=0.5"),
                                         "queue65k's objective, d->q weight 0.5"),
    "two_queue_m0.995_ib_k4k_warmup-32": ("ours", 32, main_objective("objective.queue_warmup_steps=57"),
                                          "queue65k's objective, queues count after 10% of the steps"),
    "two_queue_m0.995_ib_k4k_refresh32-32": ("ours", 32, main_objective("objective.queue_refresh=32"),
                                             "queue65k's objective + 32 queued keys of each queue re-encoded a step (negative cache)"),
    "two_queue_m0.995_ib_refresh32-32": ("ours", 32, two_queue("objective.momentum=0.995", "objective.queue_refresh=32", inbatch=1.0),
                                         "two-queue, m 0.995 + in-batch term, K 65,536 unbounded + refresh 32 a step: "
                                         "does refreshing let the older keys count without the cone?"),
    "icol-32": ("ours", 32, MAIN + ["objective=icol", "model.shared_tower=false", "objective.phase_steps=128",
                                    "objective.queue_size=4096"],
                "ICoL: two towers trained in turns (128 steps each), queue 4,096 of this phase's other-tower embeddings"),
    "inbatch_2tower-32": ("ours", 32, INBATCH + ["model.shared_tower=false"], "ours, in-batch negatives, two towers (icol-32's twin)"),
}
# the run with +experiment=queue65k's objective (the bar's subject); its queue_max_age 128 at batch
# 32 keeps the same 4,096 keys as this run's queue (the same losses: tests/test_two_queue.py)
MAIN_RUN = "two_queue_m0.995_ib_k4k-32"
# runs the bar's equal-steps lines are also reported for once they have 3 seeds (3 are planned for each)
CANDIDATES = [MAIN_RUN, "two_queue_m0.995_ib_k4k_refresh32-32", "two_queue_m0.995_ib_k4k_sameside-32"]
HEADLINE = [MAIN_RUN, "two_queue_ib-32", "inbatch-32", "mnrl-32", "inbatch-256", "cmnrl-256"]


# ----------------------------------------------------------------------------------- data


def pair_batches(bench: Bench, seed: int, pairs: int, batch: int) -> list[list[int]]:
    """The first ``pairs`` pairs of the batch-32 order of ``seed``, as batches of ``batch``."""
    cfg = compose_cfg(BASE + INBATCH + ["data.batch_size=32", f"data.seed={seed}", f"seed={seed}"])
    sampler = bench.datamodule(cfg).batch_sampler
    sampler.set_epoch(0)
    b32 = list(sampler)[: pairs // 32]
    if len(b32) * 32 < pairs:
        raise SystemExit(f"--pairs {pairs}: one epoch holds only {len(b32) * 32:,} pairs at batch 32")
    m = batch // 32
    return [sum(b32[i : i + m], []) for i in range(0, len(b32) - m + 1, m)]


class Evaluator:
    """Scores an encoder on the pool; ``every`` pairs and at the end; keeps the training clock."""

    def __init__(self, pool, eval_cfg, every: int, batch: int, steps: int, dims: tuple[int, ...] = ()):
        self.pool, self.eval_cfg, self.dims = pool, eval_cfg, tuple(dims)  # dims: also scored truncated
        self.at = {s for s in range(every // batch, steps, max(1, every // batch))} | {steps}
        self.curve: list[dict] = []
        self.train_s, self.eval_s, self._t = 0.0, 0.0, None
        self.step_times: list[float] = []
        self.batch, self.steps = batch, steps
        self._logged = time.perf_counter()

    def start(self) -> None:
        self._t = time.perf_counter()

    def step_done(self, step: int, encoder) -> None:
        dt = time.perf_counter() - self._t
        self.step_times.append(dt)
        self.train_s += dt
        if step % 50 == 0 or time.perf_counter() - self._logged > 300:  # big batches: a step can take minutes
            self._logged = time.perf_counter()
            left = (self.steps - step) * self.train_s / step
            log(f"  step {step}/{self.steps}: {self.train_s / step:.1f} s/step, about {left / 60:.0f} min of training left")
        if step in self.at:
            self.curve.append(self.score(encoder, step))
        self._t = time.perf_counter()

    def score(self, encoder, step: int) -> dict:
        from moco_retrieval.evaluation.encode import evaluate_encoder

        t0 = time.perf_counter()
        was = encoder.training
        encoder.eval()
        res = evaluate_encoder(encoder, self.pool, self.eval_cfg, batch_size=64, show_progress=False, dims=self.dims)
        encoder.train(was)
        self.eval_s += time.perf_counter() - t0
        point = {"step": step, "pairs": step * self.batch, "train_s": self.train_s, **_metrics(res),
                 "miss_in_group@1": miss_in_group(res.run, self.pool)}
        if self.dims:
            point["by_dim"] = {str(d): {k: m[k] for k in ("recall@1", "mrr@10", "ndcg@10")} for d, m in res.metrics_by_dim.items()}
        log(f"  step {step}: recall@1 {point['recall@1']:.3f} nDCG@10 {point['ndcg@10']:.3f} "
            f"unrelated cos {point['unrelated_cos_mean']:+.3f} ({self.train_s:.0f}s training)")
        return point


def _metrics(res) -> dict:
    m, g = res.metrics, res.geometry
    return {"recall@1": m["recall@1"], "mrr@10": m["mrr@10"], "ndcg@10": m["ndcg@10"], "recall@10": m["recall@10"],
            "unrelated_cos_mean": g.get("unrelated_cos_mean"), "positive_cos_mean": g.get("positive_cos_mean")}


def miss_in_group(run: dict, pool) -> float:
    """Share of queries whose top document is wrong but of the positive's group (source package):
    a confusion training cannot teach away, since group masking keeps such documents out of every
    softmax. What is left of 1 - recall@1 after it: the misses more or other negatives could fix."""
    groups, n = pool.doc_groups or {}, 0
    for qid, ranked in run.items():
        top = max(ranked, key=ranked.get) if ranked else None
        pos = [d for d, r in pool.qrels.get(qid, {}).items() if r > 0]
        g = groups.get(pos[0]) if pos else None
        n += top is not None and top not in pos and g is not None and groups.get(top) == g
    return n / max(1, len(pool.queries))


# ----------------------------------------------------------------------------------- runs


def run_ours(bench, overrides, batches, seed, ev: Evaluator) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from moco_retrieval.data.collate import Collator, PairDataset
    from moco_retrieval.training.module import RetrievalModule

    cfg = compose_cfg(BASE + list(overrides) + [f"data.batch_size={len(batches[0])}", "trainer.max_epochs=1",
                                                f"seed={seed}", f"data.seed={seed}"])
    L.seed_everything(seed, verbose=False)
    module = RetrievalModule.from_config(cfg)
    loader = DataLoader(PairDataset(bench.train_pairs), batch_sampler=batches, collate_fn=Collator(module.encoder.tokenize))

    clock = step_clock(on_start=ev.start, on_end=lambda trainer, m: ev.step_done(trainer.global_step, m.encoder))
    trainer = quiet_trainer(cfg, callbacks=[clock])
    trainer.fit(module, train_dataloaders=loader)
    out = {"objective": cfg.objective.name, "temperature": cfg.objective.temperature, "lr": cfg.optim.lr,
           "last_step": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}}
    out.update(module.objective.stats(trainer.global_step))
    return out


def run_peer(bench, kind, options, batches, seed, ev: Evaluator) -> dict:
    """sentence-transformers' MNRL / CachedMNRL / MatryoshkaLoss over the same batches (the clock
    includes tokenisation, as ours includes collation)."""
    from moco_retrieval.model.backbone import resolve_backbone_path
    from moco_retrieval.model.encoder import build_encoder

    cfg = compose_cfg(BASE + INBATCH + [f"seed={seed}"])
    torch.manual_seed(seed)
    device = "cuda" if TRAINER == "gpu" and torch.cuda.is_available() else "cpu"
    steps = len(batches)
    peer = PeerTrainer(str(resolve_backbone_path(cfg.model)), kind, options, lr=cfg.optim.lr,
                       weight_decay=cfg.optim.weight_decay, lengths=(cfg.model.query_max_len, cfg.model.doc_max_len),
                       steps=steps, warmup=int(cfg.optim.warmup_ratio * steps), device=device)
    scorer = build_encoder(cfg.model).to(device)  # our encoder, the peer's weights: same pooling + normalisation
    pairs = bench.train_pairs
    for step, idx in enumerate(batches, start=1):
        ev.start()
        peer.step(peer.features([pairs[i].query for i in idx], [pairs[i].positive for i in idx]))
        if step in ev.at:
            peer.copy_into(scorer)
        ev.step_done(step, scorer)
    return {"objective": kind, "temperature": peer.temperature, "lr": cfg.optim.lr,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}}


def trained(bench, pool, label: str, run: tuple, batches: list[list[int]], seed: int, eval_every: int,
            dims: tuple[int, ...] = ()) -> dict:
    """Trains one entry of a RUNS table, ``(kind, batch, overrides or loss options, what)``, over
    ``batches``, scored every ``eval_every`` pairs and at the end (also at ``dims``): what a
    record of B6 and the scripts built on it measures (they add its key and name)."""
    kind, batch, spec, what = run
    ev = Evaluator(pool, compose_cfg(BASE + INBATCH).eval, eval_every, batch, len(batches), dims=dims)
    log(f"{label} seed {seed}: {len(batches)} steps of {batch} ({len(batches) * batch:,} pairs), {torch.get_num_threads()} thread(s)")
    t0 = time.perf_counter()
    info = run_ours(bench, spec, batches, seed, ev) if kind == "ours" else run_peer(bench, kind, spec, batches, seed, ev)
    ts = ev.step_times[3:] or ev.step_times
    return {"seed": seed, "kind": kind, "batch_size": batch, "what": what, "steps": len(batches), "pairs": len(batches) * batch,
            "train_s": ev.train_s, "eval_s": ev.eval_s, "s_per_step": statistics.median(ts), "final": ev.curve[-1],
            "curve": ev.curve, "wall_s": time.perf_counter() - t0, "threads": torch.get_num_threads(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), **info}


def do_run(bench, pool, name, seed, args) -> dict:
    batches = pair_batches(bench, seed, args.pairs, RUNS[name][1])
    return {"key": run_key(name, seed, args), "name": name,
            **trained(bench, pool, f"B6 {name}", RUNS[name], batches, seed, args.eval_every)}


def run_key(name: str, seed: int, args) -> str:
    return f"{name}|seed={seed}|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}"


# ----------------------------------------------------------------------------------- report


def med_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return float("nan"), float("nan")
    return statistics.median(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def fmt_recorded(xs, key) -> str:
    """``fmt`` over the runs that recorded ``key`` (blank when none did), with how many did."""
    have = [x for x in xs if key in x["final"]]
    return "" if not have else fmt(have, key) + ("" if len(have) == len(xs) else f" ({len(have)} seed(s))")


def fmt(xs, key) -> str:
    m, s = med_std([r["final"][key] for r in xs])
    return f"{m:.3f}" + (f" ± {s:.3f}" if s == s else "")


def paired(q: list[dict], r: list[dict], key: str) -> list[float]:
    """Per-seed differences q - r in ``key``, over the seeds both ran (a seed fixes the batches)."""
    ref = {x["seed"]: x["final"][key] for x in r}
    return [x["final"][key] - ref[x["seed"]] for x in sorted(q, key=lambda x: x["seed"]) if x["seed"] in ref]


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


def report(records: list[dict], args, out_dir: Path, prefix: str, cut: list[str]) -> None:
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    rows = []
    for name in RUNS:
        xs = by.get(name)
        if not xs:
            continue
        rows.append([name, RUNS[name][3], xs[0]["batch_size"], len(xs), fmt(xs, "recall@1"), fmt(xs, "mrr@10"), fmt(xs, "ndcg@10"),
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
    missing = [f"{n} (seed {s})" for n in RUNS for s in range(3 if n in HEADLINE + CANDIDATES else 1)
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


def add_run_args(ap: argparse.ArgumentParser, *, default: str, runs: list[str], small: str) -> None:
    """The options of every B6-style benchmark: the harness's (runs, seeds, threads, report,
    deadline, results folder, data location) and the data and pool sizes (``small``: the name of
    the script's smoke mode, whose sizes the help mentions)."""
    cli.add_selection(ap, runs=runs, default=default)
    ap.add_argument("--pairs", type=int, default=None, help=f"training pairs per run (default 18,240; {small}: smaller)")
    ap.add_argument("--eval-every", type=int, default=None, help="pairs between evaluations (default 6,080)")
    ap.add_argument("--max-queries", type=int, default=None, help="queries of the pool (default 1,000)")
    ap.add_argument("--max-docs", type=int, default=None, help="documents of the pool (default 2,400)")
    cli.add_report(ap)
    cli.add_deadline(ap)
    cli.add_common(ap)


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
    cut = run_selected(cache, args, ["base", *RUNS], lambda name, seed: run_key(name, seed, args), lambda: runner(args, run_or_base))
    # read again: runs finished by parallel processes since belong in the report too
    records = cached_records(cache, f"|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}")
    if not any(r["name"] == "base" for r in records):
        records += base_from_other_caches(out_dir, args)
    report(records, args, out_dir, prefix, cut)
    return 0


def runner(args, make):
    """Loads the Debian set and the pool (``--max-queries`` x ``--max-docs``) once; returns what
    makes one run's record: ``make(bench, pool, name, seed, args)``."""
    from moco_retrieval.data.sources import cap_eval_set

    bench = Bench()
    pool = cap_eval_set(bench.eval_set, args.max_queries or None, args.max_docs or None, seed=0)
    return lambda name, seed: make(bench, pool, name, seed, args)


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

    cfg = compose_cfg(BASE + INBATCH)
    res = evaluate_encoder(build_encoder(cfg.model), pool, cfg.eval, batch_size=64, show_progress=False)
    final = {**_metrics(res), "miss_in_group@1": miss_in_group(res.run, pool)}
    return {"key": key, "name": "base", "seed": 0, "kind": "base", "batch_size": 0, "final": final, "curve": []}


if __name__ == "__main__":
    raise SystemExit(main())
