"""B15: training from documents alone (issue 45), the regime the queue was made for.

**(a) Pre-training a small encoder from scratch.** A BERT-shaped encoder (``--hidden`` 128, 2
layers, all-MiniLM-L6-v2's WordPiece vocabulary), randomly initialised (the same weights for a seed
in every run), trained on documents alone: the Debian training set's long descriptions (its queries
unused) and the standard library's docstrings, each drawn as two random crops with word deletion
(``data=documents``, Contriever's views). Every run sees the same number of documents
(``--epochs`` passes), so a smaller batch takes more steps. Zero-shot recall on the Debian held-out
pool (its real queries, 1,000 of them against 2,400 documents). Rows: in-batch negatives at batch
8, 32 and 256, MoCo and the main job's two-queue objective at batch 8 and 32, scaled to the batch
as the README scales the main job; the untrained encoder as the floor. The question: does a queue
at batch 32 reach in-batch 256?

**(b) Domain adaptation of all-MiniLM-L6-v2** on one corpus's documents alone (the Debian
descriptions, or the standard library's docstrings), in-batch negatives against the main job's
two-queue objective, both at batch 32 and lr 2e-5 for ``--adapt-steps`` steps, scored on that
corpus's held-out pool (its real queries) before training and every ``--adapt-every`` steps: where
adaptation peaks, and whether it ever falls below the model it started from.

**(c) Documents, then pairs.** all-MiniLM-L6-v2 adapted on the Debian descriptions alone
(``--then-steps`` steps of (b)'s in-batch or queue row), then B6's main job (the two-queue
objective at batch 32 on B6's 18,240 Debian pairs in B6's order, scored on B6's pool), against B6's
cached main job from all-MiniLM-L6-v2 as it comes (``finetune_runs.jsonl``): does adaptation
before the labelled pairs pay?

Finished runs go to ``benchmarks/results/documents_runs.jsonl`` (committed): later invocations
resume; parallel processes share the work (``--only NAME --seeds S``, one thread each).

    python -m benchmarks.documents --only inbatch-256,queue-32 --seeds 0,1,2 --threads 1
    python -m benchmarks.documents --only adapt_queue-debian,adapt_inbatch-debian --threads 1
    python -m benchmarks.documents --only then_main-inbatch --threads 1
    python -m benchmarks.documents --report
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.harness import cli
from benchmarks.harness.cli import RESULTS
from benchmarks.harness.report import environment, log, med_std
from benchmarks.harness.runs import md_table, read_jsonl, run_selected, write_results
from benchmarks.harness.training import compose_cfg, quiet_trainer

NAME = "documents"
CACHE = RESULTS / f"{NAME}_runs.jsonl"


def _queue(objective: str, batch: int) -> list[str]:
    """The main job's queue settings scaled to ``batch`` (README): the age bound x 32/b, 1 - m x b/32."""
    age = 128 * 32 // batch
    return [f"objective={objective}", f"objective.momentum={1 - 0.005 * batch / 32:.6g}",
            f"objective.queue_max_age={age}", f"objective.queue_size={age * batch}"]


# name -> (batch, overrides, what); headline rows first
RUNS: dict[str, tuple[int, list[str], str]] = {
    "inbatch-256": (256, ["objective=inbatch"], "in-batch negatives, batch 256"),
    "queue-32": (32, _queue("two_queue", 32), "the main job's two-queue objective, batch 32"),
    "inbatch-32": (32, ["objective=inbatch"], "in-batch negatives, batch 32"),
    "inbatch-8": (8, ["objective=inbatch"], "in-batch negatives, batch 8"),
    "queue-8": (8, _queue("two_queue", 8), "the two-queue objective, batch 8"),
    "moco-32": (32, _queue("moco", 32), "MoCo (one document queue), batch 32"),
    "moco-8": (8, _queue("moco", 8), "MoCo, batch 8"),
    "untrained": (32, ["objective=inbatch"], "the randomly initialised encoder, not trained"),
}
SEEDS = {"inbatch-256": (0, 1, 2), "queue-32": (0, 1, 2)}  # the headline rows; the others seed 0
# (b): name -> (corpus, overrides, what)
ADAPT: dict[str, tuple[str, list[str], str]] = {
    "adapt_queue-debian": ("debian", _queue("two_queue", 32), "the two-queue objective on the Debian descriptions"),
    "adapt_inbatch-debian": ("debian", ["objective=inbatch"], "in-batch negatives on the Debian descriptions"),
    "adapt_queue-stdlib": ("stdlib", _queue("two_queue", 32), "the two-queue objective on the stdlib docstrings"),
    "adapt_inbatch-stdlib": ("stdlib", ["objective=inbatch"], "in-batch negatives on the stdlib docstrings"),
}
# (c): name -> the adaptation of (b) it starts with
THEN: dict[str, str] = {"then_main-inbatch": "adapt_inbatch-debian", "then_main-queue": "adapt_queue-debian"}


# ------------------------------------------------------------------------------------- inputs


def one_corpus(folder: Path, which: str) -> tuple[Path, Path]:
    """(b): one corpus's training documents alone (texts only) and its held-out pool."""
    corpus(folder)  # builds both sets
    from moco_retrieval.data.formats import read_pairs_jsonl
    from moco_retrieval.data.sources import debian_folder

    source = debian_folder(compose_cfg(["data=debian"]).data) if which == "debian" else folder / "pydoc"
    out = folder / f"documents-{which}.jsonl"
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        texts = dict.fromkeys(p.positive for p in read_pairs_jsonl(source / "train.jsonl"))
        tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        tmp.replace(out)
    return out, source / "eval"


def corpus(folder: Path) -> tuple[Path, Path, dict]:
    """The documents (Debian's training documents and the stdlib docstrings, texts only, built
    once into ``folder``) and the Debian eval folder; with their counts."""
    from moco_retrieval.data.builders.stdlib_docs import build_stdlib_docs
    from moco_retrieval.data.formats import read_pairs_jsonl
    from moco_retrieval.data.sources import debian_folder

    debian = debian_folder(compose_cfg(["data=debian"]).data)
    out = folder / "documents.jsonl"
    counts_file = folder / "counts.json"
    if not out.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        pydoc = folder / "pydoc"
        if not (pydoc / "train.jsonl").is_file():
            build_stdlib_docs(pydoc)
        seen: set[str] = set()
        counts = {"debian": 0, "stdlib": 0}
        tmp = out.with_suffix(".tmp")
        with tmp.open("w") as f:
            for name, path in (("debian", debian / "train.jsonl"), ("stdlib", pydoc / "train.jsonl")):
                for p in read_pairs_jsonl(path):
                    if p.positive not in seen:
                        seen.add(p.positive)
                        counts[name] += 1
                        f.write(json.dumps({"text": p.positive}) + "\n")
        tmp.replace(out)
        counts_file.write_text(json.dumps(counts))
    return out, debian / "eval", json.loads(counts_file.read_text())


def small_bert(folder: Path, hidden: int, seed: int) -> Path:
    """A randomly initialised BERT of ``hidden`` units and 2 layers with MiniLM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from moco_retrieval.config import ModelConfig
    from moco_retrieval.model.backbone import resolve_backbone_path

    out = folder / f"bert-h{hidden}-seed{seed}"
    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(resolve_backbone_path(ModelConfig(backbone="minilm")))
    torch.manual_seed(seed)
    model = BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=2,
                                 num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                                 max_position_embeddings=512), add_pooling_layer=False)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.replace(out)
    return out


# ---------------------------------------------------------------------------------------- runs


def run_key(name: str, seed: int, args) -> str:
    return f"a:{name}|seed={seed}|hidden={args.hidden}|epochs={args.epochs}|docs={args.docs}|lr={args.lr}"


def do_run(name: str, seed: int, args) -> dict:
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.evaluation.encode import evaluate_encoder
    from moco_retrieval.training.module import RetrievalModule
    import lightning as L

    folder = cli.bench_cache(NAME)
    docs, eval_dir, counts = corpus(folder)
    batch, overrides, what = RUNS[name]
    model = small_bert(folder, args.hidden, seed)
    cfg = compose_cfg([f"model.path={model}", "model.query_max_len=64", "model.doc_max_len=64",
                       "trainer=cpu", "logger=none", "data=documents", f"data.path={docs}", f"data.eval_dir={eval_dir}",
                       f"data.batch_size={batch}", "data.max_eval_queries=1000", "data.max_eval_docs=2400",
                       f"data.max_train_examples={args.docs}", f"trainer.max_epochs={args.epochs}",
                       f"optim.lr={args.lr}", f"seed={seed}", f"data.seed={seed}", *overrides])
    L.seed_everything(seed, workers=False, verbose=False)
    module = RetrievalModule.from_config(cfg)
    dm = RetrievalDataModule(cfg.data, tokenize=module.encoder.tokenize)
    dm.setup("fit")
    t0 = time.perf_counter()
    steps = 0
    if name != "untrained":
        trainer = quiet_trainer(cfg)
        trainer.fit(module, datamodule=dm)
        steps = int(trainer.global_step)
    train_s = time.perf_counter() - t0
    res = evaluate_encoder(module.encoder, dm.eval_set, module.eval_cfg, show_progress=False)
    rec = {"key": run_key(name, seed, args), "part": "a", "name": name, "seed": seed, "what": what, "batch_size": batch,
           "overrides": overrides, "steps": steps, "documents_seen": steps * batch, "train_s": round(train_s, 1),
           "metrics": {k: float(v) for k, v in res.metrics.items()},
           "unrelated_cos_mean": res.geometry.get("unrelated_cos_mean"), "corpus": counts,
           "hidden": args.hidden, "epochs": args.epochs, "lr": args.lr, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    log(f"B15 {name} seed {seed}: recall@1 {rec['metrics']['recall@1']:.3f} recall@10 {rec['metrics']['recall@10']:.3f} "
        f"({steps} steps, {train_s:.0f}s)")
    return rec


def adapt_key(name: str, seed: int, args) -> str:
    return f"b:{name}|seed={seed}|steps={args.adapt_steps}|every={args.adapt_every}"


def do_adapt(name: str, seed: int, args) -> dict:
    """(b): all-MiniLM-L6-v2 adapted on one corpus's documents, scored before and along the way."""
    return adapt(name, seed, args, args.adapt_steps, args.adapt_every)[0]


def adapt(name: str, seed: int, args, steps: int, every: int) -> tuple[dict, object]:
    """(b)'s adaptation ``name`` for ``steps`` steps, scored every ``every``: (record, the module)."""
    import lightning as L

    from benchmarks.harness.equal_data import metrics
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.evaluation.encode import evaluate_encoder
    from moco_retrieval.training.module import RetrievalModule

    which, overrides, what = ADAPT[name]
    docs, eval_dir = one_corpus(cli.bench_cache(NAME), which)
    cfg = compose_cfg(["model=minilm", "trainer=cpu", "logger=none", "data=documents", f"data.path={docs}",
                       f"data.eval_dir={eval_dir}", "data.batch_size=32", "data.max_eval_queries=1000",
                       "data.max_eval_docs=2400", f"trainer.max_steps={steps}", "trainer.max_epochs=1000",
                       "optim.lr=2e-5",
                       f"seed={seed}", f"data.seed={seed}", *overrides])
    L.seed_everything(seed, workers=False, verbose=False)
    module = RetrievalModule.from_config(cfg)
    dm = RetrievalDataModule(cfg.data, tokenize=module.encoder.tokenize)
    dm.setup("fit")
    curve: list[dict] = []

    def score(step: int) -> None:
        was = module.encoder.training
        module.encoder.eval()
        res = evaluate_encoder(module.encoder, dm.eval_set, module.eval_cfg, batch_size=64, show_progress=False)
        module.encoder.train(was)
        curve.append({"step": step, **metrics(res)})
        log(f"  B15 {name} step {step}: recall@1 {curve[-1]['recall@1']:.3f}")

    class Along(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step % every == 0:
                score(trainer.global_step)

        def on_train_end(self, trainer, pl_module):
            if curve[-1]["step"] != trainer.global_step:
                score(trainer.global_step)

    score(0)
    t0 = time.perf_counter()
    quiet_trainer(cfg, callbacks=[Along()]).fit(module, datamodule=dm)
    best = max(curve, key=lambda p: p["recall@1"])
    rec = {"key": adapt_key(name, seed, args), "part": "b", "name": name, "seed": seed, "what": what, "corpus": which,
           "overrides": overrides, "steps": curve[-1]["step"], "wall_s": round(time.perf_counter() - t0, 1),
           "curve": curve, "before": curve[0]["recall@1"], "final": curve[-1]["recall@1"],
           "peak": best["recall@1"], "peak_step": best["step"], "documents": sum(1 for _ in docs.open()),
           "pool_queries": len(dm.eval_set.queries), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    log(f"B15 {name} seed {seed}: recall@1 {rec['before']:.3f} before, {rec['final']:.3f} after {rec['steps']} "
        f"steps, peak {rec['peak']:.3f} at step {rec['peak_step']}")
    return rec, module


def then_key(name: str, seed: int, args) -> str:
    return f"c:{name}|seed={seed}|adapt_steps={args.then_steps}|{B6_PROTOCOL}"


B6_PROTOCOL = "pairs=18240|pool=1000x2400"  # B6's (finetune.py's) protocol, as its run keys end


def do_then(name: str, seed: int, args) -> dict:
    """(c): (b)'s adaptation THEN[name] for ``--then-steps`` steps, saved as a model folder, then B6's
    main job from it on B6's pairs, order and pool."""
    import argparse

    from benchmarks.harness import equal_data
    from moco_retrieval.export.writer import export_encoder

    adapted_rec, module = adapt(THEN[name], seed, args, args.then_steps, args.then_steps)
    folder = cli.bench_cache(NAME) / f"adapted-{THEN[name]}-s{seed}-{args.then_steps}"
    if not (folder / "model.safetensors").is_file():
        export_encoder(module.encoder, folder, overwrite=True)
    del module
    b6 = argparse.Namespace(dry_run=False, pairs=None, eval_every=None, max_queries=None, max_docs=None, out=None)
    equal_data.settle(b6, "finetune")
    kind, batch, overrides, _ = equal_data.RUNS[equal_data.MAIN_RUN]
    run = (kind, batch, [*overrides, f"model.path={folder}"], f"the main job from {THEN[name]} ({args.then_steps} steps)")

    def make(bench, pool, _name, s, a):
        return equal_data.trained(bench, pool, f"B15 {name}", run, equal_data.batches_of(bench, s, a.pairs, batch), s,
                                  a.eval_every)

    rec = equal_data.runner(b6, make)(name, seed)
    return {"key": then_key(name, seed, args), "part": "c", "name": name, "adapted": {k: adapted_rec[k] for k in
            ("name", "before", "final", "steps")}, **rec}


# -------------------------------------------------------------------------------------- report


def report(args, out: Path) -> None:
    recs = [r for r in read_jsonl(CACHE) if r["key"].endswith(run_key("", 0, args).split("|", 2)[2])]
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(r["name"], []).append(r)
    rows = []
    for name, (batch, _, what) in RUNS.items():
        xs = by.get(name, [])
        if not xs:
            rows.append([name, what, batch, 0, "not run", "", "", "", ""])
            continue
        cell = lambda k: "{:.3f} ± {:.3f}".format(*med_std([x["metrics"][k] for x in xs])) if len(xs) > 1 else f"{xs[0]['metrics'][k]:.3f}"  # noqa: E731
        rows.append([name, what, batch, len(xs), cell("recall@1"), cell("recall@10"), cell("ndcg@10"),
                     f"{med_std([x['unrelated_cos_mean'] for x in xs])[0]:.3f}",
                     f"{xs[0]['steps']} / {med_std([x['train_s'] for x in xs])[0]:.0f}"])
    counts = {k: f"{v:,}" for k, v in (recs[0]["corpus"] if recs else {}).items()}
    lines = [f"# B15: training from documents alone\n",
             f"Part (a): a randomly initialised BERT ({args.hidden} hidden units, 2 layers, MiniLM's vocabulary) "
             f"trained on {counts.get('debian', '?')} Debian descriptions and {counts.get('stdlib', '?')} standard-library "
             f"docstrings (capped at {args.docs:,} documents), {args.epochs} epoch(s), every document drawn as two crops "
             f"(data=documents, Contriever's views), lr {args.lr}, 1 thread each on a shared 2-core CPU. Zero-shot on the "
             "Debian held-out pool (1,000 real queries, 2,400 documents). Medians ± spread over seeds.\n",
             md_table(["run", "what", "batch", "seeds", "recall@1", "recall@10", "nDCG@10", "unrelated cos",
                       "steps / train s"], rows), "",
             "## The question: does the queue at batch 32 reach in-batch 256?\n"]
    # the question, then what isolates the queue (the same batch, steps and documents) and MoCo's one queue
    for a, b in (("queue-32", "inbatch-256"), ("queue-32", "inbatch-32"), ("moco-32", "inbatch-256")):
        xa, xb = by.get(a, []), by.get(b, [])
        if not (xa and xb):
            lines.append(f"- {a} vs {b}: not measured yet")
            continue
        ma, mb = (med_std([x["metrics"]["recall@1"] for x in xs])[0] for xs in (xa, xb))
        theirs = {x["seed"]: x["metrics"]["recall@1"] for x in xb}
        diffs = [x["metrics"]["recall@1"] - theirs[x["seed"]] for x in xa if x["seed"] in theirs]
        lines.append(f"- recall@1 {a} vs {b}: {ma:.3f} vs {mb:.3f} ({ma - mb:+.3f}); seed by seed "
                     + " / ".join(f"{d:+.3f}" for d in diffs))
    adapt = [r for r in read_jsonl(CACHE) if r["key"].endswith(adapt_key("", 0, args).split("|", 2)[2])]
    lines += ["", "## (b) Adapting all-MiniLM-L6-v2 to one corpus's documents\n",
              f"Batch 32, lr 2e-5, {args.adapt_steps} steps (warm-up a tenth), scored on the corpus's held-out pool "
              f"(real queries) before training and every {args.adapt_every} steps.\n"]
    if adapt:
        steps = sorted({p["step"] for r in adapt for p in r["curve"]})
        rows = []
        for r in sorted(adapt, key=lambda r: (r["name"], r["seed"])):
            gain = [p["recall@1"] - r["curve"][0]["recall@1"] for p in r["curve"]]
            rows.append([r["name"], r["seed"], f"{r['documents']:,}", r["pool_queries"],
                         *[next((f"{p['recall@1']:.3f}" for p in r["curve"] if p["step"] == s), "") for s in steps],
                         f"{r['peak']:.3f} ({r['peak_step']})", f"{min(gain[1:]):+.3f}"])
        lines.append(md_table(["run", "seed", "documents", "pool queries", *[f"step {s}" for s in steps], "peak (step)",
                               "worst vs step 0"], rows))
        lines.append("\nrecall@1 at each step (step 0: all-MiniLM-L6-v2 as it comes; its pool is capped by a seeded "
                     "draw, so step 0 differs by seed). Gains over step 0, median over seeds:\n")
        for n in ADAPT:
            xs = [r for r in adapt if r["name"] == n]
            if xs:
                at = {s: [p["recall@1"] - r["curve"][0]["recall@1"] for r in xs for p in r["curve"] if p["step"] == s]
                      for s in steps}
                lines.append(f"- {n} ({len(xs)} seed(s)): " + ", ".join(
                    f"step {s} {med_std(v)[0]:+.3f}" for s, v in at.items() if v and s))
    else:
        lines.append("Not run yet.")
    missing = [f"{n} (seed {s})" for n in RUNS for s in SEEDS.get(n, (0,))
               if not any(x["seed"] == s for x in by.get(n, []))]
    missing += [f"{n} (seed 0)" for n in ADAPT if not any(r["name"] == n for r in adapt)]
    from benchmarks.harness.equal_data import MAIN_RUN

    then = [r for r in read_jsonl(CACHE) if r["key"].endswith(then_key("", 0, args).split("|", 2)[2])]
    main_alone = [r for r in read_jsonl(RESULTS / "finetune_runs.jsonl")
                  if r.get("name") == MAIN_RUN and r["key"].endswith(B6_PROTOCOL)]
    lines += ["", "## (c) Documents, then pairs\n",
              f"(b)'s adaptation on the Debian descriptions for {args.then_steps} steps, then B6's main job (two-queue, "
              "batch 32, 18,240 Debian pairs in B6's order, B6's pool of 1,000 queries x 2,400 documents), against B6's "
              "main job from all-MiniLM-L6-v2 as it comes.\n"]
    rows = [[r["name"], r["seed"], f"{r['adapted']['before']:.3f} -> {r['adapted']['final']:.3f}",
             f"{r['final']['recall@1']:.3f}", f"{r['final']['ndcg@10']:.3f}"] for r in sorted(then, key=lambda r: (r["name"], r["seed"]))]
    rows += [["main job alone (B6)", r["seed"], "", f"{r['final']['recall@1']:.3f}", f"{r['final']['ndcg@10']:.3f}"]
             for r in sorted(main_alone, key=lambda r: r["seed"])]
    lines.append(md_table(["run", "seed", "adaptation (its pool's recall@1)", "recall@1", "nDCG@10"], rows)
                 if then else "Not run yet.")
    missing += [f"{n} (seed 0)" for n in THEN if not any(r["name"] == n for r in then)]
    lines += ["", "## Not run yet\n", ", ".join(missing) if missing else "(none)"]
    write_results(NAME, "\n".join(lines) + "\n", {"runs": recs, "adapt": adapt, "then": then, "environment": environment(),
                                                  "protocol": vars(args)}, out)


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_common(ap)
    cli.add_selection(ap, runs=[*RUNS, *ADAPT, *THEN], default=None)
    cli.add_report(ap)
    cli.add_deadline(ap)
    ap.add_argument("--hidden", type=int, default=128, help="the small encoder's width")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the documents")
    ap.add_argument("--docs", type=int, default=20000, help="documents (a seeded subset)")
    ap.add_argument("--lr", type=float, default=5e-4, help="(a)'s learning rate")
    ap.add_argument("--adapt-steps", type=int, default=200, help="(b): steps of each adaptation")
    ap.add_argument("--adapt-every", type=int, default=50, help="(b): steps between scores")
    ap.add_argument("--then-steps", type=int, default=150, help="(c): steps of the adaptation before the main job")
    args = ap.parse_args()
    cli.apply(args)
    out = cli.out_dir(args)
    if not args.report:
        key = {**{n: adapt_key for n in ADAPT}, **{n: then_key for n in THEN}}
        make = {**{n: do_adapt for n in ADAPT}, **{n: do_then for n in THEN}}
        run_selected(CACHE, args, [*RUNS, *ADAPT, *THEN], lambda n, s: key.get(n, run_key)(n, s, args),
                     lambda: lambda n, s: make.get(n, do_run)(n, s, args))
    report(args, out)


if __name__ == "__main__":
    main()
