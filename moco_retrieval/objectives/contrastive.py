"""InfoNCE over a positive column and blocks of negatives, with masking, in fp32.

Both objectives reduce to: for each query i, a positive score s_i+ and some blocks of negative
scores (other batch documents, hard negatives, the queue), each with a mask of false negatives.
The loss is cross-entropy with the positive as target (van den Oord et al. 2018, "InfoNCE"):

    loss_i = -s_i+/tau + log( exp(s_i+/tau) + sum_{j unmasked} exp(s_ij/tau) )

The blocks are never concatenated: each block's log-sum-exp is taken on its own and the results
are combined, so a B x K queue block is the only K-sized tensor a step allocates (plus its mask).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


class Temperature(nn.Module):
    """Softmax temperature: fixed (a buffer) or learnable (log-parameterised, clamped to [lo, hi])."""

    def __init__(self, value: float = 0.05, learnable: bool = False, lo: float = 0.01, hi: float = 1.0):
        super().__init__()
        if not value > 0:
            raise ValueError(f"objective.temperature must be > 0, got {value}")
        self.lo, self.hi, self.learnable = lo, hi, learnable
        if learnable:
            self.log_tau = nn.Parameter(torch.tensor(math.log(value)))
        else:
            self.register_buffer("log_tau", torch.tensor(math.log(value)), persistent=False)

    def forward(self) -> Tensor:
        return self.log_tau.float().exp().clamp(self.lo, self.hi) if self.learnable else self.log_tau.float().exp()


@dataclass
class Block:
    """Raw cosine/dot scores [B, N] of one group of negatives, and its false-negative mask."""

    scores: Tensor
    mask: Tensor | None = None


def info_nce(pos: Tensor, blocks: list[Block], tau: Tensor, label_smoothing: float = 0.0) -> tuple[Tensor, dict]:
    """Loss and stats for positive scores ``pos`` [B] against negative ``blocks``.

    Scores are raw (not divided by tau) and must already be fp32. Masked entries take no part in
    the softmax. ``label_smoothing`` spreads that much target mass uniformly over all unmasked
    candidates (positive included), as torch's cross_entropy does over classes.
    """
    inv_tau = 1.0 / tau
    pos_l = pos * inv_tau
    lses = [pos_l]
    n_neg = pos.new_zeros(pos.shape[0])
    n_masked = pos.new_zeros(pos.shape[0])
    neg_sum = pos.new_zeros(())
    best_neg = torch.full_like(pos, -math.inf)
    smooth_terms = []
    for block in blocks:
        s = block.scores
        if s.shape[1] == 0:
            continue
        with torch.no_grad():
            total = s.sum()
            if block.mask is not None:
                masked = block.mask.sum(1).float()
                total = total - s.detach()[block.mask].sum()
            else:
                masked = torch.zeros_like(pos)
            n_masked += masked
            n_neg += s.shape[1] - masked
            neg_sum += total
        logits = s * inv_tau
        if block.mask is not None:
            logits.masked_fill_(block.mask, -math.inf)  # in place: mul's backward does not need its output
        lses.append(torch.logsumexp(logits, dim=1))
        with torch.no_grad():
            best_neg = torch.maximum(best_neg, logits.max(dim=1).values)
        if label_smoothing > 0:
            finite = logits if block.mask is None else logits.masked_fill(block.mask, 0.0)
            smooth_terms.append(finite.sum(1))
    lse = torch.logsumexp(torch.stack(lses, dim=1), dim=1)
    nll = lse - pos_l
    if label_smoothing > 0:
        # mean over unmasked candidates of -log p = lse - mean(logit)
        n_cand = n_neg + 1
        mean_logit = (pos_l + sum(smooth_terms)) / n_cand
        nll = (1 - label_smoothing) * nll + label_smoothing * (lse - mean_logit)
    loss = nll.mean()
    with torch.no_grad():
        stats = {
            "loss": loss.detach(),
            "accuracy": (pos_l > best_neg).float().mean(),
            "pos_cos": pos.detach().mean(),
            "neg_cos": neg_sum / n_neg.sum().clamp(min=1),
            "negatives_per_query": n_neg.mean(),
            "masked_per_query": n_masked.mean(),
            "temperature": tau.detach(),
        }
    return loss, stats
