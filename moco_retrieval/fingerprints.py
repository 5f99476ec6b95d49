"""Each rank's fingerprint of the state DDP does not sync (the objective's queues and all else it
declares in ``unsynced_state()``, and the key encoder): every checkpoint records one per rank
(``checkpoint["rank_fingerprints"]``, preemption.py), so that ranks that drifted apart show it."""
from __future__ import annotations

from typing import Iterator

import lightning as L
import torch
from torch import nn

from moco_retrieval.model.lora import base_fingerprint
from moco_retrieval.tensor_digest import tensors_sha256


def rank_fingerprints(pl_module: L.LightningModule) -> dict[str, str]:
    """sha256 of this rank's objective state (``objective.unsynced_state()``: queues, guide queues,
    refresh buffers, logQ estimates, ...) and key-encoder weights: the state DDP does not sync."""
    out = {}
    objective = getattr(pl_module, "objective", None)
    state = objective.unsynced_state() if objective is not None else {}
    if state:
        out["objective"] = tensors_sha256(sorted(state.items()))
    key_encoder = getattr(pl_module, "key_encoder", None)
    if key_encoder is not None:
        out["key_encoder"] = key_encoder_fingerprint(key_encoder, getattr(pl_module, "encoder", None))
    return out


def key_encoder_fingerprint(key_encoder: nn.Module, encoder: nn.Module | None) -> str:
    """sha256 of the tensors the key encoder owns (its EMA parameters: with LoRA, the adapters and
    the head; its buffers), and of :func:`base_fingerprint` for a LoRA base it shares with
    ``encoder``: hashing a 7B base's bytes at every checkpoint would take minutes and find nothing,
    since the trained encoder (synced by DDP) holds the same tensors and they never change."""
    named = sorted(_owned_tensors(key_encoder, encoder))
    base = base_fingerprint(key_encoder)
    if base is not None:
        named.append(("lora_base", torch.tensor(list(base.encode()), dtype=torch.uint8)))
    return tensors_sha256(named)


def _owned_tensors(key_encoder: nn.Module, encoder: nn.Module | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``key_encoder``'s parameters and buffers, less the parameters it shares with ``encoder``
    (``copy_sharing_frozen``: the frozen weights)."""
    shared = {id(p) for p in encoder.parameters()} if encoder is not None else set()
    for name, p in key_encoder.named_parameters():
        if id(p) not in shared:
            yield f"p/{name}", p.detach()
    for name, b in key_encoder.named_buffers():
        yield f"b/{name}", b


__all__ = ["key_encoder_fingerprint", "rank_fingerprints"]
