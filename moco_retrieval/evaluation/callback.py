"""After each validation: what a person looks at. One time-stamped console line (recall@1,
nDCG@10, mean unrelated cosine, best recall@1 so far), a PNG histogram of positive versus
unrelated cosines in the run directory, and on W&B the same as histograms plus a table of a fixed
sample of queries with their top-5 documents, each marked relevant or not."""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger

from moco_retrieval.progress import log_line
from moco_retrieval.evaluation.report import plot_cosine_histograms, wandb_cosine_histograms, wandb_topk_table


def trained_for(trainer) -> str:
    """``"  after N min of training"``: the run clock's total (run_clock.py), over every attempt."""
    seconds = trainer.callback_metrics.get("time/train_s")
    return "" if seconds is None else f"  after {float(seconds) / 60:.1f} min of training"


class ValidationReport(Callback):
    """Args: plots_dir: where ``cosines-step{N}.png`` go; sample_queries: rows of the W&B table
    (the same queries at every validation); tables: log the W&B table at all."""

    def __init__(self, plots_dir: str | Path, sample_queries: int = 20, tables: bool = True):
        self.plots_dir, self.sample_queries, self.tables = Path(plots_dir), sample_queries, tables
        self.best: tuple[float, int] | None = None  # (recall@1, step)

    def _update_best(self, trainer, recall: float, step: int) -> tuple[float, int]:
        if self.best is None:  # a resumed run: the checkpoint callback restored the best score
            score = getattr(getattr(trainer, "checkpoint_callback", None), "best_model_score", None)
            if score is not None and float(score) > recall:
                self.best = (float(score), -1)
        if self.best is None or recall > self.best[0]:
            self.best = (recall, step)
        return self.best

    def on_validation_end(self, trainer, pl_module) -> None:
        result = getattr(pl_module, "last_val_result", None)
        if result is None or not trainer.is_global_zero or trainer.sanity_checking:
            return
        step = trainer.global_step
        m, g = result.metrics, result.geometry
        best, at = self._update_best(trainer, m["recall@1"], step)
        log_line(f"validation at step {step}: recall@1 {m['recall@1']:.4f}  ndcg@10 {m['ndcg@10']:.4f}  "
                 f"unrelated cos {g.get('unrelated_cos_mean', float('nan')):+.3f}  "
                 f"best recall@1 {best:.4f} ({'before this attempt' if at < 0 else f'step {at}'})"
                 f"{trained_for(trainer)}")
        self.plots_dir.mkdir(parents=True, exist_ok=True)
        plot_cosine_histograms({f"step {step}": result}, self.plots_dir / f"cosines-step{step}.png")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                payload = dict(wandb_cosine_histograms(result))
                if self.tables:
                    ev = trainer.datamodule.eval_set
                    payload["val/top5"] = wandb_topk_table(
                        result.run, ev.qrels, ev.queries, ev.corpus, n=self.sample_queries, k=5
                    )
                # on Lightning's step axis (not wandb's own step counter, which Lightning does not set)
                logger.experiment.log({**payload, "trainer/global_step": step})
