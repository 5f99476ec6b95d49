"""Index scale: FAISS flat vs IVF vs IVF-PQ on synthetic corpora of 1M and 10M x 384 vectors.

    python -m benchmarks.index_scale                      # 1M and 10M (about 1 h on one busy core)
    python -m benchmarks.index_scale --sizes 1000000      # 1M only
    python -m benchmarks.index_scale --quick              # 50k, a smoke check (results *_quick.*)
    python -m benchmarks.index_scale --report             # only the report, from the run cache

Per corpus size and index: build time (train + add), search time per query (all queries in one
call), index bytes (FAISS's serialized size), peak RSS of the process that built and searched it,
and recall@10 against exact search (|approx top-10 & exact top-10| / 10, mean over queries), for
several ``nprobe``. FAISS runs on one thread (``faiss.omp_set_num_threads(1)``) so numbers are
stable on a shared machine; divide times by the cores a real job has.

Vectors: a seeded Gaussian mixture, normalized (embedding models normalize): ``--clusters``
centers (unit, lognormal weights, so cells are unequal), a shared 64-dimensional subspace of
within-cluster variation and isotropic noise (cosine to the center about 0.8). Queries are fresh
draws of the same mixture. The corpus is generated chunk by chunk into a ``.npy`` file under
``--work-dir`` (default ``$MOCO_RETRIEVAL_CACHE/bench/index_scale``; 15 GB at 10M), so no process
holds all of it; exact top-10 is computed chunk by chunk. Each measurement runs in its own child
process (its peak RSS is the index's, not an earlier one's) and reads the corpus with plain reads,
not a memory map, so the RSS is what the index build holds. Finished measurements are appended to
``results/index_scale_runs.jsonl`` (committed): a later run resumes; ``--deadline HH:MM`` (UTC)
skips measurements not started by then and the report lists them as cut.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import cli  # (the harness loads no torch: a measuring child's RSS stays its own)
from benchmarks.harness.cli import RESULTS
from benchmarks.harness.runs import append_jsonl, md_table, past_deadline, read_jsonl, write_results

NAME = "index_scale"
DEFAULT_NLIST = {1_000_000: 1024, 10_000_000: 4096}  # about sqrt(n) to 1.3 sqrt(n); other sizes: 1024
DIM = 384
SUBSPACE = 64
SUPER_CLUSTERS = 32
RERANK = 100  # IVF-PQ candidates re-scored exactly from the vectors on disk
CHUNK = 100_000
GENERATOR = "gmm2-v1"  # bump when the generator changes: cached vectors and runs are keyed by it


def log(msg: str) -> None:
    # stderr: a child's stdout carries its result line
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory now (VmRSS) or its peak (VmHWM: reset by exec, unlike
    ru_maxrss, which a child inherits from the process that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


# ----------------------------------------------------------------------------------- vectors


def _mixture(seed: int, clusters: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, 0])
    # two levels, so neighbouring clusters overlap (cosine ~0.6 between siblings' centers)
    parents = rng.standard_normal((SUPER_CLUSTERS, d)).astype(np.float32)
    parents /= np.linalg.norm(parents, axis=1, keepdims=True)
    noise = rng.standard_normal((clusters, d)).astype(np.float32)
    centers = 0.8 * parents[rng.integers(SUPER_CLUSTERS, size=clusters)] + 0.6 * noise / np.linalg.norm(noise, axis=1, keepdims=True)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    weights = np.exp(rng.standard_normal(clusters))
    basis, _ = np.linalg.qr(rng.standard_normal((d, SUBSPACE)))
    return centers, weights / weights.sum(), basis.T.astype(np.float32)


def draw(seed: int, stream: int, chunk: int, rows: int, clusters: int, d: int = DIM) -> np.ndarray:
    """Rows ``[rows, d]`` of chunk ``chunk`` of ``stream`` (0: corpus, 1: queries): the same for
    the same arguments, whatever was drawn before."""
    centers, weights, basis = _mixture(seed, clusters, d)
    rng = np.random.default_rng([seed, 1 + stream, chunk])
    label = rng.choice(clusters, size=rows, p=weights)
    x = centers[label]
    x += (0.6 / np.sqrt(SUBSPACE)) * rng.standard_normal((rows, SUBSPACE), dtype=np.float32) @ basis
    x += (0.4 / np.sqrt(d)) * rng.standard_normal((rows, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


class VectorFile:
    """The ``[n, d]`` float32 rows of a ``.npy`` file, read with plain reads (no memory map) in
    slices or sorted row lists: what ``build_index`` needs of an array."""

    def __init__(self, path: Path):
        header = np.load(path, mmap_mode="r")  # only for the header: rows are read below, not mapped
        shape, dtype, self.offset = header.shape, header.dtype, header.offset
        del header
        assert dtype == np.float32 and len(shape) == 2, (path, shape, dtype)
        self.path, self.shape, self.ndim = path, tuple(shape), 2
        self.row_bytes = shape[1] * 4

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        with open(self.path, "rb") as f:
            if isinstance(key, slice):
                start, stop, _ = key.indices(self.shape[0])
                f.seek(self.offset + start * self.row_bytes)
                return np.fromfile(f, np.float32, (stop - start) * self.shape[1]).reshape(-1, self.shape[1])
            out = np.empty((len(key), self.shape[1]), np.float32)
            for j, row in enumerate(np.asarray(key)):
                f.seek(self.offset + int(row) * self.row_bytes)
                out[j] = np.fromfile(f, np.float32, self.shape[1])
            return out


def corpus_file(work: Path, n: int, seed: int, clusters: int) -> Path:
    """The corpus of ``n`` rows as a ``.npy`` file, generated chunk by chunk on first use."""
    path = work / f"corpus_{GENERATOR}_n{n}_d{DIM}_k{clusters}_s{seed}.npy"
    if path.is_file():
        return path
    work.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial.npy")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, DIM))
    t0 = time.perf_counter()
    for c, start in enumerate(range(0, n, CHUNK)):
        rows = min(CHUNK, n - start)
        out[start : start + rows] = draw(seed, 0, c, rows, clusters)
        if c % 10 == 9:
            out.flush()
            log(f"  generated {start + rows:,}/{n:,} ({time.perf_counter() - t0:.0f}s)")
    out.flush()
    del out
    os.replace(tmp, path)
    return path


def exact_top10(vectors: VectorFile, queries: np.ndarray, k: int = 10) -> tuple[np.ndarray, float]:
    """Exact top-k indices by inner product, chunk by chunk: ``(indices [q, k], seconds)``."""
    t0 = time.perf_counter()
    best_s = np.full((len(queries), k), -np.inf, np.float32)
    best_i = np.full((len(queries), k), -1, np.int64)
    for start in range(0, len(vectors), CHUNK):
        s = queries @ vectors[start : start + CHUNK].T
        top = np.argpartition(-s, k - 1, axis=1)[:, :k] if s.shape[1] > k else np.tile(np.arange(s.shape[1]), (len(s), 1))
        cand_s = np.concatenate([best_s, np.take_along_axis(s, top, 1)], axis=1)
        cand_i = np.concatenate([best_i, top + start], axis=1)
        keep = np.argsort(-cand_s, axis=1, kind="stable")[:, :k]
        best_s, best_i = np.take_along_axis(cand_s, keep, 1), np.take_along_axis(cand_i, keep, 1)
    return best_i, time.perf_counter() - t0


def recall_at_10(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(a[:10]) & set(e[:10])) / 10 for a, e in zip(found.tolist(), exact.tolist())]))


# ----------------------------------------------------------------------------------- one measurement


def measure(spec: dict) -> dict:
    """Build one index over the corpus file, search the queries at each nprobe, score against the
    exact top-10 (all in this process; its peak RSS is reported)."""
    import faiss

    from moco_retrieval.evaluation.index import build_index, rerank_exact, search

    faiss.omp_set_num_threads(1)
    rss_before = rss_mb()  # the interpreter, numpy, faiss and the package's imports (torch among them)
    vectors = VectorFile(Path(spec["corpus"]))
    queries = np.load(spec["queries"])
    exact = np.load(spec["exact"])
    t0 = time.perf_counter()
    index = build_index(vectors, spec["index"], nlist=spec.get("nlist", 1), nprobe=1, pq_m=spec.get("pq_m", 48))
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        faiss.write_index(index, os.path.join(tmp, "x.faiss"))
        index_bytes = os.path.getsize(os.path.join(tmp, "x.faiss"))
    points = []
    for nprobe in spec.get("nprobes", [1]):
        if spec["index"] != "flat":
            faiss.extract_index_ivf(index).nprobe = nprobe
        t0 = time.perf_counter()
        _, found = search(index, queries, 10)
        secs = time.perf_counter() - t0
        points.append({"nprobe": nprobe if spec["index"] != "flat" else None, "rerank": None,
                       "search_ms_per_query": 1000 * secs / len(queries), "recall@10": recall_at_10(found, exact)})
        if spec["index"] == "ivfpq":
            t0 = time.perf_counter()
            _, cand = search(index, queries, RERANK)
            _, found = rerank_exact(queries, cand, vectors, 10)
            secs = time.perf_counter() - t0
            points.append({"nprobe": nprobe, "rerank": RERANK, "search_ms_per_query": 1000 * secs / len(queries),
                           "recall@10": recall_at_10(found, exact)})
        for p in points[-2 if spec["index"] == "ivfpq" else -1 :]:
            log(f"    {spec['index']} nprobe {nprobe} rerank {p['rerank']}: recall@10 {p['recall@10']:.3f}, "
                f"{p['search_ms_per_query']:.2f} ms/query")
    return {"build_s": build_s, "index_bytes": index_bytes, "rss_before_build_mb": rss_before,
            "peak_rss_mb": rss_mb("VmHWM"), "points": points}


def run_child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.index_scale", "--measure", json.dumps(spec)], stdout=subprocess.PIPE,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


# ----------------------------------------------------------------------------------- plan


def plan(n: int, nlist: int | None = None) -> list[dict]:
    """The measurements at corpus size ``n``: flat where its 4*d bytes per document fit in
    memory next to the rest (<= 2M here), IVF-flat at 1M, IVF-PQ (pq_m=48: 48 bytes per document)."""
    nprobes = [1, 4, 16, 32, 64, 128]
    out = []
    if n <= 2_000_000:
        out.append({"index": "flat"})
    nlist = nlist or DEFAULT_NLIST.get(n, 1024)
    if n <= 2_000_000:
        out.append({"index": "ivf", "nlist": nlist, "nprobes": nprobes})
    out.append({"index": "ivfpq", "nlist": nlist, "pq_m": 48, "nprobes": nprobes})
    return out


def spec_key(n: int, clusters: int, seed: int, queries: int, spec: dict) -> str:
    params = ",".join(f"{k}={spec[k]}" for k in ("nlist", "pq_m") if k in spec)
    return f"{GENERATOR}|n={n}|d={DIM}|k={clusters}|seed={seed}|q={queries}|{spec['index']}|{params}"


def run_size(n: int, args, cache: Path, done: dict, cut: list[str]) -> None:
    specs = [(spec_key(n, args.clusters, args.seed, args.queries, s), s) for s in plan(n, args.nlist)]
    todo = [(k, s) for k, s in specs if k not in done]
    exact_key = f"{GENERATOR}|n={n}|d={DIM}|k={args.clusters}|seed={args.seed}|q={args.queries}|exact"
    if not todo and exact_key in done:
        return
    if past_deadline(args.deadline):
        cut.extend(f"n={n:,} {s['index']}" for _, s in todo)
        return
    log(f"n={n:,}: corpus")
    t0 = time.perf_counter()
    corpus = corpus_file(args.work_dir, n, args.seed, args.clusters)
    gen_s = time.perf_counter() - t0
    queries = draw(args.seed, 1, 0, args.queries, args.clusters)
    stem = corpus.name.replace("corpus_", "").removesuffix(".npy") + f"_q{args.queries}"
    qpath, epath = args.work_dir / f"queries_{stem}.npy", args.work_dir / f"exact_{stem}.npy"
    if exact_key in done and epath.is_file() and qpath.is_file() and np.array_equal(np.load(qpath), queries):
        exact = np.load(epath)  # the ground truth of these queries over this corpus, from an earlier run
    else:
        log(f"n={n:,}: exact top-10 of {args.queries} queries, chunk by chunk")
        exact, exact_s = exact_top10(VectorFile(corpus), queries)
        np.save(qpath, queries)
        np.save(epath, exact)
    if exact_key not in done:
        rec = {"key": exact_key, "n": n, "index": "exact (chunked numpy)", "search_ms_per_query": 1000 * exact_s / args.queries,
               "generate_s": gen_s, "raw_bytes": n * DIM * 4}
        append_jsonl(cache, rec)
        done[exact_key] = rec
    for key, spec in todo:
        if past_deadline(args.deadline):
            cut.append(f"n={n:,} {spec['index']}")
            continue
        log(f"n={n:,}: {spec['index']} {spec}")
        res = run_child({**spec, "corpus": str(corpus), "queries": str(qpath), "exact": str(epath)})
        rec = {"key": key, "n": n, **spec, **res}
        append_jsonl(cache, rec)
        done[key] = rec
        log(f"  built in {res['build_s']:.1f}s, {res['index_bytes'] / 2**20:.0f} MiB, peak RSS {res['peak_rss_mb']:.0f} MB")


# ----------------------------------------------------------------------------------- report


def report(records: list[dict], args, out_dir: Path, prefix: str, cut: list[str]) -> None:
    rows = []
    for r in sorted(records, key=lambda r: (r["n"], r["index"])):
        if r["index"].startswith("exact"):
            rows.append([f"{r['n']:,}", "exact, chunked numpy (the ground truth)", "-", "-",
                         f"{r['raw_bytes'] / 2**20:,.0f} (raw vectors, on disk)", "-", f"{r['search_ms_per_query']:.1f}", "1.000"])
            continue
        params = ", ".join(f"{k}={r[k]}" for k in ("nlist", "pq_m") if k in r)
        for p in r["points"]:
            name = f"{r['index']} {params}".strip() + (f" + exact re-rank of top {p['rerank']}" if p.get("rerank") else "")
            rows.append([f"{r['n']:,}", name, f"{r['build_s']:.1f}",
                         p["nprobe"] if p["nprobe"] is not None else "-", f"{r['index_bytes'] / 2**20:,.0f}",
                         f"{r['peak_rss_mb']:,.0f} ({r['rss_before_build_mb']:,.0f})", f"{p['search_ms_per_query']:.2f}",
                         f"{p['recall@10']:.3f}"])
    md = [
        "# Index scale: flat, IVF and IVF-PQ at 1M and 10M x 384",
        "",
        f"`python -m benchmarks.index_scale` ({time.strftime('%Y-%m-%d', time.gmtime())}). One FAISS thread on a "
        "shared 2-core CPU; synthetic normalized Gaussian-mixture vectors "
        f"({args.clusters} clusters, {SUBSPACE}-d within-cluster subspace + noise; generator `{GENERATOR}`, seed {args.seed}); "
        f"{args.queries} queries from the same mixture; recall@10 = overlap of the top-10 with the exact top-10. "
        "Build = train + add (seconds); search = ms per query, all queries in one call; index MiB = FAISS's "
        "serialized size; peak RSS = the measuring process (corpus read in 100k-row chunks, never whole), in "
        "parentheses its RSS before the build (Python, numpy, FAISS and the package's imports, torch among them).",
        "",
        md_table(["documents", "index", "build s", "nprobe", "index MiB", "peak RSS MB (before build)", "search ms/query", "recall@10"], rows),
        "",
    ]
    if cut:
        md += ["**Cut (not measured):** " + "; ".join(cut), ""]
    md += [args.notes] if args.notes else []
    write_results(prefix, "\n".join(md), {"records": records, "cut": cut, "args": {
        "clusters": args.clusters, "seed": args.seed, "queries": args.queries, "generator": GENERATOR, "dim": DIM}},
        out_dir=out_dir)


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child process: one measurement
    ap.add_argument("--quick", action="store_true", help="50,000 documents, 100 queries (results index_scale_quick.*)")
    ap.add_argument("--sizes", default=None, help="comma-separated corpus sizes (default 1000000,10000000)")
    ap.add_argument("--queries", type=int, default=None, help="queries (default 500; quick 100)")
    ap.add_argument("--nlist", type=int, default=None, help=f"IVF cells (default {DEFAULT_NLIST}, else 1024)")
    ap.add_argument("--clusters", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", type=Path, default=None, help="generated corpora (default $MOCO_RETRIEVAL_CACHE/bench/index_scale)")
    cli.add_deadline(ap, "measurements")
    cli.add_report(ap, "only write the report from the run cache")
    ap.add_argument("--notes", default="", help="a paragraph appended to the report (what was cut and why)")
    cli.add_out(ap, RESULTS)  # no --threads: FAISS runs on one; no data locations: the vectors are synthetic
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))))
        return 0
    sizes = [int(s) for s in (args.sizes or ("50000" if args.quick else "1000000,10000000")).split(",")]
    args.queries = args.queries or (100 if args.quick else 500)
    args.work_dir = args.work_dir or cli.bench_cache(NAME)
    prefix = f"{NAME}_quick" if args.quick else NAME
    cache = args.out / f"{prefix}_runs.jsonl"
    done = {r["key"]: r for r in read_jsonl(cache)}
    cut: list[str] = []
    if not args.report:
        for n in sizes:
            run_size(n, args, cache, done, cut)
    records = [r for r in done.values() if f"|k={args.clusters}|seed={args.seed}|q={args.queries}|" in r["key"]]
    report(records, args, args.out, prefix, cut)
    log(f"wrote {args.out / prefix}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
