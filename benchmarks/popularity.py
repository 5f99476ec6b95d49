"""B8: popularity bias of sampled negatives, and the logQ correction.

In-batch and queued negatives are drawn with the training pairs, so a document that appears in
many pairs is a negative in many batches and is pushed down more than a full softmax would push
it (Yi et al., RecSys 2019). ``objective.logq_correction`` (objectives/logq.py) subtracts its
estimated sampling log-probability from each sampled logit. Debian's positives are nearly unique,
so this benchmark builds a popularity-skewed variant of it:

* query = a binary package's short description; positive = its *source* package's shared
  description (the first paragraph most of the source's binaries carry), so a source with 200
  binaries is a document with 200 queries: a popular document;
* held out: one binary in ten (by a stable hash of its name); the pool is every source's document,
  so popular and rare documents compete; results by the positive's popularity in training (its
  number of training pairs: 0 = never trained on, 1, 2-4, 5-19, 20+).

Frozen-head setup of B1 (bag-of-wordpieces backbone + linear head), 3 epochs, 3 seeds, with and
without the correction: in-batch negatives at batch 256 (the paper's setting) and batch 32 + the
B1 queue (``+experiment=frozen_queue`` at K 4,096). A control runs the in-batch pair on the ordinary
Debian set (B1's pairs and pool, popularity nearly uniform), where the correction should not matter.

Writes benchmarks/results/popularity.{md,json,png}; finished runs are cached in
benchmarks/results/popularity_runs.jsonl (committed), so a rerun resumes.

    python -m benchmarks.popularity [--quick] [--seeds 0,1,2] [--deadline HH:MM]
"""
from __future__ import annotations

import collections
import random
import time
from pathlib import Path

from benchmarks.harness import cli
from benchmarks.harness.report import environment, f3, figure, log, median, std
from benchmarks.harness.runs import md_table, read_jsonl, run_missing, write_results
from benchmarks.harness.training import FROZEN_BASE, Bench, compose_cfg


NAME = "popularity"
BUCKETS = [(0, 0, "0"), (1, 1, "1"), (2, 4, "2-4"), (5, 19, "5-19"), (20, 10**9, "20+")]
RUNS = {  # name -> overrides
    "in-batch 256": ["+experiment=frozen_inbatch", "data.batch_size=256", "objective.temperature=0.02"],
    "in-batch 256 + logQ": ["+experiment=frozen_inbatch", "data.batch_size=256", "objective.temperature=0.02",
                            "objective.logq_correction=true"],
    "queue 32+4k": ["+experiment=frozen_queue", "objective.queue_size=4096"],
    "queue 32+4k + logQ": ["+experiment=frozen_queue", "objective.queue_size=4096", "objective.logq_correction=true"],
}
# the same two in-batch runs on the ordinary Debian set (positives nearly unique): does logQ cost anything there?
CONTROLS = {f"control: {n}": RUNS[n] for n in ("in-batch 256", "in-batch 256 + logQ")}


def bucket_of(n: int) -> str:
    return next(label for lo, hi, label in BUCKETS if lo <= n <= hi)


def build_skewed(eval_every: int = 10, max_eval_queries: int = 3000, seed: int = 0):
    """(training pairs, eval set, popularity of each pool document) from the Debian index."""
    from moco_retrieval.data.builders.debian import load_records, resolve_debian_inputs
    from moco_retrieval.data.formats import EvalSet, Pair
    from moco_retrieval.data.ids import doc_id_for_text, normalize_text, stable_id

    tr, pk, _ = resolve_debian_inputs(None)
    records, _ = load_records(tr, pk)
    by_source: dict[str, list] = collections.defaultdict(list)
    for r in records:
        by_source[r.source].append(r)
    doc_of: dict[str, str] = {}
    for src, recs in by_source.items():
        paras = collections.Counter(r.document.split("\n\n", 1)[0].strip() for r in recs)
        doc_of[src] = max(sorted(paras), key=lambda p: paras[p])  # the most shared; ties: first in order
    seen_q: set[str] = set()
    train, held = [], []
    for r in sorted(records, key=lambda r: r.package):
        key = normalize_text(r.query).casefold()
        if key in seen_q:  # one short description, one pair
            continue
        seen_q.add(key)
        doc = doc_of[r.source]
        (held if stable_id(r.package) % eval_every == 0 else train).append((r.package, r.query, doc))
    pairs = [Pair(query=q, positive=d, doc_id=doc_id_for_text(d), query_id=p) for p, q, d in train]
    pop = collections.Counter(p.doc_id for p in pairs)
    corpus = {str(doc_id_for_text(d)): d for d in doc_of.values()}
    random.Random(seed).shuffle(held)
    held = held[:max_eval_queries]
    queries = {f"q:{p}": q for p, q, _ in held}
    qrels = {f"q:{p}": {str(doc_id_for_text(d)): 1} for p, _, d in held}
    popularity = {did: pop.get(int(did), 0) for did in corpus}
    return pairs, EvalSet(corpus=corpus, queries=queries, qrels=qrels), popularity


class SkewedBench(Bench):
    """B1's harness over the popularity-skewed pairs and pool."""

    def __init__(self, pairs, eval_set):
        cfg = compose_cfg(FROZEN_BASE)
        self.data_cfg = cfg.data
        self.train_pairs, self.eval_set = pairs, eval_set
        self._keep = []


def by_bucket(result, eval_set, popularity) -> dict:
    per: dict[str, list] = collections.defaultdict(list)
    for qid, m in result.per_query.items():
        (did,) = eval_set.qrels[qid]
        per[bucket_of(popularity[did])].append(m)
    return {b: {"queries": len(v), "recall@1": sum(x["recall@1"] for x in v) / len(v),
                "ndcg@10": sum(x["ndcg@10"] for x in v) / len(v)} for b, v in per.items() if v}


def run_one(bench, name: str, overrides: list[str], seed: int, epochs: int, key: str, buckets) -> dict:
    cfg = compose_cfg(FROZEN_BASE + overrides + [f"trainer.max_epochs={epochs}", f"seed={seed}", f"data.seed={seed}"])
    r = bench.fit_eval(cfg)
    rec = {"key": key, "name": name, "seed": seed, "metrics": dict(r["metrics"]), "train_s": r["train_s"],
           "steps": r["steps"], "unrelated_cos_mean": r["geometry"].get("unrelated_cos_mean"),
           "buckets": buckets(r["result"])}
    log(f"{name} seed {seed}: recall@1 {rec['metrics']['recall@1']:.4f} ({rec['train_s']:.0f}s)")
    return rec


def run_table(cache: Path, bench, table: dict, names: list[str], seeds: list[int], epochs: int, deadline, buckets) -> list[str]:
    """Each run of ``table`` in ``names`` over ``seeds`` (seed by seed) once, through the run cache;
    returns those the deadline cut."""
    def key(name: str, seed: int) -> str:
        return f"{name}|seed={seed}|epochs={epochs}|pairs={len(bench.train_pairs)}"

    cut: list[str] = []
    for s in seeds:
        cut += run_missing(cache, [n for n in table if n in names], [s], deadline, key,
                           lambda n, seed: run_one(bench, n, table[n], seed, epochs, key(n, seed), buckets))
    return cut


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="8,000 training pairs, 1 epoch, seed 0, in-batch only")
    cli.add_seeds(ap, None, "comma-separated seeds (default 0,1,2; quick 0)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs (default 3; quick 1)")
    cli.add_only(ap, [*RUNS, *CONTROLS], None)
    cli.add_deadline(ap)
    cli.add_common(ap)
    args = ap.parse_args(argv)
    cli.apply(args)
    q = args.quick
    seeds = cli.seeds(args.seeds or ("0" if q else "0,1,2"))
    epochs = args.epochs or (1 if q else 3)
    only = (cli.names(args.only, [*RUNS, *CONTROLS]) if args.only
            else [n for n in RUNS if n.startswith("in-batch")] if q else [*RUNS, *CONTROLS])
    out_dir = cli.out_dir(args)
    prefix = f"{NAME}_quick" if q else NAME
    cache = out_dir / f"{prefix}_runs.jsonl"
    t0 = time.time()
    pairs, eval_set, popularity = build_skewed()
    if q:  # a slice; popularity counted over it
        pairs = pairs[:: max(1, len(pairs) // 8000)][:8000]
        pop = collections.Counter(p.doc_id for p in pairs)
        popularity = {did: pop.get(int(did), 0) for did in popularity}
    bench = SkewedBench(pairs, eval_set)
    counts = collections.Counter(popularity[str(p.doc_id)] for p in pairs)
    log(f"B8: {len(pairs):,} pairs over {sum(1 for v in popularity.values() if v):,} documents "
        f"(most popular: {max(popularity.values())} pairs); pool {len(eval_set.corpus):,} docs, {len(eval_set.queries):,} queries")
    cut = run_table(cache, bench, RUNS, only, seeds, epochs, args.deadline, lambda res: by_bucket(res, eval_set, popularity))
    if any(n in only for n in CONTROLS):
        std_bench = Bench(max_train_examples=8000 if q else None)
        cut += run_table(cache, std_bench, CONTROLS, only, seeds, epochs, args.deadline, lambda res: {})
    done = {r["key"]: r for r in read_jsonl(cache)}
    recs = [r for r in done.values() if r["key"].endswith(f"|epochs={epochs}|pairs={len(pairs)}")]
    controls = [r for r in done.values() if r["name"] in CONTROLS and r["key"].split("|")[2] == f"epochs={epochs}"]
    report(recs, controls, len(pairs), eval_set, counts, popularity, epochs, seeds, cut, out_dir, prefix, time.time() - t0, q)
    return 0


def report(recs, controls, n_pairs, eval_set, counts, popularity, epochs, seeds, cut, out_dir, prefix, wall, quick) -> None:
    names = [n for n in RUNS if any(r["name"] == n for r in recs)]
    summ = {}
    for n in names:
        rs = [r for r in recs if r["name"] == n]
        summ[n] = {"seeds": sorted(r["seed"] for r in rs),
                   "recall@1": median([r["metrics"]["recall@1"] for r in rs]), "recall@1_std": std([r["metrics"]["recall@1"] for r in rs]),
                   "ndcg@10": median([r["metrics"]["ndcg@10"] for r in rs]), "ndcg@10_std": std([r["metrics"]["ndcg@10"] for r in rs]),
                   "unrelated_cos": median([r["unrelated_cos_mean"] for r in rs]),
                   "buckets": {b: {m: median([r["buckets"][b][m] for r in rs if b in r["buckets"]]) for m in ("recall@1", "ndcg@10")}
                               for _, _, b in BUCKETS if any(b in r["buckets"] for r in rs)},
                   "train_s": median([r["train_s"] for r in rs])}
    q_per_bucket = collections.Counter(bucket_of(popularity[next(iter(v))]) for v in eval_set.qrels.values())
    labels = [b for _, _, b in BUCKETS]
    md = [f"# B8: popularity bias and the logQ correction{' (quick)' if quick else ''}", "",
          "Generated by `python -m benchmarks.popularity`. Debian, popularity-skewed: query = a binary package's short "
          "description, positive = its source package's shared first paragraph; "
          f"{n_pairs:,} training pairs, pool {len(eval_set.corpus):,} documents, {len(eval_set.queries):,} held-out queries. "
          f"Frozen bag-of-wordpieces backbone + linear head, {epochs} epochs, tau 0.02; median ± std over seeds {seeds}.", "",
          md_table(["run", "seeds", "recall@1", "nDCG@10", "unrelated cos", "train s"],
                   [[n, len(s["seeds"]), f"{f3(s['recall@1'])} ± {f3(s['recall@1_std'])}",
                     f"{f3(s['ndcg@10'])} ± {f3(s['ndcg@10_std'])}", f"{s['unrelated_cos']:+.3f}", f"{s['train_s']:.0f}"]
                    for n, s in summ.items()]), "",
          "## recall@1 by the positive's popularity (training pairs of that document)", "",
          md_table(["run"] + [f"{b} ({q_per_bucket.get(b, 0)} q)" for b in labels],
                   [[n] + [f3(s["buckets"].get(b, {}).get("recall@1")) for b in labels] for n, s in summ.items()]), "",
          "Training pairs whose document has that popularity: " + ", ".join(f"{b}: {sum(c for k, c in counts.items() if bucket_of(k) == b):,}"
                                                               for b in labels[1:]) + ".", ""]
    if controls:
        ctl = {}
        for r in controls:
            ctl.setdefault(r["name"], []).append(r)
        md += ["## Control: the ordinary Debian set (B1's pairs and pool)", "",
               md_table(["run", "seeds", "recall@1", "nDCG@10"],
                        [[n, len(v), f"{f3(median([r['metrics']['recall@1'] for r in v]))} ± {f3(std([r['metrics']['recall@1'] for r in v]))}",
                          f"{f3(median([r['metrics']['ndcg@10'] for r in v]))} ± {f3(std([r['metrics']['ndcg@10'] for r in v]))}"]
                         for n, v in ctl.items()]), ""]
    if cut:
        md += ["## Cut", "", "Not run (deadline; the cache resumes them): " + ", ".join(cut) + ".", ""]
    data = {"benchmark": NAME, "epochs": epochs, "seeds": seeds, "pairs": n_pairs, "pool": len(eval_set.corpus),
            "queries": len(eval_set.queries), "queries_per_bucket": dict(q_per_bucket), "summary": summ, "cut": cut,
            "runs": recs, "controls": controls, "wall_s": wall, "environment": environment()}
    write_results(prefix, "\n".join(md), data, out_dir)
    plot(summ, labels, out_dir / f"{prefix}.png")


def plot(summ, labels, path: Path) -> None:
    if not summ:
        return
    fig = figure(7.0, 4.0)
    ax = fig.add_subplot(1, 1, 1)
    bases = list(dict.fromkeys(n.replace(" + logQ", "") for n in summ))
    for n, s in summ.items():  # one colour per objective; dashed: with logQ
        xs = [i for i, b in enumerate(labels) if b in s["buckets"]]
        ax.plot(xs, [s["buckets"][labels[i]]["recall@1"] for i in xs], marker="o", color=f"C{bases.index(n.replace(' + logQ', ''))}",
                linestyle="--" if "logQ" in n else "-", label=n)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("training pairs of the positive document (popularity)")
    ax.set_ylabel("recall@1")
    ax.set_title("Held-out recall@1 by popularity, with and without logQ (B8)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
