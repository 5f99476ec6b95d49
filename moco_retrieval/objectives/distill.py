"""Distillation: a teacher's scores of each row's positive and hard negatives, learnt beside (or
instead of) the contrastive loss, by any objective (``objective.distill``).

The teacher (a cross-encoder, or a larger embedder: ``python -m moco_retrieval.mine teacher=...``)
scored each (query, positive) and (query, hard negative) of the data (``positive_score``,
``negative_scores``). The student's scores of the same pairs are those of the objective's main
direction (the query -> document one): its anchors against their positives and their own hard
negatives, by the encoders that direction uses (MoCo's EMA keys, in-batch's trained documents). The
queue and the batch's other documents carry no teacher scores: they stay in the contrastive loss
alone. ``loss = contrastive_weight * contrastive + distill_weight * distillation``.

* ``kl`` (Lin et al. 2020, "Distilling Dense Representations for Ranking using Tightly-Coupled
  Teachers"; sentence-transformers' ``DistillKLDivLoss``, FlagEmbedding's ``kl_div``): per query,
  ``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` over [positive, its n hard negatives],
  averaged over the queries. The student's scores are its contrastive logits, cosine (or dot) /
  ``objective.temperature``, as FlagEmbedding's are; ``T = distill_temperature`` divides both sides
  and the ``T^2`` keeps the gradient's size as T changes, as in sentence-transformers (Hinton et al.
  2015). T = 1 by default: sentence-transformers' default since v5.0.1, and FlagEmbedding's (it
  has no T); the teacher's scores are then its logits as they are (a cross-encoder's).
* ``margin_mse`` (Hofstätter et al. 2020, "Improving Efficient Neural Ranking Models with
  Cross-Architecture Knowledge Distillation"; sentence-transformers' ``MarginMSELoss``): the mean
  over queries and negatives of ``((s+ - s-) - (t+ - t-))^2``, on the student's raw scores (cosine
  or dot, not / tau): the teacher's margins must be on the student's scale (a cosine teacher for a
  normalising student).

logQ leaves these scores alone (the teacher's are not sampled); Matryoshka distils at each prefix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moco_retrieval.config import Distill
from moco_retrieval.objectives.infonce import Direction


class Distillation(nn.Module):
    """The distillation term of an objective (see the module docstring).

    Args:
        kind: ``kl`` or ``margin_mse``.
        weight: ``distill_weight``, 1 by default (FlagEmbedding adds its KL term to the contrastive
            loss unweighted).
        temperature: ``distill_temperature`` (kl only), 1 by default.
        contrastive_weight: the contrastive loss's weight, 1 by default; 0 trains on the teacher alone.
    """

    def __init__(self, kind: Distill, weight: float, temperature: float, contrastive_weight: float):
        super().__init__()
        self.kind, self.weight = Distill(kind), float(weight)
        self.temperature, self.contrastive_weight = float(temperature), float(contrastive_weight)

    def student_logits(self, direction: Direction, view=None) -> Tensor:
        """[B, 1 + n]: each anchor's logits (score / tau) of its positive, then of its own hard negatives."""
        if direction.hard is None:
            raise RuntimeError("distillation needs the main direction's hard negatives (data.n_negatives)")
        tau = direction.scoring.temperature()
        a = direction.anchors if view is None else view.anchors(direction.anchors, tau)
        pos = (a * (direction.positives if view is None else view(direction.positives))).sum(dim=1)
        neg = torch.einsum("bd,bnd->bn", a, direction.own_hard(view))
        return torch.cat([pos.unsqueeze(1), neg], dim=1)

    def loss(self, direction: Direction, batch: dict, view=None) -> Tensor:
        logits = self.student_logits(direction, view)  # fp32, as the direction's anchors and keys
        B = logits.shape[0]
        teacher = torch.cat([batch["pos_score"].view(B, 1), batch["neg_score"].view(B, -1)], dim=1).to(logits)
        if self.kind == Distill.kl:
            t = self.temperature
            target = F.log_softmax(teacher / t, dim=1)
            student = F.log_softmax(logits / t, dim=1)
            return F.kl_div(student, target, reduction="batchmean", log_target=True) * t * t
        scores = logits * direction.scoring.temperature()  # the raw scores: cosine (or dot)
        margins = scores[:, :1] - scores[:, 1:]
        return F.mse_loss(margins, teacher[:, :1] - teacher[:, 1:])

    def add(self, contrastive: Tensor, stats: dict, direction: Direction, batch: dict, view=None) -> tuple[Tensor, dict]:
        """The total loss, and ``stats`` with the two terms (``loss_contrastive``, ``loss_distill``)."""
        distill = self.loss(direction, batch, view)
        total = self.contrastive_weight * contrastive + self.weight * distill
        stats = {**stats, "loss_contrastive": contrastive.detach(), "loss_distill": distill.detach(), "loss": total.detach()}
        return total, stats


def build_distillation(cfg) -> Distillation | None:
    """The term ``cfg`` (an ObjectiveConfig) asks for, or None (``distill=none``)."""
    if cfg.distill == Distill.none:
        return None
    return Distillation(cfg.distill, cfg.distill_weight, cfg.distill_temperature, cfg.contrastive_weight)


__all__ = ["Distillation", "build_distillation"]
