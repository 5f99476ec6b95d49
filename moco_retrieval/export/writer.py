"""The files of an export: a trained encoder as a sentence-transformers model directory (Transformer,
Pooling, Dense layers of the head, Normalize; a query / document ``Router`` for separate towers),
or a LoRA adapter alone, each with ``moco_retrieval.json`` listing what it wrote (see
export/__main__.py).

A LoRA backbone's adapters are merged into its base weights one safetensors shard at a time
(``save_merged``): merging into a copy of the whole backbone (``copy.deepcopy(peft_model)
.merge_and_unload()``) would cost a second model, 14 GB more for a 7B base in bfloat16. Each merged
weight is computed as peft's merge computes it (a copy of the base weight plus
``get_delta_weight``), only while its shard is written; every other tensor is written from the base
itself. The trained model is not touched.
"""
from __future__ import annotations

import json
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from moco_retrieval.errors import ConfigError
from moco_retrieval.export.card import adapter_card, base_model_name
from moco_retrieval.export.folder import install_export
from moco_retrieval.model.loading import META_FILE
from moco_retrieval.model.lora import (
    base_state_dict,
    is_lora,
    lora_layer_paths,
    save_adapter,
)

SHARD_BYTES = 256 * 2**20  # the most merged bytes held at once (safetensors serialises a shard into one more
# buffer); the files are the export's temporary ones, which sentence-transformers saves again
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


FORMAT_VERSION = 1  # of META_FILE (since "files" was added, it lists the export's entries)
ST_POOLING = {"mean": "mean", "cls": "cls", "last": "lasttoken"}  # our model.pooling -> sentence-transformers'


def export_encoder(
    encoder: Any,
    out_dir: str | Path,
    *,
    side: str = "query",
    source: Optional[dict] = None,
    overwrite: bool = False,
    extra: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Write ``encoder``'s ``side`` tower (both towers, as a query / document ``Router``, when it
    has two) as a sentence-transformers directory (see export.py); returns the directory.
    ``extra(folder)`` writes more files into it before META_FILE lists them (the ONNX form: onnx.py)."""
    if getattr(encoder, "backbone_kind", "transformer") != "transformer":
        raise ConfigError(
            "export supports backbone_kind=transformer; a bag_of_wordpieces encoder has no transformer "
            "layers for sentence-transformers to run (evaluate and search use it directly from the checkpoint)"
        )
    return install_export(Path(out_dir).expanduser(), overwrite, lambda folder: _write_export(encoder, folder, side, source, extra))


def _write_export(encoder: Any, folder: Path, side: str, source: Optional[dict],
                  extra: Optional[Callable[[Path], None]] = None) -> list[str]:
    """The export's files in ``folder`` (META_FILE lists them, itself included); their names."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Router

    towers = {"query": encoder.tower_for("query"), "document": encoder.tower_for("doc")}
    if encoder.shared_tower:
        towers = {"": encoder.tower_for(side)}
    with tempfile.TemporaryDirectory(prefix="moco-export-") as tmp:
        routes = {route: _tower_modules(encoder, tower, Path(tmp) / (route or "tower")) for route, tower in towers.items()}
        modules = routes[""] if encoder.shared_tower else [Router.for_query_document(routes["query"], routes["document"])]
        if encoder.normalize:
            modules.append(Normalize())
        prompts, default_prompt = encoder.prompts.sentence_transformers()
        st = SentenceTransformer(modules=modules, device="cpu",
                                 similarity_fn_name="cosine" if encoder.normalize else "dot",
                                 prompts=prompts, default_prompt_name=default_prompt)
        st.save(str(folder))
    if extra is not None:
        extra(folder)
    tower = towers["" if encoder.shared_tower else "query"]
    cfg = {
        "backbone_kind": "transformer",
        "pooling": tower.pooling,
        "head": _head_kind(tower.head),
        "head_dim": int(encoder.dim),
        "normalize": bool(encoder.normalize),
        "query_max_len": int(encoder.query_max_len),
        "doc_max_len": int(encoder.doc_max_len),
        "shared_tower": bool(encoder.shared_tower),
    }
    files = sorted({p.name for p in folder.iterdir()} | {META_FILE})
    meta = {"format_version": FORMAT_VERSION, "model": cfg, "side": side, "source": source or {}, "files": files,
            "prompts": encoder.prompts.to_dict()}
    if (source or {}).get("matryoshka_dims"):  # trained for these prefixes (SentenceTransformer(truncate_dim=d))
        meta["matryoshka_dims"] = list(source["matryoshka_dims"])
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return files


def _tower_modules(encoder: Any, tower: Any, folder: Path) -> list[torch.nn.Module]:
    """One tower as sentence-transformers modules: Transformer (its backbone, saved to ``folder``
    with the tokenizer), Pooling, and a Dense module per linear layer of its head."""
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Pooling,
        Transformer,
    )

    folder.mkdir(parents=True)
    _save_backbone(tower.backbone, folder)
    encoder.tokenizer.save_pretrained(folder)
    modules: list[torch.nn.Module] = [
        Transformer(str(folder), max_seq_length=int(encoder.doc_max_len), query_length=int(encoder.query_max_len),
                    document_length=int(encoder.doc_max_len)),
        Pooling(int(encoder.hidden_size), pooling_mode=ST_POOLING[tower.pooling]),
    ]
    for lin, act in _head_layers(tower.head):
        dense = Dense(lin.in_features, lin.out_features, bias=lin.bias is not None, activation_function=act)
        with torch.no_grad():
            dense.linear.weight.copy_(lin.weight)
            if lin.bias is not None:
                dense.linear.bias.copy_(lin.bias)
        modules.append(dense)
    return modules


def export_adapter(encoder: Any, out_dir: str | Path, *, side: str = "query", overwrite: bool = False) -> Path:
    """Write ``encoder``'s ``side`` LoRA adapter alone, with the tokenizer (``adapter_only=true``),
    under the same out_dir rules as :func:`export_encoder`."""
    tower = encoder.tower_for(side)
    if not isinstance(tower.head, torch.nn.Identity):
        raise ConfigError("adapter_only=true would leave out the trained head (model.head): export the merged model")
    return install_export(Path(out_dir).expanduser(), overwrite,
                          lambda folder: _write_adapter(encoder, tower, folder, str(out_dir)))


def _write_adapter(encoder: Any, tower: Any, folder: Path, out_name: str) -> list[str]:
    """peft's adapter files and the tokenizer in ``folder``; META_FILE marks them as an adapter alone
    (so overwrite=true may replace them, and our loaders refuse them as a model). The base model is
    named as the cards name it (peft writes the path it was loaded from, this machine's), and
    README.md is card.py's adapter card, not peft's blank template."""
    save_adapter(tower.backbone, folder)
    encoder.tokenizer.save_pretrained(folder)
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    base = base_model_name(str(config.get("base_model_name_or_path") or ""))
    config["base_model_name_or_path"] = base
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    lora = {"r": config.get("r"), "alpha": config.get("lora_alpha"), "targets": sorted(config.get("target_modules") or [])}
    facts = {"pooling": tower.pooling, "normalize": encoder.normalize, "dim": encoder.dim,
             "query_max_len": encoder.query_max_len, "doc_max_len": encoder.doc_max_len}
    (folder / "README.md").write_text(adapter_card(base, lora, facts, out_name), encoding="utf-8")
    files = sorted({p.name for p in folder.iterdir()} | {META_FILE})
    meta = {"format_version": FORMAT_VERSION, "adapter_only": True, "files": files}
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return files


def _save_backbone(backbone: torch.nn.Module, folder: Path) -> None:
    """``save_pretrained``; a LoRA backbone with its adapters merged (``save_merged``: a shard of merged
    weights in memory at a time, not a merged copy of the model). A (never used) pooler is put back when training dropped it, so that
    loading the directory with a plain AutoModel reports no missing weights."""
    plain = backbone.get_base_model() if is_lora(backbone) else backbone
    pooler = _fresh_pooler(plain) if getattr(plain, "pooler", "absent") is None else None
    if is_lora(backbone):
        extra = {f"pooler.{k}": v for k, v in pooler.state_dict().items()} if pooler is not None else None
        save_merged(backbone, folder, extra=extra)
        return
    if pooler is None:
        backbone.save_pretrained(folder)
        return
    backbone.pooler = pooler
    try:
        backbone.save_pretrained(folder)
    finally:
        backbone.pooler = None


def _fresh_pooler(backbone: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A newly initialised pooler of ``backbone``'s class, or None (a class without one). The class
    is read off a skeleton on the meta device: building a whole second model for it would cost as
    much memory as the model."""
    try:
        with torch.device("meta"):
            pooler_class = type(type(backbone)(backbone.config).pooler)
        return None if pooler_class is type(None) else pooler_class(backbone.config).to(backbone.dtype)
    except Exception:  # noqa: BLE001 - a model class without the add_pooling_layer default
        return None


def _head_kind(head: torch.nn.Module) -> str:
    if isinstance(head, torch.nn.Identity):
        return "none"
    if isinstance(head, torch.nn.Linear):
        return "linear"
    return "mlp"


def _head_layers(head: torch.nn.Module) -> list[tuple[torch.nn.Linear, torch.nn.Module]]:
    """(linear, activation after it) pairs of a head: none -> [], linear -> [(l, Identity)],
    mlp (Linear, GELU, Linear) -> [(l0, GELU), (l2, Identity)]."""
    if isinstance(head, torch.nn.Identity):
        return []
    if isinstance(head, torch.nn.Linear):
        return [(head, torch.nn.Identity())]
    layers = list(head)
    out: list[tuple[torch.nn.Linear, torch.nn.Module]] = []
    for i, m in enumerate(layers):
        if isinstance(m, torch.nn.Linear):
            nxt = layers[i + 1] if i + 1 < len(layers) and not isinstance(layers[i + 1], torch.nn.Linear) else None
            out.append((m, type(nxt)() if nxt is not None else torch.nn.Identity()))
    return out


__all__ = ['SHARD_BYTES', 'merged_weights', 'save_merged', 'FORMAT_VERSION', 'export_adapter', 'export_encoder']
