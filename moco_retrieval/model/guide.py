"""The frozen guide encoder of guided false-negative masking (objectives/guided.py).

``objective.guide=base`` is the run's own backbone as it was before training (no head, frozen);
any other value except "none" and "momentum" names a backbone ("minilm") or a local model folder,
mean-pooled. Guides are frozen and L2-normalised (the rule compares cosines), and their features
are cached per text like any frozen backbone's, so a text is encoded once per run.
"""
from __future__ import annotations

import dataclasses

from moco_retrieval.config import LoraConfig, ModelConfig
from moco_retrieval.model.encoder import TextEncoder, build_encoder
from moco_retrieval.objectives.guided import MOMENTUM_GUIDE, NONE


def guide_model_config(guide: str, model: ModelConfig) -> ModelConfig | None:
    """The ModelConfig of a fixed guide, or None when ``guide`` is "none" or "momentum"."""
    if guide in (NONE, MOMENTUM_GUIDE):
        return None
    # the base as it was: no adapters, nothing to back-propagate through
    frozen = dict(head="none", head_dim=None, head_init="random", frozen_backbone=True, normalize=True,
                  shared_tower=True, grad_cache_chunk=None, lora=LoraConfig(), gradient_checkpointing=False)
    if guide == "base":
        return dataclasses.replace(model, **frozen)
    return dataclasses.replace(model, backbone=guide, path=None, backbone_kind="transformer", pooling="mean", **frozen)


def build_guide_encoder(guide: str, model: ModelConfig) -> TextEncoder | None:
    cfg = guide_model_config(guide, model)
    if cfg is None:
        return None
    encoder = build_encoder(cfg)
    encoder.requires_grad_(False)
    return encoder.eval()


__all__ = ["guide_model_config", "build_guide_encoder"]
