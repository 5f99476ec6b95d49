"""MoCo: queries against the momentum encoder's keys and a FIFO queue of its past keys.

He et al., "Momentum Contrast for Unsupervised Visual Representation Learning" (CVPR 2020),
as adapted to retrieval by Izacard et al., "Unsupervised Dense Information Retrieval with
Contrastive Learning" (Contriever, 2021; facebookresearch/contriever ``src/moco.py``).

Queries come from the trained encoder; documents (positives, hard negatives) from its EMA copy,
without gradient, so only the query side learns from this loss. For query i with key k_i+ the
candidates are, in this order:

* its positive k_i+ (the target);
* the other keys of the current (global) batch, when ``batch_negatives`` (default on);
* the batch's hard negatives, shared by every query of the batch, when the batch carries them;
* every filled slot of the queue.

A candidate with the positive's document id or group is masked out (``mask_false_negatives``,
default on). The loss is computed before this batch's keys are enqueued, so a query never sees
its own key in the queue within the step that produced it: ``forward`` holds the keys back and
``after_backward`` writes them (the queue logits' backward still needs the queue as it was, and
copying a K x d queue every step to avoid that is what this design avoids).

Guided masking (``objective.guide``, guided.py): "momentum" scores candidates with the EMA key
encoder (its query embeddings, one extra forward of the queries without gradient, against the keys
this objective holds anyway); a fixed guide keeps its own embeddings of queued documents in a
second queue. logQ (``objective.logq_correction``) corrects the positive, batch and queue logits.

``queue_refresh`` N re-encodes N queued documents a step with the current key encoder (the
negative cache's refresh, refresh.py); their new keys replace the stale ones before the step's logits.

Defaults: K = 65,536 and m = 0.999 (MoCo's and Contriever's), temperature 0.05; hard negatives are
not enqueued (``enqueue_hard_negatives``: they are chosen per query and would make the queue less
representative of the corpus); no refresh.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moco_retrieval.config import MoCoConfig
from moco_retrieval.distributed import all_gather_no_grad, rank
from moco_retrieval.objectives.base import MOMENTUM, MomentumSchedule, Objective, View
from moco_retrieval.objectives.contrastive import Block
from moco_retrieval.objectives.guided import MOMENTUM_GUIDE, GuideScores
from moco_retrieval.objectives.queue import NegativeQueue
from moco_retrieval.objectives.refresh import QueueRefresh


def require_queue(size: int, name: str) -> None:
    if size <= 0:
        raise ValueError(
            f"objective.queue_size must be > 0 under objective={name} (got {size}); "
            "use objective=inbatch to train without a queue"
        )


def queue_for(cfg: MoCoConfig, dim: int) -> NegativeQueue:
    """A queue of ``dim``-wide keys as the objective's config sets it (size, storage dtype, age bound)."""
    return NegativeQueue(cfg.queue_size, dim, cfg.queue_dtype, max_age=cfg.queue_max_age)


def refresh_for(cfg: MoCoConfig, queue: NegativeQueue, kind: str, max_len: dict | None) -> QueueRefresh | None:
    """``queue``'s negative-cache refresh when ``objective.queue_refresh`` > 0 (``max_len``: the
    encoder's tokens per query and per document, the width of the stored texts)."""
    if cfg.queue_refresh == 0:
        return None
    if max_len is None:
        raise ValueError("objective.queue_refresh needs the encoder's max_len per kind (texts are stored as tokens)")
    return QueueRefresh(queue, cfg.queue_refresh, max_len[kind], kind)


class MoCoObjective(Objective):
    views = {"q": View("query"), "k": View("doc", MOMENTUM, grad=False), "neg": View("neg", MOMENTUM, grad=False)}
    guides_with_momentum = True

    def __init__(self, cfg: MoCoConfig, dim: int, guide_dim: int | None = None, max_len: dict | None = None):
        super().__init__(cfg)
        require_queue(cfg.queue_size, cfg.name)
        self.queue = queue_for(cfg, dim)
        self.doc_refresh = refresh_for(cfg, self.queue, "doc", max_len)
        if self.doc_refresh is not None:  # the drawn queued documents, by the EMA key encoder
            self.views = {**self.views, "k_fresh": View("stored_doc", MOMENTUM, grad=False)}
        # a fixed guide's embeddings of the queued documents, slot for slot with the queue
        self.guide_queue = queue_for(cfg, guide_dim) if self.fixed_guide else None
        if self.guide_name == MOMENTUM_GUIDE and "q_key" not in self.views:
            self.views = {**self.views, "q_key": View("query", MOMENTUM, grad=False)}
        self.batch_negatives = bool(cfg.batch_negatives)
        self.enqueue_hard_negatives = bool(cfg.enqueue_hard_negatives)
        self.momentum = MomentumSchedule(cfg.momentum, cfg.momentum_schedule)
        self.key_encoder_dropout = bool(cfg.key_encoder_dropout)
        self._pending: tuple | None = None

    def refreshes(self) -> dict[str, tuple[str, QueueRefresh]]:
        """Stored side -> (its view's name, the refresh of the queue it re-encodes)."""
        return {"stored_doc": ("k_fresh", self.doc_refresh)} if self.doc_refresh is not None else {}

    def stored_inputs(self, side: str, step: int) -> dict | None:
        return self.refreshes()[side][1].inputs(step)

    def refresh_queues(self, meta: dict, step: int) -> None:
        """Write the re-encoded queued keys the module embedded for this step (before any logits)."""
        for view, refresh in self.refreshes().values():
            if meta.get(view) is not None:
                refresh.write(meta[view], step)

    def gathered(self, keys: Tensor, meta: dict) -> tuple[Tensor, Tensor, Tensor]:
        """The global batch's keys, ids and groups (rank order), without gradient."""
        return all_gather_no_grad(keys), all_gather_no_grad(meta["doc_id"]), all_gather_no_grad(meta["group"])

    def doc_guide(self, meta: dict, k: Tensor, batch: tuple | None, hard: Tensor | None) -> GuideScores | None:
        """The guide's view of query -> document: EMA query embeddings against the keys
        (momentum guide), or the fixed guide's embeddings of both and of the queued documents."""
        if self.guide is None:
            return None
        if self.fixed_guide:
            cands = {"queue": self.guide_queue.keys()}
            if batch is not None:  # gathered once: after_backward enqueues these
                cands["batch"] = all_gather_no_grad(meta["g_k"])
            if meta.get("g_neg") is not None:
                cands["hard"] = meta["g_neg"]
            return GuideScores(meta["g_q"], meta["g_k"], cands)
        cands = {"queue": self.queue.keys()}
        if batch is not None:
            cands["batch"] = batch[0]
        if hard is not None:
            cands["hard"] = hard
        return GuideScores(meta["q_key"], k, cands)

    def queue_blocks(self, q: Tensor, meta: dict, queue: NegativeQueue | None, batch: tuple | None,
                     hard: Tensor | None = None, guide: GuideScores | None = None) -> list[Block]:
        """Blocks of ``q`` (already / tau) against the batch's other keys (``batch``: gathered keys,
        ids, groups), the hard negatives and ``queue``, each with its false negatives masked
        (``guide``: the guide's scores of each block's candidates, or None)."""
        ids, groups = meta["doc_id"], meta["group"]

        def g(name):
            return None if guide is None or name not in guide.candidates else (
                guide.anchor, guide.positive, guide.candidates[name])

        blocks = []
        if batch is not None:
            keys, ids_all, groups_all = batch
            blocks.append(self.batch_block(q, keys, rank() * q.shape[0], ids, groups, ids_all, groups_all, g("batch")))
        if hard is not None:
            blocks.append(Block(q @ hard.T, self.mask(ids, groups, meta["neg_id"], meta["neg_group"], g("hard"))))
        if queue is not None and queue.fill > 0:
            logits = self.corrected(queue.logits(q), queue.ids())
            blocks.append(Block(logits, self.mask(ids, groups, queue.ids(), queue.groups(), g("queue"))))
        return blocks

    def forward(self, q: Tensor, k: Tensor, meta: dict, *, step: int = 0) -> tuple[Tensor, dict]:
        self.refresh_queues(meta, step)
        with torch.autocast(device_type=q.device.type, enabled=False):  # logits in fp32
            tau = self.temperature()
            q, k = q.float() / tau, k.detach().float()  # q scaled once: every block arrives as logits
            batch = self.gathered(k, meta) if self.batch_negatives else None
            self.observe(batch[1] if batch is not None else None, meta["doc_id"], step)
            hard = meta["neg"].detach().float() if meta.get("neg") is not None else None
            guide = self.doc_guide(meta, k, batch, hard)
            pos = self.corrected((q * k).sum(dim=1), meta["doc_id"])
            loss, stats = self.info_nce(pos, self.queue_blocks(q, meta, self.queue, batch, hard, guide), tau)
        g_batch = guide.candidates.get("batch") if guide is not None and self.fixed_guide else None
        self._pending = (k, meta, step, batch, g_batch) if self.training else None
        return loss, stats

    @torch.no_grad()
    def after_backward(self) -> None:
        """Enqueue the keys of the last training ``forward`` (and the fixed guide's embeddings)."""
        if self._pending is None:
            return
        k, meta, step, batch, g_batch = self._pending
        self._pending = None
        sides = ["doc"]
        if self.enqueue_hard_negatives and meta.get("neg") is not None:
            ids, groups = torch.cat([meta["doc_id"], meta["neg_id"]]), torch.cat([meta["group"], meta["neg_group"]])
            slots = self.queue.enqueue(torch.cat([k, meta["neg"].float()]), ids, groups, step)
            sides.append("neg")
            if self.guide_queue is not None:
                self.guide_queue.enqueue(torch.cat([meta["g_k"], meta["g_neg"]]), ids, groups, step)
        elif batch is not None:  # forward already all-gathered them (and the guide's, when fixed)
            slots = self.queue.enqueue(*batch, step, gather=False)
            if self.guide_queue is not None:
                self.guide_queue.enqueue(g_batch, *batch[1:], step, gather=False)
        else:
            slots = self.queue.enqueue(k, meta["doc_id"], meta["group"], step)
            if self.guide_queue is not None:
                self.guide_queue.enqueue(meta["g_k"], meta["doc_id"], meta["group"], step)
        if self.doc_refresh is not None:
            self.doc_refresh.store(slots, [meta["tokens"][s] for s in sides], step)

    def stats(self, step: int) -> dict[str, float]:
        out = self.queue.stats(step)
        if self.doc_refresh is not None:
            out.update(self.doc_refresh.stats(step))
        return out
