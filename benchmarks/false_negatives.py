"""B7: false negatives that ids do not reveal: guided masking with the groups withheld.

Debian's packages of one source are each other's false negatives, and the data set labels them with
a group id, so the trainer masks them. A user's own data rarely has groups. This benchmark trains
with the groups *withheld* (every training pair's group set to -1: no group masking, and the
sampler may put two packages of one source in a batch) and measures how much of the group
masking's gain guided masking (objectives/guided.py, ``objective.guide``) recovers:

1. groups known (the reference: id + group masking, as the Debian set is trained today);
2. groups withheld (id masking only);
3. withheld + guide "base" (the frozen backbone itself, before the head: free here);
4. withheld + guide "minilm" (all-MiniLM-L6-v2 as a frozen guide), GIST's rule with margin 0;
5. withheld + guide "minilm", margin 0.05 (masks more).

Frozen-head setup of B1 (bag-of-wordpieces backbone + linear head, the Debian set, the held-out
pool of 3,283 queries) with the B1 queue (``+experiment=frozen_queue``: the feature memory, tau
0.02), at K = 4,096 to keep runs short (B1's preset uses 16,384), 3 seeds; 1 epoch by default
(``--epochs 3`` for B1's length: about 3x the CPU time).

Also, offline, the false-mask rate of each guide: on random batches of 32 training pairs against
4,096 random training documents (what the batch and the queue hold), the candidates each guide
masks, and the share of them outside the positive's withheld group (false masks; some may still be
unlabelled duplicates), with the share of the group's own members in the candidates it catches.

Fine-tune (``--finetune``): B6's harness on B4's setup (all-MiniLM-L6-v2 fine-tuned end to end,
4,800 pairs = 150 steps at batch 32, pool 1,000 / 2,400), the same batches as the groups-known run
(B6's ``two_queue-32``, from its cache), the two-queue objective trained with the groups withheld,
without and with ``guide=momentum`` (the EMA key encoder's own keys: no extra cost). One run per
process (``--finetune-only NAME``), so two go in parallel on two cores.

Writes benchmarks/results/false_negatives.{md,json,png}; finished runs are cached in
benchmarks/results/false_negatives_e<epochs>_runs.jsonl and false_negatives_finetune_runs.jsonl
(committed), so a rerun resumes.

    python -m benchmarks.false_negatives [--quick] [--seeds 0,1,2] [--deadline HH:MM]
    python -m benchmarks.false_negatives --finetune --finetune-only "withheld + guide momentum"
"""
from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

from benchmarks.harness import cli, equal_data
from benchmarks.harness.equal_data import INBATCH, TWO_QUEUE, Evaluator, pair_batches, run_ours
from benchmarks.harness.report import environment, f3, figure, log, median, std
from benchmarks.harness.runs import cached_keys, md_table, read_jsonl, run_missing, write_results
from benchmarks.harness.training import FROZEN_BASE, Bench, Runner, compose_cfg

import torch

NAME = "false_negatives"
BASE = ["+experiment=frozen_queue", "objective.queue_size=4096"]
RUNS = {  # name -> (groups withheld, overrides)
    "groups known": (False, []),
    "groups withheld": (True, []),
    "withheld + guide base": (True, ["objective.guide=base"]),
    "withheld + guide minilm": (True, ["objective.guide=minilm"]),
    "withheld + guide minilm, margin 0.05": (True, ["objective.guide=minilm", "objective.guide_margin=0.05"]),
}
GUIDES = {"base": 0.0, "minilm": 0.0, "minilm, margin 0.05": 0.05}
FT_RUNS = {  # fine-tune: name -> overrides on B6's two_queue-32 (groups withheld)
    "withheld": [],
    "withheld + guide momentum": ["objective.guide=momentum"],
}
FT_PAIRS, FT_POOL = 4800, (1000, 2400)


def withheld(bench: Bench) -> Bench:
    """The same data with every training pair's group removed (-1), as a user's data would come."""
    out = copy.copy(bench)
    out.train_pairs = [dataclasses.replace(p, group=-1) for p in bench.train_pairs]
    return out


def guide_encoder(name: str):
    from moco_retrieval.model.loading import build_guide_encoder

    cfg = compose_cfg(FROZEN_BASE + BASE)
    return build_guide_encoder(name.split(",")[0], cfg.model)


def warm_guide(bench: Bench, name: str):
    """The guide's features of every training and pool text, computed once (disk cache)."""
    enc = guide_encoder(name)
    t0 = time.perf_counter()
    n = enc.warm_features([p.query for p in bench.train_pairs], [p.positive for p in bench.train_pairs], progress=True)
    log(f"guide {name}: {n:,} texts encoded in {time.perf_counter() - t0:.0f}s")
    bench._keep.append(enc.feature_cache)
    return enc


@torch.no_grad()
def false_mask_rate(bench: Bench, enc, margin: float, batches: int = 100, window: int = 4096, seed: int = 0) -> dict:
    """What the guide masks on random batches against a random window of documents, judged by the
    withheld groups (and ids) of the training pairs."""
    from moco_retrieval.objectives.guided import GuidedMask

    pairs = bench.train_pairs
    g = torch.Generator().manual_seed(seed)
    rule = GuidedMask(margin)
    n_masked = n_in_group = n_group_cands = n_group_caught = rows = 0
    for _ in range(batches):
        idx = torch.randperm(len(pairs), generator=g)[: 32 + window].tolist()
        batch, cands = [pairs[i] for i in idx[:32]], [pairs[i] for i in idx[32:]]
        gq = enc({"texts": [p.query for p in batch]}, "query")
        gp = enc({"texts": [p.positive for p in batch]}, "doc")
        gc = enc({"texts": [p.positive for p in cands]}, "doc")
        r, c = rule.pairs(gq, gp, gc)
        groups = torch.tensor([p.group for p in batch])
        c_groups = torch.tensor([p.group for p in cands])
        same = (groups.unsqueeze(1) == c_groups.unsqueeze(0)) & (groups.unsqueeze(1) >= 0)
        n_masked += r.numel()
        n_in_group += int(same[r, c].sum())
        n_group_cands += int(same.sum())
        hit = torch.zeros_like(same)
        hit[r, c] = True
        n_group_caught += int((hit & same).sum())
        rows += len(batch)
    return {
        "masked_per_query": n_masked / rows,
        "in_group_share": n_in_group / max(1, n_masked),
        "false_mask_rate": 1 - n_in_group / max(1, n_masked),
        "group_members_per_query": n_group_cands / rows,
        "group_recall": n_group_caught / max(1, n_group_cands),
    }


def finetune(args, out_dir: Path) -> list[dict]:
    """B4-setup fine-tunes with the groups withheld (see the module docstring); cached records."""
    from moco_retrieval.data.sources import cap_eval_set

    cache = out_dir / "false_negatives_finetune_runs.jsonl"
    todo = [n for n in (args.finetune_only.split(";") if args.finetune_only else FT_RUNS) if n]
    if not all(f"{n}|seed=0" in cached_keys(cache) for n in todo):
        bench = Bench()
        hidden = withheld(bench)
        pool = cap_eval_set(bench.eval_set, *FT_POOL, seed=0)
        batches = pair_batches(bench, 0, FT_PAIRS, 32)  # the groups-known run's batches

        def run(name: str, seed: int) -> dict:
            ev = Evaluator(pool, compose_cfg(equal_data.BASE + INBATCH).eval, 1600, 32, len(batches))
            log(f"B7 fine-tune {name}: {len(batches)} steps of 32, groups withheld")
            info = run_ours(hidden, TWO_QUEUE + FT_RUNS[name], batches, 0, ev)
            return {"key": f"{name}|seed=0", "name": name, "seed": 0, "final": ev.curve[-1], "curve": ev.curve,
                    "train_s": ev.train_s, "last_step": info.get("last_step", {})}

        run_missing(cache, todo, [0], None, lambda name, seed: f"{name}|seed={seed}", run)
    return finetune_records(out_dir)


def finetune_records(out_dir: Path) -> list[dict]:
    """The fine-tune section's finished runs, after the groups-known reference from B6's cache."""
    recs = list({r["key"]: r for r in read_jsonl(out_dir / "false_negatives_finetune_runs.jsonl")}.values())
    known = [r for r in read_jsonl(out_dir / f"finetune_{FT_PAIRS}pairs_runs.jsonl") if r["name"] == "two_queue-32" and r["seed"] == 0]
    if known:
        recs.insert(0, {**known[0], "name": "groups known (B6 two_queue-32)"})
    return recs


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a 6,000-pair slice, 1 epoch, seed 0 (minutes)")
    cli.add_seeds(ap, None, "comma-separated seeds (default 0,1,2; quick 0)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs of every run (default 1)")
    cli.add_only(ap, list(RUNS), ",".join(RUNS), "runs to do now (the others are read from the cache)")
    cli.add_deadline(ap)
    ap.add_argument("--finetune", action="store_true", help="run the fine-tune section (see above) instead")
    ap.add_argument("--finetune-only", default=None, help="';'-separated fine-tune runs to do now")
    cli.add_report(ap, "only write the report from the caches")
    cli.add_common(ap)
    args = ap.parse_args(argv)
    cli.apply(args)
    q = args.quick
    seeds = cli.seeds(args.seeds or ("0" if q else "0,1,2"))
    epochs = args.epochs or 1
    out_dir = cli.out_dir(args)
    prefix = f"{NAME}_quick" if q else NAME
    if args.finetune:
        finetune(args, out_dir)
        return 0
    t0 = time.time()
    bench = Bench(max_train_examples=6000 if q else None)
    hidden = withheld(bench)
    log(f"B7: {len(bench.train_pairs):,} pairs, pool {len(bench.eval_set.corpus):,} docs; epochs {epochs}, seeds {seeds}")
    only = set() if args.report else set(cli.names(args.only, list(RUNS)))
    guides = {}
    for name in () if args.report else ("base", "minilm"):  # base always (free: the backbone's cached features); minilm when its runs are on
        if name == "base" or any(f"guide={name}" in " ".join(ov) for run, (_, ov) in RUNS.items() if run in only):
            guides[name] = warm_guide(bench, name)
    base = BASE + [f"trainer.max_epochs={epochs}"]
    cache = out_dir / f"{prefix}_e{epochs}_runs.jsonl"  # runs of another length never mix
    runners = {w: Runner(b, base, cache, False, deadline=args.deadline) for w, b in ((False, bench), (True, hidden))}
    records: dict[str, list[dict]] = {}
    for s in seeds:  # every run of a seed before the next seed: a deadline cuts whole seeds
        for name, (hide, ov) in RUNS.items():
            records.setdefault(name, []).extend(
                runners[hide].runs(name in only, [("fn", name, ov, s, {"groups_withheld": hide})]))
    rates = previous_rates(out_dir / f"{prefix}.json") if args.report else {}
    for label, margin in GUIDES.items():  # the guides of the runs done now (a MiniLM guide costs an encoding pass)
        enc = guides.get(label.split(",")[0])
        if enc is not None:
            rates[label] = false_mask_rate(bench, enc, margin)
            log(f"false-mask rate, guide {label}: {rates[label]}")
    report(records, rates, args, out_dir, prefix, epochs, seeds, runners, time.time() - t0)
    return 0


def previous_rates(path: Path) -> dict:
    """--report: the offline false-mask rates of the last full invocation (they need the guides'
    encodings, which a report-only invocation does not compute)."""
    return json.loads(path.read_text()).get("false_mask", {}) if path.exists() else {}


def _summary(recs: list[dict]) -> dict:
    r1 = [r["metrics"]["recall@1"] for r in recs]
    nd = [r["metrics"]["ndcg@10"] for r in recs]
    last = lambda k: median([r["last_step"].get(f"train/{k}") for r in recs])  # noqa: E731
    return {"n": len(recs), "recall@1": median(r1), "recall@1_std": std(r1), "ndcg@10": median(nd), "ndcg@10_std": std(nd),
            "unrelated_cos": median([r["unrelated_cos_mean"] for r in recs]),
            "masked_by_group": last("masked_by_group"), "masked_by_guide": last("masked_by_guide"),
            "train_s": median([r["train_s"] for r in recs]), "seeds": [r["seed"] for r in recs]}


def guide_masked(last_step: dict) -> str:
    """The two-queue run's guide-masked count per query: query -> document's; runs cached before the
    objective counted per direction logged both directions summed (and no doc -> query count)."""
    v = f3(last_step.get("train/masked_by_guide"))
    return v if "train/masked_per_query_doc_to_query" in last_step or v == "n/a" else f"{v} (both directions)"


def report(records, rates, args, out_dir, prefix, epochs, seeds, runners, wall) -> None:
    summ = {n: _summary(v) for n, v in records.items() if v}
    known, hidden = summ.get("groups known"), summ.get("groups withheld")
    gain = (known["recall@1"] - hidden["recall@1"]) if known and hidden else None
    # a share of the gain only means something when there is a gain beyond the seeds' spread
    real_gain = gain is not None and gain > 2 * max(known["recall@1_std"], hidden["recall@1_std"])
    rows = []
    for n, s in summ.items():
        rec = None
        if real_gain and n.startswith("withheld +") and hidden:
            rec = (s["recall@1"] - hidden["recall@1"]) / gain
        rows.append([n, s["n"], f"{f3(s['recall@1'])} ± {f3(s['recall@1_std'])}", f"{f3(s['ndcg@10'])} ± {f3(s['ndcg@10_std'])}",
                     f"{s['unrelated_cos']:+.3f}", f3(s["masked_by_group"]), f3(s["masked_by_guide"]),
                     "n/a" if rec is None else f"{100 * rec:.0f}%", f"{s['train_s']:.0f}"])
    md = [f"# B7: guided false-negative masking with the groups withheld{' (quick)' if args.quick else ''}", "",
          "Generated by `python -m benchmarks.false_negatives`. Frozen bag-of-wordpieces backbone + linear head, Debian "
          f"({len(runners[False].bench.train_pairs):,} training pairs; held-out pool {len(runners[False].bench.eval_set.corpus):,} "
          f"documents), `+experiment=frozen_queue` at K 4,096, batch 32, tau 0.02, {epochs} epoch(s); median ± std over seeds.",
          "", md_table(["run", "seeds", "recall@1", "nDCG@10", "unrelated cos", "masked by group / query (last step)",
                        "masked by guide / query", "share of the group gain recovered", "train s"], rows), ""]
    if gain is not None:
        md += [f"Group masking's gain (known - withheld): {gain:+.4f} recall@1"
               + ("." if real_gain else " (within 2 std of the seeds: no gain for a guide to recover)."), ""]
    md += ["## What each guide masks (offline: 100 random batches of 32 against 4,096 random training documents)", "",
           md_table(["guide", "masked / query", "in the withheld group", "false-mask rate", "group members / query",
                     "group members caught"],
                    [[k, f"{v['masked_per_query']:.2f}", f"{100 * v['in_group_share']:.2f}%", f"{100 * v['false_mask_rate']:.2f}%",
                      f"{v['group_members_per_query']:.2f}", f"{100 * v['group_recall']:.1f}%"] for k, v in rates.items()]),
           "", "A false mask here is a masked candidate outside the positive's source package: some are real "
           "duplicates the groups do not label (Debian's near-identical descriptions across sources), so the rate is "
           "an upper bound.", ""]
    ft = finetune_records(out_dir)
    if ft:
        md += ["## Fine-tune (B4's setup: MiniLM end to end, 150 steps x 32, the same batches; two-queue objective; seed 0)", "",
               md_table(["run", "recall@1", "MRR@10", "nDCG@10", "unrelated cos", "masked by guide / query, query -> document (last step)", "train s"],
                        [[r["name"], f3(r["final"]["recall@1"]), f3(r["final"]["mrr@10"]), f3(r["final"]["ndcg@10"]),
                          f"{r['final']['unrelated_cos_mean']:+.3f}",
                          guide_masked(r.get("last_step", {})), f"{r['train_s']:.0f}"] for r in ft]), ""]
    cut = sorted(set(runners[False].cut + runners[True].cut))
    if cut:
        md += ["## Not run", "", "Not selected with --only or past the deadline (the cache resumes them): " + ", ".join(cut)
               + ". The MiniLM guide needs a MiniLM pass over every training text (about 2 hours on this 2-core "
               "CPU, measured at 1-25 texts/s under load).", ""]
    data = {"benchmark": NAME, "epochs": epochs, "seeds": seeds, "summary": summ, "group_gain": gain, "finetune": ft,
            "false_mask": rates, "cut": cut, "wall_s": wall, "environment": environment(),
            "runs": [{k: v for k, v in r.items() if k != "module"} for recs in records.values() for r in recs]}
    write_results(prefix, "\n".join(md), data, out_dir)
    plot(summ, out_dir / f"{prefix}.png")


def plot(summ: dict, path: Path) -> None:
    if not summ:
        return
    fig = figure(7.5, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    names = list(summ)
    ys = [summ[n]["recall@1"] for n in names]
    es = [summ[n]["recall@1_std"] for n in names]
    # points, not bars: the axis is zoomed to where the runs differ
    for i, (y, e) in enumerate(zip(ys, es)):
        ax.errorbar([y], [i], xerr=[e], fmt="o", capsize=4, color="#555" if i == 0 else ("#c44" if i == 1 else "#48c"))
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    lo = min(ys) - 0.02
    ax.set_xlim(lo, max(ys) + 0.01)
    ax.set_xlabel("recall@1 (held-out pool; median over seeds)")
    ax.set_title("Guided masking with the groups withheld (B7)")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
