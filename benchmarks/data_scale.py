"""B10: training sets of millions of pairs: the converted store (data/convert.py, data/store.py) against
today's loader (every pair parsed into Python objects in every rank).

Synthetic pairs of realistic length (queries 8 words, documents 90 words, words of 2-9 letters; hard
negatives are other rows' documents, as mined negatives are), written as JSONL. Per size:

* conversion: ``python -m moco_retrieval.data prepare`` on one core (OMP_NUM_THREADS=1, nice): rows/s
  of the conversion itself (manifest), the command's wall time (with the content hash), the store's size;
* open: in a fresh process, the time to open the warm store (fingerprint memo, manifest, memory maps),
  to plan the sampler's first epoch, and the RSS those add;
* runs: ``torchrun --nproc_per_node=2 -m moco_retrieval.train`` (gloo, the tiny model of
  +experiment=smoke, data.num_workers=2): seconds from the command's start to rank 0's first training
  step (its ``step 1/`` progress line), and each rank's peak RSS and PSS (sampled every 0.25 s from
  /proc, the rank alone and with its DataLoader workers); cold (no store: rank 0 converts, rank 1
  waits) and warm, next to the same run on a 1k-pair file. ``before``: today's loader at the same
  size (the data module's load patched back to ``sources.load``, i.e. every pair a Python object).

* sampler (``--sampler-sizes``, alone): the training batch sampler on synthetic ids and groups
  memory-mapped from int64 files (each doc id on two rows, a third of the rows in groups of 4), rank 0
  of 2, batch 64, in a fresh process per size: the time to the first batch, to the next 1,000, the
  tracemalloc peak over those batches (a second sampler, the same batches) and the growth of the
  process's anonymous memory and RSS (RSS also counts the id/group pages read: page cache); the
  sampler of ``--sampler-before`` (a commit) at ``--sampler-before-sizes`` beside it. The files are
  deleted after each size. Written under the results' ``sampler`` key, the other sections kept.

    OMP_NUM_THREADS=1 nice -n 10 python -m benchmarks.data_scale --sizes 1000000 [--before 1000000]
        [--negatives 30 --neg-rows 100000] [--work /tmp/data_scale]
    OMP_NUM_THREADS=1 nice -n 10 python -m benchmarks.data_scale --sampler-sizes 1000000,10000000,100000000
        [--sampler-before 25b5201 --sampler-before-sizes 1000000,10000000]

``--prepare-workers 1,2 --prepare-size 2000000 [--prepare-repeats 2]`` only (B18, issue 48): the same
file prepared with each ``workers=N`` (data/parallel.py), a fresh cache each time, the settings
interleaved in each repeat; the conversion's own seconds (manifest: the parts and their join) and the
command's wall time (with the content hash, one process), the median of the repeats and the speed-up
over one process. Added to data_scale.json under ``prepare_workers``; the rest is kept.

``--stream-size 30000000 [--doc-words 40] [--loader-steps 60]`` only (B18): that many pairs and 1k,
each prepared into the store and into a stream (``workers=2``); per path, 2-rank runs to the first
step beside the 1k run (data memory per rank = the difference), and a run of ``--loader-steps`` steps
at batch 64 whose ranks record each batch's start and end (the loader's share of the step). Added
under ``stream_scale``; the rest is kept.
"""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from benchmarks.harness import cli
from benchmarks.harness.cli import ROOT
from benchmarks.harness.report import environment
from benchmarks.harness.runs import md_table, write_results

WORDS, QUERY_WORDS, DOC_WORDS = 20_000, 8, 90
STEP1 = re.compile(r"\bstep 1/\d+")
STEP2 = re.compile(r"\bstep 2/\d+")


# ------------------------------------------------------------------------------------------ data


def vocabulary(rng: np.random.Generator) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return np.array(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(WORDS)], dtype=object)


def texts(rng: np.random.Generator, vocab: np.ndarray, n: int, words: int) -> list[str]:
    idx = rng.integers(0, WORDS, size=(n, words))
    return [" ".join(row) for row in vocab[idx].tolist()]


def generate(path: Path, rows: int, negatives: int = 0, seed: int = 0, doc_words: int = DOC_WORDS) -> Path:
    """``rows`` synthetic pairs (each with ``negatives`` other rows' documents), written once."""
    if path.is_file():
        return path
    rng = np.random.default_rng(seed)
    vocab = vocabulary(rng)
    tmp = path.with_suffix(".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    chunk = 50_000
    with open(tmp, "w") as f:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            qs, ds = texts(rng, vocab, n, QUERY_WORDS), texts(rng, vocab, n, doc_words)
            for i in range(n):
                rec = {"query": qs[i], "positive": ds[i]}
                if negatives:
                    rec["negatives"] = [ds[j] for j in rng.integers(0, n, negatives) if j != i] or [ds[(i + 1) % n]]
                f.write(json.dumps(rec) + "\n")
    os.replace(tmp, path)
    return path


def write_eval(d: Path, n: int = 200) -> Path:
    if (d / "qrels" / "test.tsv").is_file():
        return d
    rng = np.random.default_rng(1)
    vocab = vocabulary(rng)
    docs, queries = texts(rng, vocab, n, DOC_WORDS), texts(rng, vocab, n, QUERY_WORDS)
    (d / "qrels").mkdir(parents=True, exist_ok=True)
    (d / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    (d / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": t}) + "\n" for i, t in enumerate(queries)))
    (d / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(n)))
    return d


def env(work: Path) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled",
                MOCO_RETRIEVAL_CACHE=str(work / "cache"), PYTHONPATH=str(ROOT))


# ------------------------------------------------------------------------------------ conversion


def du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def convert(file: Path, cache: Path, work: Path) -> dict:
    """``prepare`` in a fresh process; the conversion's own rows/s and the command's wall time."""
    t0 = time.monotonic()
    subprocess.run(["nice", "-n", "10", sys.executable, "-m", "moco_retrieval.data", "prepare", "data=jsonl",
                    f"data.train_path={file}", f"data.cache_dir={cache}"], check=True, env=env(work), capture_output=True)
    wall = time.monotonic() - t0
    stores = [p.parent for p in (cache / "pairs").glob("*/manifest.json")]
    m = json.loads((stores[0] / "manifest.json").read_text())
    return {"rows": m["rows"], "convert_s": m["converted_s"], "rows_per_s": m["rows_per_s"], "command_s": round(wall, 1),
            "input_mb": round(file.stat().st_size / 1e6, 1), "store_mb": round(du(stores[0]) / 1e6, 1)}


def prepare_workers(file: Path, workers: list[int], repeats: int, work: Path) -> dict:
    """``prepare workers=N`` of ``file`` for each N, ``repeats`` times interleaved (each from an empty
    cache, nice, one thread per process): rows/s, seconds and the speed-up over the first N, medians."""
    runs: dict[int, list[dict]] = {w: [] for w in workers}
    for r in range(repeats):
        for w in workers if r % 2 == 0 else workers[::-1]:
            cache = work / "stores" / f"workers{w}"
            subprocess.run(["rm", "-rf", str(cache)], check=True)
            t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(["nice", "-n", "10", sys.executable, "-m", "moco_retrieval.data", "prepare", "data=jsonl",
                            f"data.train_path={file}", f"data.cache_dir={cache}", f"workers={w}"],
                           check=True, env=env(work), capture_output=True)
            wall, cpu1 = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
            m = json.loads(next((cache / "pairs").glob("*/manifest.json")).read_text())
            runs[w].append({"convert_s": m["converted_s"], "rows_per_s": m["rows_per_s"], "command_s": round(wall, 1),
                            "cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1)})
            print(f"workers={w}", runs[w][-1], flush=True)
            subprocess.run(["rm", "-rf", str(cache)], check=True)
    med = {w: {k: float(np.median([x[k] for x in rs])) for k in ("convert_s", "rows_per_s", "command_s", "cpu_s")}
           for w, rs in runs.items()}
    base = med[workers[0]]
    return {"rows": m["rows"], "input_mb": round(file.stat().st_size / 1e6, 1), "repeats": repeats,
            "load_average": os.getloadavg(), "runs": {str(w): rs for w, rs in runs.items()},
            "median": {str(w): {**v, "speedup_convert": round(base["convert_s"] / v["convert_s"], 2),
                                "speedup_command": round(base["command_s"] / v["command_s"], 2)} for w, v in med.items()}}


def prepare_workers_report(p: dict) -> list[str]:
    return ["", "## Parallel preparation (prepare workers=N)", "",
            f"{p['rows']:,} synthetic pairs ({p['input_mb']:,} MB of JSONL), each setting from an empty cache, "
            f"interleaved, median of {p['repeats']}; one thread per process, nice 10. *convert s*: the conversion "
            "(manifest: the parts side by side and their join into one store); *command s*: the whole command, "
            "with the content hash and the imports; *CPU s*: user + system seconds of the command and its workers. "
            "The machine was shared with other jobs (load average "
            f"{', '.join(f'{x:.1f}' for x in p['load_average'])} at the end, on {p.get('cores', 2)} cores): CPU s "
            "over command s is the share of a core the command got; where another job holds one of the two cores, "
            "two workers share the other and the speed-up measures the machine, not the split.",
            "", md_table(["workers", "convert s", "rows/s", "speed-up", "command s", "speed-up (command)", "CPU s"],
                         [[w, f"{m['convert_s']:.1f}", f"{m['rows_per_s']:,.0f}", m["speedup_convert"],
                           f"{m['command_s']:.1f}", m["speedup_command"], m.get("cpu_s", "-")]
                          for w, m in p["median"].items()])]


OPEN_PROBE = r"""
import json, resource, sys, time
t0 = time.monotonic()
from moco_retrieval.config import DataConfig
from moco_retrieval.data.sampler import RetrievalBatchSampler
from moco_retrieval.data.sources import load_training_rows
def rss(): return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
r0, t1 = rss(), time.monotonic()
cfg = DataConfig(kind="jsonl", train_path=sys.argv[1], cache_dir=sys.argv[2], batch_size=64)
rows = load_training_rows(cfg).rows
ids, groups = rows.doc_ids, rows.groups
t2, r1 = time.monotonic(), rss()
s = RetrievalBatchSampler(ids, groups, 64, rank=0, world_size=2)
first = next(iter(s))
t3, r2 = time.monotonic(), rss()
from moco_retrieval.data.store import PairRowsDataset
rows.open()
t4, r3 = time.monotonic(), rss()
batch = PairRowsDataset(rows).__getitems__(first)
t5 = time.monotonic()
print(json.dumps({"open_s": round(t2 - t1, 3), "open_rss_mb": round(r1 - r0, 1), "sampler_plan_s": round(t3 - t2, 2),
                  "sampler_rss_mb": round(r2 - r1, 1), "table_open_s": round(t4 - t3, 2), "table_rss_mb": round(r3 - r2, 1),
                  "first_batch_read_s": round(t5 - t4, 4)}))
"""


BATCH_PROBE = r"""
import json, sys, time
from moco_retrieval.config import DataConfig, ModelConfig
from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.data.sources import load
from moco_retrieval.model.encoder import build_encoder
enc = build_encoder(ModelConfig(backbone="minilm" if sys.argv[3] == "minilm" else "tiny", path=sys.argv[4] or None))
cfg = DataConfig(kind="debian", cache_dir=sys.argv[1], batch_size=64, seed=0)
store = RetrievalDataModule(cfg, tokenize=enc.tokenize)
train, pool = load(cfg)
memory = RetrievalDataModule.from_loaded(cfg, train.pairs, pool.eval_set, enc.tokenize)
n, out = int(sys.argv[2]), {}
for rnd in range(3):  # interleaved rounds: the machine's load hits both alike
    for name, dm in (("store", store), ("memory", memory)):
        it = iter(dm.train_dataloader())
        next(it)
        t = time.perf_counter()
        for _ in range(n):
            next(it)
        out.setdefault(name, []).append((time.perf_counter() - t) / n * 1000)
print(json.dumps({k: round(sorted(v)[1], 2) for k, v in out.items()}))
"""


def debian_batches(work: Path, n: int) -> dict:
    """ms per training batch (read + collate + MiniLM tokenize, num_workers=0) on the Debian set: the store against
    the same pairs in memory, median of 3 interleaved rounds of ``n`` batches."""
    debian = os.environ.get("MOCO_RETRIEVAL_DEBIAN_DIR") or str(ROOT.parent / "shared" / "data" / "debian-bookworm")
    out = subprocess.run(["nice", "-n", "10", sys.executable, "-c", BATCH_PROBE, str(work / "debian_cache"), str(n), "minilm", ""],
                         check=True, env=dict(env(work), MOCO_RETRIEVAL_DEBIAN_DIR=debian), capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def open_probe(file: Path, cache: Path, work: Path) -> dict:
    out = subprocess.run(["nice", "-n", "10", sys.executable, "-c", OPEN_PROBE, str(file), str(cache)], check=True,
                         env=env(work), capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------- sampler


SAMPLER_PROBE = r"""
import json, sys, time, tracemalloc
import numpy as np
ids_path, groups_path, n, batches, before = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if before:
    sys.path.insert(0, before)
    from old_sampler import RetrievalBatchSampler
else:
    from moco_retrieval.data.sampler import RetrievalBatchSampler
def mem():
    s = open("/proc/self/status").read()
    return [int(s.split(k + ":")[1].split()[0]) / 1024 for k in ("VmRSS", "RssAnon")]
ids = np.memmap(ids_path, dtype=np.int64, mode="r", shape=(n,))
groups = np.memmap(groups_path, dtype=np.int64, mode="r", shape=(n,))
def make():
    return RetrievalBatchSampler(ids, groups, 64, seed=0, rank=0, world_size=2)
(r0, a0), t0 = mem(), time.perf_counter()
it = iter(make())
next(it)
t1 = time.perf_counter()
for _ in range(batches):
    next(it)
t2, (r1, a1) = time.perf_counter(), mem()
del it
tracemalloc.start()
it = iter(make())
for _ in range(batches + 1):
    next(it)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
print(json.dumps({"first_batch_s": round(t1 - t0, 3), "per_1000_batches_s": round((t2 - t1) * 1000 / batches, 3),
                  "tracemalloc_peak_mb": round(peak / 1e6, 1), "anon_growth_mb": round(a1 - a0, 1),
                  "rss_growth_mb": round(r1 - r0, 1), "batches_per_epoch": len(make()), "batches": batches}))
"""


def synthetic_ids(work: Path, n: int) -> tuple[Path, Path]:
    """int64 doc ids (each on two rows, far apart) and groups (a third of the rows, 4 to a group),
    written a chunk at a time."""
    work.mkdir(parents=True, exist_ok=True)
    paths = work / f"ids_{n}.i64", work / f"groups_{n}.i64"
    ids = np.memmap(paths[0], dtype=np.int64, mode="w+", shape=(n,))
    groups = np.memmap(paths[1], dtype=np.int64, mode="w+", shape=(n,))
    half, n_groups = (n + 1) // 2, max(1, n // 12)
    for a in range(0, n, 1 << 22):
        i = np.arange(a, min(n, a + (1 << 22)), dtype=np.int64)
        ids[a : a + len(i)] = (i % half) * 1_000_003 + 17
        groups[a : a + len(i)] = np.where(i % 3 == 0, (i // 3) % n_groups, -1)
    ids.flush(), groups.flush()
    del ids, groups
    return paths


def sampler_probe(work: Path, n: int, batches: int, before: Optional[Path]) -> dict:
    ids, groups = synthetic_ids(work, n)
    try:
        proc = subprocess.run(["nice", "-n", "10", sys.executable, "-c", SAMPLER_PROBE, str(ids), str(groups), str(n),
                               str(batches), str(before or "")], env=env(work), capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"sampler probe at {n:,} rows failed:\n{proc.stderr[-3000:]}")
        out = proc.stdout
    finally:
        ids.unlink(), groups.unlink()
    return json.loads(out.strip().splitlines()[-1])


def sampler_section(sizes: list[int], before_sizes: list[int], before: str, work: Path, batches: int = 1000) -> dict:
    """The sampler at each size (and the one of commit ``before`` at ``before_sizes``), each in a fresh process."""
    res = {"env": environment(), "batches": batches, "batch": "64 x 2 ranks (rank 0)", "now": {}, "before": {}}
    old_dir = None
    if before and before_sizes:
        old_dir = work / "old_sampler"
        old_dir.mkdir(parents=True, exist_ok=True)
        code = subprocess.run(["git", "show", f"{before}:moco_retrieval/data/sampler.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (old_dir / "old_sampler.py").write_text(code)
        res["before_commit"] = before
    for n in sizes:
        res["now"][f"{n:,}"] = sampler_probe(work, n, batches, None)
        print("sampler", n, res["now"][f"{n:,}"], flush=True)
    for n in before_sizes:
        res["before"][f"{n:,}"] = sampler_probe(work, n, batches, old_dir)
        print("sampler before", n, res["before"][f"{n:,}"], flush=True)
    return res


def sampler_report(res: dict) -> list[str]:
    cols = ("first_batch_s", "per_1000_batches_s", "tracemalloc_peak_mb", "anon_growth_mb", "rss_growth_mb",
            "batches_per_epoch")
    rows = [[k, "now"] + [v[c] for c in cols] for k, v in res["now"].items()]
    rows += [[k, f"before ({res.get('before_commit', '')})"] + [v[c] for c in cols] for k, v in res["before"].items()]
    return ["", "## The training batch sampler at 1M to 100M rows", "",
            f"Synthetic ids and groups memory-mapped from int64 files (each doc id on two rows, a third of the rows "
            f"in groups of 4), batch {res['batch']}, duplicate-free; a fresh process per size "
            f"({res['env']['date_utc']} UTC, {res['env']['cpu_count']} shared cores, OMP_NUM_THREADS=1, nice 10). "
            f"*first batch*: from creating the sampler to its first batch; then the next {res['batches']:,} "
            "batches; the tracemalloc peak over the same batches drawn again by a new sampler; the process's "
            "anonymous memory and RSS after them minus before the sampler (RSS also counts the pages of the "
            "id and group files read, i.e. page cache). *now*: blocks of ~32k rows arranged one at a time "
            "(moco_retrieval/data/sampler.py); *before*: the whole epoch planned at the first batch.", "",
            md_table(["rows", "sampler", "first batch s", f"next {res['batches']:,} batches s", "tracemalloc peak MB",
                      "anon growth MB", "RSS growth MB", "batches / epoch"], rows)] + \
        [line for note in res.get("notes", []) for line in ("", note)]


# ------------------------------------------------------------------------------------------ runs


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def local_rank(pid: int):
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"LOCAL_RANK="):
                return int(item.split(b"=", 1)[1])
    except OSError:
        return None
    return None


def memory_mb(pid: int) -> tuple[float, float, float]:
    """(RSS, its anonymous part, PSS) of one process in MB (0 when it is gone). RSS also counts the
    pages of memory-mapped files (the store) a process touched: page cache, shared and reclaimable;
    the anonymous part is the process's own memory."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(status.split("VmRSS:")[1].split()[0])
        anon = int(status.split("RssAnon:")[1].split()[0])
        pss = int(Path(f"/proc/{pid}/smaps_rollup").read_text().split("\nPss:")[1].split()[0])
        return rss / 1024, anon / 1024, pss / 1024
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0, 0.0


class Sampler(threading.Thread):
    """Each rank's peak RSS / PSS, alone and with its DataLoader workers, every 0.25 s."""

    def __init__(self, root_pid: int):
        super().__init__(daemon=True)
        self.root, self.stop, self.peak = root_pid, threading.Event(), {}

    def run(self) -> None:
        while not self.stop.wait(0.25):
            for pid in children(self.root):  # torchrun's children are the ranks, theirs the DataLoader workers
                r = local_rank(pid)
                if r is None:
                    continue
                rss, anon, pss = memory_mb(pid)
                workers = [memory_mb(w) for w in children(pid)]
                now = {"rss_mb": rss, "anon_mb": anon, "pss_mb": pss, "workers": len(workers),
                       "pss_with_workers_mb": pss + sum(w[2] for w in workers),
                       "anon_with_workers_mb": anon + sum(w[1] for w in workers)}
                peak = self.peak.setdefault(f"rank{r}", dict.fromkeys(now, 0.0))
                for k, v in now.items():
                    peak[k] = max(peak[k], v)


def run(label: str, file: Path, cache: Path, eval_dir: Path, work: Path, before: bool = False, timeout: float = 1500,
        extra: tuple = (), steps: int = 0) -> dict:
    """One 2-rank training command up to its second step: seconds to the first step, peak memory.
    ``steps``: the whole run of that many steps instead, each rank's batch times kept (:func:`loader_share`)."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", label)
    overrides = ["+experiment=smoke", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "data=jsonl",
                 f"data.train_path={file}", f"data.eval_dir={eval_dir}", f"data.cache_dir={cache}",
                 "data.max_train_examples=null", "data.max_eval_docs=null", "data.max_eval_queries=null",
                 "data.num_workers=2", "trainer.log_every_n_steps=1", f"trainer.max_steps={steps or 4}",
                 "trainer.val_check_interval=1000", f"run_dir={work}/runs/{slug}/rank${{oc.env:LOCAL_RANK}}",
                 f"hydra.run.dir={work}/runs/{slug}/hydra", *extra]
    entry = ["-m", "benchmarks.data_scale", "worker"] + (["--before"] if before else [])
    cmd = ["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *entry, *overrides]
    times = work / "runs" / slug / "batch_times"
    subprocess.run(["rm", "-rf", str(times)], check=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env={**env(work), **({"DATA_SCALE_BATCH_TIMES": str(times)} if steps else {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    mem = Sampler(proc.pid)
    mem.start()
    first, lines = None, []
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    for line in proc.stdout:
        lines.append(line)
        if first is None and STEP1.search(line):
            first = time.monotonic() - t0
        if not steps and STEP2.search(line):
            time.sleep(1.0)  # a last memory sample with the workers busy
            os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()
    timer.cancel()
    mem.stop.set()
    mem.join()
    log = work / "runs" / f"{slug}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(lines))
    if first is None:
        raise RuntimeError(f"{label}: no first step; see {log}")
    out = {"label": label, "first_step_s": round(first, 1), **{k: {kk: round(vv) for kk, vv in v.items()}
                                                              for k, v in sorted(mem.peak.items())}}
    return {**out, "loader": loader_share(times)} if steps else out


def loader_share(times: Path, skip: int = 10) -> dict:
    """Per rank, from the times :func:`batch_times` wrote, over the steps after the first ``skip``: the
    loader's share of the step (the time in the training loop's fetches of the next batch, over the
    period from one batch's start to the next one's), and the gap's share (everything from one batch's
    end to the next one's start: the fetch, logging, callbacks); median milliseconds of each."""
    out = {}
    for f in sorted(times.glob("rank*.json")):
        t = json.loads(f.read_text())  # [[start, end], ...] of each training batch
        fetches = json.loads((times / f"fetch_{f.name}").read_text())  # [[start, end], ...] of every fetch
        window = list(zip(t[skip:], t[skip + 1:]))
        periods = [b[0] - a[0] for a, b in window]
        gaps = [b[0] - a[1] for a, b in window]
        fetch = [sum(f1 - f0 for f0, f1 in fetches if a[1] <= f0 < b[0]) for a, b in window]
        out[f.stem] = {"steps": len(window), "share": round(sum(fetch) / sum(periods), 4),
                       "gap_share": round(sum(gaps) / sum(periods), 4), "fetch_ms": round(float(np.median(fetch)) * 1e3, 2),
                       "gap_ms": round(float(np.median(gaps)) * 1e3, 2), "step_ms": round(float(np.median(periods)) * 1e3, 1)}
    return out


def batch_times(folder: str, fetches: list) -> Any:
    """A Lightning callback (the run's workers' entry adds it): each training batch's start and end
    times, written per rank with ``fetches`` when training ends."""
    import lightning.pytorch as pl

    class Times(pl.Callback):
        def __init__(self) -> None:
            self.t: list = []

        def on_train_batch_start(self, *a) -> None:
            self.t.append([time.perf_counter(), None])

        def on_train_batch_end(self, *a) -> None:
            self.t[-1][1] = time.perf_counter()

        def on_train_end(self, trainer, *a) -> None:
            Path(folder).mkdir(parents=True, exist_ok=True)
            Path(folder, f"rank{trainer.global_rank}.json").write_text(json.dumps([x for x in self.t if x[1]]))
            Path(folder, f"fetch_rank{trainer.global_rank}.json").write_text(json.dumps(fetches))

    return Times()


def worker(argv: list[str]) -> None:
    """torchrun's entry: moco_retrieval.train's main; ``--before`` restores today's loader."""
    if argv and argv[0] == "--before":
        argv = argv[1:]
        from moco_retrieval.data.datamodule import RetrievalDataModule
        from moco_retrieval.data.sources import load
        from moco_retrieval.data.store import PairList, PairRows

        def load_today(self) -> None:  # every pair a Python object, in every rank
            train, pool = load(self.cfg)
            self.data_dir = train.folder
            self._set_data(PairRows(PairList(train.pairs, train.where)), pool.eval_set)

        RetrievalDataModule._load = load_today
    if os.environ.get("DATA_SCALE_BATCH_TIMES"):
        import lightning.pytorch as pl
        from lightning.pytorch.loops import fetchers

        init, fetch, fetched = pl.Trainer.__init__, fetchers._DataFetcher.__next__, []

        def with_times(self, *a, callbacks=None, **k):
            init(self, *a, callbacks=[*(callbacks or []), batch_times(os.environ["DATA_SCALE_BATCH_TIMES"], fetched)], **k)

        def timed_fetch(self):  # every loop's next(dataloader): the prefetching fetcher's too (super().__next__)
            t0 = time.perf_counter()
            try:
                return fetch(self)
            finally:
                fetched.append([t0, time.perf_counter()])

        pl.Trainer.__init__, fetchers._DataFetcher.__next__ = with_times, timed_fetch
    from moco_retrieval.train import main

    sys.argv = [sys.argv[0], *argv]
    main()


def evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache, so that a run reads its data from disk as a node
    that did not write it would. (A file just written stays cached in large folios, which a page fault
    maps whole: a rank's RSS and PSS would count most of a store it barely read.)"""
    os.sync()
    for p in (p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def stream_scale(n: int, doc_words: int, steps: int, work: Path, paths: tuple = ("store", "stream")) -> dict:
    """B18 (issue 48): ``n`` pairs and 1k, the store against the stream (``paths``). Each prepared by
    ``prepare workers=2`` (the stream from the store: litdata.optimize, 2 processes); per path and file
    a 2-rank run to its first step (memory peaks, as :func:`run`), and on the big file a run of
    ``steps`` steps at batch 64 with its loader share (:func:`loader_share`); the page cache emptied of
    the data before each run (:func:`evict`). Stores and chunks deleted at the end."""
    work.mkdir(parents=True, exist_ok=True)
    eval_dir = write_eval(work / "eval")
    files = {"1k": generate(work / f"pairs_1k_w{doc_words}.jsonl", 1000, doc_words=doc_words),
             f"{n:,}": generate(work / f"pairs_{n}_w{doc_words}.jsonl", n, doc_words=doc_words)}
    out: dict = {"doc_words": doc_words, "steps": steps, "prepare": {}, "runs": [], "env": environment()}
    for key, f in files.items():
        cache, chunks = work / "stores" / f.stem, work / "streams" / f.stem
        subprocess.run(["rm", "-rf", str(cache), str(chunks)], check=True)
        for path, opts in (("store", ()), ("stream", ("data.stream=true", f"data.stream_dir={chunks}"))):
            if path not in paths:
                continue
            t0 = time.monotonic()
            subprocess.run(["nice", "-n", "10", sys.executable, "-m", "moco_retrieval.data", "prepare", "data=jsonl",
                            f"data.train_path={f}", f"data.cache_dir={cache}", "workers=2", *opts],
                           check=True, env=env(work), capture_output=True)
            folder = chunks if path == "stream" else next(p.parent for p in (cache / "pairs").glob("*/manifest.json"))
            out["prepare"][f"{key} {path}"] = {"command_s": round(time.monotonic() - t0, 1), "mb": round(du(folder) / 1e6, 1),
                                               "input_mb": round(f.stat().st_size / 1e6, 1)}
            print(key, path, out["prepare"][f"{key} {path}"], flush=True)
            evict(work)
            out["runs"].append({"path": path, "file": key, **run(f"{key} {path} warm", f, cache, eval_dir, work, extra=opts)})
            print(out["runs"][-1], flush=True)
            if key != "1k":
                evict(work)
                out["runs"].append({"path": path, "file": key, **run(
                    f"{key} {path} {steps} steps, batch 64", f, cache, eval_dir, work, steps=steps,
                    extra=(*opts, "data.batch_size=64"))})
                print(out["runs"][-1], flush=True)
        subprocess.run(["rm", "-rf", str(cache), str(chunks)], check=True)
    return out


def stream_scale_report(r: dict) -> list[str]:
    big = next(k for k in r["prepare"] if not k.startswith("1k")).split()[0]
    ref = {x["path"]: x for x in r["runs"] if x["file"] == "1k"}
    rows = []
    for x in (x for x in r["runs"] if x["file"] == big and "loader" not in x):
        for rank in ("rank0", "rank1"):
            base = ref[x["path"]][rank]
            rows.append([x["path"], rank[-1], f"{x['first_step_s']:.1f}", f"{ref[x['path']]['first_step_s']:.1f}",
                         f"{x['first_step_s'] - ref[x['path']]['first_step_s']:+.1f}",
                         x[rank]["anon_mb"] - base["anon_mb"], x[rank]["pss_mb"] - base["pss_mb"],
                         x[rank]["rss_mb"] - base["rss_mb"],
                         x[rank]["anon_with_workers_mb"] - base["anon_with_workers_mb"]])
    loader = [[x["path"], rank[-1], v["steps"], v["step_ms"], v["fetch_ms"], f"{100 * v['share']:.1f}%", v["gap_ms"],
               f"{100 * v['gap_share']:.1f}%"] for x in r["runs"] if "loader" in x for rank, v in x["loader"].items()]
    prep = [[k, v["input_mb"], v["mb"], v["command_s"]] for k, v in r["prepare"].items()]
    return ["", f"## B18: {big} pairs, the store against the stream (issue 48)", "",
            f"Synthetic pairs as above but documents of {r['doc_words']} words (the disk holds the JSONL, the store "
            "and the chunks at once), prepared with `workers=2` (the stream from the store). Runs as above: 2 gloo "
            "ranks, the tiny model, data.num_workers=2, each beside the same path's 1k-pair run of this invocation; "
            "*data* memory = the run's peak minus its 1k run's.", "",
            md_table(["prepared", "input MB", "on disk MB", "command s"], prep), "",
            md_table(["path", "rank", "first step s", "1k first step s", "difference s", "data anon MB", "data PSS MB",
                      "data RSS MB", "data anon with workers MB"], rows), "",
            f"The loader's share of the step: {r['steps']} steps at batch 64 on the big file, the first 10 left out; "
            "per rank, the time in the training loop's `next()` on the DataLoader (the batch from its workers) "
            "over the period from one batch's start to the next one's; *gap*: all from one batch's end to the "
            "next one's start (the fetch, and Lightning's logging and callbacks: log_every_n_steps=1); medians in ms.", "",
            md_table(["path", "rank", "steps", "step ms", "fetch ms", "loader share", "gap ms", "gap share"], loader)
            ] + _hot_store_line(r, big)


def _hot_store_line(r: dict, big: str) -> list[str]:
    """The store's runs of an invocation that did not empty the page cache first, if kept."""
    hot = [x for x in r.get("hot_store_runs", []) if x["file"] == big and "loader" not in x]
    if not hot:
        return []
    x = hot[0]
    return ["", f"The same {big}-pair store run without emptying the page cache first (the store just written, "
            f"another invocation): first step {x['first_step_s']} s; per rank RSS {x['rank0']['rss_mb']:,} / "
            f"{x['rank1']['rss_mb']:,} MB, PSS {x['rank0']['pss_mb']:,} / {x['rank1']['pss_mb']:,} MB, anonymous "
            f"{x['rank0']['anon_mb']} / {x['rank1']['anon_mb']} MB. A file just written sits in the page cache in "
            "large folios, and a page fault maps a whole folio: opening the table (reading each record batch's "
            "header) then maps gigabytes a rank never reads. Those pages are the page cache's, shared by the "
            "node's processes and reclaimable; the ranks' own (anonymous) memory is the same either way."]


# --------------------------------------------------------------------------------------- report


def paper_report(res: dict) -> list[str]:
    """100M and 1B pairs on paper (issue 48, B18): each figure scaled from a per-row cost measured
    above, so it moves with the measurements; what it assumes is said beside it."""
    big = max(res["conversion"].values(), key=lambda c: c["rows"])
    bytes_per_row = big["store_mb"] * 1e6 / big["rows"]
    p = res["prepare_workers"]
    cpu_per_row = sorted(r["cpu_s"] for r in p["runs"]["1"])[len(p["runs"]["1"]) // 2] / p["rows"]
    sampler = res["sampler"]["now"][max(res["sampler"]["now"], key=lambda k: int(k.replace(",", "")))]
    chunks = "a stream's chunks: not measured"
    if res.get("stream_scale"):
        prep = res["stream_scale"]["prepare"]
        big_key = next(k for k in prep if not k.startswith("1k")).split()[0]
        chunks = (f"a stream's chunks take {prep[big_key + ' stream']['mb'] / prep[big_key + ' store']['mb']:.2f}x "
                  f"the store's bytes at {big_key} pairs")
    rows = []
    for n in (100_000_000, 1_000_000_000):
        rows.append([f"{n:,}", f"{n * bytes_per_row / 1e9:,.0f} GB", f"{n * 16 / 1e9:,.1f} GB",
                     f"{n * cpu_per_row / 3600:,.1f} h", f"{n * cpu_per_row / 16 / 60:,.0f} min",
                     f"{sampler['anon_growth_mb']:.0f} MB", f"{sampler['first_batch_s']:.2f} s"])
    return ["", "## 100M and 1B pairs, on paper", "",
            f"Scaled from the rows above: the store's {bytes_per_row:,.0f} bytes per pair ({big['rows']:,} pairs; "
            f"{chunks}), {cpu_per_row * 1e6:.0f} µs of "
            "CPU per pair to convert (`prepare`, one process, the median of the workers=1 rounds), 16 bytes per "
            "pair of ids and groups (memory-mapped: page cache shared by a node's ranks, not a rank's own memory), "
            "and the sampler's own memory and first batch at its largest measured size. *16 cores* assumes "
            f"`workers=16` scales linearly, which this 2-core machine can only show up to 2 (workers=2: "
            f"{p['median']['2']['speedup_convert']}x).", "",
            md_table(["pairs", "store on disk", "ids + groups mapped", "conversion, one core", "on 16 cores",
                      "sampler memory per rank", "sampler first batch"], rows)]


def report(res: dict) -> str:
    conv = res["conversion"]
    lines = ["# B10: data at scale (converted store vs today's loader)", "",
             "Synthetic pairs (queries 8 words, documents 90; negatives are other rows' documents), JSONL. "
             f"Machine: {res['env']['cpu_count']} shared cores, other jobs running; OMP_NUM_THREADS=1, nice 10. "
             "See benchmarks/data_scale.py for how each number is taken.", "",
             "## Conversion (one core) and opening the warm store", "",
             md_table(["file", "rows", "input MB", "store MB", "conversion rows/s", "prepare command s"],
                      [[k, f"{c['rows']:,}", c["input_mb"], c["store_mb"], f"{c['rows_per_s']:,}", c["command_s"]]
                       for k, c in conv.items()]),
             "", "Opening the warm store in a fresh process (after its imports): fingerprint memo, manifest, ids + "
             "groups memory-mapped (*open*); the sampler's first epoch planned, rank 0 of 2, batch 64 (its RSS "
             "includes the id/group pages it reads); the Arrow table memory-mapped (pyarrow's import included); "
             "the first batch's 64 rows read.", "",
             md_table(["file", "open s", "open RSS MB", "sampler plan s", "sampler RSS MB", "table open s",
                       "table RSS MB", "first batch read s"],
                      [[k] + [o[m] for m in ("open_s", "open_rss_mb", "sampler_plan_s", "sampler_rss_mb", "table_open_s",
                                             "table_rss_mb", "first_batch_read_s")] for k, o in res["open"].items()]),
             "", "## 2 gloo ranks, data.num_workers=2, tiny model: command start to the first training step", "",
             "Peaks per rank over the run (sampled every 0.25 s up to step 2 + 1 s). RSS counts the store's "
             "memory-mapped pages a process has touched (page cache: shared by the ranks and workers, "
             "reclaimable); *anon* is the process's own memory; PSS splits shared pages among their users. "
             "*with workers*: the rank plus its DataLoader workers (their anonymous memory is summed, so pages a "
             "worker shares with its rank since the fork count twice there; PSS does not).", "",
             md_table(["run", "rank", "first step s", "RSS MB", "anon MB", "PSS MB", "with workers: PSS MB", "anon MB"],
                      [[r["label"], k[-1], r["first_step_s"]] + [r[k].get(m, "-") for m in
                       ("rss_mb", "anon_mb", "pss_mb", "pss_with_workers_mb", "anon_with_workers_mb")]
                       for r in res["runs"] for k in ("rank0", "rank1") if k in r])]
    if res.get("debian_batches"):
        d = res["debian_batches"]
        lines += ["", "## A training batch on the Debian set", "",
                  f"Read + collate + tokenize (MiniLM's tokenizer, batch 64, num_workers=0), ms per batch, median of "
                  f"3 interleaved rounds of {d['batches']} batches: store {d['store']} ms, the same pairs in memory "
                  f"(today's loader) {d['memory']} ms."]
    if res.get("prepare_workers"):
        lines += prepare_workers_report(res["prepare_workers"])
    if res.get("stream_scale"):
        lines += stream_scale_report(res["stream_scale"])
    if res.get("cut"):
        lines += ["", "Not measured: " + res["cut"]]
    for note in res.get("notes", []):
        lines += ["", note]
    for section in res.get("sections", []):  # written by hand into the results (kept in the JSON)
        lines += ["", section.rstrip()]
    if res.get("sampler") and res.get("prepare_workers"):
        lines += paper_report(res)
    if res.get("sampler"):
        lines += sampler_report(res["sampler"])
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])
    ap = cli.parser(__doc__)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1_000_000])
    ap.add_argument("--before", type=int, nargs="*", default=[1_000_000], help="sizes to run today's loader at")
    ap.add_argument("--negatives", type=int, default=0, help="also a file of --neg-rows rows with this many negatives")
    ap.add_argument("--neg-rows", type=int, default=100_000)
    ap.add_argument("--train-negatives", type=int, default=0, help="data.n_negatives of the negatives file's runs")
    ap.add_argument("--work", default="/tmp/data_scale")
    ap.add_argument("--cut", default="", help="what was left out, for the report")
    ap.add_argument("--merge", action="store_true", help="add to --out's data_scale.json (earlier sizes kept)")
    ap.add_argument("--tag", default="", help="appended to this invocation's 1k reference labels (side by side)")
    ap.add_argument("--note", action="append", default=[], help="a line for the report (kept in the JSON)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the JSON (with --note)")
    ap.add_argument("--debian-batches", type=int, default=0,
                    help="only: ms per batch on the Debian set, store vs in memory (added to the results)")
    ap.add_argument("--sampler-sizes", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="only: the batch sampler at these row counts (comma-separated), added to the results")
    ap.add_argument("--sampler-before", default="25b5201", help="the commit whose sampler is measured beside it")
    ap.add_argument("--sampler-before-sizes", type=lambda v: [int(x) for x in v.split(",") if x],
                    default=[1_000_000, 10_000_000])
    ap.add_argument("--prepare-workers", default="", help="only: prepare with each workers=N (e.g. 1,2), added to the results")
    ap.add_argument("--prepare-size", type=int, default=2_000_000, help="pairs of --prepare-workers' file")
    ap.add_argument("--prepare-repeats", type=int, default=2)
    ap.add_argument("--stream-size", type=int, default=0, help="only: the store against the stream at this many pairs (B18)")
    ap.add_argument("--doc-words", type=int, default=DOC_WORDS, help="--stream-size: words per document")
    ap.add_argument("--loader-steps", type=int, default=60, help="--stream-size: steps of the loader-share runs")
    ap.add_argument("--stream-paths", default="store,stream", help="--stream-size: the paths to run now (the others kept)")
    cli.add_out(ap)  # no --threads: the measured processes are torchrun's; the Debian set: $MOCO_RETRIEVAL_DEBIAN_DIR
    args = ap.parse_args()
    out = cli.out_dir(args)
    if args.sampler_sizes:
        res = json.loads((out / "data_scale.json").read_text())
        res["sampler"] = sampler_section(args.sampler_sizes, args.sampler_before_sizes, args.sampler_before,
                                         Path(args.work) / "sampler")
        write_results("data_scale", report(res), res, out)
        return
    if args.debian_batches:
        res = json.loads((out / "data_scale.json").read_text())
        res["debian_batches"] = {"batches": args.debian_batches, **debian_batches(Path(args.work), args.debian_batches)}
        write_results("data_scale", report(res), res, out)
        return
    if args.stream_size:
        res = json.loads((out / "data_scale.json").read_text())
        paths = tuple(args.stream_paths.split(","))
        new = stream_scale(args.stream_size, args.doc_words, args.loader_steps, Path(args.work) / "stream", paths)
        old = res.get("stream_scale") or {"prepare": {}, "runs": []}  # the other path's measurements kept
        new["prepare"] = {**{k: v for k, v in old["prepare"].items() if k.split()[-1] not in paths}, **new["prepare"]}
        new["runs"] = [r for r in old["runs"] if r["path"] not in paths] + new["runs"]
        res["stream_scale"] = new
        write_results("data_scale", report(res), res, out)
        return
    if args.prepare_workers:
        res = json.loads((out / "data_scale.json").read_text())
        work = Path(args.work)
        f = generate(work / f"pairs_{args.prepare_size}.jsonl", args.prepare_size)
        res["prepare_workers"] = {**prepare_workers(f, [int(w) for w in args.prepare_workers.split(",")],
                                                    args.prepare_repeats, work), "cores": os.cpu_count()}
        write_results("data_scale", report(res), res, out)
        return
    if args.report_only:
        res = json.loads((out / "data_scale.json").read_text())
        res["notes"] = res.get("notes", []) + args.note
        write_results("data_scale", report(res), res, out)
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    eval_dir = write_eval(work / "eval")
    files = {f"1k{args.tag}": generate(work / "pairs_1k.jsonl", 1000)}
    files.update({f"{n:,}": generate(work / f"pairs_{n}.jsonl", n) for n in args.sizes})
    if args.negatives:
        files[f"{args.neg_rows:,} x {args.negatives} neg"] = generate(work / f"pairs_{args.neg_rows}x{args.negatives}.jsonl",
                                                                       args.neg_rows, args.negatives)
    res = {"env": environment(), "conversion": {}, "open": {}, "runs": [], "cut": args.cut}
    for key, f in files.items():
        cache = work / "stores" / f.stem
        if cache.exists():
            subprocess.run(["rm", "-rf", str(cache)], check=True)
        res["conversion"][key] = convert(f, cache, work)
        res["open"][key] = open_probe(f, cache, work)
        print(key, res["conversion"][key], res["open"][key], flush=True)
        extra = (f"data.n_negatives={args.train_negatives}",) if "neg" in key and args.train_negatives else ()
        if extra:
            key_runs = f"{key}, {args.train_negatives} per row trained"
        else:
            key_runs = key
        res["runs"].append(run(f"{key_runs} warm", f, cache, eval_dir, work, extra=extra))
        print(res["runs"][-1], flush=True)
        if not key.startswith("1k"):
            cold = work / "stores" / f"{f.stem}_cold"
            subprocess.run(["rm", "-rf", str(cold)], check=True)
            res["runs"].append(run(f"{key_runs} cold", f, cold, eval_dir, work, extra=extra))
            print(res["runs"][-1], flush=True)
            subprocess.run(["rm", "-rf", str(cold)], check=True)
    for n in args.before:
        f = files[f"{n:,}"]
        res["runs"].append(run(f"{n:,} before (today's loader)", f, work / "stores" / "unused", eval_dir, work, before=True))
        print(res["runs"][-1], flush=True)
    if args.merge:
        res = merged(json.loads((out / "data_scale.json").read_text()), res)
    write_results("data_scale", report(res), res, out)


def merged(old: dict, new: dict) -> dict:
    """``new`` over ``old``: conversions and openings by file, runs by label, the newest environment."""
    labels = {r["label"] for r in new["runs"]}
    return {"env": new["env"], "conversion": {**old["conversion"], **new["conversion"]}, "open": {**old["open"], **new["open"]},
            "runs": [r for r in old["runs"] if r["label"] not in labels] + new["runs"],
            "cut": new["cut"] or old.get("cut", ""), "notes": old.get("notes", []) + new.get("notes", []),
            **{k: old[k] for k in ("debian_batches", "sections", "sampler", "prepare_workers", "stream_scale") if k in old}}


if __name__ == "__main__":
    main()
