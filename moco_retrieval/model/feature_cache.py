"""The frozen-backbone feature cache and its file.

Frozen-backbone mode (``model.frozen_backbone``): each distinct text's pooled backbone feature is
computed once and kept in a ``FeatureCache`` keyed by (backbone fingerprint, max_len, text),
optionally persisted to ``model.feature_cache_dir/<fingerprint>.pt``. The cache is shared, never
copied: a deep copy of the encoder (the momentum key encoder) and any other encoder with the same
fingerprint use one object. Filling it is the encoder's job (``TextEncoder.warm_features``).
"""
from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch


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
        """The live cache of ``fingerprint`` (and ``cache_dir``) in this process, made when there is none."""
        key = (fingerprint, str(Path(cache_dir).expanduser().resolve()) if cache_dir else None)
        cache = cls._registry.get(key)
        if cache is None or cache.dim != int(dim):
            cache = cls(fingerprint, dim, cache_dir)
            cls._registry[key] = cache
        return cache

    @classmethod
    def clear_shared(cls) -> None:
        """Forget every live cache: encoders built from now on start from empty (or from disk)."""
        cls._registry.clear()

    def __deepcopy__(self, memo):
        return self

    def __len__(self) -> int:
        return self._n

    @property
    def path(self) -> Optional[Path]:
        return None if self.cache_dir is None else self.cache_dir / f"{self.fingerprint}.pt"

    def texts(self, max_len: int) -> list[str]:
        """The texts with a row for ``max_len``, in the order they were added."""
        rows = self._rows.get(int(max_len), {})
        return sorted(rows, key=rows.__getitem__)

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

    def save(self) -> Optional[Path]:
        """Write the cache to its file (atomically) when it changed; returns the path."""
        path = self.path
        if path is None or not self._dirty:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        order = sorted(((r, ml, t) for ml, rows in self._rows.items() for t, r in rows.items()))
        state = {
            "version": 1,
            "fingerprint": self.fingerprint,
            "dim": self.dim,
            "max_lens": torch.tensor([ml for _, ml, _ in order], dtype=torch.long),
            "texts": [t for _, _, t in order],
            "features": self._data[torch.tensor([r for r, _, _ in order], dtype=torch.long)].clone(),
        }
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)
        self._dirty = False
        return path

    def load(self) -> None:
        """Replace the rows with those of the cache file (which must belong to this fingerprint)."""
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


__all__ = ["FeatureCache"]
