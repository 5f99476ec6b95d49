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

Part (c), adaptation then the main job, is not built yet.

Finished runs go to ``benchmarks/results/documents_runs.jsonl`` (committed): later invocations
resume; parallel processes share the work (``--only NAME --seeds S``, one thread each).

    python -m benchmarks.documents --only inbatch-256,queue-32 --seeds 0,1,2 --threads 1
    python -m benchmarks.documents --only adapt_queue-debian,adapt_inbatch-debian --threads 1
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
    import lightning as L

    from benchmarks.harness.equal_data import metrics
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.evaluation.encode import evaluate_encoder
    from moco_retrieval.training.module import RetrievalModule

    which, overrides, what = ADAPT[name]
    docs, eval_dir = one_corpus(cli.bench_cache(NAME), which)
    cfg = compose_cfg(["model=minilm", "trainer=cpu", "logger=none", "data=documents", f"data.path={docs}",
                       f"data.eval_dir={eval_dir}", "data.batch_size=32", "data.max_eval_queries=1000",
                       "data.max_eval_docs=2400", f"trainer.max_steps={args.adapt_steps}", "trainer.max_epochs=1000",
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
            if trainer.global_step % args.adapt_every == 0:
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
    return rec


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
    counts = recs[0]["corpus"] if recs else {}
    lines = [f"# B15: training from documents alone\n",
             f"Part (a): a randomly initialised BERT ({args.hidden} hidden units, 2 layers, MiniLM's vocabulary) "
             f"trained on {counts.get('debian', '?'):,} Debian descriptions and {counts.get('stdlib', '?'):,} standard-library "
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
              f"(real queries) before training and every {args.adapt_every} steps; 1 seed.\n"]
    if adapt:
        steps = sorted({p["step"] for r in adapt for p in r["curve"]})
        lines.append(md_table(["run", "documents", "pool queries", *[f"step {s}" for s in steps], "peak (step)"],
                              [[r["name"], f"{r['documents']:,}", r["pool_queries"],
                                *[next((f"{p['recall@1']:.3f}" for p in r["curve"] if p["step"] == s), "") for s in steps],
                                f"{r['peak']:.3f} ({r['peak_step']})"] for r in sorted(adapt, key=lambda r: r["name"])]))
        lines.append("\nrecall@1 at each step (step 0: all-MiniLM-L6-v2 as it comes).")
    else:
        lines.append("Not run yet.")
    missing = [f"{n} (seed {s})" for n in RUNS for s in SEEDS.get(n, (0,))
               if not any(x["seed"] == s for x in by.get(n, []))]
    missing += [f"{n} (seed 0)" for n in ADAPT if not any(r["name"] == n for r in adapt)]
    lines += ["", "## Not run yet\n", ", ".join(missing) if missing else "(none)",
              "", "Part (c) (adaptation, then the main job) is not built yet."]
    write_results(NAME, "\n".join(lines) + "\n", {"runs": recs, "adapt": adapt, "environment": environment(), "protocol": vars(args)}, out)


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_common(ap)
    cli.add_selection(ap, runs=[*RUNS, *ADAPT], default=None)
    cli.add_report(ap)
    cli.add_deadline(ap)
    ap.add_argument("--hidden", type=int, default=128, help="the small encoder's width")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the documents")
    ap.add_argument("--docs", type=int, default=20000, help="documents (a seeded subset)")
    ap.add_argument("--lr", type=float, default=5e-4, help="(a)'s learning rate")
    ap.add_argument("--adapt-steps", type=int, default=200, help="(b): steps of each adaptation")
    ap.add_argument("--adapt-every", type=int, default=50, help="(b): steps between scores")
    args = ap.parse_args()
    cli.apply(args)
    out = cli.out_dir(args)
    if not args.report:
        run_selected(CACHE, args, [*RUNS, *ADAPT], lambda n, s: (adapt_key if n in ADAPT else run_key)(n, s, args),
                     lambda: lambda n, s: (do_adapt if n in ADAPT else do_run)(n, s, args))
    report(args, out)


if __name__ == "__main__":
    main()
