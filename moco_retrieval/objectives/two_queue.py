"""Two-queue momentum contrast (``TwoQueueObjective``), the main job's objective: both inputs trained,
each against an EMA encoder's keys of the other side and a queue of them, plus in-batch negatives.

Design notes. Each softmax stays inside one consistent key space (EMA keys of one side), while both
encoders' inputs get gradient, which is what in-batch negatives have and MoCo lacks. The query
memory stores each query key with its pair's document id and group, so false negatives are masked
in both memories and in the batch. The global batch's ids and groups are the same for both sides:
gathered once.

``inbatch_weight``: why an in-batch term. Every key the two directions see comes from the EMA
encoder, and queued keys are older than the batch's; the faster the EMA moves, the more the current
embeddings can lower the queue's logits by drifting together away from older keys, and the space
narrows into a cone (a rising mean unrelated cosine). The in-batch term contrasts current
embeddings with each other, which that drift does not help. It costs one B x B product (both sides
are embedded with gradient already) and reuses the query -> document batch block's mask.

``same_side_negatives`` adds the other side's space to each softmax: queries against the other
query keys and the query queue, documents against the other document keys and the document queue
(a model never contrasted on title-title pairs behaves oddly there; GTE's "improved contrastive
loss"); the guide does not score these blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from moco_retrieval.config import NON_NEGATIVE, setting
from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad
from moco_retrieval.objectives.base import Objective, ObjectiveConfig, hard_keys
from moco_retrieval.objectives.guided import GuideScores
from moco_retrieval.objectives.infonce import Direction, Keys, gathered_keys
from moco_retrieval.objectives.memory import (MomentumOptions, QueueOptions, batch_enqueue, build_with_memories,
                                              side_memories)


@dataclass
class TwoQueueConfig(MomentumOptions, QueueOptions, ObjectiveConfig):
    """``objective=two_queue``: query->document against EMA document keys + a document queue, and
    document->query against EMA query keys + a query queue, plus an in-batch term."""

    name: str = "two_queue"
    # a faster key encoder than MoCo's (ALBEF's m), with the queue's span held inside its EMA time
    # constant 1/(1-m) = 200 steps: older keys let the space narrow (benchmarks/results/finetune.md)
    momentum: float = 0.995
    queue_max_age: Optional[int] = 128
    queue_warmup_steps: int = setting(0, NON_NEGATIVE)  # optimizer steps before queued keys count as negatives
    # also same-side negatives: queries against the other query keys and the query queue, documents
    # against the other document keys and the document queue (GTE's improved contrastive loss)
    same_side_negatives: bool = False
    # weight of an added in-batch loss: queries against the trained encoder's documents, with gradient
    # (0: off); on by default: it keeps current embeddings apart, which queued EMA keys do not
    inbatch_weight: float = setting(1.0, NON_NEGATIVE)


class TwoQueueObjective(Objective):
    """Two-queue momentum contrast: the mean of two InfoNCE directions,

    * query -> document: each query against the EMA key of its document, the batch's other document
      keys, the hard negatives and a queue of past EMA document keys (MoCo's loss);
    * document -> query: each document, by the trained encoder, against the EMA key of its query,
      the batch's other query keys and a queue of past EMA query keys;

    plus ``inbatch_weight`` times in-batch InfoNCE of the queries against the trained encoder's
    documents. Candidates sharing the positive's document id or group are masked everywhere.

    Args:
        cfg: ``TwoQueueConfig``. Defaults, and why: ``queue_size`` 65,536 per queue and ``temperature``
            0.05 (MoCo's); ``momentum`` 0.995 (ALBEF's) with ``queue_max_age`` 128, so every queued key
            is younger than the EMA's time constant 1/(1-m) = 200 steps (older keys let the space narrow
            into a cone; at batch 32 a 4,096-key window, at a global batch of 512 the whole ring);
            ``inbatch_weight`` 1; ``queue_warmup_steps`` 0; ``same_side_negatives`` and
            ``queue_refresh`` off. Each is compared in benchmarks/results/finetune.md (B6).
        dim: the embedding dimension (both queues' key width).
        guide_dim: a fixed guide encoder's dimension, when ``cfg.guide`` names one.
        max_len: the encoder's tokens per kind, when ``cfg.queue_refresh`` keeps the queued texts.
        sources: the training sources; with ``cfg.queue_per_source``, one pair of queues per source.

    References:
        - Yang et al., "xMoCo: Cross Momentum Contrastive Learning for Open-Domain Question
          Answering", ACL 2021 (two queues, one per direction).
        - Li et al., "Align before Fuse" (ALBEF, NeurIPS 2021): momentum distillation both ways, m 0.995,
          queue 65,536. Kim et al., ContAccum (NeurIPS 2024): a dual memory bank of queries and documents.
        - Wang et al., "Cross-Batch Memory for Embedding Learning" (XBM, CVPR 2020): a batch loss and a
          memory loss summed. Li et al. 2023 (GTE): same-side negatives.

    Relations: ``MoCoObjective`` is the query -> document direction alone; ``InBatchObjective(symmetric=True)``
    is both directions without EMA keys or queues.
    """

    def __init__(self, cfg: TwoQueueConfig, dim: int, guide_dim: int | None = None, max_len: dict | None = None,
                 sources: int = 1):
        super().__init__(cfg)
        guide_dim = guide_dim if self.guide.fixed else None
        self.docs, self.queries = side_memories(cfg, dim, sources, ("doc", "query"), guide_dim, max_len)
        self.batch_negatives = bool(cfg.batch_negatives)
        self.queue_warmup_steps = int(cfg.queue_warmup_steps)
        self.same_side_negatives = bool(cfg.same_side_negatives)
        self.inbatch_weight = float(cfg.inbatch_weight)

    build = classmethod(build_with_memories)

    def directions(self, batch: dict, embed) -> dict[str, Direction]:
        step, ids, groups = embed.step, batch["doc_id"], batch["group"]
        source = self.docs.source_of(batch)  # (one check across ranks for both sides)
        docs, queries = self.docs.for_source(source), self.queries.for_source(source)
        for memory in (docs, queries):
            memory.refresh_keys(embed, self.keys)
        q, d = embed("query"), embed("doc")  # trained, with gradient
        k, q_key = embed("doc", self.keys, grad=False), embed("query", self.keys, grad=False)  # (online: q, d detached)
        tau = self.scoring.temperature()
        q_tau, d_tau = q.float() / tau, d.float() / tau  # anchors scaled once: every block arrives as logits
        batch_k = gathered_keys(k, ids, groups) if self.batch_negatives else None
        batch_q = Keys(all_gather_no_grad(q_key), batch_k.ids, batch_k.groups) if batch_k is not None else None
        self.scoring.observe(batch_k.ids if batch_k is not None else None, ids, step)
        counted = step >= self.queue_warmup_steps
        guide_qd = self.guide.scores(embed, "query", memory=docs, hard=True,
                                     batch_keys=batch_k.vectors if batch_k is not None else None)
        qd = Direction(self.scoring, q_tau, k, ids, groups, guide_qd).add_keys(batch_k, hard_keys(batch, embed, self.keys),
                                                                           docs if counted else None)
        guide_dq = self.guide.scores(embed, "doc", memory=queries,
                                     batch_keys=batch_q.vectors if batch_q is not None else None)
        dq = Direction(self.scoring, d_tau, q_key, ids, groups, guide_dq).add_keys(batch_q, None, queries if counted else None)
        if self.same_side_negatives:  # q -> other query keys + query queue; d -> other doc keys + doc queue
            qd.add_keys(batch_q, None, queries if counted else None, guided=False)
            dq.add_keys(batch_k, None, docs if counted else None, guided=False)
        out = {"query_to_doc": qd, "doc_to_query": dq}
        if self.inbatch_weight > 0:
            out["in_batch"] = self.in_batch(q_tau, d, batch, batch_k, qd, guide_qd)
        fixed = self.guide.fixed
        for memory, side, keys, gathered, guide in ((docs, "doc", k, batch_k, guide_qd),
                                                    (queries, "query", q_key, batch_q, guide_dq)):
            self.hold(memory, batch_enqueue(batch, step, side, keys, gathered,
                                            self.guide.embedding(embed, side) if fixed else None,
                                            guide.candidates.get("batch") if fixed else None))
        return out

    def total(self, losses: dict[str, Tensor]) -> Tensor:
        loss = (losses["query_to_doc"] + losses["doc_to_query"]) / 2.0
        return loss + self.inbatch_weight * losses["in_batch"] if "in_batch" in losses else loss

    def in_batch(self, q: Tensor, d: Tensor, batch: dict, batch_k: Keys | None, qd: Direction,
                 guide: GuideScores | None) -> Direction:
        """Queries (``q``: / tau) against the global batch's trained documents, gathered with gradient; with batch
        negatives on, the query -> document batch block's ids, groups and mask (id, group and guide)
        are those of the same documents; without them they are built here."""
        if batch_k is None:
            ids_all, groups_all = all_gather_no_grad(batch["doc_id"]), all_gather_no_grad(batch["group"])
            mask = None
            if guide is not None:
                guide = GuideScores(guide.anchor, guide.positive, {"batch": all_gather_no_grad(guide.positive)})
        else:
            ids_all, groups_all, mask, guide = batch_k.ids, batch_k.groups, qd.blocks[0].mask, None
        ib = Direction(self.scoring, q, d, batch["doc_id"], batch["group"], guide)
        ib.add_batch(Keys(all_gather_with_grad(d.float()), ids_all, groups_all), mask=mask)
        return ib
