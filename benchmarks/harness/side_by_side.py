"""The cost of a run table's runs, side by side: seconds per training pair and training memory.

A run's own clock runs beside whatever else shares the CPU, so its seconds do not compare runs
made hours apart. ``measure`` times the runs the way B6's bar needs ("at equal data, in at most half
their training seconds"): every run in one process, one step of each in turn, repeat after repeat,
so machine noise hits all alike; ``summarise`` takes medians of the repeats and the median of each
round's per-pair ratio (``per_pair_ratio``); ``table_lines`` prints it.

One step = forward of both sides + loss + backward + clipping + AdamW + (ours) EMA update and
enqueue, on a run's real batches (same pairs, same order, so real token lengths); tokenisation is
done before the clock starts, for ours and the peers alike. The two-queue objective's queues are
pre-filled with ``MEAN_FILL`` keys each, their mean fill over a B6 run; a queue with
``queue_refresh`` also holds real training texts for them, so its re-encodings cost what they cost
in training. ``memory`` measures each run's steps alone (``step_memory``): MiB resident between
steps and the most MiB a step adds.

The tables are ``equal_data.RUNS``-shaped (name -> (kind, batch, overrides or loss options, what));
B6's by default. Used by finetune_cost.py (B6), small_batch.py (B11) and matryoshka.py (B12).
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from benchmarks.harness import equal_data, step_memory
from benchmarks.harness.equal_data import INBATCH, RUNS, pair_batches
from benchmarks.harness.report import log
from benchmarks.harness.runs import md_table, refuse_retired
from benchmarks.harness.steps import OurStep, PeerTrainer
from benchmarks.harness.training import Bench, compose_cfg

MEAN_FILL = 9120  # half of the 18,240 keys a B6 run has queued by its end


class OursStep:
    """One training step of our module (``harness.steps.OurStep``) on a B6 run's config, its
    queues pre-filled to ``MEAN_FILL``; ``prepare`` collates a batch outside the clock."""

    def __init__(self, bench: Bench, overrides, batch: int):
        from moco_retrieval.data.collate import Collator, PairDataset
        from moco_retrieval.training.module import RetrievalModule, decay_groups

        cfg = compose_cfg(equal_data.BASE + list(overrides) + [f"data.batch_size={batch}", "seed=0", "data.seed=0"])
        torch.manual_seed(0)
        self.m = RetrievalModule.from_config(cfg).train()
        opt = torch.optim.AdamW(decay_groups(self.m.named_parameters(), cfg.optim.weight_decay), lr=cfg.optim.lr)
        self.step = OurStep(self.m, opt, clip=cfg.trainer.gradient_clip_val)
        self.data, self.collate = PairDataset(bench.train_pairs), Collator(self.m.encoder.tokenize)
        for memory in self.m.objective.memories():
            keys = torch.nn.functional.normalize(torch.randn(MEAN_FILL, self.m.encoder.dim), dim=1)
            slots = memory.queue.enqueue(keys, torch.arange(MEAN_FILL) + 10**9, torch.full((MEAN_FILL,), -1), step=0,
                                         gather=False)
            if memory.refresh is not None:  # a refreshed queue re-encodes real texts: store real ones
                self.store_texts(memory.refresh, slots, bench)

    def store_texts(self, refresh, slots, bench: Bench) -> None:
        """Training texts of the refresh's side as the tokens of ``slots`` (the pre-filled keys)."""
        pairs = bench.train_pairs[: len(slots)]
        texts = [p.query if refresh.kind == "query" else p.positive for p in pairs]
        # tokenized in chunks (each padded to its own longest); store pads them all to one width
        refresh.store(slots, [self.m.encoder.tokenize(texts[i : i + 512], refresh.kind) for i in range(0, len(texts), 512)], step=0)

    def prepare(self, idx: list[int]):
        return self.collate([self.data[i] for i in idx])

    def holds(self) -> tuple[list, list]:
        """What stays resident between steps: the module (encoders, EMA copy, queues) and the optimizer."""
        return [self.m], [self.step.opt]

    def __call__(self, batch) -> None:
        self.step(batch)


class PeerStep:
    """One step of sentence-transformers' MNRL / CachedMNRL (``harness.steps.PeerTrainer``, as
    ``equal_data.run_peer`` trains it, without the schedule); ``prepare`` tokenises outside the clock."""

    def __init__(self, bench: Bench, kind: str, options: dict):
        from moco_retrieval.model.backbone import resolve_backbone_path

        cfg = compose_cfg(equal_data.BASE + INBATCH)
        torch.manual_seed(0)
        self.peer = PeerTrainer(str(resolve_backbone_path(cfg.model)), kind, options, lr=cfg.optim.lr,
                                weight_decay=cfg.optim.weight_decay, lengths=(cfg.model.query_max_len, cfg.model.doc_max_len))
        self.pairs = bench.train_pairs

    def prepare(self, idx: list[int]):
        return self.peer.features([self.pairs[i].query for i in idx], [self.pairs[i].positive for i in idx])

    def holds(self) -> tuple[list, list]:
        return [self.peer.model], [self.peer.opt]

    def __call__(self, features) -> None:
        self.peer.step(features)


def make_step(bench: Bench, name: str, runs: dict = RUNS):
    kind, batch, spec, _ = runs[name]
    return OursStep(bench, spec, batch) if kind == "ours" else PeerStep(bench, kind, spec)


def measure(bench: Bench, names: list[str], rounds: int, warmup: int, runs: dict = RUNS,
            batches=pair_batches) -> dict[str, list[float]]:
    """Per run of ``names`` (in ``runs``, B6's table by default), the seconds of each timed step;
    ``batches(bench, seed, pairs, batch)`` gives a run's batches (B6's order by default)."""
    refuse_retired(names, equal_data.retired(runs), "measured")
    steps = {n: make_step(bench, n, runs) for n in names}
    orders = {n: batches(bench, 0, 18240, runs[n][1]) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        t_round = time.perf_counter()
        for n in names:  # interleaved: one step of each per round
            batch = steps[n].prepare(orders[n][r % len(orders[n])])
            t0 = time.perf_counter()
            steps[n](batch)
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
        left = (warmup + rounds - r - 1) * (time.perf_counter() - t_round)
        log(f"  round {r + 1}/{warmup + rounds}{' (warm-up)' if r < warmup else ''}: about {left / 60:.0f} min left")
    return times


def memory(bench: Bench, names: list[str], pairs: int = 256, runs: dict = RUNS, batches=pair_batches) -> list[dict]:
    """Per run, one at a time (``harness.step_memory``): MiB resident between steps, and the most
    MiB a step adds at its peak over the steps that train the run's first ``pairs`` pairs (the
    same pairs for every run, so a batch of 8 faces the same longest texts as one GradCache step
    of 256); a first step on the run's last batch allocates the optimizer state and gradients."""
    refuse_retired(names, equal_data.retired(runs), "measured")
    out = []
    for n in names:
        step, order = make_step(bench, n, runs), batches(bench, 0, 18240, runs[n][1])
        peaks = []
        for r, idx in enumerate([order[-1], *order[: max(1, pairs // runs[n][1])]]):
            batch = step.prepare(idx)
            peak = step_memory.peak_during(lambda: step(batch))
            if r and peak is not None:
                peaks.append(peak)
        out.append({"name": n, "batch": runs[n][1], "pairs": pairs, "resident_mib": step_memory.resident_mib(*step.holds()),
                    "step_peak_mib": max(peaks) if peaks else None, "step_peaks_mib": peaks})
        log(f"  {n}: resident {out[-1]['resident_mib']:,.0f} MiB, step peak "
            + (f"{out[-1]['step_peak_mib']:,.0f} MiB (the most of {len(peaks)} steps)" if peaks else "not measurable here"))
        del step
        gc.collect()
    return out


def summarise(times: dict[str, list[float]], ref: str, runs: dict = RUNS) -> list[dict]:
    """Per run: median s/step, s per 1,000 pairs, and the median over rounds of its per-pair cost
    over ``ref``'s (the ratio at equal data)."""
    rows = []
    for n, ts in times.items():
        b = runs[n][1]
        rows.append({"name": n, "batch": b, "s_per_step": statistics.median(ts), "s_per_1k_pairs": 1000 * statistics.median(ts) / b,
                     f"per_pair_vs_{ref}": per_pair_ratio(ts, b, times[ref], runs[ref][1]), "repeats": len(ts), "times": ts})
    return rows


def per_pair_ratio(times_a: list[float], batch_a: int, times_b: list[float], batch_b: int) -> float:
    """The median over rounds of a's seconds per pair over b's (each round timed both side by side)."""
    return statistics.median((ta / batch_a) / (tb / batch_b) for ta, tb in zip(times_a, times_b))


def table_lines(cost: dict) -> list[str]:
    """A ``summarise``d cost (with ``ref``, ``rounds``, ``threads``, ``rows``) as Markdown lines."""
    ref = cost["ref"]
    rows = [[r["name"], r["batch"], f"{r['s_per_step']:.2f}", f"{r['s_per_1k_pairs']:.1f}", f"{r[f'per_pair_vs_{ref}']:.2f}",
             r["repeats"]] for r in cost["rows"]]
    return [f"One step of each run in turn, {cost['rounds']} timed rounds after a warm-up, {cost['threads']} thread(s), "
            "real batches, tokenisation not timed; a run's queues, if it has any, pre-filled to a B6 run's mean fill. At equal data, training "
            "seconds are in the ratio of the per-pair costs.", "",
            md_table(["run", "batch", "s/step (median)", "s per 1,000 pairs", f"per pair vs {ref} (median of rounds)",
                      "rounds"], rows)]
