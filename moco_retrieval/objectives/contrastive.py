"""InfoNCE over a positive column and blocks of negatives, with masking, in fp32.

Both objectives reduce to: for each query i, a positive logit s_i+ / tau and some blocks of
negative logits (other batch documents, hard negatives, the queue), each with its masked (false
negative) entries. The loss is cross-entropy with the positive as target (van den Oord et al. 2018,
"Representation Learning with Contrastive Predictive Coding"):

    loss_i = -s_i+/tau + log( exp(s_i+/tau) + sum_{j unmasked} exp(s_ij/tau) )

Callers scale the query side by 1/tau before their matmuls, so each block arrives as logits. The
blocks are never concatenated: each block's log-sum-exp is taken on its own and the results are
combined, so a B x K queue block is the only K-sized tensor a step allocates besides the
log-sum-exp's own exp(). Masked entries are set to -inf in place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moco_retrieval.objectives.masking import Mask


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
    """Logits (scores / tau) [B, N] of one group of negatives, and its masked entries."""

    logits: Tensor
    mask: Mask | None = None


def info_nce(pos_logits: Tensor, blocks: list[Block], tau: Tensor, label_smoothing: float = 0.0) -> tuple[Tensor, dict]:
    """Loss and stats for positive logits [B] against negative ``blocks`` (all fp32, already / tau).

    Masked entries take no part in the softmax. ``label_smoothing`` spreads that much target mass
    uniformly over all unmasked candidates (positive included), as torch's cross_entropy does over
    classes. The blocks' logits are modified in place (masked entries become -inf). The stats
    include ``masked_by_<rule>``: the blocks' masks' counts per query, summed over the blocks.
    """
    B = pos_logits.shape[0]
    lses, smooth = [pos_logits], []
    n_neg, n_masked = pos_logits.new_zeros(B), pos_logits.new_zeros(B)
    neg_sum, best_neg = pos_logits.new_zeros(()), torch.full_like(pos_logits, -math.inf).detach()
    by_rule: dict[str, Tensor] = {}
    for block in blocks:
        s, mask = block.logits, block.mask or Mask()
        for rule, n in mask.counts.items():
            by_rule[rule] = by_rule.get(rule, 0) + n
        if s.shape[1] == 0:
            continue
        rows, cols = mask.pairs if mask.pairs is not None else (s.new_zeros(0, dtype=torch.long),) * 2
        with torch.no_grad():
            masked = torch.bincount(rows, minlength=B).to(s.dtype)
            n_masked += masked
            n_neg += s.shape[1] - masked
            neg_sum += s.detach().sum() - s.detach()[rows, cols].sum()
        if label_smoothing > 0:  # per-row sum of the unmasked logits, with gradient
            smooth.append(s.sum(1) - s.new_zeros(B).index_add(0, rows, s[rows, cols]))
        if rows.numel():
            s.index_put_((rows, cols), s.new_tensor(-math.inf))  # the matmul's backward does not need s
        # log-sum-exp by hand so its row max doubles as "best negative" for the accuracy stat
        m = s.detach().amax(dim=1)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        lses.append(m_safe + torch.exp(s - m_safe.unsqueeze(1)).sum(dim=1).log())
        best_neg = torch.maximum(best_neg, m)
    lse = torch.logsumexp(torch.stack(lses, dim=1), dim=1)
    nll = lse - pos_logits
    if label_smoothing > 0:
        mean_logit = (pos_logits + sum(smooth)) / (n_neg + 1)  # mean over unmasked candidates
        nll = (1 - label_smoothing) * nll + label_smoothing * (lse - mean_logit)
    loss = nll.mean()
    with torch.no_grad():
        t = tau.detach()
        stats = {
            "loss": loss.detach(),
            "accuracy": (pos_logits.detach() > best_neg).float().mean(),
            "pos_cos": pos_logits.detach().mean() * t,
            "neg_cos": neg_sum * t / n_neg.sum().clamp(min=1),
            "negatives_per_query": n_neg.mean(),
            "masked_per_query": n_masked.mean(),
            "temperature": t,
            **{f"masked_by_{rule}": n / B for rule, n in by_rule.items()},
        }
    return loss, stats
