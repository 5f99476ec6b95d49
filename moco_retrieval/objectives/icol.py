"""ICoL: the query tower and the document tower trained in turns, each against a queue of the other's
embeddings, which do not go stale.

Xu et al., "LaPraDoR: Unsupervised Pretrained Dense Retriever for Zero-Shot Text Retrieval"
(Findings of ACL 2022), Iterative Contrastive Learning. A dual encoder (``model.shared_tower=false``)
trains one tower at a time. For ``phase_steps`` optimizer steps the query tower learns, with
gradient, against documents that the document tower (not trained in this phase) embeds without
gradient: each query's positive, the batch's other documents, its hard negatives, and a queue of
the document embeddings of this phase. Then the document tower learns the same way against the
query tower's embeddings of the queries and a queue of them, and so on, starting with the queries.
Within a phase the tower that fills the queue does not change, so every queued embedding is what
that tower would make of its text now: a large set of negatives without MoCo's stale keys and
without an EMA copy. When the phase turns the queue is emptied (it held the other side).

False negatives (same document id or group as the pair's positive) are masked in the batch and the
queue in both phases (queued queries carry their pair's document id and group). Under DDP the
batch's embeddings are all-gathered in rank order before they are enqueued, so every rank holds the
same queue. The tower out of training gets no gradient in its phase, so DDP must allow unused
parameters (``unused_parameters``: train.py's strategy sets it). A shared tower cannot take turns:
the objective refuses one.

Defaults: ``phase_steps`` 128 and ``queue_size`` 4,096 (a phase at batch 32 fills the queue once;
at larger batches the queue holds the newest 4,096), temperature 0.05; no guided masking and no
logQ correction (refused: the queue's side changes every phase).
"""
from __future__ import annotations

import torch
from torch import Tensor

from moco_retrieval.config import ICoLConfig
from moco_retrieval.distributed import all_gather_no_grad, rank
from moco_retrieval.objectives.base import Objective, View
from moco_retrieval.objectives.contrastive import Block
from moco_retrieval.objectives.queue import NegativeQueue
from moco_retrieval.objectives.guided import NONE

# each phase's views: "q" and "k" are the batch's queries and documents; one side carries gradient
QUERY_PHASE = {"q": View("query"), "k": View("doc", grad=False), "neg": View("neg", grad=False)}
DOC_PHASE = {"q": View("query", grad=False), "k": View("doc")}


class ICoLObjective(Objective):
    views = {**QUERY_PHASE}  # (the first phase's; views_for(step) gives each step's)
    unused_parameters = True  # the tower out of training gets no gradient

    def __init__(self, cfg: ICoLConfig, dim: int):
        super().__init__(cfg)
        if self.guide_name != NONE or self.logq is not None:
            raise ValueError("objective=icol takes no guide and no logq_correction: its queue changes side every phase")
        self.phase_steps = int(cfg.phase_steps)
        self.batch_negatives = bool(cfg.batch_negatives)
        self.queue = NegativeQueue(cfg.queue_size, dim, cfg.queue_dtype)
        # which phase filled the queue (-1: none yet); host mirror restored after a load
        self.register_buffer("queue_phase", torch.tensor(-1, dtype=torch.long))
        self._queue_phase = -1
        self.register_load_state_dict_post_hook(_sync_phase)
        self._pending: tuple | None = None

    def phase(self, step: int) -> int:
        """0: the query tower trains at ``step``; 1: the document tower."""
        return (step // self.phase_steps) % 2

    def views_for(self, step: int) -> dict[str, View]:
        return QUERY_PHASE if self.phase(step) == 0 else DOC_PHASE

    def forward(self, q: Tensor, k: Tensor, meta: dict, *, step: int = 0) -> tuple[Tensor, dict]:
        phase = self.phase(step)
        with torch.autocast(device_type=q.device.type, enabled=False):  # logits in fp32
            tau = self.temperature()
            anchors, positives = (q, k) if phase == 0 else (k, q)  # the trained side, the other
            a, p = anchors.float() / tau, positives.detach().float()
            ids, groups = meta["doc_id"], meta["group"]
            batch = (all_gather_no_grad(p), all_gather_no_grad(ids), all_gather_no_grad(groups)) if self.batch_negatives else None
            blocks = []
            if batch is not None:
                blocks.append(self.batch_block(a, batch[0], rank() * a.shape[0], ids, groups, batch[1], batch[2]))
            if phase == 0 and meta.get("neg") is not None:
                neg = meta["neg"].detach().float()
                blocks.append(Block(a @ neg.T, self.mask(ids, groups, meta["neg_id"], meta["neg_group"])))
            if self._queue_phase == phase and self.queue.fill > 0:  # this phase's queue only
                blocks.append(Block(self.queue.logits(a), self.mask(ids, groups, self.queue.ids(), self.queue.groups())))
            loss, stats = self.info_nce((a * p).sum(dim=1), blocks, tau)
        stats.update(loss=loss.detach())
        self._pending = (p, meta, step, batch) if self.training else None
        return loss, stats

    @torch.no_grad()
    def after_backward(self) -> None:
        """Enqueue the untrained side's embeddings of the last batch; a new phase empties the queue first."""
        if self._pending is None:
            return
        p, meta, step, batch = self._pending
        self._pending = None
        phase = self.phase(step)
        if self._queue_phase != phase:
            self.queue.reset()
            self._queue_phase = phase
            self.queue_phase.fill_(phase)
        if batch is not None:  # forward gathered them already
            self.queue.enqueue(*batch, step, gather=False)
        else:
            self.queue.enqueue(p, meta["doc_id"], meta["group"], step)

    def stats(self, step: int) -> dict[str, float]:
        return {**self.queue.stats(step), "trained_side_is_doc": float(self.phase(step))}


def _sync_phase(module: ICoLObjective, incompatible_keys) -> None:
    module._queue_phase = int(module.queue_phase)
