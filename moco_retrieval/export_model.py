"""The files of an export: a trained encoder as a sentence-transformers model directory (Transformer,
Pooling, Dense layers of the head, Normalize; a query / document ``Router`` for separate towers),
or a LoRA adapter alone, each with ``moco_retrieval.json`` listing what it wrote (see export.py)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from moco_retrieval.errors import ConfigError
from moco_retrieval.export_folder import install_export
from moco_retrieval.model.loading import META_FILE
from moco_retrieval.model.lora import is_lora, save_adapter
from moco_retrieval.model.lora_merge import save_merged

FORMAT_VERSION = 1  # of META_FILE (since "files" was added, it lists the export's entries)
ST_POOLING = {"mean": "mean", "cls": "cls", "last": "lasttoken"}  # our model.pooling -> sentence-transformers'


def export_encoder(
    encoder: Any,
    out_dir: str | Path,
    *,
    side: str = "query",
    source: Optional[dict] = None,
    overwrite: bool = False,
) -> Path:
    """Write ``encoder``'s ``side`` tower (both towers, as a query / document ``Router``, when it
    has two) as a sentence-transformers directory (see export.py); returns the directory."""
    if getattr(encoder, "backbone_kind", "transformer") != "transformer":
        raise ConfigError(
            "export supports backbone_kind=transformer; a bag_of_wordpieces encoder has no transformer "
            "layers for sentence-transformers to run (evaluate and search use it directly from the checkpoint)"
        )
    return install_export(Path(out_dir).expanduser(), overwrite, lambda folder: _write_export(encoder, folder, side, source))


def _write_export(encoder: Any, folder: Path, side: str, source: Optional[dict]) -> list[str]:
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
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer

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
    return install_export(Path(out_dir).expanduser(), overwrite, lambda folder: _write_adapter(encoder, tower, folder))


def _write_adapter(encoder: Any, tower: Any, folder: Path) -> list[str]:
    """peft's adapter files and the tokenizer in ``folder``; META_FILE marks them as an adapter alone
    (so overwrite=true may replace them, and our loaders refuse them as a model)."""
    save_adapter(tower.backbone, folder)
    encoder.tokenizer.save_pretrained(folder)
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


__all__ = ["FORMAT_VERSION", "export_adapter", "export_encoder"]
