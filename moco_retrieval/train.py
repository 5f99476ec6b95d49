"""The main job: ``python -m moco_retrieval.train [+experiment=NAME] [overrides...]``.

Composes the config (strict: see config.py), builds data module -> Lightning module -> trainer,
fits, runs a final validation and writes into the run directory:
``checkpoints/last.ckpt`` and ``checkpoints/best-*.ckpt`` (by val/recall@1), ``metrics.json``
(final validation metrics, flat keys), ``config.yaml`` (resolved) and the loggers' files.
"""
from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf

from moco_retrieval import distributed
from moco_retrieval.checkpointing import AtomicCheckpointIO, resolve_ckpt_path
from moco_retrieval.config import TrainConfig, TrainerConfig, register_configs
from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.lightning_module import RetrievalModule
from moco_retrieval.loggers import build_loggers

register_configs()
# The key encoder is in eval mode on purpose (no dropout in keys); faiss announces each CPU
# instruction set it tries. Neither is news to a user.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
logging.getLogger("faiss.loader").setLevel(logging.WARNING)


def trainer_kwargs(cfg: TrainerConfig) -> dict:
    """Lightning Trainer arguments from the config; ``precision: auto`` is bf16-mixed on a GPU."""
    precision = cfg.precision
    if precision == "auto":
        gpu = torch.cuda.is_available() and cfg.accelerator in ("auto", "gpu", "cuda")
        precision = "bf16-mixed" if gpu else "32-true"
    kw = dict(
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=cfg.strategy,
        precision=precision,
        max_epochs=cfg.max_epochs,
        max_steps=cfg.max_steps,
        accumulate_grad_batches=cfg.accumulate_grad_batches,
        gradient_clip_val=cfg.gradient_clip_val,
        log_every_n_steps=cfg.log_every_n_steps,
        enable_progress_bar=cfg.enable_progress_bar,
        deterministic=cfg.deterministic,
        num_sanity_val_steps=0,
        # the data module shards and orders batches itself (resumable mid-epoch)
        use_distributed_sampler=False,
    )
    if cfg.val_check_interval:
        kw.update(val_check_interval=cfg.val_check_interval, check_val_every_n_epoch=None)
    return kw


def build(cfg: TrainConfig, run_dir: Path) -> tuple[RetrievalModule, RetrievalDataModule, L.Trainer]:
    module = RetrievalModule.from_config(cfg)
    enc = module.encoder
    dm = RetrievalDataModule(cfg.data, tokenize=enc.tokenize if enc.needs_tokens else None)
    checkpoints = ModelCheckpoint(
        dirpath=run_dir / "checkpoints",
        filename="best-{step}",
        monitor="val/recall@1",
        mode="max",
        save_top_k=1,
        save_last=True,
        auto_insert_metric_name=False,
    )
    # A TQDM bar: on a terminal it redraws; in a cluster job's log file it prints a line every
    # `refresh` steps instead of nothing (Rich's bar) or a line per step.
    callbacks = [checkpoints, TQDMProgressBar(refresh_rate=1 if sys.stderr.isatty() else 10)]
    loggers = build_loggers(cfg.logger, run_dir)
    if loggers:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    trainer = L.Trainer(
        default_root_dir=str(run_dir),
        logger=loggers or False,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        **trainer_kwargs(cfg.trainer),
    )
    return module, dm, trainer


def train(cfg: TrainConfig, run_dir: Path) -> dict:
    """Fit, validate once more at the end, write metrics.json and config.yaml; return the metrics."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True)
    module, dm, trainer = build(cfg, run_dir)
    dm.setup("fit")  # reads and checks the data now: bad input stops the run before training
    if cfg.model.frozen_backbone:
        module.encoder.warm_cache([p.query for p in dm.train_pairs] + list(dm.eval_set.queries.values()), "query")
        module.encoder.warm_cache([p.positive for p in dm.train_pairs] + list(dm.eval_set.corpus.values()), "doc")
    if trainer.is_global_zero:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    trainer.fit(module, datamodule=dm, ckpt_path=resolve_ckpt_path(cfg.ckpt_path, run_dir))
    results = trainer.validate(module, datamodule=dm, verbose=False)
    metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
    if trainer.is_global_zero:
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        print(f"final validation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()) if "@" in k))
        print(f"run directory: {run_dir}")
    distributed.teardown()
    return metrics


def check_complete(cfg: DictConfig) -> None:
    """Required values left at ``???`` are an error that names them, before anything is built."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise SystemExit(
            "missing required config values: " + ", ".join(missing)
            + " (set them on the command line, e.g. data.train_path=FILE data.eval_dir=DIR)"
        )


@hydra.main(config_path="pkg://moco_retrieval.conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    check_complete(cfg)
    run_dir = Path(cfg.run_dir or HydraConfig.get().runtime.output_dir)
    train(OmegaConf.to_object(cfg), run_dir)


if __name__ == "__main__":
    main()
