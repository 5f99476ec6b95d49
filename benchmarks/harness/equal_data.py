"""B6's protocol, which B7, B11, B12 and B13 reuse: a fine-tune at equal data.

Every run sees **the same pairs in the same order**: the batch sampler's order at batch 32 (seed
s), cut to a number of pairs (``pair_batches``); a run at batch 32 m takes m consecutive batches of
32 as one. Each run is scored on a held-out pool every so many pairs and at the end
(``Evaluator``: recall@1, MRR@10, nDCG@10, the mean unrelated cosine, the share of top-1 misses
from the positive's group, against the training seconds so far, evaluation not counted).

* the configs: ``BASE`` (every run's), ``INBATCH``, ``MAIN`` (``+experiment=queue65k``), ``MOCO``,
  ``two_queue`` (the two-queue objective at the options B6 first ran it with, pinned, so a cached
  run keeps its meaning when the defaults move) and ``main_objective`` (queue65k's objective as B6
  runs it at batch 32); ``use_model`` puts every composed config on another model preset;
* ``RUNS``: B6's run table, name -> (kind, batch, overrides or loss options, what it is), with
  ``MAIN_RUN``, ``HEADLINE`` and ``CANDIDATES``; ``retired(runs)``: the runs of a table that use a
  retired option (``training.RETIRED``), name -> why: read from the caches, never run again;
* ``trained``: one run of such a table over given batches (``run_ours``: our module through a
  quiet Lightning trainer, with hard negatives and teacher scores when the config asks; ``run_peer``:
  sentence-transformers' MNRL / CachedMNRL / MatryoshkaLoss, or B16's DistillKLDivLoss / MarginMSELoss),
  the record every script built on B6 stores;
* ``add_run_args`` and ``runner``: the options of every B6-style script and the data loaded once.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import cli
from benchmarks.harness.report import log
from benchmarks.harness.steps import DISTILL_LOSSES, PeerTrainer, step_clock
from benchmarks.harness.training import TRAINER, Bench, compose_cfg, quiet_trainer, retired_reason

DEFAULT_BASE = [f"trainer={TRAINER}", "logger=none", "data=debian", "trainer.val_check_interval=null"]
BASE = list(DEFAULT_BASE)  # every config this protocol composes starts here (``use_model``)
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


# name -> (kind, batch, overrides or loss options, what it is); in order of priority. Three runs use
# an option issue 43 retired (``RETIRED_RUNS``, below: two_queue_cosine-32, ..._dq0.5-32, icol-32):
# they stay so their cached records stay in the report, and can no longer be run.
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
    # retired (issue 43): kept for its cached records
    "two_queue_cosine-32": ("ours", 32, two_queue("objective.momentum=0.99", "objective.momentum_schedule=cosine"),
                            "two-queue, m cosine 0.99 -> 1"),
    "two_queue_k16k-32": ("ours", 32, two_queue("objective.queue_size=16384"), "two-queue, K 16,384"),
    # each change on its own, against the main job's objective (MAIN_RUN, 3 seeds)
    "two_queue_m0.995_ib_k4k_sameside-32": ("ours", 32, main_objective("objective.same_side_negatives=true"),
                                            "queue65k's objective + q->q and d->d negatives (GTE)"),
    # retired (issue 43): kept for its cached records
    "two_queue_m0.995_ib_k4k_dq0.5-32": ("ours", 32, main_objective("objective.doc_to_query_weight=0.5"),
                                         "queue65k's objective, d->q weight 0.5"),
    "two_queue_m0.995_ib_k4k_warmup-32": ("ours", 32, main_objective("objective.queue_warmup_steps=57"),
                                          "queue65k's objective, queues count after 10% of the steps"),
    "two_queue_m0.995_ib_k4k_refresh32-32": ("ours", 32, main_objective("objective.queue_refresh=32"),
                                             "queue65k's objective + 32 queued keys of each queue re-encoded a step (negative cache)"),
    "two_queue_m0.995_ib_refresh32-32": ("ours", 32, two_queue("objective.momentum=0.995", "objective.queue_refresh=32", inbatch=1.0),
                                         "two-queue, m 0.995 + in-batch term, K 65,536 unbounded + refresh 32 a step: "
                                         "does refreshing let the older keys count without the cone?"),
    # retired (issue 43): kept for its cached records
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


# ---- smaller per-step batches (B11, B14): B6's pairs and order, its batch-32 batches split

MAIN_AT_32 = {"momentum": 0.995, "queue_max_age": 128, "keys": 4096}  # MAIN_RUN: queue65k's objective at 32


def main_objective_at(batch: int, *extra: str) -> list[str]:
    """The main job's objective at ``batch``: the same keys (queue_max_age x batch = 4,096) and the
    same EMA span in pairs (time constant 1 / (1 - m) steps scaled by 32 / batch)."""
    scale = 32 // batch
    m = 1 - (1 - MAIN_AT_32["momentum"]) / scale
    return two_queue(f"objective.momentum={m:g}", f"objective.queue_size={MAIN_AT_32['keys']}",
                        f"objective.queue_max_age={MAIN_AT_32['queue_max_age'] * scale}", *extra, inbatch=1.0)



def use_model(preset: str | None, path: str | None = None) -> None:
    """Every config composed from ``BASE`` on the model preset ``preset`` (e.g. "tiny", the random
    test model of small_batch.py's dry run); None: the default, all-MiniLM-L6-v2; ``path``: its
    weights from that folder (``model.path``; B16's 3-layer student), our runs' and the peers'."""
    global BASE
    BASE = [*DEFAULT_BASE, f"model={preset}"] if preset else list(DEFAULT_BASE)
    if path:
        BASE.append(f"model.path={path}")


def retired(runs: dict) -> dict[str, str]:
    """The runs of a table (name -> (kind, batch, overrides or loss options, what)) whose overrides
    use a retired option, name -> why. Their records stay in the caches and the reports; running
    one again is refused (``runs.run_selected``'s ``retired``)."""
    return {name: why for name, (kind, _, spec, _) in runs.items() if kind == "ours" and (why := retired_reason(spec))}


RETIRED_RUNS = retired(RUNS)


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


def batches_of(bench, seed: int, pairs: int, batch: int) -> list[list[int]]:
    """B6's pairs in B6's order: its batch-32 batches, each split into 32 / ``batch`` steps below 32."""
    if batch >= 32:
        return pair_batches(bench, seed, pairs, batch)
    if 32 % batch:
        raise SystemExit(f"batch {batch}: must divide 32 (or be a multiple of it)")
    return [b[i : i + batch] for b in pair_batches(bench, seed, pairs, 32) for i in range(0, 32, batch)]



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
        point = {"step": step, "pairs": step * self.batch, "train_s": self.train_s, **metrics(res),
                 "miss_in_group@1": miss_in_group(res.run, self.pool)}
        if self.dims:
            point["by_dim"] = {str(d): {k: m[k] for k in ("recall@1", "mrr@10", "ndcg@10")} for d, m in res.metrics_by_dim.items()}
        log(f"  step {step}: recall@1 {point['recall@1']:.3f} nDCG@10 {point['ndcg@10']:.3f} "
            f"unrelated cos {point['unrelated_cos_mean']:+.3f} ({self.train_s:.0f}s training)")
        return point


def metrics(res) -> dict:
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
    # hard negatives and the teacher's scores when the config asks for them (B16's rows), else pairs alone
    collator = Collator(module.encoder.tokenize, cfg.data.n_negatives, cfg.data.seed,
                        scores=getattr(cfg.objective, "distill", "none") != "none")
    loader = DataLoader(PairDataset(bench.train_pairs), batch_sampler=batches, collate_fn=collator)

    clock = step_clock(on_start=ev.start, on_end=lambda trainer, m: ev.step_done(trainer.global_step, m.encoder))
    trainer = quiet_trainer(cfg, callbacks=[clock])
    trainer.fit(module, train_dataloaders=loader)
    out = {"objective": cfg.objective.name, "temperature": cfg.objective.temperature, "lr": cfg.optim.lr,
           "last_step": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}}
    out.update(module.objective.stats(trainer.global_step))
    return out


def run_peer(bench, kind, options, batches, seed, ev: Evaluator) -> dict:
    """sentence-transformers' MNRL / CachedMNRL / MatryoshkaLoss over the same batches (the clock
    includes tokenisation, as ours includes collation); a distillation loss (``steps.DISTILL_LOSSES``,
    option ``n_negatives``) on each row's query, positive and its hard negatives as our collator
    picks them, the teacher's scores as labels."""
    from moco_retrieval.data.collate import select_negatives

    options = dict(options)
    n_neg = options.pop("n_negatives", None) if kind in DISTILL_LOSSES else None
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
        if n_neg:
            negs = [select_negatives(pairs[i], i, n_neg, seed) for i in idx]
            labels = torch.tensor([[pairs[i].positive_score] + [n.score for n in ns] for i, ns in zip(idx, negs)])
            peer.step(peer.features([pairs[i].query for i in idx], [pairs[i].positive for i in idx],
                                    *[[ns[j].text for ns in negs] for j in range(n_neg)]), labels)
        else:
            peer.step(peer.features([pairs[i].query for i in idx], [pairs[i].positive for i in idx]))
        if step in ev.at:
            peer.copy_into(scorer)
        ev.step_done(step, scorer)
    return {"objective": kind, "temperature": peer.temperature, "lr": cfg.optim.lr,
            **({"n_negatives": n_neg} if n_neg else {}), **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}}


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


def add_dry_run(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dry-run", action="store_true",
                    help="the tiny random model, 512 pairs, a 50 / 100 pool: checks the harness (results to --out or a temp folder)")


def settle(args, name: str) -> tuple[Path, str, Path]:
    """The protocol's sizes on ``args`` (B6's, or ``--dry-run``'s on the tiny model), and where the
    results go: ``(results folder, file prefix, run cache)``."""
    d = args.dry_run
    args.model = "tiny" if d else "minilm"
    use_model("tiny" if d else None)  # a dry run: every config of B6's protocol on the tiny random encoder
    args.pairs = args.pairs or (512 if d else 18240)
    args.eval_every = args.eval_every or (256 if d else 6080)
    args.max_queries = args.max_queries if args.max_queries is not None else (50 if d else 1000)
    args.max_docs = args.max_docs if args.max_docs is not None else (100 if d else 2400)
    out_dir = cli.out_dir(args, Path(tempfile.mkdtemp(prefix=f"{name}-dry-")) if d else cli.RESULTS)
    prefix = f"{name}_dry_run" if d else (name if args.pairs == 18240 else f"{name}_{args.pairs}pairs")
    return out_dir, prefix, out_dir / f"{prefix}_runs.jsonl"


def protocol_suffix(args) -> str:
    """The end of every run key of one protocol (model, pairs, pool): records of others are not mixed in."""
    return f"|model={args.model}|pairs={args.pairs}|pool={args.max_queries}x{args.max_docs}"


def runner(args, make):
    """Loads the Debian set and the pool (``--max-queries`` x ``--max-docs``) once; returns what
    makes one run's record: ``make(bench, pool, name, seed, args)``."""
    from moco_retrieval.data.sources import cap_eval_set

    bench = Bench()
    pool = cap_eval_set(bench.eval_set, args.max_queries or None, args.max_docs or None, seed=0)
    return lambda name, seed: make(bench, pool, name, seed, args)
