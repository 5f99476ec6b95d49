"""After each validation: the pictures a person looks at. A PNG histogram of positive versus
unrelated cosines in the run directory, and on W&B the same as histograms plus a table of a fixed
sample of queries with their top-5 documents, each marked relevant or not."""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger

from moco_retrieval.evaluation.report import plot_cosine_histograms, wandb_cosine_histograms, wandb_topk_table


class ValidationReport(Callback):
    """Args: plots_dir: where ``cosines-step{N}.png`` go; sample_queries: rows of the W&B table
    (the same queries at every validation); tables: log the W&B table at all."""

    def __init__(self, plots_dir: str | Path, sample_queries: int = 20, tables: bool = True):
        self.plots_dir, self.sample_queries, self.tables = Path(plots_dir), sample_queries, tables

    def on_validation_end(self, trainer, pl_module) -> None:
        result = getattr(pl_module, "last_val_result", None)
        if result is None or not trainer.is_global_zero or trainer.sanity_checking:
            return
        step = trainer.global_step
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
                logger.experiment.log(payload, step=step)
