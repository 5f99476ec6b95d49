"""Two-queue momentum contrast (``TwoQueueObjective``): both inputs trained, each against a momentum
queue of the other side.

Design notes. Each softmax stays inside one consistent key space (EMA keys of one side), while both
encoders' inputs get gradient, which is what in-batch negatives have and MoCo lacks. The query
memory stores each query key with its pair's document id and group, so false negatives are masked
in both memories and in the batch. Under DDP both memories are all-gathered in rank order before
they are written, so every rank holds identical ones. The global batch's ids and groups are the
same for both sides: gathered once.

``same_side_negatives`` adds the other side's space to each softmax: a query is also contrasted with
the other queries' EMA keys and the query queue, a document with the other documents' keys and the
document queue (a model never contrasted on title-title pairs behaves oddly there; GTE's "improved
contrastive loss"). A pair's own key on the other side is masked, as are keys sharing its document
id or group; the guide does not score these blocks.

``inbatch_weight``: why an in-batch term here. Every key the two directions see comes from the EMA
encoder, and queued keys are older than the batch's; the faster the EMA moves, the more the current
embeddings can lower the queue's logits by drifting together away from older keys, and the space
narrows into a cone (a rising mean unrelated cosine). The in-batch term contrasts current
embeddings with each other, which that drift does not help. It costs one B x B product (both sides
are embedded with gradient already). Its candidates are the batch's documents, so it reuses the
query -> document batch block's mask (id, group and guide) when that block exists.

Guided masking and logQ work as in MoCo, in both directions (the document -> query direction's
guide scores query keys against the documents). ``queue_refresh`` N re-encodes N queued documents
and N queued queries a step with the current key encoder (refresh.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from moco_retrieval.config import TwoQueueConfig
from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad
from moco_retrieval.objectives.base import Objective
from moco_retrieval.objectives.direction import Direction, Keys, gathered_keys
from moco_retrieval.objectives.guided import GuideScores
from moco_retrieval.objectives.memory import batch_enqueue, check_memories_fit, side_memory
from moco_retrieval.objectives.moco import build_momentum_objective, hard_keys
from moco_retrieval.objectives.step import MOMENTUM, StepInput, View


class TwoQueueObjective(Objective):
    """Two-queue momentum contrast: two InfoNCE directions, averaged with weights ``1 : doc_to_query_weight``:

    * query -> document: each query against the EMA key of its document, the batch's other document
      keys, the hard negatives and a queue of past EMA document keys (MoCo's loss);
    * document -> query: each document, by the trained encoder, against the EMA key of its query, the
      batch's other query keys and a queue of past EMA query keys;

    plus ``inbatch_weight`` times in-batch InfoNCE of the queries against the trained encoder's
    documents. Candidates sharing the positive's document id or group are masked everywhere.

    Args:
        cfg: ``TwoQueueConfig``. Defaults, and why: ``queue_size`` 65,536 per queue and ``temperature``
            0.05 (MoCo's); ``momentum`` 0.995 (ALBEF's) with ``queue_max_age`` 128, so every queued key
            is younger than the EMA's time constant 1/(1-m) = 200 steps (older keys let the space narrow
            into a cone; at batch 32 a 4,096-key window, at a global batch of 512 the whole ring);
            ``doc_to_query_weight`` 1 (both directions alike); ``queue_warmup_steps`` 0 (queues count
            from the first step); ``same_side_negatives`` off; ``queue_refresh`` 0; ``inbatch_weight``
            1 (0 turns the in-batch term off). Each is compared in benchmarks/results/finetune.md.
        dim: the embedding dimension (both queues' key width).
        guide_dim: a fixed guide encoder's dimension, when ``cfg.guide`` names one.
        max_len: the encoder's tokens per kind, when ``cfg.queue_refresh`` keeps the queued texts.
        sources: the training sources (``data.sources``); with ``cfg.queue_per_source`` and more than
            one, one pair of queues per source, and a batch (of one source) meets only its own source's
            keys in both directions. Off by default; with one source it changes nothing.

    References:
        - Yang et al., "xMoCo: Cross Momentum Contrastive Learning for Open-Domain Question
          Answering", ACL 2021 (two fast/slow encoder pairs and two queues, one per direction).
        - Chen et al., "An Empirical Study of Training Self-Supervised Vision Transformers" (MoCo v3,
          ICCV 2021): the symmetrized loss.
        - Li et al., "Align before Fuse" (ALBEF, NeurIPS 2021): momentum distillation both ways, m 0.995,
          queue 65,536. Kim et al., ContAccum (NeurIPS 2024): a dual memory bank of queries and documents.
        - Wang et al., "Cross-Batch Memory for Embedding Learning" (XBM, CVPR 2020): a batch loss and a
          memory loss summed. Li et al. 2023, "Towards General Text Embeddings with Multi-stage
          Contrastive Learning" (GTE): same-side negatives.

    Parts: two ``Direction``s (and an in-batch one); two ``KeyMemory``s, ``docs`` and ``queries`` (each a
    ``PerSourceMemory`` of them with ``queue_per_source``).

    Relations:
        - ``MoCoObjective`` is the query -> document direction alone.
        - ``InBatchObjective(symmetric=True)`` is both directions without EMA keys or queues.
    """

    VIEWS = {
        "q": View("query"),
        "k": View("doc", MOMENTUM, grad=False),
        "neg": View("neg", MOMENTUM, grad=False),
        "d": View("doc"),  # documents by the trained encoder: the document -> query side
        "q_key": View("query", MOMENTUM, grad=False),
    }
    momentum_keys = True
    LEGACY_KEYS = {**Objective.LEGACY_KEYS, "queue.": "docs.queue.", "guide_queue.": "docs.guide.",
                   "doc_refresh.": "docs.refresh.", "query_queue.": "queries.queue.",
                   "query_guide_queue.": "queries.guide.", "query_refresh.": "queries.refresh."}

    def __init__(self, cfg: TwoQueueConfig, dim: int, guide_dim: int | None = None, max_len: dict | None = None,
                 sources: int = 1):
        super().__init__(cfg)
        if min(cfg.doc_to_query_weight, cfg.queue_warmup_steps, cfg.inbatch_weight) < 0:
            raise ValueError("objective.doc_to_query_weight, queue_warmup_steps and inbatch_weight must be >= 0")
        guide_dim = guide_dim if self.fixed_guide else None
        check_memories_fit(cfg, dim, guide_dim, sides=2, sources=sources)
        self.docs = side_memory(cfg, dim, sources, guide_dim=guide_dim, max_len=max_len)
        self.queries = side_memory(cfg, dim, sources, kind="query", prefix="query_queue", guide_dim=guide_dim,
                                   max_len=max_len)
        self.batch_negatives = bool(cfg.batch_negatives)
        self.doc_to_query_weight = float(cfg.doc_to_query_weight)
        self.queue_warmup_steps = int(cfg.queue_warmup_steps)
        self.same_side_negatives = bool(cfg.same_side_negatives)
        self.inbatch_weight = float(cfg.inbatch_weight)
        self.use_momentum_encoder(cfg)

    build = classmethod(build_momentum_objective)

    def forward(self, batch: StepInput) -> tuple[Tensor, dict]:
        self.write_fresh(batch)
        with torch.autocast(device_type=batch.q.device.type, enabled=False):  # logits in fp32
            tau = self.scoring.temperature()
            q, k = batch.q.float() / tau, batch.k.detach().float()
            d, q_key = batch.d.float() / tau, batch.q_key.detach().float()
            ids, groups = batch.doc_id, batch.group
            batch_k = gathered_keys(k, ids, groups) if self.batch_negatives else None
            # the global batch's ids and groups are the same for both sides: gathered once
            batch_q = Keys(all_gather_no_grad(q_key), batch_k.ids, batch_k.groups) if batch_k is not None else None
            self.scoring.observe(batch_k.ids if batch_k is not None else None, ids, batch.step)
            counted = batch.step >= self.queue_warmup_steps
            source = self.docs.source_of(batch)  # (one check across ranks for both sides)
            docs_memory, queries_memory = self.docs.for_source(source), self.queries.for_source(source)
            docs, queries = (docs_memory, queries_memory) if counted else (None, None)
            # masked_by_* are query -> document's (each loss counts its own blocks' masks), as under MoCo
            guide_qd = self.guide.scores(batch, "query", memory=docs_memory, hard=True,
                                         batch_keys=batch_k.vectors if batch_k is not None else None)
            qd = Direction(self.scoring, q, k, ids, groups, guide_qd).add_keys(batch_k, hard_keys(batch), docs)
            guide_dq = self.guide.scores(batch, "doc", memory=queries_memory,
                                         batch_keys=batch_q.vectors if batch_q is not None else None)
            dq = Direction(self.scoring, d, q_key, ids, groups, guide_dq).add_keys(batch_q, None, queries)
            if self.same_side_negatives:  # q -> other query keys + query queue; d -> other doc keys + doc queue
                qd.add_keys(batch_q, None, queries, guided=False)
                dq.add_keys(batch_k, None, docs, guided=False)
            loss_qd, stats = qd.loss(tau)
            loss_dq, stats_dq = dq.loss(tau)
            w = self.doc_to_query_weight
            loss = (loss_qd + w * loss_dq) / (1.0 + w)
            if self.inbatch_weight > 0:
                # with batch negatives, qd's first block holds the same documents: its mask is reused
                loss_ib, stats_ib = self.in_batch(q, batch, batch_k, qd.blocks[0].mask if batch_k is not None else None,
                                                  guide_qd).loss(tau)
                loss = loss + self.inbatch_weight * loss_ib
                stats.update(loss_in_batch=loss_ib.detach(), masked_per_query_in_batch=stats_ib["masked_per_query"])
        stats.update(loss=loss.detach(), loss_query_to_doc=loss_qd.detach(), loss_doc_to_query=loss_dq.detach(),
                     accuracy_doc_to_query=stats_dq["accuracy"],
                     masked_per_query_doc_to_query=stats_dq["masked_per_query"])
        self.hold_keys(batch, (docs_memory, "doc", k, batch_k, guide_qd),
                       (queries_memory, "query", q_key, batch_q, guide_dq))
        return loss, stats

    def hold_keys(self, batch: StepInput, *memories: tuple) -> None:
        """Each (memory, side, this rank's keys, the gathered Keys or None, its direction's guide
        scores): the batch's keys of that side, enqueued after backward (with a fixed guide's
        embeddings of them, gathered by the guide's scores when the keys were)."""
        fixed = self.fixed_guide
        for memory, side, keys, gathered, guide in memories:
            self.hold(memory, batch_enqueue(batch, side, keys, gathered, self.guide.embedding(batch, side) if fixed else None,
                                            guide.candidates.get("batch") if fixed else None))

    def in_batch(self, q: Tensor, batch: StepInput, batch_k: Keys | None, batch_mask, guide: GuideScores | None) -> Direction:
        """In-batch InfoNCE: queries (already / tau) against the global batch's trained documents,
        gathered with gradient. ``batch_k`` / ``batch_mask``: the gathered keys' ids and groups and
        the query -> document batch block's mask (the same documents: id, group and guide masks are
        shared), when batch negatives are on; without them the mask is built here, ``guide``
        (query -> document's) masking as it would there."""
        d = batch.d.float()
        if batch_k is None:
            ids_all, groups_all = all_gather_no_grad(batch.doc_id), all_gather_no_grad(batch.group)
            if guide is not None:
                guide = GuideScores(guide.anchor, guide.positive, {"batch": all_gather_no_grad(guide.positive)})
        else:
            ids_all, groups_all, guide = batch_k.ids, batch_k.groups, None  # (the reused mask has the guide's)
        ib = Direction(self.scoring, q, d, batch.doc_id, batch.group, guide)
        ib.add_batch(Keys(all_gather_with_grad(d), ids_all, groups_all), mask=batch_mask)
        return ib
