"""LoRA adapters (``model.lora``, peft) on a frozen backbone.

``apply_lora(backbone, cfg)`` wraps a Hugging Face backbone in a ``peft.PeftModel``: every base
weight frozen, low-rank adapters on ``model.lora.target_modules`` (default: per architecture,
:data:`DEFAULT_TARGETS`) trained. The EMA key encoder (momentum.py) shares the frozen base
weights with the trained encoder, so its momentum copy is the adapters and the head only.

Checkpoints leave the base weights out (they are the backbone folder's, loaded again when the
model is built): :func:`drop_base_weights` before a save, :func:`restore_base_weights` before a
load. Export merges the adapters into a plain backbone (export/writer.py: no copy of the base), or
saves the adapter alone (:func:`save_adapter`).
"""
from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch import nn

from moco_retrieval.errors import CheckpointError, ConfigError

# the attention (and, for encoders, feed-forward) projections, by config.model_type
_BERT_LIKE = ["query", "key", "value", "dense"]
_DECODER = ["q_proj", "k_proj", "v_proj", "o_proj"]
DEFAULT_TARGETS: dict[str, list[str]] = {
    "bert": _BERT_LIKE, "roberta": _BERT_LIKE, "xlm-roberta": _BERT_LIKE, "electra": _BERT_LIKE,
    "llama": _DECODER, "mistral": _DECODER, "qwen2": _DECODER, "qwen3": _DECODER, "gemma": _DECODER,
    "gemma2": _DECODER, "phi3": ["qkv_proj", "o_proj"], "mpnet": ["q", "k", "v", "o"],
}
LORA_BASE = "lora_base_fingerprint"  # the checkpoint key of base_fingerprint
ADAPTER_MARK = "lora_"  # in the name of every adapter parameter (peft: lora_A, lora_B, ...)


def target_modules(backbone: nn.Module, configured: Optional[Iterable[str]]) -> list[str]:
    """The module names to adapt: ``model.lora.target_modules``, else the architecture's default."""
    if configured:
        return list(configured)
    model_type = str(getattr(getattr(backbone, "config", None), "model_type", ""))
    if model_type in DEFAULT_TARGETS:
        return list(DEFAULT_TARGETS[model_type])
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    if model_type in PEFT_DEFAULTS:
        return list(PEFT_DEFAULTS[model_type])
    raise ConfigError(
        f"model.lora: no default target modules for a {model_type or type(backbone).__name__!r} backbone; "
        "set model.lora.target_modules=[NAME,...] (names of its linear layers, e.g. q_proj,v_proj)"
    )


def apply_lora(backbone: nn.Module, cfg: Any) -> nn.Module:
    """``backbone`` wrapped in a peft model with LoRA adapters (``cfg``: a ``LoraConfig``); the base
    weights are frozen, the adapters (float32, whatever the base's dtype) trainable."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = target_modules(backbone, cfg.target_modules)
    peft_cfg = PeftLoraConfig(r=int(cfg.r), lora_alpha=float(cfg.alpha), lora_dropout=float(cfg.dropout),
                              target_modules=targets, bias="none")
    try:
        with warnings.catch_warnings():
            # peft reads transformers' deprecated ``is_gradient_checkpointing`` alias: a FutureWarning
            # on every LoRA start that is neither ours nor the user's to act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(backbone, peft_cfg)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(f"model.lora.target_modules={targets}: {e}") from e


def is_lora(backbone: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(backbone, PeftModel)


def base_weight_keys(module: nn.Module) -> list[str]:
    """The state-dict keys of ``module`` that are a LoRA backbone's base weights (and buffers):
    what a checkpoint leaves out. Empty without LoRA."""
    keys = []
    for name, sub in module.named_modules():
        if is_lora(sub):
            prefix = f"{name}." if name else ""
            keys += [prefix + k for k in sub.state_dict() if ADAPTER_MARK not in k]
    return keys


def drop_base_weights(state_dict: dict, module: nn.Module) -> int:
    """Remove ``module``'s LoRA base weights from ``state_dict`` (a checkpoint's); returns how many."""
    keys = [k for k in base_weight_keys(module) if k in state_dict]
    for k in keys:
        del state_dict[k]
    return len(keys)


def restore_base_weights(state_dict: dict, module: nn.Module) -> None:
    """Put ``module``'s current base weights (the backbone folder's) into a checkpoint's
    ``state_dict`` where it left them out, so the checkpoint loads strictly."""
    keys = base_weight_keys(module)
    if not keys:
        return
    current = module.state_dict()
    for k in keys:
        state_dict.setdefault(k, current[k])


def lora_layer_paths(backbone: nn.Module) -> list[str]:
    """The module paths (in ``backbone.get_base_model()``) of the layers peft wrapped with adapters."""
    from peft.tuners.lora import LoraLayer

    return [name for name, m in backbone.get_base_model().named_modules() if isinstance(m, LoraLayer)]


def base_state_dict(backbone: nn.Module) -> dict[str, torch.Tensor]:
    """The base model under a LoRA ``backbone``'s adapters as a plain model's state dict (its own
    key names, e.g. ``...query.weight`` for peft's ``...query.base_layer.weight``), the tensors
    themselves (no copy)."""
    layers = lora_layer_paths(backbone)
    wrapped = tuple(f"{p}." for p in layers)
    out = {}
    for key, t in backbone.get_base_model().state_dict().items():
        layer = next((w for w in wrapped if key.startswith(w)), None)
        if layer is None:
            out[key] = t
        elif key.startswith(layer + "base_layer."):
            out[layer + key[len(layer) + len("base_layer."):]] = t
    return out


class AdaptersDisabled(nn.Module):
    """The frozen base under a LoRA backbone, run through that backbone with its adapters disabled
    (``objective.guide=base`` with LoRA: the guide is the base model without a second copy of it).

    The peft model is held outside this module's tree, so that freezing this module or putting it
    in eval mode leaves the trained encoder alone; each call runs it in eval mode (no dropout, no
    activation checkpointing) without gradient and puts every submodule's mode back. Its state
    dict is the base's, under the plain model's names (what a frozen tower's feature-cache
    fingerprint hashes: the same as a separately loaded base's)."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        if not is_lora(backbone):
            raise ValueError("AdaptersDisabled needs a peft (LoRA) backbone")
        self._lora = (backbone,)  # a tuple: not a submodule (see the class docstring)
        self.config = backbone.get_base_model().config

    def forward(self, *args, **kwargs):
        backbone = self._lora[0]
        modes = [(m, m.training) for m in backbone.modules()]
        backbone.eval()
        try:
            with torch.no_grad(), backbone.disable_adapter():
                return backbone(*args, **kwargs)
        finally:
            for m, mode in modes:
                m.training = mode

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, t in base_state_dict(self._lora[0]).items():
            destination[prefix + key] = t if keep_vars else t.detach()


SAMPLE = 256  # values hashed from each end of every base tensor: a fingerprint in milliseconds for 7B weights


def base_fingerprint(module: nn.Module) -> Optional[str]:
    """A cheap fingerprint of ``module``'s LoRA base weights (names, shapes, dtypes, the first and
    last values of each), kept in checkpoints that leave them out; None without LoRA."""
    backbone = next((m for m in module.modules() if is_lora(m)), None)
    if backbone is None:
        return None
    state = backbone.state_dict()  # keys of the backbone alone: the same in a training module and an encoder
    h = hashlib.sha256()
    for k in sorted(k for k in state if ADAPTER_MARK not in k):
        t = state[k].detach().reshape(-1)
        h.update(f"{k}|{tuple(state[k].shape)}|{t.dtype}".encode())
        ends = torch.cat([t[:SAMPLE], t[-SAMPLE:]]).to("cpu", torch.float64)
        h.update(ends.numpy().tobytes())
    return h.hexdigest()[:24]


def check_same_base(saved: Optional[str], module: nn.Module, where: str) -> None:
    """A checkpoint's adapters fit the base weights they were trained on: refuse another base."""
    if saved is not None and saved != base_fingerprint(module):
        raise CheckpointError(
            f"{where} holds LoRA adapters trained on other base weights than the backbone loaded now "
            "(model.backbone / model.path point at another model folder, or its files changed)"
        )


def check_same_lora(trained: Optional[dict], current: Any, where: str) -> None:
    """Resuming needs the adapters the checkpoint holds: refuse other ``model.lora`` settings (another
    rank or other targets cannot load; another alpha or dropout would train another model mid-run).
    ``trained``: the checkpoint's ``hyper_parameters.model.lora`` (None: from before LoRA existed)."""
    trained = dict(trained or {"r": 0})
    now = {"r": int(current.r), "alpha": float(current.alpha), "dropout": float(current.dropout),
           "target_modules": None if current.target_modules is None else list(current.target_modules)}
    if int(trained.get("r", 0)) == 0 and now["r"] == 0:
        return
    changed = [k for k in now if trained.get(k) != now[k]]
    if changed:
        raise CheckpointError(
            f"{where} was trained with " + ", ".join(f"model.lora.{k}={trained.get(k)}" for k in changed)
            + ", but this run's config has " + ", ".join(f"model.lora.{k}={now[k]}" for k in changed)
            + "; set the trained values to resume it (or start a new run_dir)")


def save_adapter(backbone: nn.Module, folder: Path) -> None:
    """The adapter alone (``adapter_config.json``, ``adapter_model.safetensors``): loadable with
    ``peft.PeftModel.from_pretrained(base_model, folder)``."""
    if not is_lora(backbone):
        raise ConfigError("adapter_only=true needs a model trained with LoRA (model.lora.r > 0)")
    backbone.save_pretrained(str(folder))


def adapter_bytes(module: nn.Module) -> int:
    """Bytes of the adapters' parameters in ``module``."""
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if ADAPTER_MARK in n)


__all__ = [
    "AdaptersDisabled",
    "ADAPTER_MARK",
    "LORA_BASE",
    "DEFAULT_TARGETS",
    "adapter_bytes",
    "apply_lora",
    "base_fingerprint",
    "base_state_dict",
    "base_weight_keys",
    "check_same_base",
    "check_same_lora",
    "drop_base_weights",
    "is_lora",
    "lora_layer_paths",
    "restore_base_weights",
    "save_adapter",
    "target_modules",
]
