"""The Lightning module: wires encoder, key encoder, objective (and its queue), optimizer and
validation. The flow of one step is in docs/design.md.
"""
from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from omegaconf import OmegaConf

from moco_retrieval.config import EvalConfig, ModelConfig, ObjectiveConfig, OptimConfig, TrainConfig
from moco_retrieval.evaluation.encode import evaluate_embeddings
from moco_retrieval.gradcache import GradCache
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.model.momentum import MomentumEncoder, momentum_at
from moco_retrieval.objectives import build_objective


def _as(cls, node):
    """A dataclass config from a dataclass, DictConfig or plain dict."""
    if isinstance(node, cls):
        return node
    if not isinstance(node, dict):
        node = OmegaConf.to_container(node, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))


def lr_lambda(schedule: str, warmup: int, total: int):
    """Linear warmup to 1, then linear decay to 0, cosine decay to 0, or constant."""

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1.0 - t if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * t))

    if schedule not in ("linear", "cosine", "constant"):
        raise ValueError(f"optim.schedule must be linear, cosine or constant, got {schedule!r}")
    return f


class RetrievalModule(L.LightningModule):
    """Trains a text encoder with a contrastive objective.

    Args:
        model, objective, optim, eval: configs (dataclasses, DictConfigs or dicts); see config.py.
    """

    def __init__(self, model: Any, objective: Any, optim: Any, eval: Any = None, seed: int = 0):
        super().__init__()
        self.seed = seed
        self.model_cfg: ModelConfig = _as(ModelConfig, model)
        self.objective_cfg: ObjectiveConfig = _as(ObjectiveConfig, objective)
        self.optim_cfg: OptimConfig = _as(OptimConfig, optim)
        self.eval_cfg: EvalConfig = _as(EvalConfig, eval or {})
        # plain containers, so checkpoints reload without this package's classes pickled in
        self.save_hyperparameters(
            {k: OmegaConf.to_container(OmegaConf.structured(v)) for k, v in
             dict(model=self.model_cfg, objective=self.objective_cfg, optim=self.optim_cfg, eval=self.eval_cfg).items()}
            | {"seed": seed}
        )
        self.encoder = build_encoder(self.model_cfg)
        self.objective = build_objective(self.objective_cfg, self.encoder.dim)
        use_ema = self.objective.keys_from_key_encoder and self.model_cfg.key_encoder == "ema"
        if self.model_cfg.key_encoder not in ("ema", "query"):
            raise ValueError(f"model.key_encoder must be 'ema' or 'query', got {self.model_cfg.key_encoder!r}")
        self.key_encoder = MomentumEncoder(self.encoder, self.model_cfg.key_encoder_dropout) if use_ema else None
        # GradCache (objective.grad_cache_chunk, see gradcache.py): the trained side is embedded in
        # chunks and re-run during backward; key-encoder sides are embedded in chunks (no graph).
        # Automatic optimization is kept: clipping, accumulation, schedules and the EMA/queue hooks
        # see an ordinary loss.backward().
        chunk = self.objective_cfg.grad_cache_chunk
        self.grad_cache = GradCache(chunk) if chunk is not None else None
        if self.objective_cfg.queue_reproject:
            if not (self.objective.keys_from_key_encoder and hasattr(self.objective, "reproject_features")):
                raise ValueError("objective.queue_reproject=true needs objective=moco (a queue)")
            if not self.encoder.frozen:
                raise ValueError(
                    "objective.queue_reproject=true needs model.frozen_backbone=true: only a frozen backbone's "
                    "features stay valid, so the queue can hold features and re-project them every step"
                )
            if self.objective_cfg.key_grad and self.key_encoder is not None:
                raise ValueError("objective.key_grad=true needs model.key_encoder=query: an EMA key encoder is not trained")
            self.objective.reproject_features(self._key_side().hidden_size, key_grad=self.objective_cfg.key_grad)
        elif self.objective_cfg.key_grad:
            raise ValueError(
                "objective.key_grad=true needs objective.queue_reproject=true: stored queue keys cannot carry "
                "gradient, and gradient through the batch's keys alone is unbalanced by the queue"
            )
        self._val_outputs: dict[str, list] = {}
        self.last_val_result = None
        self.last_val_step = -1
        # Hugging Face loads models in eval mode and Lightning (>= 2.2) keeps each submodule's mode
        # at fit start: without this the query encoder would train with dropout off. Frozen
        # backbones and the key encoder keep eval mode through their own train() overrides.
        self.train()

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "RetrievalModule":
        return cls(cfg.model, cfg.objective, cfg.optim, cfg.eval, seed=cfg.seed)

    # ---- training -------------------------------------------------------------------------
    def momentum(self) -> float:
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 0
        return momentum_at(self.global_step, int(total), self.model_cfg.momentum, self.model_cfg.momentum_schedule)

    def _encode(self, encoder, side: dict, kind: str, grad: bool = True) -> torch.Tensor:
        """``encoder(side, kind)``; through GradCache when ``objective.grad_cache_chunk`` is set."""
        if self.grad_cache is None:
            return encoder(side, kind)
        return self.grad_cache.embed(lambda part: encoder(part, kind), side, device=self.device, grad=grad)

    def encode_keys(self, side: dict) -> torch.Tensor:
        """Document-side vectors that play the role of keys in the objective."""
        if not self.objective.keys_from_key_encoder:
            return self._encode(self.encoder, side, "doc")  # in-batch: the trained tower, with gradient
        if self.key_encoder is not None:
            return self._encode(self.key_encoder, side, "doc", grad=False)
        if getattr(self.objective, "key_grad", False):  # keys train the tower too (objective.key_grad)
            return self._encode(self.encoder, side, "doc")
        with torch.no_grad():  # key_encoder=query: the query encoder without a momentum copy
            return self._encode(self.encoder, side, "doc", grad=False)

    def _key_side(self):
        """The encoder that makes keys: the EMA copy, else the query encoder."""
        return self.key_encoder.key_encoder if self.key_encoder is not None else self.encoder

    def key_features(self, side: dict) -> torch.Tensor:
        """Frozen backbone features of documents (queue_reproject; cached by the key encoding)."""
        enc = self._key_side()
        tower = enc.tower_for("doc")
        enc._fill_cache(tower, side["texts"], "doc", batch_size=256, progress=False)
        return tower.feature_cache.gather(side["texts"], enc.max_len("doc")).to(tower.special_ids.device)

    def project_keys(self, feats: torch.Tensor) -> torch.Tensor:
        """Keys from frozen features with the *current* key head (queue_reproject). Differentiable:
        the objective calls it under no_grad unless objective.key_grad."""
        enc = self._key_side()
        out = enc.tower_for("doc").project(feats).float()
        return torch.nn.functional.normalize(out, dim=-1) if enc.normalize else out

    def shared_step(self, batch: dict) -> tuple[torch.Tensor, dict]:
        q = self._encode(self.encoder, batch["query"], "query")
        k = self.encode_keys(batch["doc"])
        meta = {"doc_id": batch["doc_id"], "group": batch["group"]}
        if "neg" in batch:
            meta.update(neg=self.encode_keys(batch["neg"]), neg_id=batch["neg_id"], neg_group=batch["neg_group"])
        if getattr(self.objective, "reproject", False):
            meta.update(key_features=self.key_features(batch["doc"]), project_keys=self.project_keys)
            if "neg" in batch:
                meta["neg_features"] = self.key_features(batch["neg"])
        return self.objective(q, k, meta, step=self.global_step)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, stats = self.shared_step(batch)
        if self.key_encoder is not None:
            stats["momentum"] = torch.tensor(self.momentum())
        bs = batch["doc_id"].shape[0]
        self.log("train/loss", stats.pop("loss"), prog_bar=True, batch_size=bs)
        self.log_dict({f"train/{k}": v.float() for k, v in stats.items()}, batch_size=bs)
        return loss

    def on_fit_start(self) -> None:
        if self.grad_cache is not None and self.trainer.world_size > 1:
            # Each chunk's re-run inside the one backward fires every parameter's DDP hook again
            # (reentrant backward, as in activation checkpointing); DDP supports that with a static
            # graph: it counts the hooks of the first iteration and all-reduces once they all fired.
            from torch.nn.parallel import DistributedDataParallel

            model = getattr(self.trainer.strategy, "model", None)
            if not isinstance(model, DistributedDataParallel):
                raise ValueError(
                    "objective.grad_cache_chunk with several processes needs trainer.strategy=ddp "
                    f"(got {type(model).__name__}); or unset objective.grad_cache_chunk"
                )
            if not model.static_graph:
                model._set_static_graph()  # what DDP(static_graph=True) calls; before the first step

    def on_after_backward(self) -> None:
        # right after backward (the queue logits' backward needed the queue as it was), before any
        # callback's end-of-step checkpoint, so checkpoints hold this step's keys
        if hasattr(self.objective, "commit"):
            self.objective.commit()

    def optimizer_step(self, *args, **kwargs) -> None:
        # Lightning calls this once per optimizer step (not per micro-batch under accumulation),
        # so the EMA follows optimizer steps.
        super().optimizer_step(*args, **kwargs)
        if self.key_encoder is not None:
            self.key_encoder.update(self.encoder, self.momentum())

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad or name.startswith("key_encoder."):
                continue
            (no_decay if p.ndim < 2 or "norm" in name.lower() or "temperature" in name else decay).append(p)
        o = self.optim_cfg
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=tuple(o.betas),
        )
        total = int(self.trainer.estimated_stepping_batches)
        warmup = o.warmup_steps or int(o.warmup_ratio * total)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(o.schedule, warmup, total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- dropout masks that depend on the batch, not on the history of the generator ---------
    def on_train_batch_start(self, batch, batch_idx) -> None:
        # Seeded from (seed, epoch, batch, rank): a run resumed from any checkpoint draws exactly
        # the masks the uninterrupted run drew, whatever else used the global generator meanwhile.
        self._reseed(self.current_epoch, batch_idx)

    def _reseed(self, epoch: int, batch_idx: int) -> None:
        mix = ((self.seed * 1_000_003 + epoch) * 1_000_003 + batch_idx) * 1009 + self.global_rank
        torch.manual_seed(mix % (2**63 - 1))

    # ---- validation: the whole held-out pool on every rank, metrics computed once ----------
    def on_validation_epoch_start(self) -> None:
        self._val_outputs = {"doc_ids": [], "doc": [], "query_ids": [], "query": []}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        kind = batch["kind"]
        emb = self.encoder(batch, kind).float().cpu()
        self._val_outputs[f"{kind}_ids"].extend(batch["ids"])
        self._val_outputs[kind].append(emb)

    def on_validation_epoch_end(self) -> None:
        out = self._val_outputs
        if not out.get("doc"):
            return
        dm = self.trainer.datamodule
        result = evaluate_embeddings(
            out["doc_ids"], torch.cat(out["doc"]).numpy(), out["query_ids"], torch.cat(out["query"]).numpy(),
            dm.eval_set.qrels, self.eval_cfg, normalize=self.encoder.normalize,
        )
        self.last_val_result, self.last_val_step = result, self.global_step
        logged = {f"val/{k}": float(v) for k, v in result.metrics.items()}
        logged.update({f"val/{k}": float(v) for k, v in result.geometry.items() if isinstance(v, (int, float))})
        if hasattr(self.objective, "queue"):
            logged["val/queue_fill"] = float(self.objective.queue.fill)
            logged["val/queue_age"] = self.objective.queue.mean_age(self.global_step)
        # identical on every rank (each encodes the whole pool), so no reduction is needed
        self.log_dict(logged, sync_dist=False)
        self._val_outputs = {}
