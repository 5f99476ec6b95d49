"""Training-step time with an empty queue (K = 0) and a full 65,536-key queue, side by side.

One step (``harness.steps.OurStep``, the module's order) = query forward + EMA key forward + MoCo
loss + backward + enqueue + AdamW step + EMA update, on random token batches (the text does not matter for timing). The two settings are
interleaved repeat by repeat so machine noise hits both alike; medians are reported.

    python -m benchmarks.core_step_time [--quick] [--models tiny minilm] [--batch 32] [--out DIR]
Writes core_step_time.{md,json} to --out (default benchmarks/results).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import cli
from benchmarks.harness.steps import OurStep

from moco_retrieval.config import ModelConfig, OptimConfig
from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.training.module import RetrievalModule
from moco_retrieval.model.tiny import build_tiny_bert


def make(model: str, K: int, tiny_dir: str) -> RetrievalModule:
    mcfg = ModelConfig(backbone="tiny", path=tiny_dir) if model == "tiny" else ModelConfig(backbone="minilm")
    m = RetrievalModule(mcfg, MoCoConfig(queue_size=max(K, 1)), OptimConfig())
    if K:  # fill the queue: every slot takes part in the loss
        keys = torch.nn.functional.normalize(torch.randn(K, m.encoder.dim), dim=1)
        m.objective.docs.queue.enqueue(keys, torch.arange(K) + 10**9, torch.full((K,), -1), step=0)
    return m.train()


def batch(m: RetrievalModule, B: int, q_len: int, d_len: int, g: torch.Generator) -> dict:
    vocab = m.encoder.tokenizer.vocab_size

    def side(n, L):
        return {"texts": None, "input_ids": torch.randint(1000 % vocab, vocab, (n, L), generator=g),
                "attention_mask": torch.ones(n, L, dtype=torch.long)}

    return {"query": side(B, q_len), "doc": side(B, d_len), "doc_id": torch.randint(0, 10**6, (B,), generator=g),
            "group": torch.full((B,), -1)}


def timed(step: OurStep, b: dict) -> float:
    t0 = time.perf_counter()
    step(b)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = cli.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--models", nargs="+", default=["tiny", "minilm"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--K", type=int, default=65536)
    cli.add_out(ap)
    cli.add_threads(ap)  # no data locations: the batches are random tokens
    args = ap.parse_args(argv)
    cli.apply(args)
    out = cli.out_dir(args)
    repeats, warmup = (5, 1) if args.quick else (15, 3)
    tiny_dir = str(build_tiny_bert(Path(tempfile.mkdtemp()) / "tiny"))
    rows = []
    for model in args.models:
        g = torch.Generator().manual_seed(0)
        mods = {K: make(model, K, tiny_dir) for K in (0, args.K)}
        # no clipping, as before; the momentum is MoCoConfig's constant 0.999
        steps = {K: OurStep(m, torch.optim.AdamW([p for p in m.encoder.parameters() if p.requires_grad], lr=1e-5))
                 for K, m in mods.items()}
        times = {K: [] for K in mods}
        for r in range(warmup + repeats):
            b = batch(mods[0], args.batch, 32, 128, g)
            for K in mods:  # interleaved, same batch
                if K == 0:  # the K = 0 module's queue stays empty
                    mods[K].objective.docs.reset()
                t = timed(steps[K], b)
                if r >= warmup:
                    times[K].append(t)
        med = {K: statistics.median(v) for K, v in times.items()}
        rows.append({"model": model, "batch": args.batch, "K": args.K, "step_s_K0": med[0], "step_s_K": med[args.K],
                     "ratio": med[args.K] / med[0], "repeats": repeats, "threads": torch.get_num_threads()})
        print(rows[-1], flush=True)
    (out / "core_step_time.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["# Training-step time, empty queue vs full queue (CPU)", "",
             f"Batch {args.batch}, query length 32, document length 128 tokens, median of {repeats} interleaved repeats "
             f"({rows[0]['threads']} torch threads).", "",
             "| model | K = 0 (s/step) | K = 65,536 (s/step) | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['step_s_K0']:.4f} | {r['step_s_K']:.4f} | {r['ratio']:.3f} |" for r in rows]
    (out / "core_step_time.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
