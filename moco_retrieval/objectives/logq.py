"""logQ correction: removes the sampling bias of batch and queue negatives.

A document that appears in many pairs is a negative in many batches (and fills many queue
slots), so a softmax over sampled negatives pushes popular documents down more than the full
softmax would. Yi et al. ("Sampling-Bias-Corrected Neural Modeling for Large Corpus Item
Recommendations", RecSys 2019; TensorFlow Recommenders' ``candidate_sampling_probability``)
subtract log q(d), the probability that document d is sampled, from every sampled logit, the
positive's included:

    s_c(i, j) = s(i, j) - log q(d_j)

q is estimated in a stream, with no pass over the data first (the paper's Algorithm 2): each
document id hashes to a bucket holding the step it was last seen (A) and a running estimate of
the steps between sightings (B); on a sighting at step t, B <- (1 - alpha) B + alpha (t - A),
A <- t, and q = 1 / B. A document's first sighting at step t counts as one in t + 1 steps.

Only candidates labelled by document id are corrected (the batch and the queue); hard negatives
are chosen per query, not sampled by popularity, and stay as they are. Defaults: off; alpha 0.01
(the paper's order of magnitude); 2^20 buckets (collisions merge documents' counts).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class StreamingFrequency(nn.Module):
    """Hashed per-document sampling-interval estimates; buffers, so checkpoints carry them."""

    def __init__(self, buckets: int = 1 << 20, alpha: float = 0.01):
        super().__init__()
        self.buckets, self.alpha = int(buckets), float(alpha)
        self.register_buffer("logq_last", torch.full((buckets,), -1, dtype=torch.long))
        self.register_buffer("logq_interval", torch.zeros(buckets, dtype=torch.float64))

    def bucket(self, ids: Tensor) -> Tensor:
        return torch.remainder(ids.long(), self.buckets)

    @torch.no_grad()
    def observe(self, ids: Tensor, step: int) -> None:
        """Record one sighting, at ``step``, of each distinct id (the global batch's documents)."""
        h = torch.unique(self.bucket(ids))
        last = self.logq_last[h]
        first = last < 0
        gap = torch.where(first, torch.full_like(last, step + 1), step - last).to(torch.float64)
        old = self.logq_interval[h]
        self.logq_interval[h] = torch.where(first, gap, (1 - self.alpha) * old + self.alpha * gap)
        self.logq_last[h] = step

    def log_q(self, ids: Tensor) -> Tensor:
        """log q for ``ids`` (float32); an id never seen gets log q = 0 (no correction)."""
        interval = self.logq_interval[self.bucket(ids)]
        return -torch.log(interval.clamp(min=1.0)).float()


__all__ = ["StreamingFrequency"]
