"""The Lightning module: the trained encoder, its EMA key encoder and a frozen guide when the
objective needs them, the objective, the optimizer and validation. The flow of one step is in
docs/design.md: the module serves ``embed`` (``Embeddings``), the objective asks it for what it
needs and returns the loss, and after backward the objective's memories write their keys.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import lightning as L
import numpy as np
import torch
from omegaconf import OmegaConf

from moco_retrieval.config import MEAN_SET, EvalConfig, LrSchedule, ModelConfig, OptimConfig, TrainConfig, to_config
from moco_retrieval.data.prompts import to_prompts
from moco_retrieval.distributed import all_gather_rows, row_counts, shard_range
from moco_retrieval.evaluation.encode import evaluate_embeddings, metrics_by_dim
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.model.gradcache import GradCache, autocast_state, autocast_to
from moco_retrieval.model.loading import build_guide_encoder
from moco_retrieval.model.lora import (
    LORA_BASE,
    base_fingerprint,
    check_same_base,
    check_same_lora,
    drop_base_weights,
    restore_base_weights,
)
from moco_retrieval.model.momentum import MomentumEncoder
from moco_retrieval.objectives.base import MOMENTUM, TRAINED, ObjectiveConfig
from moco_retrieval.objectives.registry import build_objective, objective_config


def lr_lambda(schedule: LrSchedule, warmup: int, total: int):
    """Linear warmup to 1, then linear decay to 0, cosine decay to 0, or constant."""

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == LrSchedule.constant or total <= warmup:
            return 1.0
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1.0 - t if schedule == LrSchedule.linear else 0.5 * (1 + math.cos(math.pi * t))

    return f


class Embeddings:
    """``embed`` for one training step (objectives/base.py's ``Embed``): the batch's sides by the
    encoder an objective names, each (side, encoder) embedded once, under the autocast the step
    started in (the objective scores in fp32 with autocast off); through GradCache when
    ``model.grad_cache_chunk`` is set. A side asked without gradient after it was embedded with
    gradient is served detached (online keys); the other way round is a bug in the objective."""

    KIND = {"query": "query", "doc": "doc", "neg": "doc"}

    def __init__(self, module: "RetrievalModule", batch: dict, step: int):
        self.module, self.batch, self.step = module, batch, step
        self.autocast = autocast_state(module.device.type)
        self._done: dict[tuple[str, str], tuple[torch.Tensor, bool]] = {}

    def __call__(self, side: str, encoder: str = TRAINED, grad: bool = True) -> torch.Tensor | None:
        if side not in self.batch:
            return None
        if grad and encoder != TRAINED:
            raise ValueError(f"embed({side!r}, {encoder!r}): only the trained encoder's embeddings carry gradient")
        if (side, encoder) not in self._done:
            self._done[side, encoder] = (self.module.encode(encoder, self.batch[side], self.KIND[side], grad,
                                                            self.autocast), grad)
        out, with_grad = self._done[side, encoder]
        if grad and not with_grad:
            raise RuntimeError(f"embed({side!r}) with gradient after embedding it without: ask with gradient first")
        return out if grad else out.detach()

    def tokens(self, side: dict, kind: str, encoder: str = MOMENTUM) -> torch.Tensor:
        return self.module.encode(encoder, side, kind, False, self.autocast)

    def features(self, side: str) -> torch.Tensor:
        with torch.no_grad(), autocast_to(self.autocast):
            return self.module.encoder.features(self.batch[side], self.KIND[side])

    def project(self, features: torch.Tensor) -> torch.Tensor:
        with autocast_to(self.autocast):
            return self.module.encoder.embed_features(features, "doc")


def decay_groups(named_parameters, weight_decay: float) -> list[dict]:
    """AdamW's two parameter groups: weight decay on weight matrices, none on biases, norms and a
    learned temperature (decaying them pulls them toward 0, which nothing justifies). Frozen
    parameters and the EMA key encoder (``key_encoder.``, updated by the EMA, not the optimizer)
    are left out."""
    decay, no_decay = [], []
    for name, p in named_parameters:
        if not p.requires_grad or name.startswith("key_encoder."):
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() or "temperature" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class RetrievalModule(L.LightningModule):
    """Trains a text encoder with a contrastive objective.

    The objective asks for the embeddings it needs (``Embeddings``): the trained encoder with or
    without gradient, its EMA copy (built when ``objective.momentum`` is set) or a frozen guide
    (``objective.guide.fixed``); after backward it lets the objective enqueue. It never asks which
    objective it holds.

    Args:
        model, objective, optim, eval: configs (dataclasses, DictConfigs or dicts); see config.py.
        prompts: the data's query / document prompts (``data.prompts``), kept in the checkpoint's
            hyper-parameters so that the commands and the export use the ones trained with.
        sources: the number of training sources (``data.sources``; 1 without): the objective keeps a
            memory per source under ``objective.queue_per_source``.
    """

    def __init__(self, model: Any, objective: Any, optim: Any, eval: Any = None, seed: int = 0, prompts: Any = None,
                 sources: int = 1):
        super().__init__()
        self.seed = seed
        self.model_cfg: ModelConfig = to_config(ModelConfig, model)
        self.objective_cfg: ObjectiveConfig = objective_config(objective)
        self.optim_cfg: OptimConfig = to_config(OptimConfig, optim)
        self.eval_cfg: EvalConfig = to_config(EvalConfig, eval)
        # plain containers, so checkpoints reload without this package's classes pickled in
        self.save_hyperparameters(
            {k: OmegaConf.to_container(OmegaConf.structured(v), enum_to_str=True) for k, v in
             dict(model=self.model_cfg, objective=self.objective_cfg, optim=self.optim_cfg, eval=self.eval_cfg).items()}
            | {"seed": seed, "prompts": to_prompts(prompts).to_dict(), "sources": int(sources)}
        )
        self.encoder = build_encoder(self.model_cfg)
        self.encoder.prompts = to_prompts(prompts)
        # the fixed guide of guided masking: frozen, held outside the state dict (checkpoints stay
        # the trained model's; the guide is rebuilt from its config)
        guide = build_guide_encoder(self.objective_cfg.guide, self.model_cfg, self.encoder)
        self._guide = (guide,) if guide is not None else ()
        self.objective = build_objective(self.objective_cfg, self.encoder, guide, sources=int(sources))
        uses_ema = self.objective.momentum is not None
        self.key_encoder = MomentumEncoder(self.encoder, self.objective.key_encoder_dropout) if uses_ema else None
        # GradCache (model.grad_cache_chunk, see model/gradcache.py): sides embedded with gradient go
        # through the encoder in chunks and are re-run during backward; the others are embedded in chunks.
        # Automatic optimization is kept: clipping, accumulation, schedules and the EMA/queue hooks
        # see an ordinary loss.backward().
        chunk = self.model_cfg.grad_cache_chunk
        self.grad_cache = GradCache(chunk) if chunk is not None else None
        self._val_outputs: dict[int, dict[str, list]] = {}  # by evaluation set (dataloader_idx)
        self.last_val_results: dict = {}  # the last validation's EvalResult of each set, by name
        self.last_val_metrics: dict[str, float] = {}  # and its logged metrics
        self.last_val_step = -1
        # Hugging Face loads models in eval mode and Lightning (>= 2.2) keeps each submodule's mode
        # at fit start: without this the query encoder would train with dropout off. Frozen
        # backbones and the key encoder keep eval mode through their own train() overrides.
        self.train()

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "RetrievalModule":
        return cls(cfg.model, cfg.objective, cfg.optim, cfg.eval, seed=cfg.seed, prompts=cfg.data.prompts,
                   sources=max(1, len(cfg.data.sources)))

    # ---- training -------------------------------------------------------------------------
    def momentum(self) -> float:
        return self.objective.momentum

    def encode(self, encoder: str, side: dict, kind: str, grad: bool, autocast) -> torch.Tensor:
        """``side`` by the trained encoder, its EMA copy or the guide, under ``autocast`` (the step's)."""
        if encoder == TRAINED:
            enc = self.encoder
        elif encoder == MOMENTUM:
            enc = self.key_encoder.key_encoder
        else:
            enc = self._guide[0]
            if enc.tower.special_ids.device != self.device:  # not a submodule: Lightning does not move it
                enc.to(self.device)
        with autocast_to(autocast), torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            if self.grad_cache is None:
                return enc(side, kind)
            return self.grad_cache.embed(lambda part: enc(part, kind), side, device=self.device, grad=grad)

    def shared_step(self, batch: dict) -> tuple[torch.Tensor, dict]:
        embed = Embeddings(self, batch, self.global_step)
        with torch.autocast(device_type=self.device.type, enabled=False):  # logits in fp32
            return self.objective(batch, embed)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, stats = self.shared_step(batch)
        if self.key_encoder is not None:
            stats["momentum"] = self.momentum()
        stats.update(self.objective.stats(self.global_step))
        bs = batch["doc_id"].shape[0]
        # the logged step is the one this batch completes, as on the console and in checkpoint
        # names (Lightning would log the steps completed before it: one less)
        self.log("step", float(self.global_step + 1), batch_size=bs)
        self.log("train/loss", stats.pop("loss"), prog_bar=True, batch_size=bs)
        if self._trainer is not None and self.trainer.optimizers:  # the rate this batch's step applies
            self.log("lr-AdamW", float(self.trainer.optimizers[0].param_groups[0]["lr"]), batch_size=bs)
        self.log_dict({f"train/{k}": torch.as_tensor(v).float() for k, v in stats.items()}, batch_size=bs)
        if "source" in batch:  # several sources (data.sources, in their order): every rank's batch is of one
            self.log_source_counts(batch["source"], bs)
        return loss

    def log_source_counts(self, source: torch.Tensor, bs: int) -> None:
        """``train/source``: this step's source; ``train/pairs_source_S``: pairs of source S trained
        on in the epoch, all ranks (logged at the epoch's end)."""
        world = self.trainer.world_size if self._trainer is not None else 1
        values, counts = torch.unique(source.detach().cpu(), return_counts=True)
        self.log("train/source", float(values[0]), batch_size=bs)
        for s, n in zip(values.tolist(), counts.tolist()):
            self.log(f"train/pairs_source_{s}", float(n * world), on_step=False, on_epoch=True, reduce_fx="sum",
                     batch_size=bs)

    def on_fit_start(self) -> None:
        if self.grad_cache is not None and self.trainer.world_size > 1:
            # Each chunk's re-run inside the one backward fires every parameter's DDP hook again
            # (reentrant backward, as in activation checkpointing); DDP supports that with a static
            # graph: it counts the hooks of the first iteration and all-reduces once they all fired.
            from torch.nn.parallel import DistributedDataParallel

            model = getattr(self.trainer.strategy, "model", None)
            if not isinstance(model, DistributedDataParallel):
                raise ValueError(
                    "model.grad_cache_chunk with several processes needs trainer.strategy=ddp "
                    f"(got {type(model).__name__}); or unset model.grad_cache_chunk"
                )
            if not model.static_graph:
                model._set_static_graph()  # what DDP(static_graph=True) calls; before the first step

    def on_after_backward(self) -> None:
        # right after backward (the queue logits' backward needed the queue as it was), before any
        # callback's end-of-step checkpoint, so checkpoints hold this step's keys
        self.objective.after_backward()

    def optimizer_step(self, *args, **kwargs) -> None:
        # Lightning calls this once per optimizer step (not per micro-batch under accumulation),
        # so the EMA follows optimizer steps.
        super().optimizer_step(*args, **kwargs)
        if self.key_encoder is not None:
            self.key_encoder.update(self.encoder, self.momentum())

    def configure_optimizers(self):
        o = self.optim_cfg
        opt = torch.optim.AdamW(decay_groups(self.named_parameters(), o.weight_decay), lr=o.lr, betas=tuple(o.betas))
        total = int(self.trainer.estimated_stepping_batches)
        warmup = o.warmup_steps or int(o.warmup_ratio * total)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(o.schedule, warmup, total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- checkpoints: a LoRA backbone's base weights are its folder's, loaded when the module is built
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if drop_base_weights(checkpoint["state_dict"], self):
            checkpoint[LORA_BASE] = base_fingerprint(self)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        trained = (checkpoint.get("hyper_parameters") or {}).get("model") or {}
        check_same_lora(trained.get("lora"), self.model_cfg.lora, "the checkpoint resumed from")
        check_same_base(checkpoint.get(LORA_BASE), self, "the checkpoint resumed from")
        restore_base_weights(checkpoint["state_dict"], self)

    # ---- dropout masks that depend on the batch, not on the history of the generator ---------
    def on_train_batch_start(self, batch, batch_idx) -> None:
        # Seeded from (seed, epoch, batch, rank): a run resumed from any checkpoint draws exactly
        # the masks the uninterrupted run drew, whatever else used the global generator meanwhile.
        self._reseed(self.current_epoch, batch_idx)

    def _reseed(self, epoch: int, batch_idx: int) -> None:
        mix = ((self.seed * 1_000_003 + epoch) * 1_000_003 + batch_idx) * 1009 + self.global_rank
        torch.manual_seed(mix % (2**63 - 1))

    # ---- validation: each evaluation set whole on every rank, metrics computed once -----------
    def on_validation_epoch_start(self) -> None:
        self._val_outputs = {}

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        kind = batch["kind"]
        emb = self.encoder(batch, kind).float().cpu()
        out = self._val_outputs.setdefault(dataloader_idx, {"doc_ids": [], "doc": [], "query_ids": [], "query": []})
        out[f"{kind}_ids"].extend(batch["ids"])
        out[kind].append(emb)

    def on_validation_epoch_end(self) -> None:
        dm = self.trainer.datamodule
        sets = list(dm.eval_sets.items())
        results, logged = {}, {}
        for index, (name, ev) in enumerate(sets):
            if not self._val_outputs.get(index, {}).get("doc"):
                continue
            doc_ids, docs = self._val_rows("doc", dm, index)
            query_ids, queries = self._val_rows("query", dm, index)
            result = evaluate_embeddings(doc_ids, docs, query_ids, queries, ev.qrels, self.eval_cfg,
                                         normalize=self.encoder.normalize)
            if self.objective_cfg.matryoshka_dims:  # the metrics at each Matryoshka prefix too
                result.metrics_by_dim = metrics_by_dim(doc_ids, docs, query_ids, queries, ev.qrels, self.eval_cfg,
                                                       self.objective_cfg.matryoshka_dims, bool(self.encoder.normalize))
            results[name] = result
            prefix = metric_prefix(len(sets), name)
            logged.update(set_metrics(result, prefix))
            # what these numbers were measured on (a capped pool is easier than the full held-out set)
            logged.update({f"{prefix}pool_queries": float(len(query_ids)), f"{prefix}pool_docs": float(len(doc_ids))})
        if not results:
            return
        if len(sets) > 1:
            logged.update(mean_metrics(results.values()))
        self.last_val_results, self.last_val_metrics, self.last_val_step = results, logged, self.global_step
        logged.update({f"val/{k}": v for k, v in self.objective.stats(self.global_step).items()})
        # identical on every rank (each holds the whole pool's embeddings), so no reduction is needed
        logged["step"] = float(self.global_step)  # the steps completed, as in best-STEP.ckpt
        self.log_dict(logged, sync_dist=False, add_dataloader_idx=False)
        self._val_outputs = {}

    def _val_rows(self, kind: str, dm, index: int) -> tuple[list, np.ndarray]:
        """``(ids, embeddings)`` of the validated ``kind`` rows of evaluation set ``index``: this
        rank's, gathered from every rank in rank order when the data module split the set (``eval_shard``)."""
        ids, parts = self._val_outputs[index][f"{kind}_ids"], self._val_outputs[index][kind]
        local = torch.cat(parts).numpy() if parts else np.zeros((0, self.encoder.dim), np.float32)
        rank, world = dm.eval_shard(index)
        if world == 1:
            return ids, local
        ev = list(dm.eval_sets.values())[index]
        pool = list(ev.corpus if kind == "doc" else ev.queries)
        blocks = [shard_range(len(pool), r, world) for r in range(world)]
        if ids != pool[blocks[rank][0] : blocks[rank][0] + len(ids)]:
            raise RuntimeError(f"rank {rank} validated {kind} rows that are not its block of the pool")
        counts = row_counts(len(local))
        return [i for (start, _), n in zip(blocks, counts) for i in pool[start : start + n]], all_gather_rows(local)


def metric_prefix(n_sets: int, name: str) -> str:
    """Where a set's validation metrics are logged: ``val/`` for the one pool, ``val/<name>/`` among several."""
    return "val/" if n_sets < 2 else f"val/{name}/"


def monitored_metric(best_set: str, sets: Sequence[str]) -> str:
    """The metric that picks the best checkpoints: recall@1 of the one pool, else of ``best_set``
    (a set's name, or the mean over the sets: trainer.best_set)."""
    return metric_prefix(len(sets), best_set) + "recall@1"


def set_metrics(result, prefix: str) -> dict[str, float]:
    """One set's logged numbers: retrieval metrics, at each Matryoshka prefix, and the geometry."""
    out = {f"{prefix}{k}": float(v) for k, v in result.metrics.items()}
    out.update({f"{prefix}dim{d}/{k}": float(v) for d, m in result.metrics_by_dim.items() for k, v in m.items()})
    out.update({f"{prefix}{k}": float(v) for k, v in result.geometry.items() if isinstance(v, (int, float))})
    return out


def mean_metrics(results) -> dict[str, float]:
    """``val/mean/<metric>``: each retrieval metric (and at each Matryoshka prefix) averaged over the
    sets, unweighted (a set of 50 queries counts as much as one of 5,000, as NanoBEIR's mean)."""
    per_set = [{**r.metrics, **{f"dim{d}/{k}": v for d, m in r.metrics_by_dim.items() for k, v in m.items()}}
               for r in results]
    return {f"val/{MEAN_SET}/{k}": float(np.mean([float(m[k]) for m in per_set])) for k in per_set[0]}
