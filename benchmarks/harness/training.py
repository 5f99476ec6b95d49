"""A training config through Hydra's compose API, and many quiet runs in one process.

* ``compose_cfg(overrides)``: the training config (strict schema); an override of a retired option
  (``RETIRED``) exits with one message naming it and why, rather than Hydra's traceback.
* ``Bench``: one process, many runs: the Debian set is read once, the frozen feature cache is
  warmed once and kept alive, and ``fit_eval(cfg)`` trains a ``RetrievalModule`` with a quiet
  Lightning ``Trainer`` (``quiet_trainer``: no logger, no progress bar, no checkpoints, no
  validation loop) and scores the held-out pool with ``evaluate_encoder``.
* ``Runner``: frozen-head configs (``FROZEN_BASE`` + overrides) run once each through a run cache.
* ``TRAINER``: ``MR_BENCH_TRAINER=gpu`` runs the benchmarks on a GPU (benchmarks/gpu.sh).
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from benchmarks.harness.report import log
from benchmarks.harness.runs import RunCache, past_deadline

warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
warnings.filterwarnings("ignore", message=r".*LightningModule.*log.*")
warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
for _name in ("lightning.pytorch", "lightning.fabric", "lightning", "faiss.loader", "pytorch_lightning"):
    logging.getLogger(_name).setLevel(logging.ERROR)


# MR_BENCH_TRAINER=gpu runs the frozen-head benchmarks on a GPU (benchmarks/gpu.sh)
TRAINER = os.environ.get("MR_BENCH_TRAINER", "cpu")
FROZEN_BASE = ["model=frozen_head", f"trainer={TRAINER}", "logger=none", "data=debian"]

# Options issue 43 retired, each with the simpler twin B6 measured it below. Runs made with them stay
# in the run caches and reports (history); composing them again is refused, saying why.
RETIRED = {
    "objective=icol": "inbatch_2tower-32, in-batch negatives on the same two towers",
    "objective.momentum_schedule": "two_queue_m0.995-32, a constant momentum",
    "objective.doc_to_query_weight": "two_queue_m0.995_ib_k4k-32, the main job's objective with both directions at weight 1",
}


class Retired(SystemExit):
    """A run or an override of a retired option: one message, no traceback, exit status 1."""


def retired_reason(overrides: Iterable[Any]) -> Optional[str]:
    """Why ``overrides`` (a run's overrides; other specs, e.g. a peer's loss options, never are)
    cannot be composed any more, naming the retired override; None when they can."""
    if not isinstance(overrides, (list, tuple)):
        return None
    for o in overrides:
        if not isinstance(o, str):
            continue
        key = o.lstrip("+~").split("=", 1)[0]
        for option, twin in RETIRED.items():
            if o == option or key == option:
                return f"{o} is retired (issue 43): B6 measured it below its simpler twin ({twin})"
    return None


def compose_cfg(overrides: Sequence[str] = ()):
    """A ``TrainConfig`` from conf/ through Hydra's compose API, e.g. ``["model=frozen_head"]``."""
    why = retired_reason(list(overrides))
    if why:
        raise Retired(f"cannot compose the config: {why}; runs made with it stay in the run caches and reports")
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from moco_retrieval.command import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("moco_retrieval.conf", version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    return OmegaConf.to_object(cfg)


# ----------------------------------------------------------------------------------- runs


class Bench:
    """Data read once; frozen features cached once; many quiet runs."""

    def __init__(self, max_train_examples: Optional[int] = None, max_eval_queries: Optional[int] = None):
        from moco_retrieval.data.sources import load

        cfg = compose_cfg(FROZEN_BASE)
        cfg.data.max_train_examples = max_train_examples
        cfg.data.max_eval_queries = max_eval_queries
        self.data_cfg = cfg.data
        train, pool = load(cfg.data)
        self.train_pairs = train.pairs
        self.eval_set = pool.eval_set
        self._keep: list[Any] = []  # encoders whose feature caches must stay alive

    def warm(self, encoder) -> float:
        """Fill (or load) the frozen features of every train and eval text; returns seconds."""
        t0 = time.perf_counter()
        if encoder.frozen:
            encoder.warm_features([p.query for p in self.train_pairs] + list(self.eval_set.queries.values()),
                                  [p.positive for p in self.train_pairs] + list(self.eval_set.corpus.values()),
                                  progress=False)
            self._keep.append(encoder.feature_cache)
        return time.perf_counter() - t0

    def datamodule(self, cfg):
        from moco_retrieval.data.datamodule import RetrievalDataModule

        data = cfg.data
        data.max_train_examples = self.data_cfg.max_train_examples
        data.max_eval_queries = self.data_cfg.max_eval_queries
        return RetrievalDataModule.from_loaded(data, self.train_pairs, self.eval_set)  # read once, shared

    def fit_eval(self, cfg, *, callbacks: Iterable[Any] = (), evaluate: bool = True) -> dict:
        """Train ``cfg`` (frozen-head runs: texts only) and score the held-out pool."""
        import lightning as L

        from moco_retrieval.evaluation.encode import evaluate_encoder
        from moco_retrieval.training.module import RetrievalModule

        L.seed_everything(cfg.seed, workers=False, verbose=False)
        module = RetrievalModule.from_config(cfg)
        self.warm(module.encoder)
        dm = self.datamodule(cfg)
        if not module.encoder.frozen:
            dm.tokenize = module.encoder.tokenize
        trainer = quiet_trainer(cfg, callbacks=callbacks)
        t0 = time.perf_counter()
        trainer.fit(module, datamodule=dm)
        train_s = time.perf_counter() - t0
        out = {"train_s": train_s, "steps": int(trainer.global_step), "module": module}
        # the last step's logged stats (negatives_per_query, masked_per_query, queue_age, ...)
        out["last_step"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        queue = module.objective.stats(trainer.global_step)
        if queue:
            out["queue_fill"] = queue["queue_fill"]
            out["queue_age_end"] = queue["queue_age"]
        if evaluate:
            res = evaluate_encoder(module.encoder, self.eval_set, module.eval_cfg, show_progress=False)
            out.update(metrics=dict(res.metrics), geometry=dict(res.geometry), result=res)
        return out

    def eval_untrained(self, cfg) -> dict:
        import lightning as L

        from moco_retrieval.evaluation.encode import evaluate_encoder
        from moco_retrieval.training.module import RetrievalModule

        L.seed_everything(cfg.seed, workers=False, verbose=False)
        module = RetrievalModule.from_config(cfg)
        self.warm(module.encoder)
        res = evaluate_encoder(module.encoder, self.eval_set, module.eval_cfg, show_progress=False)
        return {"metrics": dict(res.metrics), "geometry": dict(res.geometry), "result": res, "steps": 0}


def run_key(name: str, seed: int) -> str:
    return f"{name}|seed={seed}"


class Runner:
    """Runs configs once each through a run cache (``harness.runs.RunCache``), so a restarted
    benchmark resumes and parallel processes share the work."""

    def __init__(self, bench: Bench, base: list[str], cache: Path, fresh: bool, deadline: Optional[str] = None):
        self.bench, self.base = bench, base
        self.cache = RunCache(cache, fresh)
        self.deadline = deadline  # UTC "HH:MM": runs not started by then are cut
        self.cut: list[str] = []

    @property
    def done(self) -> dict[str, dict]:
        return self.cache.done

    def runs(self, active: bool, specs: list[tuple]) -> list[dict]:
        """Run (when ``active``) or read from the cache each (group, name, overrides, seed, extra) spec;
        the records that exist, in order."""
        out = []
        for group, name, overrides, seed, extra in specs:
            key = run_key(f"{group}:{name}", seed)
            rec = self.cache.get(key)
            if rec is None and active and not past_deadline(self.deadline):
                with self.cache.claimed(key) as mine:
                    rec = self.run(group, name, overrides, seed, **extra) if mine else self.cache.get(key)
            if rec is not None:
                out.append(rec)
            else:
                self.cut.append(f"{group}: {name}, seed {seed}")
        return out

    def run(self, group: str, name: str, overrides: list[str], seed: int, untrained: bool = False, **info) -> dict:
        key = run_key(f"{group}:{name}", seed)
        if key in self.done:
            return self.done[key]
        cfg = compose_cfg(FROZEN_BASE + self.base + overrides + [f"seed={seed}", f"data.seed={seed}"])
        t0 = time.perf_counter()
        r = self.bench.eval_untrained(cfg) if untrained else self.bench.fit_eval(cfg)
        o = cfg.objective
        rec = {
            "key": key, "group": group, "name": name, "seed": seed, "overrides": overrides,
            "batch_size": cfg.data.batch_size, "objective": o.name, "queue_size": getattr(o, "queue_size", 0),
            "momentum": getattr(o, "momentum", None),
            "key_encoder": "ema" if hasattr(o, "momentum") else ("query" if o.name == "feature_memory" else None),
            "queue_reproject": o.name == "feature_memory",
            "key_grad": o.name == "feature_memory",
            "mask_false_negatives": o.mask_false_negatives, "batch_negatives": getattr(o, "batch_negatives", True),
            "temperature": o.temperature, "lr": cfg.optim.lr, "epochs": cfg.trainer.max_epochs,
            "steps": r["steps"], "train_s": r.get("train_s", 0.0),
            "ms_per_step": 1000 * r["train_s"] / r["steps"] if r["steps"] else None,
            "metrics": r["metrics"], "positive_cos_mean": r["geometry"].get("positive_cos_mean"),
            "unrelated_cos_mean": r["geometry"].get("unrelated_cos_mean"),
            "last_step": r.get("last_step", {}), "queue_age_end": r.get("queue_age_end"),
            "wall_s": time.perf_counter() - t0, **info,
        }
        self.cache.add(rec)
        log(f"{group}: {name} seed {seed}: recall@1 {rec['metrics']['recall@1']:.3f} "
            f"({rec['steps']} steps, {rec['train_s']:.0f}s)")
        return rec


def quiet_trainer(cfg, callbacks: Iterable[Any] = (), **kw):
    import lightning as L

    t = cfg.trainer
    args = dict(
        accelerator=t.accelerator, devices=1, precision=t.precision, max_epochs=t.max_epochs, max_steps=t.max_steps,
        gradient_clip_val=t.gradient_clip_val, accumulate_grad_batches=t.accumulate_grad_batches,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=list(callbacks),
        default_root_dir=str(Path(tempfile.gettempdir()) / "mr-bench-lightning"),
    )
    args.update(kw)
    return L.Trainer(**args)
