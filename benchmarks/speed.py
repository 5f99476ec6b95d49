"""B5: speed and memory.

Sections (each runs in its own child process, so its peak RSS is its own):

* ``step``: training-step time of all-MiniLM-L6-v2 (``+experiment=queue65k objective=moco``) at batch 64 for a
  MoCo queue of K = 0, 4,096, 16,384, 65,536, 262,144 keys, side by side in one process: one
  module per K (same weights, same real Debian batches), queues pre-filled to K, measured in
  interleaved rounds; median step time per K and its ratio to K = 0 (K = 0: the same MoCo step,
  EMA key encoder and batch negatives, with the queue kept empty). A step = query forward, key
  encoder forward, objective, backward, enqueue, clip, AdamW, EMA update (``harness.steps.OurStep``,
  the module's order); without Lightning's
  per-step overhead (which would only make the ratios smaller). Target: <= 1.10 at K = 65,536.
* ``queue``: our ``NegativeQueue`` (logits + enqueue of keys, ids, groups, steps) against lightly's
  ``MemoryBankModule`` (forward with update=True, then the logits; imported alone, as lightly's
  package ``__init__`` needs torchvision) and a naive ``torch.cat`` queue, at the same K, d, B.
* ``faiss``: evaluation search at 100,000 documents (d 384, unit vectors, 3,283 queries, top 100):
  ``IndexFlatIP`` (our evaluation path) against torch brute force (chunked matmul + topk).
* ``memory``: the peak RSS of each section and of the other benchmarks (read from their JSON).

Writes benchmarks/results/speed.{md,json} and speed_step.png, speed_queue.png.
``--quick``: fewer K, rounds and steps, 20,000 documents.

    python -m benchmarks.speed [--quick] [--device auto|cpu|cuda] [--sections step,queue,faiss]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from benchmarks.harness import cli
from benchmarks.harness.cli import RESULTS
from benchmarks.harness.report import environment, figure, log, peak_rss_mb
from benchmarks.harness.runs import md_table, write_results
from benchmarks.harness.steps import OurStep
from benchmarks.harness.training import Bench, compose_cfg

import torch

from moco_retrieval.model.devices import pick_device

NAME = "speed"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ step time


def section_step(args) -> dict:
    from moco_retrieval.training.module import RetrievalModule

    dev = pick_device(args.device)
    ks = [int(k) for k in args.ks.split(",")]
    batch = args.batch_size
    bench = Bench()
    job = ["trainer=cpu", "logger=none", "data=debian", "+experiment=queue65k", "objective=moco", f"data.batch_size={batch}"]
    cfg0 = compose_cfg(job)
    dm = bench.datamodule(cfg0)
    modules, steps = {}, {}
    for k in ks:
        cfg = compose_cfg(job + [f"objective.queue_size={max(k, batch)}"])
        torch.manual_seed(0)
        m = RetrievalModule.from_config(cfg).to(dev)
        m.train()
        q = m.objective.docs.queue
        if k > 0:  # steady state: a full queue of unit keys with ids that never match
            g = torch.Generator().manual_seed(k)
            for s in range(0, k, 16384):
                n = min(16384, k - s)
                keys = torch.nn.functional.normalize(torch.randn(n, q.dim, generator=g), dim=1).to(dev)
                ids = torch.randint(2**40, 2**62, (n,), generator=g).to(dev)
                q.enqueue(keys, ids, torch.full((n,), -1, device=dev), 0, gather=False)
            assert q.fill == k
        params = [p for p in m.encoder.parameters() if p.requires_grad]
        modules[k] = m
        steps[k] = OurStep(m, torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01), clip=1.0,
                           amp=torch.bfloat16 if dev.type == "cuda" else None)
    dm.tokenize = modules[ks[0]].encoder.tokenize
    loader = iter(dm.train_dataloader())
    batches = [next(loader) for _ in range(args.batches)]

    def to_dev(b):
        if isinstance(b, dict):
            return {k: to_dev(v) for k, v in b.items()}
        return b.to(dev) if torch.is_tensor(b) else b

    batches = [to_dev(b) for b in batches]
    amp = dev.type == "cuda"

    def one_step(k: int, b: dict) -> float:
        sync(dev)
        t = time.perf_counter()
        steps[k](b)  # the module's order; its momentum is the config's constant 0.999
        if k == 0:  # the queue stays empty
            modules[k].objective.docs.reset()
        sync(dev)
        return time.perf_counter() - t

    for k in ks:  # warm-up
        for i in range(args.warmup):
            one_step(k, batches[i % len(batches)])
    times = {k: [] for k in ks}
    rounds = []
    for r in range(args.rounds):
        order = ks[r % len(ks):] + ks[: r % len(ks)]  # rotate, so no K always runs first
        this = {}
        for k in order:
            ts = [one_step(k, batches[(r * args.steps + i) % len(batches)]) for i in range(args.steps)]
            times[k] += ts
            this[k] = statistics.median(ts)
        rounds.append(this)
        log(f"step round {r}: " + ", ".join(f"K={k}: {this[k]:.3f}s" for k in ks))
    base = ks[0]
    out = {"device": str(dev), "batch_size": batch, "ks": ks, "rounds": rounds, "times": {str(k): v for k, v in times.items()},
           "median_s": {str(k): statistics.median(v) for k, v in times.items()},
           "threads": torch.get_num_threads(), "amp_bf16": amp}
    out["ratio_vs_k0"] = {str(k): out["median_s"][str(k)] / out["median_s"][str(base)] for k in ks}
    out["ratio_paired_median"] = {str(k): statistics.median(rd[k] / rd[base] for rd in rounds) for k in ks}
    if dev.type == "cuda":
        out["cuda_max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


# ------------------------------------------------------------------------------------ queues


def import_lightly_memory_bank():
    """lightly's MemoryBankModule without importing lightly.models (which needs torchvision)."""
    spec = importlib.util.find_spec("lightly")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("lightly is not installed (pip install --no-deps lightly)")
    root = Path(list(spec.submodule_search_locations)[0])
    import lightly.utils.dist as ldist  # plain torch

    stub_models = types.ModuleType("lightly.models")
    stub_models.__path__ = [str(root / "models")]
    stub_utils = types.ModuleType("lightly.models.utils")

    def concat_all_gather(x):  # only used with gather_distributed=True under DDP
        raise RuntimeError("not used in this benchmark")

    stub_utils.concat_all_gather = concat_all_gather
    stub_models.utils = stub_utils
    saved = {k: sys.modules.get(k) for k in ("lightly.models", "lightly.models.utils")}
    sys.modules["lightly.models"], sys.modules["lightly.models.utils"] = stub_models, stub_utils
    try:
        path = root / "models" / "modules" / "memory_bank.py"
        mspec = importlib.util.spec_from_file_location("lightly_memory_bank_only", path)
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    del ldist
    import lightly

    return mod.MemoryBankModule, getattr(lightly, "__version__", "?")


def section_queue(args) -> dict:
    from moco_retrieval.objectives.memory import NegativeQueue

    dev = pick_device(args.device)
    ks = [int(k) for k in args.queue_ks.split(",")]
    B, d = args.batch_size, 384
    try:
        MemoryBank, lightly_version = import_lightly_memory_bank()
        lightly_note = f"lightly {lightly_version}: MemoryBankModule imported alone (its package __init__ needs torchvision)"
    except Exception as e:  # noqa: BLE001
        MemoryBank, lightly_note = None, f"lightly unavailable: {type(e).__name__}: {e}"
    log(lightly_note)
    g = torch.Generator().manual_seed(0)
    qs = [torch.nn.functional.normalize(torch.randn(B, d, generator=g), dim=1).to(dev) for _ in range(4)]
    ids = torch.arange(B, device=dev)
    groups = torch.full((B,), -1, device=dev)
    res = {}
    for K in ks:
        ours = NegativeQueue(K, d).to(dev)
        bank0 = torch.nn.functional.normalize(torch.randn(K, d, generator=g), dim=1).to(dev)
        ours.enqueue(bank0, torch.arange(K, device=dev) + 10**9, torch.full((K,), -1, device=dev), 0, gather=False)
        impls = {}

        def ours_step(i, q=ours):
            logits = q.logits(qs[i % 4])
            q.enqueue(qs[(i + 1) % 4], ids, groups, i, gather=False)
            return logits

        impls["ours (NegativeQueue)"] = ours_step
        if MemoryBank is not None:
            lb = MemoryBank(size=(K, d), feature_dim_first=True).to(dev)
            lb.bank.copy_(bank0)

            def lightly_step(i, lb=lb):
                _, bank = lb(qs[(i + 1) % 4], update=True)
                return qs[i % 4] @ bank

            impls["lightly MemoryBankModule"] = lightly_step
        naive = {"q": bank0.clone()}

        def cat_step(i, st=naive):
            logits = qs[i % 4] @ st["q"].T
            st["q"] = torch.cat([qs[(i + 1) % 4], st["q"][:-B]])
            return logits

        impls["naive torch.cat queue"] = cat_step
        times = {n: [] for n in impls}
        for n, f in impls.items():
            for i in range(3):
                f(i)
        for r in range(args.queue_rounds):
            for n, f in impls.items():
                sync(dev)
                t = time.perf_counter()
                for i in range(args.queue_iters):
                    f(i)
                sync(dev)
                times[n].append((time.perf_counter() - t) / args.queue_iters)
        res[str(K)] = {n: {"median_ms": 1000 * statistics.median(v), "all_ms": [1000 * x for x in v]} for n, v in times.items()}
        log(f"queue K={K}: " + ", ".join(f"{n} {res[str(K)][n]['median_ms']:.2f} ms" for n in impls))
    return {"device": str(dev), "B": B, "d": d, "ks": ks, "results": res, "lightly": lightly_note,
            "threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------ faiss


def section_faiss(args) -> dict:
    import numpy as np

    from moco_retrieval.config import EvalConfig
    from moco_retrieval.evaluation.index import build_index_from_config, search

    n, d, nq, k = args.docs, 384, 3283, 100
    rng = np.random.default_rng(0)
    docs = rng.standard_normal((n, d), dtype=np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    queries = docs[rng.choice(n, nq, replace=False)] + 0.1 * rng.standard_normal((nq, d), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    cfg = EvalConfig(index="flat", top_k=k)

    def run_faiss():
        t = time.perf_counter()
        idx = build_index_from_config(docs, cfg)
        t_build = time.perf_counter() - t
        s, i = search(idx, queries, k)
        return t_build, time.perf_counter() - t, i

    td, tq = torch.from_numpy(docs), torch.from_numpy(queries)

    def run_torch(chunk=1024):
        t = time.perf_counter()
        out = []
        for s in range(0, nq, chunk):
            sc = tq[s: s + chunk] @ td.T
            out.append(torch.topk(sc, k, dim=1).indices)
        return time.perf_counter() - t, torch.cat(out).numpy()

    f_times, f_build, t_times = [], [], []
    for _ in range(args.faiss_rounds):
        b, tot, fi = run_faiss()
        f_times.append(tot)
        f_build.append(b)
        tt, ti = run_torch()
        t_times.append(tt)
    agree = float(np.mean([len(set(a[:10]) & set(b[:10])) / 10 for a, b in zip(fi, ti)]))
    return {"docs": n, "dim": d, "queries": nq, "top_k": k, "faiss_flat_s": statistics.median(f_times),
            "faiss_build_s": statistics.median(f_build), "torch_bruteforce_s": statistics.median(t_times),
            "faiss_all_s": f_times, "torch_all_s": t_times, "top10_agreement": agree, "threads": torch.get_num_threads()}


SECTIONS = {"step": section_step, "queue": section_queue, "faiss": section_faiss}


# ------------------------------------------------------------------------------------ driver


def child(args) -> int:
    out = SECTIONS[args.section](args)
    out["peak_rss_mb"] = peak_rss_mb()
    Path(args.child_out).write_text(json.dumps(out))
    return 0


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--sections", default="step,queue,faiss")
    ap.add_argument("--ks", default=None, help="queue sizes of the step section (first is the baseline)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per K per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--queue-ks", default=None)
    ap.add_argument("--queue-rounds", type=int, default=7)
    ap.add_argument("--queue-iters", type=int, default=None)
    ap.add_argument("--docs", type=int, default=None)
    ap.add_argument("--faiss-rounds", type=int, default=3)
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    cli.add_common(ap)
    args = ap.parse_args(argv)
    cli.apply(args)
    q = args.quick
    args.ks = args.ks or ("0,4096,65536" if q else "0,4096,16384,65536,262144")
    args.rounds = args.rounds or (2 if q else 3)
    args.steps = args.steps or (2 if q else 3)
    args.queue_ks = args.queue_ks or ("4096,65536" if q else "4096,16384,65536,262144")
    args.queue_iters = args.queue_iters or (5 if q else 20)
    args.docs = args.docs or (20000 if q else 100000)
    if args.section:
        return child(args)

    t0 = time.time()
    prefix = NAME if not q else f"{NAME}_quick"
    out_dir = cli.out_dir(args)
    results = previous_sections(out_dir / f"{prefix}.json")  # sections not re-run now keep their last measurement
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    for section in [x for x in args.sections.split(",") if x]:
        results[section] = run_section(section, passthrough)
    memory = other_benchmarks_memory()
    data = {"benchmark": "B5 speed and memory", "mode": "quick" if q else "full", "sections": results,
            "other_benchmarks_peak_rss_mb": memory, "wall_s": time.time() - t0, "environment": environment()}
    write_results(prefix, render(data), data, out_dir)
    plots(data, out_dir, prefix)
    log(f"wrote {out_dir / (prefix + '.md')}")
    return 0


def previous_sections(path: Path) -> dict:
    try:
        return dict(json.loads(path.read_text()).get("sections", {})) if path.is_file() else {}
    except ValueError:
        return {}


def run_section(section: str, passthrough: list[str]) -> dict:
    """One section in a child process of its own (so its peak RSS is its own)."""
    out_file = Path(tempfile.gettempdir()) / f"mr-bench-speed-{section}-{os.getpid()}.json"
    cmd = [sys.executable, "-m", "benchmarks.speed", *passthrough, "--section", section, "--child-out", str(out_file)]
    log(f"section {section}")
    t = time.time()
    rc = subprocess.call(cmd)
    if rc != 0 or not out_file.is_file():
        log(f"section {section} failed ({rc})")
        return {"error": f"exit status {rc}"}
    res = json.loads(out_file.read_text())
    res["wall_s"] = time.time() - t
    res["measured_at_utc"] = time.strftime("%H:%M", time.gmtime())
    out_file.unlink()
    return res


def other_benchmarks_memory() -> dict:
    out = {}
    for name in ("batch_size", "temperature", "geometry", "peer"):
        p = RESULTS / f"{name}.json"
        if p.is_file():
            try:
                out[name] = json.loads(p.read_text()).get("peak_rss_mb")
            except (ValueError, OSError):
                pass
    return out


def render(data: dict) -> str:
    s = data["sections"]
    env = data["environment"]
    L = [f"# B5: speed and memory ({data['mode']})", "",
         f"torch {env['torch']}, {env['cpu_count']} CPU(s){', ' + env['cuda'] if env.get('cuda') else ''}. "
         "All timings are medians of interleaved repeats in one process per section; the CPU is shared with other "
         "jobs, so absolute numbers are indicative, the side-by-side ratios are the measurement.", ""]
    st = s.get("step", {})
    if "median_s" in st:
        L += [f"## Training step, all-MiniLM-L6-v2, batch {st['batch_size']} ({st['device']}, {st['threads']} threads"
              f"{', bf16 autocast' if st.get('amp_bf16') else ''})", ""]
        rows = []
        for k in st["ks"]:
            rows.append([f"{k:,}", f"{st['median_s'][str(k)]:.3f}", f"{st['ratio_vs_k0'][str(k)]:.3f}",
                         f"{st['ratio_paired_median'][str(k)]:.3f}", len(st["times"][str(k)])])
        L.append(md_table(["queue K", "median s/step", "ratio vs K=0", "ratio, median of per-round ratios", "timed steps"], rows))
        r65 = st["ratio_vs_k0"].get("65536")
        if r65 is not None:
            L += ["", f"Overhead at K = 65,536: **{r65:.3f}x** (target <= 1.10: {'met' if r65 <= 1.10 else 'not met'})."]
        L += ["", "K = 0 is the same MoCo step (EMA key encoder, batch negatives) with the queue kept empty. Queues are "
              "full (pre-filled) while timed. No Lightning overhead in these steps.", ""]
    elif "step" in s:
        L += ["## Training step", "", f"failed: {st.get('error')}", ""]
    qu = s.get("queue", {})
    if "results" in qu:
        names = list(next(iter(qu["results"].values())).keys())
        L += [f"## Queue: logits + enqueue, B = {qu['B']}, d = {qu['d']} ({qu['device']}, {qu['threads']} threads)", "",
              md_table(["K"] + [f"{n} ms" for n in names] + [f"{n} / ours" for n in names[1:]],
                       [[f"{int(k):,}"] + [f"{v[n]['median_ms']:.2f}" for n in names] +
                        [f"{v[n]['median_ms'] / v[names[0]]['median_ms']:.2f}" for n in names[1:]]
                        for k, v in qu["results"].items()]), "",
              f"{qu['lightly']}. lightly's forward clones the whole bank every call (K x d copy); ours scores the "
              "ring buffer in place and writes B rows (keys, ids, groups, steps); the naive queue re-concatenates K x d "
              "every step.", ""]
    fa = s.get("faiss", {})
    if "faiss_flat_s" in fa:
        L += [f"## Evaluation search at {fa['docs']:,} documents (d {fa['dim']}, {fa['queries']:,} queries, top {fa['top_k']})", "",
              md_table(["method", "median s (build + search)", "vs FAISS"],
                       [["FAISS IndexFlatIP (our eval path)", f"{fa['faiss_flat_s']:.3f} (build {fa['faiss_build_s']:.3f})", "1.00"],
                        ["torch brute force (matmul + topk, 1,024-query chunks)", f"{fa['torch_bruteforce_s']:.3f}",
                         f"{fa['torch_bruteforce_s'] / fa['faiss_flat_s']:.2f}"]]), "",
              f"Top-10 agreement between the two: {fa['top10_agreement']:.4f}.", ""]
    L += ["## Peak memory (max RSS)", ""]
    rows = [[f"B5 section {n}", f"{v.get('peak_rss_mb', float('nan')):.0f}"] for n, v in s.items() if "peak_rss_mb" in v]
    rows += [[f"{n}.py", f"{v:.0f}" if v else "n/a"] for n, v in data["other_benchmarks_peak_rss_mb"].items()]
    L.append(md_table(["benchmark", "peak RSS MB"], rows))
    L += ["", "![step time](speed_step.png)" if data["mode"] == "full" else "![step time](speed_quick_step.png)", ""]
    return "\n".join(L)


def plots(data: dict, out_dir: Path, prefix: str) -> None:
    st = data["sections"].get("step", {})
    if "median_s" in st:
        fig = figure(6.0, 3.8)
        ax = fig.subplots()
        ks = st["ks"]
        ax.bar([f"{k:,}" for k in ks], [st["ratio_vs_k0"][str(k)] for k in ks], color="#1f77b4")
        ax.axhline(1.10, color="#d62728", linestyle="--", label="target 1.10")
        ax.set_xlabel("queue size K")
        ax.set_ylabel("step time / step time at K = 0")
        ax.set_title(f"MiniLM training step, batch {st['batch_size']} ({st['device']})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(out_dir / f"{prefix}_step.png")
    qu = data["sections"].get("queue", {})
    if "results" in qu:
        fig = figure(6.0, 3.8)
        ax = fig.subplots()
        ks = [int(k) for k in qu["results"]]
        names = list(next(iter(qu["results"].values())).keys())
        for n in names:
            ax.plot(ks, [qu["results"][str(k)][n]["median_ms"] for k in ks], "o-", label=n)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("K")
        ax.set_ylabel("ms per logits + enqueue")
        ax.set_title(f"Queue cost, B = {qu['B']}, d = {qu['d']}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"{prefix}_queue.png")


if __name__ == "__main__":
    raise SystemExit(main())
