"""Loading trained encoders: from a training checkpoint, from a model directory, or the base one.

Used by every command that reads a model (evaluate, search, mine, export):

* :func:`load_checkpoint_encoder`: the query encoder of a ``RetrievalModule`` checkpoint, or
  (``encoder="key"``) its momentum key encoder; where each sits in the state dict is
  :func:`moco_retrieval.model.momentum.state_dict_prefix`.
* :func:`load_model_dir`: a directory written by ``moco_retrieval.export`` (rebuilt exactly from
  its ``moco_retrieval.json``), or any local Hugging Face model directory (built with a fallback
  ``ModelConfig``'s pooling/head/normalize).
* :func:`load_encoder`: one of the two, or the untrained base encoder of a ``ModelConfig``;
  :func:`describe_spec` turns ``base`` / a file / a folder into its keyword arguments.

Each returns ``(encoder, description)``, the description a JSON-able dict for reports. The
encoder's ``prompts`` (data/prompts.py) are the model's own: a checkpoint's hyper-parameters
``prompts``, an exported directory's ``moco_retrieval.json`` (or, for another sentence-transformers
directory, its ``config_sentence_transformers.json``); a base model takes the command's
``data.prompts`` (:func:`load_encoder`'s ``prompts``), which may not contradict stored ones.

The frozen guide encoder of guided false-negative masking (objectives/guided.py).

``objective.guide=base`` is the run's own backbone as it was before training (no head, frozen);
any other value except "none" and "momentum" names a backbone ("minilm") or a local model folder,
mean-pooled. Guides are frozen and L2-normalised (the rule compares cosines), and their features
are cached per text like any frozen backbone's, so a text is encoded once per run.

With LoRA, the base guide is the trained encoder's own frozen base run with the adapters disabled
(``lora.AdaptersDisabled``): the same model, without a second copy of its weights in memory.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from moco_retrieval.config import LoraConfig, ModelConfig, to_config
from moco_retrieval.data.prompts import Prompts, model_prompts, to_prompts
from moco_retrieval.errors import (
    CheckpointError,
    ConfigError,
    ModelLoadError,
    ModelNotFoundError,
)
from moco_retrieval.model.encoder import TextEncoder, build_encoder
from moco_retrieval.model.lora import (
    LORA_BASE,
    AdaptersDisabled,
    check_same_base,
    is_lora,
    restore_base_weights,
)
from moco_retrieval.model.momentum import ENCODERS, state_dict_prefix
from moco_retrieval.files import read_checkpoint

META_FILE = "moco_retrieval.json"  # written next to an exported model: its ModelConfig and source
ST_CONFIG = "config_sentence_transformers.json"


def load_checkpoint(path: str | Path) -> dict:
    """A Lightning checkpoint of ``RetrievalModule`` (tensors and plain containers only)."""
    ckpt = read_checkpoint(path, "checkpoint")
    if "state_dict" not in ckpt or "model" not in (ckpt.get("hyper_parameters") or {}):
        raise CheckpointError(
            f"checkpoint={path}: not a moco_retrieval training checkpoint (expected state_dict and "
            "hyper_parameters.model)"
        )
    return ckpt


def describe_encoder(cfg: ModelConfig, enc: Any) -> dict:
    """The architecture part of a description: backbone, kind, pooling, head, dim, lengths."""
    return {
        "backbone": str(cfg.path or cfg.backbone),
        "backbone_kind": cfg.backbone_kind,
        "pooling": cfg.pooling,
        "head": cfg.head,
        "dim": int(getattr(enc, "dim", 0)),
        "normalize": bool(cfg.normalize),
        "query_max_len": int(cfg.query_max_len),
        "doc_max_len": int(cfg.doc_max_len),
    }


def load_checkpoint_encoder(path: str | Path, encoder: str = "query") -> tuple[TextEncoder, dict]:
    """The ``TextEncoder`` of a training checkpoint: its query encoder, or (``encoder="key"``) its
    momentum key encoder. Returns ``(encoder, description)``."""
    if encoder not in ENCODERS:
        raise ConfigError(f"encoder={encoder!r}: expected one of {ENCODERS}")
    ckpt = load_checkpoint(path)
    cfg = to_config(ModelConfig, ckpt["hyper_parameters"]["model"])
    prefix = state_dict_prefix(encoder)
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise ConfigError(
            f"checkpoint={path} has no {encoder} encoder weights"
            + (" (objective=inbatch or feature_memory has no key encoder: use encoder=query)" if encoder == "key" else "")
        )
    enc = build_encoder(cfg)
    check_same_base(ckpt.get(LORA_BASE), enc, f"checkpoint={path}")
    restore_base_weights(state, enc)  # a LoRA checkpoint holds the adapters, not the base weights
    enc.load_state_dict(state, strict=True)
    enc.eval()
    desc = {
        "source": "checkpoint",
        "path": str(Path(path).expanduser().resolve()),
        "encoder": encoder,
        "global_step": int(ckpt.get("global_step", -1)),
        "epoch": int(ckpt.get("epoch", -1)),
        **describe_encoder(cfg, enc),
    }
    enc.prompts = checkpoint_prompts(ckpt)
    dims = (ckpt["hyper_parameters"].get("objective") or {}).get("matryoshka_dims")
    if dims:  # trained for these prefixes: evaluate scores each, export records them
        desc["matryoshka_dims"] = [int(d) for d in dims]
    return enc, desc


def checkpoint_prompts(ckpt: dict) -> Prompts:
    """The prompts a checkpoint was trained with (none for one from before prompts existed)."""
    return to_prompts((ckpt.get("hyper_parameters") or {}).get("prompts"))


def stored_prompts(model_dir: Path) -> Optional[Prompts]:
    """A model directory's prompts: ours (``moco_retrieval.json``, empty ones included: trained
    without), else a sentence-transformers ``prompts`` dict with a non-empty query or document
    prompt (empty ones are its default, not a record); None when it records none."""
    for name in (META_FILE, ST_CONFIG):
        try:
            meta = json.loads((model_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if name == META_FILE and isinstance(meta.get("prompts"), dict):
            return to_prompts(meta["prompts"])
        if name == ST_CONFIG and isinstance(meta.get("prompts"), dict):
            found = Prompts.from_sentence_transformers(meta["prompts"])
            return None if found.empty else found
    return None


def load_model_dir(path: str | Path, fallback: Optional[ModelConfig] = None) -> tuple[TextEncoder, dict]:
    """An encoder from a model directory: one written by ``moco_retrieval.export`` (rebuilt exactly),
    or any local Hugging Face model directory, built with ``fallback``'s pooling/head/normalize."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise ModelNotFoundError(f"model_dir={path}: no such directory")
    meta_path = d / META_FILE
    if not meta_path.is_file():
        if fallback is None:
            raise ModelNotFoundError(f"model_dir={path}: no {META_FILE} (not written by moco_retrieval.export)")
        cfg = to_config(ModelConfig, {**OmegaConf.to_container(OmegaConf.structured(fallback), enum_to_str=True), "path": str(d)})
        enc = build_encoder(cfg)
        enc.eval()
        enc.prompts = stored_prompts(d) or enc.prompts
        return enc, {"source": "model_dir", "path": str(d.resolve()), "exported": False, **describe_encoder(cfg, enc)}
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("adapter_only"):
        raise ModelLoadError(f"model_dir={path}: a LoRA adapter alone (export adapter_only=true), not a model; load it "
                             "with peft onto its base model, or export the merged model (adapter_only=false)")
    shared = bool(meta["model"].get("shared_tower", True))
    if shared:  # one tower: backbone and tokenizer at the top level, then the head's Dense modules
        enc = build_encoder(exported_config(meta, d, shared=True))
        modules = json.loads((d / "modules.json").read_text(encoding="utf-8"))
        _load_head(enc.tower_for("query").head, [d / m["path"] for m in modules if m["type"].endswith("Dense")], path)
    else:  # two towers: a Router's "query" and "document" routes, each its own backbone and head
        routes = _router_routes(d)
        enc = build_encoder(exported_config(meta, d / routes["query"][0], shared=False))
        enc.doc_tower = build_encoder(exported_config(meta, d / routes["doc"][0], shared=True)).tower
        for kind, folders in routes.items():
            _load_head(enc.tower_for(kind).head, [d / f for f in folders if f.endswith("Dense")], path)
    enc.eval()
    enc.prompts = stored_prompts(d) or enc.prompts
    desc = {"source": "model_dir", "path": str(d.resolve()), "exported": True, "exported_from": meta.get("source", {}),
            **describe_encoder(exported_config(meta, d, shared), enc)}
    if meta.get("matryoshka_dims"):
        desc["matryoshka_dims"] = [int(x) for x in meta["matryoshka_dims"]]
    return enc, desc


def exported_config(meta: dict, backbone: Path, shared: bool) -> ModelConfig:
    """The ModelConfig an exported directory records (``meta``: its META_FILE), built on ``backbone``."""
    return to_config(ModelConfig, {**meta["model"], "backbone": str(backbone), "path": None, "frozen_backbone": False,
                                   "feature_cache_dir": None, "shared_tower": shared})


def _router_routes(d: Path) -> dict[str, list[str]]:
    """A Router directory's module folders by side ("query", "doc"), in order."""
    structure = json.loads((d / "router_config.json").read_text(encoding="utf-8"))["structure"]
    return {"query": structure["query"], "doc": structure["document"]}


def _load_head(head: torch.nn.Module, dense_dirs: list[Path], path: str | Path) -> None:
    """The exported Dense modules' weights into a tower's head, layer by layer."""
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    if len(linears) != len(dense_dirs):
        raise ModelLoadError(f"model_dir={path}: {len(dense_dirs)} Dense modules for a head with {len(linears)} layers")
    for lin, dd in zip(linears, dense_dirs):
        sd = _read_dense(dd)
        with torch.no_grad():
            lin.weight.copy_(sd["linear.weight"])
            if lin.bias is not None:
                lin.bias.copy_(sd["linear.bias"])


def _read_dense(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)


def load_encoder(
    *, checkpoint: Optional[str] = None, model_dir: Optional[str] = None, model: Any = None, encoder: str = "query",
    prompts: Any = None,
) -> tuple[TextEncoder, dict]:
    """The encoder of a checkpoint, of an exported model directory, or (neither) the untrained
    base encoder described by ``model`` (a ModelConfig, DictConfig or dict). ``prompts``: the
    command's ``data.prompts``, for a model without prompts on record (:func:`~moco_retrieval.data.
    prompts.model_prompts`; ConfigError when they contradict the model's)."""
    if checkpoint and model_dir:
        raise ConfigError("give checkpoint=PATH or model_dir=PATH, not both")
    if checkpoint:
        enc, desc = load_checkpoint_encoder(checkpoint, encoder)
        stored: Optional[Prompts] = enc.prompts
    else:
        fallback = to_config(ModelConfig, model)
        if model_dir:
            enc, desc = load_model_dir(model_dir, fallback)
            stored = stored_prompts(Path(model_dir).expanduser())
        else:
            enc = build_encoder(fallback)
            enc.eval()
            desc, stored = {"source": "base", **describe_encoder(fallback, enc)}, None
    enc.prompts = model_prompts(stored, prompts, f"checkpoint={checkpoint}" if checkpoint else
                                f"model_dir={model_dir}" if model_dir else "the base model")
    if not enc.prompts.empty:
        desc["prompts"] = enc.prompts.to_dict()
    return enc, desc


def describe_spec(spec: str) -> dict[str, Optional[str]]:
    """``"base"``, a checkpoint file or a model directory -> keyword arguments of :func:`load_encoder`."""
    if spec in ("base", ""):
        return {}
    p = Path(spec).expanduser()
    if p.is_dir():
        return {"model_dir": spec}
    if p.is_file():
        return {"checkpoint": spec}
    raise ModelNotFoundError(f"{spec!r}: not 'base', a checkpoint file or a model directory")


BASE_GUIDE = "base"


def guide_model_config(guide: str, model: ModelConfig) -> ModelConfig | None:
    """The ModelConfig of a fixed guide, or None when ``guide`` is "none" or "momentum"."""
    if guide in ("none", "momentum"):
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


__all__ = ['META_FILE', 'describe_encoder', 'describe_spec', 'load_checkpoint', 'load_checkpoint_encoder', 'load_encoder', 'load_model_dir', 'BASE_GUIDE', 'guide_model_config', 'build_guide_encoder']
