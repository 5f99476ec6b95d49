"""B3: geometry of the embedding space on the held-out Debian pool.

For each encoder: anisotropy (mean cosine of unrelated (query, document) pairs, with its 5th-95th
percentiles), mean positive cosine, alignment and uniformity (Wang & Isola 2020), and recall@1 for
reference, all from ``moco_retrieval.evaluation`` (``evaluate_encoder`` -> ``compute_geometry``):

* a randomly initialised MiniLM (all-MiniLM-L6-v2's architecture, ``AutoConfig`` + random init);
* the bag-of-wordpieces encoder (mean of MiniLM's input word embeddings, no head);
* all-MiniLM-L6-v2 as released (contrastively trained by its authors);
* our trained heads: the frozen bag-of-wordpieces backbone + linear head trained here with the
  B1 winner preset (``+experiment=frozen_queue``, tau 0.02) and with in-batch negatives at batch
  256 (``+experiment=frozen_inbatch``, tau 0.05) (``--head-presets``);
* the MiniLM fine-tuned by the main job (``--checkpoint``, default
  ../runs/queue65k/checkpoints/last.ckpt next to the repository), when it exists.

Writes benchmarks/results/geometry.{md,json}, geometry_hist.png (positive vs unrelated cosine
histograms side by side) and geometry_recall.png. The pool: 1,000 of the 3,283 held-out queries
and 2,400 documents (every relevant one kept) by default, to bound the CPU time of three MiniLM
encodings (``--max-queries 0 --max-docs 0``: all). ``--quick``: 300 queries / 600 documents and a
1-epoch head.

    python -m benchmarks.geometry [--quick] [--checkpoint PATH]
"""
from __future__ import annotations

import time
from pathlib import Path

from benchmarks.harness import cli
from benchmarks.harness.cli import ROOT
from benchmarks.harness.report import environment, f3, log, peak_rss_mb
from benchmarks.harness.runs import md_table, write_results
from benchmarks.harness.training import FROZEN_BASE, Bench, compose_cfg

import torch
from moco_retrieval.training.checkpoints import last_checkpoint

NAME = "geometry"
DEFAULT_CKPT = str(last_checkpoint(ROOT.parent / "runs" / "queue65k"))


def random_minilm(seed: int = 0):
    """A TextEncoder with all-MiniLM-L6-v2's architecture and tokenizer, weights randomly initialised."""
    from transformers import AutoConfig, AutoModel

    from moco_retrieval.config import ModelConfig
    from moco_retrieval.model.backbone import resolve_backbone_path
    from moco_retrieval.model.encoder import build_encoder

    cfg = ModelConfig(backbone="minilm", head="none")
    enc = build_encoder(cfg)
    hf = AutoConfig.from_pretrained(str(resolve_backbone_path(cfg)), local_files_only=True)
    torch.manual_seed(seed)
    try:
        model = AutoModel.from_config(hf, add_pooling_layer=False)
    except TypeError:
        model = AutoModel.from_config(hf)
    model.pooler = None
    enc.tower.backbone = model.eval()
    return enc


def bag_of_wordpieces():
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.model.encoder import build_encoder

    return build_encoder(ModelConfig(backbone="minilm", backbone_kind="bag_of_wordpieces", head="none"))


def released_minilm():
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.model.encoder import build_encoder

    return build_encoder(ModelConfig(backbone="minilm", head="none"))


# the encoders every invocation scores: name -> (factory, what it is); then the trained heads
# (--head-presets) and the fine-tuned checkpoint (--checkpoint)
ENCODERS = {
    "MiniLM, random init": (random_minilm, "all-MiniLM-L6-v2 architecture, AutoConfig + random init, mean pooling"),
    "bag-of-wordpieces": (bag_of_wordpieces, "mean of MiniLM's input word embeddings, no head"),
    "all-MiniLM-L6-v2": (released_minilm, "as released, mean pooling"),
}


class Scores:
    """Each encoder's evaluation on the pool, its note and its encode + score seconds."""

    def __init__(self, pool, ecfg):
        self.pool, self.ecfg = pool, ecfg
        self.results, self.notes, self.timing = {}, {}, {}

    def measure(self, name: str, encoder, note: str) -> None:
        from moco_retrieval.evaluation.encode import evaluate_encoder

        t = time.perf_counter()
        encoder.eval()
        with torch.no_grad():
            self.results[name] = evaluate_encoder(encoder, self.pool, self.ecfg, batch_size=64, show_progress=False)
        self.timing[name] = time.perf_counter() - t
        self.notes[name] = note
        g, r1 = self.results[name].geometry, self.results[name].metrics["recall@1"]
        log(f"{name}: unrelated {g['unrelated_cos_mean']:+.3f} [{g['unrelated_cos_p05']:+.2f}, {g['unrelated_cos_p95']:+.2f}], "
            f"positive {g['positive_cos_mean']:+.3f}, recall@1 {r1:.3f} ({self.timing[name]:.0f}s)")


def train_heads(scores: Scores, bench: Bench, presets: list[str], epochs: int | None) -> None:
    for preset in presets:
        hcfg = compose_cfg(FROZEN_BASE + [f"+experiment={preset}"] + ([f"trainer.max_epochs={epochs}"] if epochs else []))
        t = time.perf_counter()
        run = bench.fit_eval(hcfg, evaluate=False)
        head_train_s = time.perf_counter() - t
        scores.measure(f"our head ({preset}, tau {hcfg.objective.temperature})", run["module"].encoder,
                       f"bag-of-wordpieces + linear head trained with +experiment={preset}, batch {hcfg.data.batch_size}, "
                       f"{hcfg.trainer.max_epochs} epoch(s), {run['steps']} steps ({head_train_s:.0f}s)")
        del run


def score_checkpoint(scores: Scores, ckpt: Path | None) -> str | None:
    """The fine-tuned MiniLM of ``ckpt``; else the note saying why its row is left out."""
    if ckpt is None or not ckpt.is_file():
        note = f"no fine-tuned checkpoint at {ckpt}: row left out"
        log(note)
        return note
    from moco_retrieval.training.module import RetrievalModule

    m = RetrievalModule.load_from_checkpoint(str(ckpt), map_location="cpu", weights_only=False)
    step = torch.load(str(ckpt), map_location="cpu", weights_only=False).get("global_step")
    scores.measure("MiniLM fine-tuned (queue65k)", m.encoder, f"{ckpt} (global step {step}), query encoder")
    return None


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--checkpoint", default=DEFAULT_CKPT)
    ap.add_argument("--head-presets", default="frozen_queue,frozen_inbatch",
                    help="comma-separated presets to train a head with (frozen_queue: tau 0.02; frozen_inbatch: tau 0.05)")
    ap.add_argument("--head-epochs", type=int, default=None, help="epochs of the trained head (default: the preset's; quick 1)")
    ap.add_argument("--max-queries", type=int, default=1000, help="queries of the pool (0: all 3,283); quick 300")
    ap.add_argument("--max-docs", type=int, default=2400, help="documents of the pool (0: all 3,283; every relevant one kept); quick 600")
    cli.add_common(ap)
    args = ap.parse_args(argv)
    cli.apply(args)
    from moco_retrieval.data.sources import cap_eval_set

    quick = args.quick
    t0 = time.time()
    mq = (300 if quick else args.max_queries) or None
    md_ = (600 if quick else args.max_docs) or None
    bench = Bench(max_train_examples=6000 if quick else None)
    pool = cap_eval_set(bench.eval_set, mq, md_, seed=0)
    log(f"B3: pool {len(pool.corpus):,} documents / {len(pool.queries):,} queries")
    scores = Scores(pool, compose_cfg(FROZEN_BASE).eval)
    for name, (make, note) in ENCODERS.items():
        scores.measure(name, make(), note)
    train_heads(scores, bench, [p for p in args.head_presets.split(",") if p], args.head_epochs or (1 if quick else None))
    ckpt_note = score_checkpoint(scores, Path(args.checkpoint) if args.checkpoint else None)
    report(scores, ckpt_note, quick, time.time() - t0, cli.out_dir(args), NAME if not quick else f"{NAME}_quick")
    return 0


def report(scores: Scores, ckpt_note: str | None, quick: bool, wall_s: float, out_dir: Path, prefix: str) -> None:
    from moco_retrieval.evaluation.report import plot_cosine_histograms, plot_recall_curves

    results, notes, pool = scores.results, scores.notes, scores.pool
    plot_cosine_histograms(results, out_dir / f"{prefix}_hist.png")
    plot_side_by_side(results, out_dir / f"{prefix}_hist_grid.png")
    plot_recall_curves(results, out_dir / f"{prefix}_recall.png")
    rows = []
    for name, r in results.items():
        g = r.geometry
        rows.append([name, f"{g['unrelated_cos_mean']:+.3f}", f"[{g['unrelated_cos_p05']:+.2f}, {g['unrelated_cos_p95']:+.2f}]",
                     f"{g['positive_cos_mean']:+.3f}", f"{g['cos_gap']:+.3f}", f3(g["alignment"]), f3(g["uniformity"]),
                     f3(r.metrics["recall@1"]), f3(r.metrics["ndcg@10"])])
    data = {
        "benchmark": "B3 geometry", "mode": "quick" if quick else "full",
        "pool": {"docs": len(pool.corpus), "queries": len(pool.queries)},
        "models": {n: {"note": notes[n], "geometry": r.geometry, "metrics": r.metrics, "encode_eval_s": scores.timing[n]}
                   for n, r in results.items()},
        "checkpoint_note": ckpt_note, "wall_s": wall_s, "peak_rss_mb": peak_rss_mb(),
        "environment": environment(),
    }
    md = [f"# B3: geometry ({data['mode']})", "",
          f"Held-out Debian pool: {len(pool.corpus):,} documents, {len(pool.queries):,} queries. Anisotropy = mean "
          "cosine of unrelated (query, document) pairs (20,000 sampled), with its 5th-95th percentiles; alignment = "
          "E||f(q) - f(d+)||^2 (lower is better); uniformity = log E exp(-2||f(x) - f(y)||^2), the mean of the "
          "query and document sides (lower is more uniform). All on L2-normalised embeddings.", "",
          md_table(["encoder", "anisotropy (mean unrel. cos)", "unrel. 5th-95th pct", "mean pos. cos", "gap",
                    "alignment", "uniformity", "recall@1", "nDCG@10"], rows), ""]
    md += ["Encoders:", ""] + [f"- **{n}**: {notes[n]}" for n in results] + [""]
    if ckpt_note:
        md += [f"Note: {ckpt_note}.", ""]
    md += [f"![cosine histograms side by side]({prefix}_hist_grid.png)", "",
           f"![cosine histograms]({prefix}_hist.png)", "", f"![recall at k]({prefix}_recall.png)", "",
           f"Wall time {data['wall_s'] / 60:.1f} min, peak RSS {data['peak_rss_mb']:.0f} MB."]
    write_results(prefix, "\n".join(md), data, out_dir)
    log(f"wrote {out_dir / (prefix + '.md')}")


def plot_side_by_side(results: dict, path: Path, bins: int = 60) -> None:
    """One column per encoder: unrelated vs positive cosine histograms on a shared x axis."""
    import numpy as np

    from benchmarks.harness.report import figure

    n = len(results)
    fig = figure(3.0 * n, 3.2)
    axes = fig.subplots(1, n, sharex=True, squeeze=False)[0]
    edges = np.linspace(-0.4, 1.0, bins + 1)
    for ax, (name, r) in zip(axes, results.items()):
        ax.hist(np.clip(r.unrelated_cosines, -0.4, 1.0), bins=edges, density=True, alpha=0.55, color="#7f7f7f", label="unrelated")
        ax.hist(np.clip(r.positive_cosines, -0.4, 1.0), bins=edges, density=True, alpha=0.55, color="#1f77b4", label="positive")
        g = r.geometry
        ax.axvline(g["unrelated_cos_mean"], color="#404040", linestyle="--", linewidth=1)
        ax.axvline(g["positive_cos_mean"], color="#0b4f8a", linestyle="--", linewidth=1)
        ax.set_title(f"{name}\nunrel {g['unrelated_cos_mean']:+.2f}, pos {g['positive_cos_mean']:+.2f}", fontsize=8)
        ax.set_xlabel("cosine")
        ax.set_yticks([])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
