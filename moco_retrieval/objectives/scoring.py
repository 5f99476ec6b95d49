"""What every objective scores and masks the same way: temperature, label smoothing, false-negative
masks (id and group, masking.py; guided, guided.py), the logQ correction (logq.py) and Matryoshka
prefixes (matryoshka.py).

Every direction (direction.py) of every objective scores its blocks through one ``Scoring``, so a
rule changes in one place.
"""
from __future__ import annotations

from torch import Tensor, nn

from moco_retrieval.config import ObjectiveConfig
from moco_retrieval.distributed import all_gather_no_grad
from moco_retrieval.objectives.contrastive import Block, Temperature, info_nce
from moco_retrieval.objectives.guided import GuidedMask
from moco_retrieval.objectives.logq import StreamingFrequency
from moco_retrieval.objectives.matryoshka import Matryoshka
from moco_retrieval.objectives.masking import Mask, Pairs, false_negative_pairs, merge_pairs


class Scoring(nn.Module):
    """The objective's temperature (a buffer, or a parameter when learned), its masking rules and
    its logQ estimator (buffers: state each rank keeps itself, from the all-gathered batch ids)."""

    def __init__(self, cfg: ObjectiveConfig, guided: bool):
        super().__init__()
        self.temperature = Temperature(cfg.temperature, cfg.learn_temperature, cfg.temperature_min, cfg.temperature_max)
        self.label_smoothing = float(cfg.label_smoothing)
        self.mask_false_negatives = bool(cfg.mask_false_negatives)
        self.guide = GuidedMask(cfg.guide_margin, cfg.guide_threshold) if guided else None
        self.logq = StreamingFrequency(cfg.logq_buckets, cfg.logq_alpha) if cfg.logq_correction else None
        # Matryoshka prefixes (matryoshka.py); build_objective sets whether they are re-normalised
        self.matryoshka = Matryoshka(cfg.matryoshka_dims, cfg.matryoshka_weights) if cfg.matryoshka_dims else None

    def mask(self, pos_ids: Tensor, pos_groups: Tensor, cand_ids: Tensor, cand_groups: Tensor,
             guide: tuple[Tensor, Tensor, Tensor] | None = None, own: Pairs | None = None) -> Mask:
        """False negatives among candidates: same document id or group as the positive (if
        masking), and those the guide scores too close to it (``guide``: the guide's anchors,
        positives and candidates). ``own``: each row's own positive in the block, masked too but
        not counted. Counted by rule (what an earlier rule already masked is not counted again)."""
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

    def info_nce(self, pos: Tensor, blocks: list[Block], tau: Tensor) -> tuple[Tensor, dict]:
        """InfoNCE over ``blocks``; ``masked_by_<rule>`` counts these blocks' masks only, and is
        logged (0) for every rule on even when no block has candidates yet."""
        loss, stats = info_nce(pos, blocks, tau, self.label_smoothing)
        rules = (("id", "group") if self.mask_false_negatives else ()) + (("guide",) if self.guide is not None else ())
        for rule in rules:
            stats.setdefault(f"masked_by_{rule}", 0.0)
        return loss, stats


__all__ = ["Scoring"]
