"""The momentum (EMA) key encoder (MoCo, He et al. 2020, eq. 2).

The key encoder is a copy of the query side (tower and head) that never receives gradients and
follows it as k <- m*k + (1-m)*q after every optimizer step; buffers are copied.

Where the two encoders sit in a training module's state dict is defined here, once, for the
module and for the checkpoint loaders: ``state_dict_prefix("query")`` is ``"encoder."`` (the
module's ``encoder`` attribute), ``state_dict_prefix("key")`` is ``"key_encoder.key_encoder."`` (its
``key_encoder``, a ``MomentumEncoder``, whose copy is ``.key_encoder``).
"""
from __future__ import annotations

import copy

import torch
from torch import nn


ENCODERS = ("query", "key")
QUERY_ENCODER_ATTR = "encoder"  # the training module's query encoder attribute
KEY_ENCODER_ATTR = "key_encoder"  # its MomentumEncoder attribute (and the MomentumEncoder's copy)


def state_dict_prefix(encoder: str) -> str:
    """The state-dict key prefix of a training module's ``encoder`` ("query" or "key")."""
    if encoder == "query":
        return f"{QUERY_ENCODER_ATTR}."
    if encoder == "key":
        return f"{KEY_ENCODER_ATTR}.{KEY_ENCODER_ATTR}."
    raise ValueError(f"encoder={encoder!r}: expected one of {ENCODERS}")


def copy_sharing_frozen(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose frozen parameters (``requires_grad`` False: a LoRA or frozen
    backbone's base weights) are the original's own tensors, not copies: they never change, so a
    second model's worth of memory would buy nothing."""
    memo = {id(p): p for p in module.parameters() if not p.requires_grad}
    return copy.deepcopy(module, memo)


def _without_activation_checkpointing(module: nn.Module) -> None:
    """Hugging Face layers recompute activations when their ``gradient_checkpointing`` is set; a
    copy that never back-propagates has nothing to save by it (model.gradient_checkpointing)."""
    for sub in module.modules():
        if getattr(sub, "gradient_checkpointing", False) is True:
            sub.gradient_checkpointing = False


class MomentumEncoder(nn.Module):
    """An EMA copy of ``encoder``: of its trained parameters; the frozen ones are shared (with LoRA,
    the copy is the adapters and the head: megabytes, not a second backbone).

    Args:
        encoder: the query-side encoder to copy (deep-copied once; frozen feature caches are
            shared, see ``FeatureCache.__deepcopy__``).
        dropout: False (default) keeps the key encoder in eval mode even while the trainer puts
            modules in train mode, so keys are deterministic; True lets it follow train/eval.
    """

    def __init__(self, encoder: nn.Module, dropout: bool = False):
        super().__init__()
        self.key_encoder = copy_sharing_frozen(encoder)  # KEY_ENCODER_ATTR: see state_dict_prefix
        _without_activation_checkpointing(self.key_encoder)
        for p in self.key_encoder.parameters():
            p.requires_grad_(False)
        self.dropout = dropout
        self.train(False)

    def train(self, mode: bool = True) -> "MomentumEncoder":
        super().train(mode)
        self.key_encoder.train(mode and self.dropout)
        return self

    @torch.no_grad()
    def update(self, encoder: nn.Module, m: float) -> None:
        """k <- m*k + (1-m)*q for trained parameters; buffers are copied. Frozen parameters are
        left alone: they never change, and averaging equal values would still round (a frozen
        backbone must stay bit-identical so its cached features stay valid)."""
        k_params = list(self.key_encoder.parameters())
        q_params = list(encoder.parameters())
        if len(k_params) != len(q_params):
            raise RuntimeError("key encoder and query encoder have different parameter lists")
        trained = [(k, q.detach()) for k, q in zip(k_params, q_params) if q.requires_grad]
        if trained:
            ks, qs = map(list, zip(*trained))
            torch._foreach_mul_(ks, m)
            torch._foreach_add_(ks, qs, alpha=1.0 - m)
        for kb, qb in zip(self.key_encoder.buffers(), encoder.buffers()):
            kb.copy_(qb)

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            return self.key_encoder(*args, **kwargs)

