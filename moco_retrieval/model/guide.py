"""The frozen guide encoder of guided false-negative masking (objectives/guided.py).

``objective.guide=base`` is the run's own backbone as it was before training (no head, frozen);
any other value except "none" and "momentum" names a backbone ("minilm") or a local model folder,
mean-pooled. Guides are frozen and L2-normalised (the rule compares cosines), and their features
are cached per text like any frozen backbone's, so a text is encoded once per run.

With LoRA, the base guide is the trained encoder's own frozen base run with the adapters disabled
(``lora.AdaptersDisabled``): the same model, without a second copy of its weights in memory.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from moco_retrieval.config import LoraConfig, ModelConfig
from moco_retrieval.model.encoder import TextEncoder, build_encoder
from moco_retrieval.model.lora import AdaptersDisabled, is_lora
from moco_retrieval.objectives.guided import MOMENTUM_GUIDE, NONE

BASE_GUIDE = "base"


def guide_model_config(guide: str, model: ModelConfig) -> ModelConfig | None:
    """The ModelConfig of a fixed guide, or None when ``guide`` is "none" or "momentum"."""
    if guide in (NONE, MOMENTUM_GUIDE):
        return None
    # the base as it was: no adapters, nothing to back-propagate through
    frozen = dict(head="none", head_dim=None, head_init="random", frozen_backbone=True, normalize=True,
                  shared_tower=True, grad_cache_chunk=None, lora=LoraConfig(), gradient_checkpointing=False)
    if guide == BASE_GUIDE:
        return dataclasses.replace(model, **frozen)
    return dataclasses.replace(model, backbone=guide, path=None, backbone_kind="transformer", pooling="mean", **frozen)


def build_guide_encoder(guide: str, model: ModelConfig, encoder: Optional[TextEncoder] = None) -> TextEncoder | None:
    """The frozen guide, or None. ``encoder``: the run's trained encoder, whose LoRA base (when it
    has one) the "base" guide runs with the adapters disabled instead of loading the base again."""
    cfg = guide_model_config(guide, model)
    if cfg is None:
        return None
    backbone = encoder.tower_for("query").backbone if guide == BASE_GUIDE and encoder is not None else None
    if backbone is not None and is_lora(backbone):
        guide_encoder = TextEncoder(cfg, loaded=(AdaptersDisabled(backbone), encoder.tokenizer))
    else:
        guide_encoder = build_encoder(cfg)
    guide_encoder.requires_grad_(False)
    return guide_encoder.eval()


__all__ = ["BASE_GUIDE", "guide_model_config", "build_guide_encoder"]
