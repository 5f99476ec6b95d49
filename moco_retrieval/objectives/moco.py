"""MoCo for retrieval (``MoCoObjective``): one direction, queries -> documents, and one key memory.

Design notes. Queries come from the trained encoder; documents (positives, hard negatives) from its
EMA copy, without gradient. For query i the candidates are, in this order: its positive k_i+ (the
target), the other keys of the current (global) batch, the batch's hard negatives (shared by every
query of the batch), every negative of the queue. The loss is computed before this batch's keys
are enqueued, so a query never sees its own key in the queue within the step that produced it:
``forward`` holds the keys back (an ``Enqueue``) and ``after_backward`` writes them (the queue
logits' backward still needs the queue as it was, and copying a K x d queue every step to avoid
that is what this design avoids).

Guided masking (``objective.guide``, guided.py): "momentum" scores candidates with the EMA key
encoder (its query embeddings, one extra forward of the queries without gradient, against the keys
this objective holds anyway); a fixed guide keeps its own embeddings of queued documents in the
memory, slot for slot. logQ (``objective.logq_correction``) corrects the positive, batch and queue
logits. ``queue_refresh`` N re-encodes N queued documents a step with the current key encoder (the
negative cache's refresh, refresh.py); their new keys replace the stale ones before the step's logits.
"""
from __future__ import annotations

import torch

from moco_retrieval.config import MoCoConfig
from moco_retrieval.objectives.base import Objective
from moco_retrieval.objectives.direction import Direction, Keys, gathered_keys
from moco_retrieval.objectives.memory import batch_enqueue, check_memories_fit, side_memory
from moco_retrieval.objectives.step import MOMENTUM, Enqueue, StepInput, View


def hard_keys(batch: StepInput) -> Keys | None:
    """The batch's hard negatives as EMA keys (no gradient, fp32), or None."""
    if batch.neg is None:
        return None
    return Keys(batch.neg.detach().float(), batch.neg_id, batch.neg_group)


def build_momentum_objective(cls, cfg, encoder, guide_dim: int | None, sources: int = 1):
    """``cls(cfg, dim, guide_dim, max_len, sources)`` for ``encoder``: MoCo's and the two-queue
    objective's ``build`` (``max_len``, the encoder's tokens per kind, is the width of a refreshing
    memory's texts)."""
    max_len = None
    if cfg.queue_refresh:
        if encoder.frozen:  # (TrainConfig refuses the combination first)
            raise ValueError("objective.queue_refresh needs a trained backbone: a frozen one never changes its keys")
        max_len = {kind: encoder.max_len(kind) for kind in ("query", "doc")}
    return cls(cfg, encoder.dim, guide_dim, max_len, sources)


class MoCoObjective(Objective):
    """MoCo's loss for retrieval: each query against the EMA key encoder's key of its document (the
    positive), the batch's other keys, the batch's hard negatives and a FIFO queue of past keys, in one
    softmax. Only the query side gets gradient from it; candidates sharing the positive's document id
    or group are masked.

    Args:
        cfg: ``MoCoConfig``. Defaults, and why: ``queue_size`` 65,536 and ``momentum`` 0.999 (MoCo's
            and Contriever's: a large, slowly changing set of negatives); ``temperature`` 0.05
            (Contriever's); ``batch_negatives`` on (one B x B product for B more negatives);
            ``enqueue_hard_negatives`` off (they are chosen per query and would make the queue less
            representative of the corpus); ``queue_max_age`` null and ``queue_refresh`` 0 (every queued
            key counts as it was encoded: MoCo's own setting).
        dim: the embedding dimension (the queue's key width).
        guide_dim: a fixed guide encoder's dimension, when ``cfg.guide`` names one.
        max_len: the encoder's tokens per kind, when ``cfg.queue_refresh`` keeps the queued texts.
        sources: the training sources (``data.sources``); with ``cfg.queue_per_source`` and more than
            one, one queue per source, and a batch (of one source) meets only its own source's keys:
            a queue mixing kinds of text hands a batch mostly easy negatives. Off by default (MoCo's
            one queue); with one source it changes nothing.

    References:
        - He et al., "Momentum Contrast for Unsupervised Visual Representation Learning", CVPR 2020.
        - Izacard et al., "Unsupervised Dense Information Retrieval with Contrastive Learning"
          (Contriever), 2021; facebookresearch/contriever ``src/moco.py``.

    Parts: one ``Direction`` (queries -> documents); one ``KeyMemory``, ``docs`` (a ``PerSourceMemory``
    of them with ``queue_per_source``).

    Relations:
        - ``TwoQueueObjective`` adds the document -> query direction and a query memory: both
          inputs train.
        - ``InBatchObjective`` has neither EMA keys nor queue: the batch's documents, with gradient.
    """

    VIEWS = {"q": View("query"), "k": View("doc", MOMENTUM, grad=False), "neg": View("neg", MOMENTUM, grad=False)}
    momentum_keys = True
    LEGACY_KEYS = {**Objective.LEGACY_KEYS, "queue.": "docs.queue.", "guide_queue.": "docs.guide.",
                   "doc_refresh.": "docs.refresh."}

    def __init__(self, cfg: MoCoConfig, dim: int, guide_dim: int | None = None, max_len: dict | None = None,
                 sources: int = 1):
        super().__init__(cfg)
        guide_dim = guide_dim if self.fixed_guide else None
        check_memories_fit(cfg, dim, guide_dim, sides=1, sources=sources)
        self.docs = side_memory(cfg, dim, sources, guide_dim=guide_dim, max_len=max_len)
        self.batch_negatives = bool(cfg.batch_negatives)
        self.enqueue_hard_negatives = bool(cfg.enqueue_hard_negatives)
        self.use_momentum_encoder(cfg)

    build = classmethod(build_momentum_objective)

    def forward(self, batch: StepInput) -> tuple[torch.Tensor, dict]:
        self.write_fresh(batch)
        with torch.autocast(device_type=batch.q.device.type, enabled=False):  # logits in fp32
            tau = self.scoring.temperature()
            q, k = batch.q.float() / tau, batch.k.detach().float()  # q scaled once: every block arrives as logits
            keys = gathered_keys(k, batch.doc_id, batch.group) if self.batch_negatives else None
            self.scoring.observe(keys.ids if keys is not None else None, batch.doc_id, batch.step)
            hard = hard_keys(batch)
            docs = self.docs.for_batch(batch)  # (the batch's source's, with queue_per_source)
            guide = self.guide.scores(batch, "query", memory=docs,
                                      batch_keys=keys.vectors if keys is not None else None, hard=True)
            qd = Direction(self.scoring, q, k, batch.doc_id, batch.group, guide).add_keys(keys, hard, docs)
            loss, stats = qd.loss(tau)
        self.hold(docs, self.enqueue(batch, k, keys, guide))
        return loss, stats

    def enqueue(self, batch: StepInput, k: torch.Tensor, keys: Keys | None, guide) -> Enqueue:
        """The batch's keys (and with ``enqueue_hard_negatives`` its hard negatives) for the queue."""
        fixed = self.fixed_guide
        if self.enqueue_hard_negatives and batch.neg is not None:
            return Enqueue(torch.cat([k, batch.neg.float()]), torch.cat([batch.doc_id, batch.neg_id]),
                           torch.cat([batch.group, batch.neg_group]), batch.step,
                           guide_keys=torch.cat([batch.g_k, batch.g_neg]) if fixed else None,
                           tokens=[batch.tokens[s] for s in ("doc", "neg") if s in batch.tokens])
        return batch_enqueue(batch, "doc", k, keys, batch.g_k if fixed else None,
                             guide.candidates.get("batch") if fixed else None)
