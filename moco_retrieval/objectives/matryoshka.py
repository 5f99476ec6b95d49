"""Matryoshka embeddings: an objective's loss summed over truncated prefixes of the embeddings.

Kusupati et al., "Matryoshka Representation Learning" (NeurIPS 2022). As sentence-transformers'
``MatryoshkaLoss`` wraps a loss, ``Matryoshka`` wraps an objective: the objective builds its
directions once (its memories hold their keys once, logQ counts the batch once), and each direction
is re-scored on the first d_i coordinates of every embedding, anchors, positives and candidates
alike (queued keys too: the queues keep full-size keys, truncated when scored), re-normalised when
the model normalises. The objective combines its directions at each prefix as it does at full size,
and the losses are summed with ``objective.matryoshka_weights`` (1 each by default). Masks (id,
group, guide) do not depend on the dimension: computed once. A model trained so can be truncated to
any d_i at inference (sentence-transformers' ``truncate_dim``).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from moco_retrieval.config import ConfigError


class Matryoshka(nn.Module):
    """``objective`` scored at each of ``dims`` (each at most the embedding dimension ``dim``) with
    ``weights``; ``normalize``: re-normalise each prefix (the model's embeddings are unit vectors).
    Everything else the module asks of an objective is the wrapped one's."""

    def __init__(self, objective: nn.Module, dims: list[int], weights: list[float], dim: int, normalize: bool):
        super().__init__()
        if max(dims) > dim:
            raise ConfigError(f"objective.matryoshka_dims={list(dims)}: the embeddings have {dim} dimensions "
                              "(model.head_dim, or the backbone's width without a head)")
        self.objective = objective
        self.dims, self.weights = [int(d) for d in dims], [float(w) for w in weights] if weights else [1.0] * len(dims)
        self.normalize = bool(normalize)

    def forward(self, batch: dict, embed) -> tuple[Tensor, dict]:
        directions = self.objective.directions(batch, embed)
        total, stats = 0.0, None
        for dim, weight in zip(self.dims, self.weights):
            view = Prefix(dim, self.normalize)
            loss, s = self.objective.scored(directions, batch, view)
            total = total + weight * loss
            stats = s if stats is None else stats
            stats[f"loss_dim{dim}"] = loss.detach()
        stats["loss"] = total.detach()
        return total, stats

    # what else the module asks is the wrapped objective's
    momentum = property(lambda self: self.objective.momentum)
    key_encoder_dropout = property(lambda self: self.objective.key_encoder_dropout)
    guide = property(lambda self: self.objective.guide)

    def after_backward(self) -> None:
        self.objective.after_backward()

    def stats(self, step: int) -> dict[str, float]:
        return self.objective.stats(step)

    def unsynced_state(self) -> dict[str, Tensor]:
        return self.objective.unsynced_state()


class Prefix:
    """The first ``dim`` coordinates of each row, re-normalised when the model normalises; anchors
    arrive / tau: re-normalised, they are divided by tau again."""

    def __init__(self, dim: int, normalize: bool):
        self.dim, self.normalize = dim, normalize

    def __call__(self, x: Tensor) -> Tensor:
        x = x[..., : self.dim]
        return F.normalize(x, dim=-1) if self.normalize else x

    def anchors(self, a: Tensor, tau: Tensor) -> Tensor:
        return self(a) / tau if self.normalize else a[..., : self.dim]


__all__ = ["Matryoshka", "Prefix"]
