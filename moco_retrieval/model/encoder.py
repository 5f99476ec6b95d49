"""Text encoder: a Hugging Face tower + pooling + optional head + L2 normalization.

``TextEncoder.forward(side, kind) -> Float[B, d]`` with ``side = {"texts", optional "input_ids",
"attention_mask"}`` and ``kind`` in ``{"query", "doc"}``; it is ``embed_features(features(side,
kind), kind)``. Built by ``build_encoder(cfg)`` from a ``ModelConfig``; the backbone comes from
``backbone.py`` (a local folder only, never a hub id).

Frozen-backbone mode (``model.frozen_backbone``): the backbone never trains and stays in eval
mode; only the head trains. Pooled backbone features come from the shared ``FeatureCache``
(``feature_cache.py``); ``warm_features`` fills it (and its file) ahead of training or encoding.

``backbone_kind=bag_of_wordpieces``: the mean of the backbone's input (word) embeddings over the
non-special tokens; no transformer layers, no position embeddings.

``model.lora.r > 0``: LoRA adapters on the frozen backbone (``lora.py``); ``pooling=last``: the
last token's hidden state, an end-of-text token appended to every text (decoder backbones,
``decoder.py``); ``model.gradient_checkpointing``: the backbone recomputes activations in backward.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from moco_retrieval.progress import progress_bar

from moco_retrieval.config import ModelConfig
from moco_retrieval.data.prompts import NO_PROMPTS, Prompts
from moco_retrieval.errors import ConfigError
from moco_retrieval.model.backbone import (
    bag_of_wordpieces,
    load_backbone,
    resolve_backbone,
    tokenizer_fingerprint,
)
from moco_retrieval.model.decoder import append_eos, last_token
from moco_retrieval.model.feature_cache import FeatureCache
from moco_retrieval.model.lora import apply_lora
from moco_retrieval.model.momentum import copy_sharing_frozen

KINDS = ("query", "doc")


# --------------------------------------------------------------------------- heads and tower


def _make_head(kind: str, hidden: int, out: int, init: str) -> nn.Module:
    if kind == "none":
        if out != hidden:
            raise ConfigError(f"model.head_dim={out} needs a head (model.head=linear|mlp): the backbone gives {hidden}")
        return nn.Identity()
    if kind == "linear":
        head = nn.Linear(hidden, out)
        if init == "identity":
            if out != hidden:
                raise ConfigError(f"model.head_init=identity needs model.head_dim == hidden size ({hidden}), got {out}")
            with torch.no_grad():
                head.weight.copy_(torch.eye(hidden))
                head.bias.zero_()
        return head
    return nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, out))


def _hash_tensor(h: "hashlib._Hash", t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    h.update(f"{t.dtype}{t.numel()}".encode())
    if t.numel():
        h.update(t.view(torch.uint8).numpy().tobytes())


class Tower(nn.Module):
    """Backbone + pooling + head, before normalization. ``features`` gives pooled backbone output."""

    def __init__(
        self,
        backbone: nn.Module,
        backbone_kind: str,
        pooling: str,
        head: nn.Module,
        special_ids: Sequence[int],
        frozen: bool,
        tokenizer_hash: str = "",
        cache_dir: Optional[str] = None,
    ):
        super().__init__()
        self.backbone = backbone
        self.backbone_kind = backbone_kind
        self.pooling = pooling
        self.head = head
        self.frozen = frozen
        self.register_buffer("special_ids", torch.tensor(sorted(set(special_ids)), dtype=torch.long), persistent=False)
        self.tokenizer_hash = tokenizer_hash
        self.cache_dir = cache_dir
        self.feature_cache: Optional[FeatureCache] = None
        if frozen:
            for p in self.backbone.parameters():
                p.requires_grad_(False)
            self.backbone.eval()
            self.attach_cache()
            self.register_load_state_dict_post_hook(_refresh_cache_after_load)

    @property
    def feature_dim(self) -> int:
        if self.backbone_kind == "bag_of_wordpieces":
            return int(self.backbone.embedding_dim)
        return int(self.backbone.config.hidden_size)

    def attach_cache(self) -> None:
        """Point at the process-wide cache for this backbone's current fingerprint."""
        fp = self.fingerprint()
        if self.feature_cache is None or self.feature_cache.fingerprint != fp:
            self.feature_cache = FeatureCache.shared(fp, self.feature_dim, self.cache_dir)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:
            self.backbone.eval()
        return self

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Pooled backbone features, float32 [B, hidden]."""
        if self.backbone_kind == "bag_of_wordpieces":
            emb = self.backbone(input_ids)
            mask = attention_mask.bool() & ~torch.isin(input_ids, self.special_ids)
        else:
            emb = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            if self.pooling == "cls":
                return emb[:, 0].float()
            if self.pooling == "last":
                return last_token(emb, attention_mask)
            mask = attention_mask.bool()
        m = mask.to(torch.float32)
        with torch.autocast(emb.device.type, enabled=False):  # pool in fp32 even under bf16 autocast
            summed = torch.bmm(m.unsqueeze(1), emb.float()).squeeze(1)  # masked sum, no [B, L, H] product
        return summed / m.sum(1, keepdim=True).clamp(min=1.0)

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        p = next(iter(self.head.parameters()), None)
        if p is not None and feats.dtype != p.dtype and not torch.is_autocast_enabled(feats.device.type):
            feats = feats.to(p.dtype)
        return self.head(feats)

    def fingerprint(self) -> str:
        """Hash of what determines the features: kind, pooling, backbone weights, tokenizer."""
        h = hashlib.sha256()
        h.update(f"{self.backbone_kind}|{self.pooling if self.backbone_kind == 'transformer' else 'mean'}".encode())
        h.update(repr(self.special_ids.tolist()).encode())
        h.update(self.tokenizer_hash.encode())
        for name, t in sorted(self.backbone.state_dict().items()):
            h.update(name.encode())
            _hash_tensor(h, t)
        return h.hexdigest()[:24]


def _refresh_cache_after_load(module: Tower, incompatible_keys) -> None:
    """After load_state_dict: new backbone weights mean another cache."""
    module.attach_cache()


# --------------------------------------------------------------------------- encoder


def _trained_backbone(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """``model`` with activation checkpointing (non-reentrant: the frozen inputs of a LoRA backbone
    need no gradient for it) and LoRA adapters, as configured."""
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if int(cfg.lora.r) > 0:
        return apply_lora(model, cfg.lora)
    return model


# Characters per token that tokenize() keeps before tokenizing (at max_len tokens): generous, so
# that a cut text nearly always still fills max_len (most tokens are under 10 characters).
CHARS_PER_TOKEN = 32


def cut_text(text: str, max_chars: int, side: str = "right") -> str:
    """``text`` cut to at most ``max_chars`` characters at whitespace (mid-word only when there is
    none), keeping its start, or with ``side="left"`` (a tokenizer truncating on the left) its end."""
    if len(text) <= max_chars:
        return text
    if side == "left":
        tail = text[-max_chars:]
        space = re.search(r"\s", tail)
        return tail[space.start():] if space else tail
    head = text[:max_chars]
    space = re.search(r"\s\S*\Z", head)
    return head[:space.start()] if space else head


class TextEncoder(nn.Module):
    """Query/document encoder: see the module docstring. ``dim``, ``normalize``, ``tokenizer``."""

    def __init__(self, cfg: ModelConfig, loaded: Optional[tuple[nn.Module, Any]] = None):
        """``loaded``: the (model, tokenizer) of ``cfg``'s backbone when the caller has them (the
        base-model guide of a LoRA run: model/loading.py); None loads them from its folder."""
        super().__init__()
        path, key = resolve_backbone(cfg)
        model, tokenizer = loaded if loaded is not None else load_backbone(path, key, cfg.backbone_dtype)
        if cfg.pooling == "last":
            tokenizer = append_eos(tokenizer, f"{str(path)!r} (from {key})")
        self.tokenizer = tokenizer
        self.normalize = bool(cfg.normalize)
        self.frozen = bool(cfg.frozen_backbone)
        self.backbone_kind = str(cfg.backbone_kind)
        self.query_max_len = int(cfg.query_max_len)
        self.doc_max_len = int(cfg.doc_max_len)
        self.feature_cache_dir = str(cfg.feature_cache_dir) if cfg.feature_cache_dir else None
        # the prompts it was trained with (data/prompts.py): set by training and the loaders, put
        # before the texts by encode_texts; forward() takes texts as given (batches carry them already)
        self.prompts: Prompts = NO_PROMPTS
        if cfg.backbone_kind == "bag_of_wordpieces":
            backbone: nn.Module = bag_of_wordpieces(model)
            hidden = backbone.embedding_dim
            del model
        else:
            hidden = int(model.config.hidden_size)
            backbone = _trained_backbone(model, cfg)
        self.hidden_size = hidden
        out = int(cfg.head_dim) if cfg.head_dim else hidden
        head = _make_head(str(cfg.head), hidden, out, str(cfg.head_init))
        self.dim = out
        tower = Tower(
            backbone,
            self.backbone_kind,
            str(cfg.pooling),
            head,
            tokenizer.all_special_ids,
            self.frozen,
            tokenizer_hash=tokenizer_fingerprint(tokenizer) if self.frozen else "",
            cache_dir=self.feature_cache_dir,
        )
        self.shared_tower = bool(cfg.shared_tower)
        if self.shared_tower:
            self.tower = tower
        else:
            self.query_tower = tower
            self.doc_tower = copy_sharing_frozen(tower)  # the feature cache and frozen weights are shared

    # -- towers and tokens

    @property
    def needs_tokens(self) -> bool:
        """Whether batches must carry input_ids/attention_mask (False: texts suffice)."""
        return not self.frozen

    def tower_for(self, kind: str) -> Tower:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: expected 'query' or 'doc'")
        if self.shared_tower:
            return self.tower
        return self.query_tower if kind == "query" else self.doc_tower

    def max_len(self, kind: str) -> int:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: expected 'query' or 'doc'")
        return self.query_max_len if kind == "query" else self.doc_max_len

    def tokenize(self, texts: Sequence[str], kind: str) -> dict[str, torch.Tensor]:
        """input_ids and attention_mask (CPU, Long), truncated to the kind's max_len, padded to the longest.

        Each text is cut first (:func:`cut_text`): a tokenizer holds every token of what it is
        given, so one 10 MB text cost 2 GB before truncation. The cut is at whitespace, which no
        token crosses, so a cut text that still fills max_len gives the tokens of the whole one;
        one that no longer does (tokens longer than CHARS_PER_TOKEN) is tokenized whole."""
        max_len, side = self.max_len(kind), getattr(self.tokenizer, "truncation_side", "right")
        cut = [cut_text(t, max_len * CHARS_PER_TOKEN, side) for t in texts]
        enc = self._tokenize(cut, max_len)
        filled = enc["attention_mask"].sum(dim=1) >= max_len
        short = [i for i, (text, c) in enumerate(zip(texts, cut)) if len(c) < len(text) and not filled[i]]
        if short:
            enc = self._tokenize([texts[i] if i in short else c for i, c in enumerate(cut)], max_len)
        return enc

    def _tokenize(self, texts: list[str], max_len: int) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(texts, max_length=max_len, truncation=True, padding="longest", return_tensors="pt",
                             return_token_type_ids=False)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    # -- frozen-backbone cache

    @property
    def feature_cache(self) -> Optional[FeatureCache]:
        """The query tower's cache (the doc tower's is the same object unless its backbone differs)."""
        return self.tower_for("query").feature_cache

    def _fill_cache(self, tower: Tower, texts: Sequence[str], kind: str, batch_size: int = 256,
                    progress: bool = False) -> int:
        """Compute and add the features of ``texts`` missing from ``tower``'s cache; returns how many."""
        cache = tower.feature_cache
        max_len = self.max_len(kind)
        missing = cache.missing(texts, max_len)
        if not missing:
            return 0
        missing.sort(key=len, reverse=True)  # similar lengths together: less padding
        device = tower.special_ids.device
        was_training = tower.backbone.training
        tower.backbone.eval()
        bar = progress_bar(len(missing), f"encoding {kind} features", " texts") if progress else None
        try:
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                for start in range(0, len(missing), batch_size):
                    chunk = missing[start : start + batch_size]
                    tok = self.tokenize(chunk, kind)
                    feats = tower.features(tok["input_ids"].to(device), tok["attention_mask"].to(device))
                    cache.add(chunk, max_len, feats)
                    cache.computed += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
            tower.backbone.train(was_training and not tower.frozen)
        return len(missing)

    def warm_features(
        self, queries: Iterable[str] = (), docs: Iterable[str] = (), *, batch_size: int = 256, progress: bool = True
    ) -> int:
        """Compute and cache the backbone features of every query and document text not cached yet;
        returns how many were computed. Frozen mode only (0 otherwise). Then saves the cache file(s)
        when ``model.feature_cache_dir`` is set."""
        if not self.frozen:
            return 0
        n = 0
        for kind, texts in (("query", queries), ("doc", docs)):
            n += self._fill_cache(self.tower_for(kind), list(texts), kind, batch_size, progress)
        for kind in KINDS:
            self.tower_for(kind).feature_cache.save()
        return n

    # -- forward

    def features(self, side: dict, kind: str) -> torch.Tensor:
        """Pooled backbone features [B, hidden] of one side of a batch, before the head. Frozen
        backbones: from the feature cache (missing texts are computed and cached first)."""
        tower = self.tower_for(kind)
        device = tower.special_ids.device
        if self.frozen:
            texts = side["texts"]
            self._fill_cache(tower, texts, kind)
            return tower.feature_cache.gather(texts, self.max_len(kind)).to(device, non_blocking=True)
        if side.get("input_ids") is not None:
            ids, mask = side["input_ids"], side["attention_mask"]
        else:
            tok = self.tokenize(side["texts"], kind)
            ids, mask = tok["input_ids"], tok["attention_mask"]
        return tower.features(ids.to(device), mask.to(device))

    def embed_features(self, feats: torch.Tensor, kind: str) -> torch.Tensor:
        """Embeddings from backbone features: the kind's head, then L2 normalization (when on)."""
        out = self.tower_for(kind).project(feats).float()
        return F.normalize(out, dim=-1) if self.normalize else out

    def forward(self, side: dict, kind: str) -> torch.Tensor:
        return self.embed_features(self.features(side, kind), kind)


def build_encoder(cfg: ModelConfig) -> TextEncoder:
    """The encoder described by ``cfg`` (a ``ModelConfig`` or a DictConfig of one)."""
    return TextEncoder(cfg)


__all__ = [
    "HEADS",
    "HEAD_INITS",
    "KINDS",
    "POOLINGS",
    "TextEncoder",
    "Tower",
    "build_encoder",
]
