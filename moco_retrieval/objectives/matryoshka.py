"""Matryoshka embeddings: the loss summed over truncated prefixes of the embeddings.

Kusupati et al., "Matryoshka Representation Learning" (NeurIPS 2022); sentence-transformers'
``MatryoshkaLoss``. With ``objective.matryoshka_dims`` [d_1, d_2, ...] (and optional
``matryoshka_weights``, 1 each by default) every direction's InfoNCE is computed once per d_i on the
first d_i coordinates of every embedding, anchors, positives and candidates alike (batch keys, hard
negatives and queued keys: the queues keep full-size keys, truncated when scored), re-normalised
when the model normalises, and the losses are summed with their weights. The masks (id, group,
guide) do not depend on the dimension and are computed once; logQ corrects every prefix's logits.
A model trained so can be truncated to any d_i at inference (sentence-transformers' ``truncate_dim``).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from moco_retrieval.errors import ConfigError


class Matryoshka:
    """The prefixes ``dims`` (each at most the embedding dimension) and their loss ``weights``;
    ``normalize``: re-normalise each prefix (the model's embeddings are unit vectors)."""

    def __init__(self, dims: list[int], weights: list[float] | None = None, normalize: bool = True):
        dims = [int(d) for d in dims]
        weights = [1.0] * len(dims) if not weights else [float(w) for w in weights]
        if not dims or min(dims) < 1 or len(set(dims)) != len(dims):
            raise ConfigError(f"objective.matryoshka_dims must be distinct dimensions >= 1, got {dims}")
        if len(weights) != len(dims) or min(weights) < 0:
            raise ConfigError(f"objective.matryoshka_weights must be one weight >= 0 per dimension "
                             f"(objective.matryoshka_dims={dims}), got {weights}")
        self.dims, self.weights, self.normalize = dims, weights, bool(normalize)

    def check(self, dim: int) -> None:
        """Refuse a prefix longer than the embeddings (``dim``)."""
        if max(self.dims) > dim:
            raise ConfigError(f"objective.matryoshka_dims={self.dims}: the embeddings have {dim} dimensions "
                              "(model.head_dim, or the backbone's width without a head)")

    def prefix(self, x: Tensor, dim: int) -> Tensor:
        """The first ``dim`` coordinates of each row of ``x``, re-normalised when the model normalises."""
        x = x[..., :dim]
        return F.normalize(x, dim=-1) if self.normalize else x

    def __iter__(self):
        return iter(zip(self.dims, self.weights))


__all__ = ["Matryoshka"]
