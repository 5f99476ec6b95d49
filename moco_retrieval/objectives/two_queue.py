"""Two-queue momentum contrast: both inputs trained, each against a momentum queue of the other side.

MoCo (moco.py) trains only the query side: its keys are constants. Here the trained encoder embeds
queries *and* documents, the EMA key encoder embeds both sides too, and two losses are averaged:

* query -> document: query q_i against the EMA key of its document, the batch's other document
  keys, the hard negatives and a queue of past EMA document keys (MoCo's loss);
* document -> query: document d_i against the EMA key of its query, the batch's other query keys
  and a queue of past EMA query keys.

Each softmax stays inside one consistent key space (EMA keys of one side), while both encoders'
inputs get gradient, which is what in-batch negatives have and MoCo lacks. False negatives (same
document id or group as the pair's positive) are masked in both queues and in the batch; the query
queue stores each query key with its pair's document id and group. Under DDP both queues are
all-gathered in rank order before enqueue, so every rank holds identical queues.

Sources: xMoCo (Yang et al., "xMoCo: Cross Momentum Contrastive Learning for Open-Domain Question
Answering", ACL 2021: two fast/slow encoder pairs and two queues, one per direction); MoCo v3's
symmetrized loss (Chen et al., ICCV 2021); ALBEF's retrieval fine-tune (Li et al., NeurIPS 2021:
momentum distillation with both directions, m 0.995, queue 65,536); ContAccum (Kim et al., NeurIPS
2024: a dual memory bank of queries and documents).

``same_side_negatives`` adds the other side's space to each softmax: a query is also contrasted
with the other queries' EMA keys and the query queue, a document with the other documents' keys
and the document queue (the essay: a model never contrasted on title-title pairs behaves oddly
there; GTE's "improved contrastive loss", Li et al. 2023, "Towards General Text Embeddings with
Multi-stage Contrastive Learning"). A pair's own key on the other side is masked, as are keys
sharing its document id or group; the guide does not score these blocks.

``inbatch_weight`` adds a third loss, weighted: each query against the trained encoder's documents
of the (global) batch, with gradient on both sides, i.e. in-batch negatives (inbatch.py), masked by
id and group. XBM (Wang et al., "Cross-Batch Memory for Embedding Learning", CVPR 2020) sums a
batch loss and a memory loss the same way. Why here: every key the two directions see comes from
the EMA encoder, and queued keys are older than the batch's; the faster the EMA moves, the more
the current embeddings can lower the queue's logits by drifting together away from older keys,
and the space narrows into a cone (B6 measures it as mean unrelated cosine). The in-batch term
contrasts current embeddings with each other, which that drift does not help. It costs one B x B
product: both sides are embedded with gradient already. Its candidates are the batch's documents,
so the query -> document guide masks the same ones there.

Guided masking and logQ work as in MoCo, in both directions (the document -> query direction's
guide scores query keys against the documents).

``queue_refresh`` N re-encodes N queued documents and N queued queries a step with the current
key encoder (refresh.py), as MoCo's does its document queue.

Defaults: K 65,536 per queue and temperature 0.05 (MoCo's); m 0.995 (ALBEF's) with
``queue_max_age`` 128, so every queued key is younger than the EMA's time constant 1/(1-m) = 200
steps (older keys let the space narrow into a cone; at batch 32 this is a 4,096-key window, at a
global batch of 512 the whole ring); both directions weighted equally (``doc_to_query_weight`` 1),
queues count from the first step (``queue_warmup_steps`` 0), no same-side negatives, no refresh, and the
in-batch term at weight 1 (``inbatch_weight``; 0 turns it off). B6 measured each of these.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moco_retrieval.config import TwoQueueConfig
from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad, rank
from moco_retrieval.objectives.base import MOMENTUM, View
from moco_retrieval.objectives.contrastive import Block
from moco_retrieval.objectives.guided import GuideScores
from moco_retrieval.objectives.moco import MoCoObjective, queue_for, refresh_for
from moco_retrieval.objectives.refresh import QueueRefresh


class TwoQueueObjective(MoCoObjective):
    views = {
        "q": View("query"),
        "k": View("doc", MOMENTUM, grad=False),
        "neg": View("neg", MOMENTUM, grad=False),
        "d": View("doc"),  # documents by the trained encoder: the document -> query side
        "q_key": View("query", MOMENTUM, grad=False),
    }

    def __init__(self, cfg: TwoQueueConfig, dim: int, guide_dim: int | None = None, max_len: dict | None = None):
        super().__init__(cfg, dim, guide_dim, max_len)
        if min(cfg.doc_to_query_weight, cfg.queue_warmup_steps, cfg.inbatch_weight) < 0:
            raise ValueError("objective.doc_to_query_weight, queue_warmup_steps and inbatch_weight must be >= 0")
        self.query_queue = queue_for(cfg, dim)
        self.query_refresh = refresh_for(cfg, self.query_queue, "query", max_len)
        if self.query_refresh is not None:  # the drawn queued queries, by the EMA key encoder
            self.views = {**self.views, "q_key_fresh": View("stored_query", MOMENTUM, grad=False)}
        self.query_guide_queue = queue_for(cfg, guide_dim) if self.fixed_guide else None
        self.doc_to_query_weight = float(cfg.doc_to_query_weight)
        self.queue_warmup_steps = int(cfg.queue_warmup_steps)
        self.same_side_negatives = bool(cfg.same_side_negatives)
        self.inbatch_weight = float(cfg.inbatch_weight)
        self._pending_queries: tuple | None = None

    def refreshes(self) -> dict[str, tuple[str, QueueRefresh]]:
        out = super().refreshes()
        if self.query_refresh is not None:
            out["stored_query"] = ("q_key_fresh", self.query_refresh)
        return out

    def forward(self, q: Tensor, k: Tensor, meta: dict, *, step: int = 0) -> tuple[Tensor, dict]:
        self.refresh_queues(meta, step)
        with torch.autocast(device_type=q.device.type, enabled=False):  # logits in fp32
            tau = self.temperature()
            q, k = q.float() / tau, k.detach().float()
            d, q_key = meta["d"].float() / tau, meta["q_key"].detach().float()
            counts = step >= self.queue_warmup_steps
            batch_k = self.gathered(k, meta) if self.batch_negatives else None
            # the global batch's ids and groups are the same for both sides: gathered once
            batch_q = (all_gather_no_grad(q_key), *batch_k[1:]) if batch_k is not None else None
            hard = meta["neg"].detach().float() if meta.get("neg") is not None else None
            self.observe(batch_k[1] if batch_k is not None else None, meta["doc_id"], step)
            ids = meta["doc_id"]
            doc_queue, query_queue = (self.queue, self.query_queue) if counts else (None, None)
            # masked_by_* are query -> document's (each loss counts its own blocks' masks), as under MoCo
            guide_qd = self.doc_guide(meta, k, batch_k, hard)
            blocks_qd = self.queue_blocks(q, meta, doc_queue, batch_k, hard, guide_qd)
            if self.same_side_negatives:  # q -> other query keys + query queue
                blocks_qd += self.queue_blocks(q, meta, query_queue, batch_q)
            loss_qd, stats = self.info_nce(self.corrected((q * k).sum(dim=1), ids), blocks_qd, tau)
            guide_dq = self.query_guide(meta, k, q_key, batch_q)
            blocks_dq = self.queue_blocks(d, meta, query_queue, batch_q, None, guide_dq)
            if self.same_side_negatives:  # d -> other doc keys + doc queue
                blocks_dq += self.queue_blocks(d, meta, doc_queue, batch_k)
            loss_dq, stats_dq = self.info_nce(self.corrected((d * q_key).sum(dim=1), ids), blocks_dq, tau)
            w = self.doc_to_query_weight
            loss = (loss_qd + w * loss_dq) / (1.0 + w)
            if self.inbatch_weight > 0:
                # with batch negatives, blocks_qd[0] holds the same documents: its mask is reused
                mask = blocks_qd[0].mask if batch_k is not None else None
                loss_ib, stats_ib = self.in_batch(q, meta["d"].float(), meta, tau, batch_k, mask, guide_qd)
                loss = loss + self.inbatch_weight * loss_ib
                stats.update(loss_in_batch=loss_ib.detach(), masked_per_query_in_batch=stats_ib["masked_per_query"])
        stats.update(loss=loss.detach(), loss_query_to_doc=loss_qd.detach(), loss_doc_to_query=loss_dq.detach(),
                     accuracy_doc_to_query=stats_dq["accuracy"],
                     masked_per_query_doc_to_query=stats_dq["masked_per_query"])
        def fixed_batch(guide):  # the fixed guide's gathered batch embeddings, enqueued after backward
            return guide.candidates.get("batch") if guide is not None and self.fixed_guide else None

        self._pending = (k, meta, step, batch_k, fixed_batch(guide_qd)) if self.training else None
        self._pending_queries = (q_key, meta, step, batch_q, fixed_batch(guide_dq)) if self.training else None
        return loss, stats

    def in_batch(self, q: Tensor, d: Tensor, meta: dict, tau: Tensor, batch_k: tuple | None, batch_mask,
                 guide: GuideScores | None) -> tuple[Tensor, dict]:
        """In-batch InfoNCE (loss, stats): queries (already / tau) against the global batch's trained documents,
        gathered with gradient. ``batch_k`` / ``batch_mask``: the gathered keys, ids and groups and
        the query -> document batch block's mask (the same documents: id, group and guide masks
        are shared), when batch negatives are on; without them both are built here, ``guide``
        (query -> document's) masking as it would there."""
        ids = meta["doc_id"]
        pos = self.corrected((q * d).sum(dim=1), ids)
        d_all = all_gather_with_grad(d)
        if batch_k is not None:
            block = Block(self.corrected(q @ d_all.T, batch_k[1]), batch_mask)
        else:
            groups = meta["group"]
            g = None if guide is None else (guide.anchor, guide.positive, all_gather_no_grad(guide.positive))
            block = self.batch_block(q, d_all, rank() * q.shape[0], ids, groups, all_gather_no_grad(ids),
                                     all_gather_no_grad(groups), g)
        return self.info_nce(pos, [block], tau)

    def query_guide(self, meta: dict, k: Tensor, q_key: Tensor, batch_q: tuple | None) -> GuideScores | None:
        """The guide's view of document -> query: documents as anchors, query keys as candidates."""
        if self.guide is None:
            return None
        if self.fixed_guide:
            cands = {"queue": self.query_guide_queue.keys()}
            if batch_q is not None:  # gathered once: after_backward enqueues these
                cands["batch"] = all_gather_no_grad(meta["g_q"])
            return GuideScores(meta["g_k"], meta["g_q"], cands)
        cands = {"queue": self.query_queue.keys()}
        if batch_q is not None:
            cands["batch"] = batch_q[0]
        return GuideScores(k, q_key, cands)

    @torch.no_grad()
    def after_backward(self) -> None:
        """Enqueue the last training batch's document keys and query keys."""
        if self._pending_queries is not None:
            q_key, meta, step, batch, g_batch = self._pending_queries
            self._pending_queries = None
            if batch is not None:
                slots = self.query_queue.enqueue(*batch, step, gather=False)
                if self.query_guide_queue is not None:
                    self.query_guide_queue.enqueue(g_batch, *batch[1:], step, gather=False)
            else:
                slots = self.query_queue.enqueue(q_key, meta["doc_id"], meta["group"], step)
                if self.query_guide_queue is not None:
                    self.query_guide_queue.enqueue(meta["g_q"], meta["doc_id"], meta["group"], step)
            if self.query_refresh is not None:
                self.query_refresh.store(slots, [meta["tokens"]["query"]], step)
        super().after_backward()

    def stats(self, step: int) -> dict[str, float]:
        out = {**super().stats(step), **self.query_queue.stats(step, "query_queue")}
        if self.query_refresh is not None:
            out.update(self.query_refresh.stats(step, "query_queue"))
        return out
