"""The main job: ``python -m moco_retrieval.train [+experiment=NAME] [overrides...]``.

Composes the config (strict, ranges checked: see config.py), takes the run directory's lock
(training/run_lock.py), checks the checkpoint to resume from, reads and checks the data, then builds the
Lightning module -> trainer, fits, runs a final validation and writes into the run directory:
``checkpoints/last.ckpt`` and ``checkpoints/best-*.ckpt`` (by val/recall@1; with several ``data.eval_dirs``
by val/mean/recall@1, or val/SET/recall@1 with ``trainer.best_set=SET``), ``metrics.json``
(final validation metrics, flat keys; the run's training and validation seconds over all its attempts: training/records.py), ``config.yaml`` (resolved), ``metrics.csv`` (every attempt's logged metrics in step order: training/records.py) and
the loggers' files. It prints, at its start, the command that resumes it; ``ckpt_path=last`` without ``run_dir``
resumes the newest run of the same experiment among Hydra's folders (training/checkpoints.py).

Preemption (see training/preemption.py): on SIGTERM, SIGUSR1 or Ctrl-C (SIGINT) the run finishes the current
step, writes ``checkpoints/last.ckpt`` atomically, prints the command that resumes it and exits with
status 128 + signal (143 / 138 / 130) without a final validation or ``metrics.json``. A requeued job
runs the same command with the same ``run_dir`` and ``ckpt_path=last``, which resumes from that checkpoint (or from ``last.prev.ckpt`` when it cannot
be read; it starts fresh, and says so, when there is none yet), refusing a config that changes what
the checkpoint trained (training/resume_check.py). A loss or weights that stop being finite end the run
before any checkpoint records them (training/finite_guard.py). Known errors (errors.py) end the command with
one message and status 2.
"""
from __future__ import annotations

if __name__ == "__main__":  # --help at once, before Lightning's import (seconds)
    from moco_retrieval.command import exit_after_help

    exit_after_help("train", __doc__)

import json
import logging
import shlex
import signal
import sys
import warnings
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig, OmegaConf

from moco_retrieval import distributed
from moco_retrieval.command import command
from moco_retrieval.config import TrainConfig, TrainerConfig, eval_set_names
from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.data.multisource import source_names, source_prompts
from moco_retrieval.data.prompts import apply_by_row, by_row, to_prompts
from moco_retrieval.data.sampler import source_of
from moco_retrieval.training.checkpoints import AtomicCheckpointIO, RebaseCheckpointPaths, checkpoints_dir, last_checkpoint, latest_run, remove_best_after, remove_stale_temporaries, resolve_ckpt_path, set_aside_unreadable
from moco_retrieval.files import checkpoint_step, previous_of, read_checkpoint
from moco_retrieval.training.cluster import is_rank_zero, on_slurm, torchrun_devices
from moco_retrieval.training.finite_guard import FiniteGuard
from moco_retrieval.training.loggers import build_loggers, finish_loggers, log_config
from moco_retrieval.training.module import RetrievalModule, monitored_metric
from moco_retrieval.training.preemption import (
    Preempted,
    PreemptionCheckpoint,
    sigterm_exit_status,
)
from moco_retrieval.training.records import RecordAttempt, RunClock, flush_and_merge
from moco_retrieval.training.report import ValidationReport, progress_callback
from moco_retrieval.training.resume_check import RecordTraining, adopt_data_location, check_resumable, check_same_data
from moco_retrieval.training.run_lock import RunLock, claim_run_dir, writable_run_dir

# (the eval-mode and FAISS notices every command shares are silenced in command.py)
# validation metrics are computed on the whole pool by every rank, identical: nothing to sync
warnings.filterwarnings("ignore", message=r".*sync_dist=True.*when logging on epoch level")
# Lightning's and torch's noise that says nothing about this run: an advertisement, a deprecation
# inside Lightning, the default of an argument we never pass, and (on resume, or a fresh start over
# an old run, which build() warns about itself) "Checkpoint directory exists".
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "litlogger" not in r.getMessage())
logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector").addFilter(
    lambda r: "`weights_only` was not set" not in r.getMessage())
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
# a checkpoint before the first validation (a preemption, a short run) has no val/.../recall@1 to rank by yet
warnings.filterwarnings("ignore", message=r"`ModelCheckpoint\(monitor='val/(.+/)?recall@1'\)` could not find the monitored key")
# a stream (data.stream) is read by one loader worker at most, so its length holds
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")


def trainer_kwargs(cfg: TrainerConfig) -> dict:
    """Lightning Trainer arguments from the config; ``precision: auto`` is bf16-mixed on a GPU.
    Under torchrun, devices and nodes are the launcher's (its processes are already running)."""
    precision = cfg.precision
    if precision == "auto":
        gpu = torch.cuda.is_available() and cfg.accelerator in ("auto", "gpu", "cuda")
        precision = "bf16-mixed" if gpu else "32-true"
    devices, num_nodes = torchrun_devices() or (cfg.devices, cfg.num_nodes)
    kw = dict(
        accelerator=cfg.accelerator,
        devices=devices,
        num_nodes=num_nodes,
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
        enable_model_summary=False,  # (its table shows FLOPs 0; the parameters are one line: parameter_line)
        # the data module shards and orders batches itself (resumable mid-epoch)
        use_distributed_sampler=False,
    )
    if cfg.val_check_interval:
        kw.update(val_check_interval=cfg.val_check_interval, check_val_every_n_epoch=None)
    return kw


def ddp_strategy(timeout_s: int = 1800, **options) -> DDPStrategy:
    """DDP without the per-step broadcast of buffers from rank 0: every rank enqueues the same
    all-gathered keys, so the queue (K x d buffers) stays identical without it (each checkpoint
    records every rank's fingerprint, training/checkpoints.py), and copying it every step costs
    K x d x 4 bytes (200 MB at 65k x 768). The buffers are still synced once, at the start.
    ``timeout_s``: how long a collective waits for the other ranks (trainer.process_group_timeout).
    ``options``: more DDPStrategy arguments (e.g. ``start_method``)."""
    return DDPStrategy(forward_sync_buffers=False, timeout=timedelta(seconds=timeout_s), **options)


class ValidateLastStep(L.Callback):
    """The last step of training validates inside ``fit`` (Lightning validates within fit when the run
    is to stop), not after it, so that its checkpoints (best-STEP.ckpt, last.ckpt) see that validation."""

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        loop = trainer.fit_loop
        by_steps = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        last_epoch = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1
        if by_steps or (last_epoch and loop.epoch_loop.batch_progress.is_last_batch):
            trainer.should_stop = True


def data_module(cfg: TrainConfig) -> RetrievalDataModule:
    """The run's data module: its hard negatives, and their teacher scores when the objective distils."""
    distills = getattr(cfg.objective, "distill", "none") != "none"
    return RetrievalDataModule(cfg.data, n_negatives=cfg.data.n_negatives, teacher_scores=distills)


def build(cfg: TrainConfig, run_dir: Path, dm: Optional[RetrievalDataModule] = None,
          resuming: bool = False) -> tuple[RetrievalModule, RetrievalDataModule, L.Trainer]:
    """The module, the data module (``dm``: one that has read its data already) and the trainer;
    ``resuming``: this attempt continues a checkpoint (prepare_run_dir found one)."""
    module = RetrievalModule.from_config(cfg)
    enc = module.encoder
    if dm is None:
        dm = data_module(cfg)
    dm.tokenize = enc.tokenize if enc.needs_tokens else None
    monitor = monitored_metric(cfg.trainer.best_set, eval_set_names(cfg.data.eval_dirs))
    checkpoints = ModelCheckpoint(
        dirpath=checkpoints_dir(run_dir),
        filename="best-{step}",
        monitor=monitor,
        mode="max",
        save_top_k=cfg.trainer.keep_best_checkpoints,
        auto_insert_metric_name=False,
    )
    # checkpoints/last.ckpt, what `ckpt_path=last` resumes from, holds the latest state: written at
    # every validation (a job killed without warning loses at most val_check_interval steps), at a
    # preemption and at the end of training (PreemptionCheckpoint below). (`save_last=True` above
    # would write it only along with a new best.) Overwritten, never versioned to last-v1.ckpt.
    latest = ModelCheckpoint(dirpath=checkpoints_dir(run_dir), filename="last", save_top_k=1,
                             enable_version_counter=False)
    callbacks = [checkpoints, latest] + ([progress_callback(cfg.trainer.log_every_n_steps)] if cfg.trainer.enable_progress_bar else [])
    callbacks.append(ValidationReport(run_dir / "plots", cfg.eval.sample_queries, cfg.logger.log_tables, monitor))
    callbacks += [RunClock(), RecordAttempt(), ValidateLastStep()]
    # what the checkpoint trains with (a resume that changes it is refused), its paths after a move
    callbacks += [RecordTraining(cfg), RebaseCheckpointPaths(checkpoints_dir(run_dir))]
    loggers = build_loggers(cfg.logger, run_dir, resume=resuming)
    log_config(loggers, cfg)
    # SIGTERM / SIGUSR1 / Ctrl-C: finish the step, write checkpoints/last.ckpt, exit 128 + signal (training/preemption.py).
    # Under SLURM, Lightning's auto-requeue on SIGUSR1 (`scontrol requeue` after that checkpoint).
    slurm = on_slurm()
    # (first in line, so that the run stops before the other callbacks' hooks of the next step)
    callbacks.insert(0, PreemptionCheckpoint(last_checkpoint(run_dir),
                                             requeue_signal=signal.SIGUSR1 if slurm else None))
    # before it: a loss or weights gone inf / NaN stop the run before any checkpoint records them
    callbacks.insert(0, FiniteGuard(cfg.trainer.log_every_n_steps, checkpoints_dir(run_dir)))
    plugins: list = [AtomicCheckpointIO()]
    if slurm:
        plugins.append(SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1))
    kw = trainer_kwargs(cfg.trainer)
    if kw["strategy"] == "ddp" or (kw["strategy"] == "auto" and torchrun_devices() is not None):
        kw["strategy"] = ddp_strategy(cfg.trainer.process_group_timeout)
    trainer = L.Trainer(
        default_root_dir=str(run_dir),
        logger=loggers or False,
        callbacks=callbacks,
        plugins=plugins,
        **kw,
    )
    return module, dm, trainer


def prepare_run_dir(cfg: TrainConfig, run_dir: Path) -> Optional[str]:
    """Before data and model: remove what killed checkpoint writes left, check the checkpoint to
    resume from (CheckpointError naming it when it cannot be read, or when this config changes
    what it trained); return its path."""
    folder = checkpoints_dir(run_dir)
    continues = cfg.ckpt_path == "last" or (
        cfg.ckpt_path is not None and Path(cfg.ckpt_path).expanduser().resolve().parent == folder.resolve())
    if is_rank_zero():  # (rank 0 holds the run directory's lock: no write of this run is under way)
        claim_run_dir(run_dir, continues, cfg.overwrite)  # a fresh start never overwrites a run (or the user's files)
        remove_stale_temporaries(folder)
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, run_dir)
    last = last_checkpoint(run_dir)
    if ckpt_path == str(previous_of(last)) and is_rank_zero():  # the fallback: keep the good one as predecessor
        set_aside_unreadable(last)
    if ckpt_path is not None:
        ckpt = read_checkpoint(ckpt_path, "ckpt_path", verify=False)  # (resolve_ckpt_path verified it)
        adopted = adopt_data_location(ckpt, cfg)
        if adopted and is_rank_zero():
            print(f"[moco_retrieval] resuming with the checkpoint's data location: {' '.join(adopted)}",
                  file=sys.stderr, flush=True)
        check_resumable(ckpt, ckpt_path, cfg)
        if is_rank_zero() and Path(ckpt_path).resolve().parent == folder.resolve():
            remove_best_after(folder, checkpoint_step(ckpt))
    return ckpt_path


def train(cfg: TrainConfig, run_dir: Path) -> dict:
    """Fit, validate once more at the end, write metrics.json and config.yaml; return the metrics.
    Rank 0 holds the run directory's lock (training/run_lock.py) throughout."""
    run_dir = Path(run_dir)
    writable_run_dir(run_dir)
    with RunLock(run_dir) if is_rank_zero() else nullcontext():
        return _train(cfg, run_dir)


def _train(cfg: TrainConfig, run_dir: Path) -> dict:
    ckpt_path = prepare_run_dir(cfg, run_dir)
    if is_rank_zero():
        print(f"[moco_retrieval] run directory {run_dir}; to resume this run: {resume_command(run_dir)}",
              file=sys.stderr, flush=True)
    # the data is read and checked first: bad input stops the run before the model and the loggers start
    dm = data_module(cfg)
    dm.setup("fit")
    if ckpt_path is not None:  # the same rows as it trained on, not only the same options
        check_same_data(read_checkpoint(ckpt_path, "ckpt_path", verify=False), ckpt_path, dm.data_keys())
    if is_rank_zero():
        if not cfg.data.stream:  # (a stream's rows are not in memory; its manifest holds the checks' counts)
            announce_negatives(dm.train_rows.negative_counts, cfg.data.n_negatives)
        announce_prompts(cfg.data)
    L.seed_everything(cfg.seed, workers=True)
    module, dm, trainer = build(cfg, run_dir, dm, resuming=ckpt_path is not None)
    if is_rank_zero():
        print(parameter_line(module), file=sys.stderr, flush=True)
    if module.encoder.frozen:  # every frozen feature computed (or loaded) once, up front
        warm_frozen_features(module.encoder, dm)
    if trainer.is_global_zero:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    with distributed.exit_when_peers_stall(cfg.trainer.process_group_timeout, lambda: trainer.global_step):
        return _fit(module, dm, trainer, ckpt_path, run_dir)


def parameter_line(module: RetrievalModule) -> str:
    """The model's parameters in one line: trained, and in the objective's other parts (EMA key encoder)."""
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    return (f"[moco_retrieval] model: {trained:,} trained parameters ({type(module.encoder).__name__}), "
            f"{total - trained:,} not trained (frozen, or a momentum copy)")


def announce_negatives(counts, n_negatives: Optional[int]) -> None:
    """Say how many hard negatives each row trains with, above all when the rows carry some that
    ``data.n_negatives`` (unset) leaves out."""
    have = int((counts > 0).sum())
    if n_negatives:
        print(f"[moco_retrieval] each row trains with {n_negatives} of its hard negatives (data.n_negatives)",
              file=sys.stderr, flush=True)
    elif have:
        print(f"[moco_retrieval] {have:,} of {len(counts):,} training rows carry hard negatives (up to {int(counts.max())}), "
              f"not used: data.n_negatives=N trains each row with N of them", file=sys.stderr, flush=True)


def announce_prompts(data) -> None:
    """With ``data.sources`` of prompts of their own: which prompts validation and the export use."""
    if not data.sources:
        return
    own = [f"{n} ({p.to_dict()})" for n, s, p in zip(source_names(data), data.sources, source_prompts(data))
           if s.prompts is not None and not p.empty]
    if own:
        print(f"[moco_retrieval] sources with prompts of their own: {', '.join(own)}; validation and the exported model "
              f"apply data.prompts ({'none' if to_prompts(data.prompts).empty else to_prompts(data.prompts).describe()}); "
              "the model card lists the sources' prompts",
              file=sys.stderr, flush=True)


def warm_frozen_features(encoder, dm: RetrievalDataModule) -> int:
    """A frozen backbone's features of every text the run will embed, as its batches hold them
    (with their prompts: the cache is keyed by the text the model sees); returns how many were computed."""
    queries, docs = dm.train_texts("query"), dm.train_texts("positive")
    if dm.source_offsets is None:
        queries, docs = dm.prompts.apply(queries, "query"), dm.prompts.apply(docs, "doc")
    else:  # each source's rows with its own prompts
        rows = by_row(source_prompts(dm.cfg), source_of(range(len(queries)), dm.source_offsets))
        queries, docs = apply_by_row(rows, queries, "query"), apply_by_row(rows, docs, "doc")
    sets = dm.eval_sets.values()
    return encoder.warm_features(
        queries=queries + dm.prompts.apply([t for ev in sets for t in ev.queries.values()], "query"),
        docs=docs + dm.prompts.apply([t for ev in sets for t in ev.corpus.values()], "doc"))


def _fit(module: RetrievalModule, dm: RetrievalDataModule, trainer: L.Trainer, ckpt_path: Optional[str],
         run_dir: Path) -> dict:
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    except Preempted:  # checkpoint written on every rank's behalf; the status says "requeue me"
        if trainer.is_global_zero:
            flush_and_merge(trainer.loggers, run_dir)
            print(f"[moco_retrieval] to resume: {resume_command(run_dir)}", file=sys.stderr, flush=True)
        finish_loggers(trainer.loggers)
        distributed.teardown()
        raise
    if module.last_val_step != trainer.global_step:  # the end of fit was not a validation point
        trainer.validate(module, datamodule=dm, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    clock = next(c for c in trainer.callbacks if isinstance(c, RunClock))
    metrics.update({k: round(v, 1) for k, v in clock.seconds().items()}, attempts=clock.attempts)
    if trainer.is_global_zero:
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        flush_and_merge(trainer.loggers, run_dir)
        print(f"final validation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()) if "@" in k))
        print(clock.summary())
        print(f"run directory: {run_dir}")
    finish_loggers(trainer.loggers)
    distributed.teardown()
    return metrics


def resume_command(run_dir: Path) -> str:
    """The command that resumes this run: its own overrides (less ``overwrite``) with ``ckpt_path=last`` and, when it
    had none, ``run_dir=`` the directory it used (Hydra's default is a new folder per start)."""
    try:
        overrides = HydraConfig.get().overrides
        given = list(overrides.task) + [o for o in overrides.hydra if not o.startswith("hydra.mode=")]
    except ValueError:  # not started by Hydra (train() called from Python)
        return f"the same command with run_dir={shlex.quote(str(run_dir.resolve()))} ckpt_path=last"
    keep = [o for o in given if o.split("=", 1)[0].lstrip("+~") not in ("ckpt_path", "overwrite")]
    if not any(o.split("=", 1)[0].lstrip("+~") == "run_dir" for o in keep):
        keep.append(f"run_dir={run_dir.resolve()}")
    args = shlex.join([*keep, "ckpt_path=last"])
    if torchrun_devices() is not None:
        return f"the same torchrun launch with the arguments {args}"
    return f"python -m moco_retrieval.train {args}"


def chosen_run_dir(cfg: DictConfig) -> Path:
    """``run_dir``, else Hydra's new folder; with ``ckpt_path=last`` and no ``run_dir``, the newest
    run of the same experiment among Hydra's folders (training/checkpoints.py), said on stderr."""
    if cfg.run_dir:  # (before Hydra's config: main(cfg) runs without Hydra too)
        return Path(cfg.run_dir)
    hydra = HydraConfig.get()
    own = Path(hydra.runtime.output_dir)
    if cfg.ckpt_path != "last":
        return own
    experiment = hydra.runtime.choices.get("experiment")
    found = latest_run(own.resolve().parents[1], experiment, exclude=own)
    if is_rank_zero():
        print(f"[moco_retrieval] ckpt_path=last without run_dir: resuming the newest run of experiment "
              f"{experiment or '(none)'}: {found}", file=sys.stderr, flush=True)
    return found


@command("train")
def main(cfg: DictConfig) -> None:
    run_dir = chosen_run_dir(cfg)
    with sigterm_exit_status():  # a SIGTERM Lightning handles itself exits 143 too, not 0
        train(OmegaConf.to_object(cfg), run_dir)


if __name__ == "__main__":
    main()
