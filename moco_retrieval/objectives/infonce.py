"""InfoNCE in blocks, with false negatives masked: what every objective scores with.

For each anchor i (a query, or a document for the reverse direction), a positive logit and blocks of
negative logits, all scores / tau in fp32 (van den Oord et al. 2018, "Representation Learning with
Contrastive Predictive Coding"):

    loss_i = -s_i+ / tau + log( exp(s_i+ / tau) + sum over unmasked candidates j of exp(s_ij / tau) )

A ``Direction`` holds the anchors, their positives and the blocks in this order, when present: the
batch's keys (row i's own positive among them is scored apart, so masked), the hard negatives, a key
memory's negatives (memory.py). Every objective is a few directions: MoCo one, two-queue two and an
in-batch one, in-batch one or two.

False negatives are candidates sharing the positive's document id or group (groups >= 0), and, with
a guide (guided.py), candidates the guide scores too close to the positive. They are removed from
the softmax, not pushed away. Masks are sparse (row, column) pairs: false negatives are rare, so one
``isin`` over the N candidates and a small compare are far cheaper than B x N boolean passes over a
65,536-key queue. Each block carries its mask and its per-rule counts, so a loss reports exactly its
own softmax's masks. logQ (logq.py), when on, subtracts log q of each candidate's document from the
positive, batch and memory logits; hard negatives are chosen per query, not sampled, and stay as
they are. Blocks are never concatenated: each block's log-sum-exp is taken on its own, so a B x K
queue block is the only K-sized tensor a step allocates besides its exp().
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from moco_retrieval.distributed import all_gather_no_grad, rank

Pairs = tuple[Tensor, Tensor]  # (rows, cols) of masked entries


class Temperature(nn.Module):
    """Softmax temperature: fixed (a buffer) or learnable (log-parameterised, clamped to [lo, hi])."""

    def __init__(self, value: float, learnable: bool = False, lo: float = 0.01, hi: float = 1.0):
        super().__init__()
        self.lo, self.hi, self.learnable = lo, hi, learnable
        if learnable:
            self.log_tau = nn.Parameter(torch.tensor(math.log(value)))
        else:
            self.register_buffer("log_tau", torch.tensor(math.log(value)), persistent=False)

    def forward(self) -> Tensor:
        return self.log_tau.float().exp().clamp(self.lo, self.hi) if self.learnable else self.log_tau.float().exp()


@dataclass
class Mask:
    """One block's masked entries, and how many each rule (id, group, guide) masked. A row's own
    positive, scored apart, is among the pairs but not counted."""

    pairs: Pairs | None = None
    counts: dict[str, Tensor] = field(default_factory=dict)


def false_negative_pairs(pos_ids: Tensor, pos_groups: Tensor, cand_ids: Tensor, cand_groups: Tensor) -> Pairs:
    """(i, j) for every candidate j sharing anchor i's positive id or its (non-negative) group."""
    pg = torch.where(pos_groups >= 0, pos_groups, torch.full_like(pos_groups, -2))  # no group matches nothing
    cols = (torch.isin(cand_ids, pos_ids) | torch.isin(cand_groups, pg)).nonzero().squeeze(1)
    sub = (cand_ids[cols].unsqueeze(0) == pos_ids.unsqueeze(1)) | (cand_groups[cols].unsqueeze(0) == pg.unsqueeze(1))
    rows, c = sub.nonzero(as_tuple=True)
    return rows, cols[c]


def merge_pairs(a: Pairs, b: Pairs, ncols: int) -> Pairs:
    """Union of two index sets, each entry once."""
    key = torch.unique(torch.cat([a[0] * ncols + a[1], b[0] * ncols + b[1]]))
    return key // ncols, key % ncols


class Keys(NamedTuple):
    """Candidate keys [N, d] with their documents' ids and groups [N]."""

    vectors: Tensor
    ids: Tensor
    groups: Tensor


def gathered_keys(keys: Tensor, ids: Tensor, groups: Tensor) -> Keys:
    """The global batch's keys, ids and groups (rank order), without gradient."""
    return Keys(all_gather_no_grad(keys), all_gather_no_grad(ids), all_gather_no_grad(groups))


class Scoring(nn.Module):
    """What every direction of an objective scores with: its temperature (a buffer, or a parameter
    when learned), label smoothing, the masking rules and the plug-ins: a guide's rule (guided.py)
    and a logQ estimator (logq.py; buffers each rank keeps itself, from the all-gathered ids)."""

    def __init__(self, cfg, guide=None, logq=None):
        super().__init__()
        self.temperature = Temperature(cfg.temperature, cfg.learn_temperature, cfg.temperature_min, cfg.temperature_max)
        self.label_smoothing = float(cfg.label_smoothing)
        self.mask_false_negatives = bool(cfg.mask_false_negatives)
        self.guide, self.logq = guide, logq

    def mask(self, pos_ids: Tensor, pos_groups: Tensor, cand_ids: Tensor, cand_groups: Tensor,
             guide: tuple[Tensor, Tensor, Tensor] | None = None, own: Pairs | None = None) -> Mask:
        """False negatives among candidates: same document id or group as the positive, and those the
        guide (its anchors, positives, candidates) scores too close to it; ``own``: each row's own
        positive, masked too but not counted. Counted by rule, each entry by the first rule that masks it."""
        out, n, counts = own, cand_ids.shape[0], {}
        if self.mask_false_negatives:
            before = 0 if out is None else out[0].numel()
            fn = false_negative_pairs(pos_ids, pos_groups, cand_ids, cand_groups)
            out = fn if out is None else merge_pairs(out, fn, n)
            # a device-side sum: the counts never wait for the device (own pairs match by id)
            counts["id"] = (cand_ids[out[1]] == pos_ids[out[0]]).sum() - before
            counts["group"] = out[0].numel() - before - counts["id"]
        if self.guide is not None and guide is not None:
            before = 0 if out is None else out[0].numel()
            g = self.guide.pairs(*guide)
            out = g if out is None else merge_pairs(out, g, n)
            counts["guide"] = out[0].numel() - before
        return Mask(out, counts)

    def observe(self, global_ids: Tensor | None, ids: Tensor, step: int) -> None:
        """logQ: the global batch's documents were sampled at ``step`` (training forward only).
        ``global_ids``: the batch's ids all-gathered already, or None (gathered here, once)."""
        if self.logq is not None and self.training:
            self.logq.observe(all_gather_no_grad(ids) if global_ids is None else global_ids, step)

    def corrected(self, logits: Tensor, cand_ids: Tensor) -> Tensor:
        """Logits [B, N] (or [B] positives, with ids [B]) minus log q of their documents (logQ on)."""
        if self.logq is None:
            return logits
        lq = self.logq.log_q(cand_ids)
        return logits - (lq if logits.dim() == 1 else lq.unsqueeze(0))


@dataclass
class Block:
    """One block of a direction: its candidates (vectors [N, d], or a key memory's negatives), their
    ids, its mask (the same at every Matryoshka prefix) and whether logQ corrects it."""

    keys: Tensor | None
    memory: Any
    ids: Tensor
    mask: Mask
    logq: bool


class Direction:
    """Anchors [B, d], already / tau (scaled once, so every block arrives as logits), against their
    positives [B, d], labelled by the positives' ids and groups [B]; ``guide``: the guide's scores of
    this direction's candidates by block (guided.GuideScores)."""

    def __init__(self, scoring: Scoring, anchors: Tensor, positives: Tensor, ids: Tensor, groups: Tensor,
                 guide=None):
        self.scoring, self.anchors, self.positives = scoring, anchors.float(), positives.float()
        self.ids, self.groups, self.guide = ids, groups, guide
        self.blocks: list[Block] = []
        self.hard: tuple[Block, int, int] | None = None  # the hard negatives' block, where this rank's start, how many

    def add(self, keys: Tensor | None, ids: Tensor, groups: Tensor, guided: str | None = None, logq: bool = True,
            own_offset: int | None = None, mask: Mask | None = None, memory=None) -> Block:
        """A block of candidate ``keys`` [N, d] (or ``memory``'s negatives) labelled ``ids``, ``groups``;
        ``guided``: the guide's name for the block ("batch", "hard", "queue"); ``own_offset``: row i's
        own positive is candidate ``own_offset + i``; ``mask``: another block's over the same candidates."""
        if mask is None:
            own = None
            if own_offset is not None:
                r = torch.arange(self.anchors.shape[0], device=ids.device)
                own = (r, r + own_offset)
            g = self.guide
            rule = (g.anchor, g.positive, g.candidates[guided]) if g is not None and guided in g.candidates else None
            mask = self.scoring.mask(self.ids, self.groups, ids, groups, rule, own)
        block = Block(None if keys is None else keys.float(), memory, ids, mask, logq)
        self.blocks.append(block)
        return block

    def add_batch(self, keys: Keys, offset: int | None = None, guided: bool = True, mask: Mask | None = None) -> Block:
        """The batch's keys (every rank's, rank order); this rank's rows start at ``offset`` (default
        rank * B); ``mask``: another block's over the same candidates, reused."""
        offset = rank() * self.anchors.shape[0] if offset is None else offset
        return self.add(keys.vectors, keys.ids, keys.groups, "batch" if guided else None, own_offset=offset, mask=mask)

    def add_hard(self, keys: Keys, offset: int = 0, count: int | None = None) -> Block:
        """The hard negatives, n per anchor, row-major; logQ leaves them as they are (chosen per query,
        not sampled). Gathered from every rank, this rank's ``count`` of them start at ``offset``."""
        block = self.add(keys.vectors, keys.ids, keys.groups, "hard", logq=False)
        self.hard = (block, offset, keys.vectors.shape[0] if count is None else count)
        return block

    def own_hard(self, view=None) -> Tensor:
        """Each anchor's own hard negatives [B, n, d] (``view``: what to take of them, a Matryoshka prefix)."""
        block, offset, count = self.hard
        keys = block.keys[offset : offset + count]
        keys = keys if view is None else view(keys)
        return keys.view(self.anchors.shape[0], count // self.anchors.shape[0], keys.shape[-1])

    def add_keys(self, batch: Keys | None, hard: Keys | None = None, memory=None, guided: bool = True) -> "Direction":
        """The batch's keys, the hard negatives and a memory's negatives (none yet: no block), each
        when present."""
        if batch is not None:
            self.add_batch(batch, guided=guided)
        if hard is not None:
            self.add_hard(hard)
        if memory is not None and memory.fill > 0:
            self.add(None, memory.ids(), memory.groups(), "queue" if guided else None, memory=memory)
        return self

    def loss(self, view=None) -> tuple[Tensor, dict]:
        """InfoNCE over the positive and every block, with its stats; ``view``: what to score instead
        of the embeddings (a Matryoshka prefix): ``view(x)`` of positives and candidates (memory keys
        a chunk at a time), ``view.anchors(anchors, tau)`` of the anchors."""
        tau = self.scoring.temperature()
        v = view or (lambda x: x)
        a, corrected = self.anchors if view is None else view.anchors(self.anchors, tau), self.scoring.corrected
        blocks = []
        for b in self.blocks:
            s = b.memory.logits(a, view) if b.memory is not None else a @ v(b.keys).T
            blocks.append((corrected(s, b.ids) if b.logq else s, b.mask))
        return info_nce(corrected((a * v(self.positives)).sum(dim=1), self.ids), blocks, tau,
                        self.scoring.label_smoothing, self.scoring)


def info_nce(pos: Tensor, blocks: list[tuple[Tensor, Mask]], tau: Tensor, label_smoothing: float = 0.0,
             scoring: Scoring | None = None) -> tuple[Tensor, dict]:
    """Loss and stats for positive logits [B] against blocks of negative logits [B, N] with their
    masks (fp32, already / tau; masked entries are set to -inf in place). ``label_smoothing``
    spreads that much target mass uniformly over the unmasked candidates, positive included, as
    torch's cross_entropy does. ``masked_by_<rule>``: the blocks' masks per anchor, logged (0) for
    every rule ``scoring`` has even when no block has candidates yet."""
    B = pos.shape[0]
    lses, smooth = [pos], []
    n_neg, n_masked = pos.new_zeros(B), pos.new_zeros(B)
    neg_sum, best_neg = pos.new_zeros(()), torch.full_like(pos, -math.inf).detach()
    by_rule: dict[str, Tensor] = {}
    for s, mask in blocks:
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
    nll = lse - pos
    if label_smoothing > 0:
        mean_logit = (pos + sum(smooth)) / (n_neg + 1)  # mean over unmasked candidates
        nll = (1 - label_smoothing) * nll + label_smoothing * (lse - mean_logit)
    loss = nll.mean()
    if scoring is not None:
        rules = (("id", "group") if scoring.mask_false_negatives else ()) + (("guide",) if scoring.guide else ())
        for rule in rules:
            by_rule.setdefault(rule, 0.0)
    with torch.no_grad():
        t = tau.detach()
        stats = {
            "loss": loss.detach(),
            "accuracy": (pos.detach() > best_neg).float().mean(),
            "pos_cos": pos.detach().mean() * t,
            "neg_cos": neg_sum * t / n_neg.sum().clamp(min=1),
            "negatives_per_query": n_neg.mean(),
            "masked_per_query": n_masked.mean(),
            "temperature": t,
            **{f"masked_by_{rule}": n / B for rule, n in by_rule.items()},
        }
    return loss, stats


__all__ = ["Temperature", "Mask", "Keys", "gathered_keys", "Scoring", "Block", "Direction", "info_nce"]
