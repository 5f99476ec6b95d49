"""A LoRA backbone's adapters merged into its base weights, written to a folder as a plain Hugging
Face model (export), one safetensors shard at a time.

Merging into a copy of the whole backbone (``copy.deepcopy(peft_model).merge_and_unload()``) costs
a second model: 14 GB more for a 7B base in bfloat16. Here each merged weight is computed as peft's
merge computes it (a copy of the base weight plus ``get_delta_weight``), only while its shard is
written; every other tensor is written from the base itself. The trained model is not touched.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from moco_retrieval.model.lora import base_state_dict, lora_layer_paths

SHARD_BYTES = 256 * 2**20  # the most merged bytes held at once (safetensors serialises a shard into one more
# buffer); the files are export_model.py's temporary ones, which sentence-transformers saves again
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"  # transformers' file names


def merged_weights(backbone: nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    """The plain model's state dict, each tensor behind a call: the base's own tensor, or for a
    layer with adapters its merged weight, computed when called."""
    base = base_state_dict(backbone)
    out: dict[str, Callable[[], torch.Tensor]] = {k: partial(_itself, t) for k, t in base.items()}
    model = backbone.get_base_model()
    for path in lora_layer_paths(backbone):
        key = f"{path}.weight"
        if key not in out:
            raise RuntimeError(f"LoRA layer {path!r} has no base weight {key!r} to merge into")
        out[key] = partial(_merged_weight, model.get_submodule(path))
    return out


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


def _merged_weight(layer: nn.Module) -> torch.Tensor:
    """``layer``'s base weight with its active adapters added, as peft's (unsafe) ``merge`` does it."""
    if getattr(layer, "lora_variant", None) or any(getattr(layer, "lora_bias", {}).values()):
        raise ValueError("merging supports plain LoRA adapters (no DoRA or other variant, no LoRA bias)")
    weight = layer.get_base_layer().weight.detach().clone()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
            weight += layer.get_delta_weight(adapter)
    return weight


def save_merged(backbone: nn.Module, folder: Path, extra: Optional[dict[str, torch.Tensor]] = None,
                shard_bytes: Optional[int] = None) -> list[str]:
    """Write ``backbone`` (a peft LoRA model) with its adapters merged to ``folder`` as a plain
    model (config, safetensors shards of at most ``shard_bytes`` (default :data:`SHARD_BYTES`),
    their index when there are several); ``extra``: more tensors to save (e.g. a pooler). Returns
    the file names written."""
    from safetensors.torch import save_file

    folder = Path(folder)
    base = base_state_dict(backbone)
    tensors = {**merged_weights(backbone), **{k: partial(_itself, t) for k, t in (extra or {}).items()}}
    sizes = {k: t.numel() * t.element_size() for k, t in {**base, **(extra or {})}.items()}
    shards = _shards(list(tensors), sizes, int(shard_bytes or SHARD_BYTES))
    names = [WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        save_file({k: tensors[k]().contiguous() for k in keys}, str(folder / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        names.append(INDEX)
    backbone.get_base_model().config.save_pretrained(str(folder))
    return names + ["config.json"]


def _shards(keys: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """``keys`` in order, cut into runs of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for k in keys:
        if shards[-1] and used + sizes[k] > limit:
            shards.append([])
            used = 0
        shards[-1].append(k)
        used += sizes[k]
    return shards


__all__ = ["SHARD_BYTES", "merged_weights", "save_merged"]
