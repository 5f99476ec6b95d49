"""ICoL (``ICoLObjective``): the query tower and the document tower trained in turns, each against a
queue of the other's embeddings, which do not go stale.

Design notes. Within a phase the tower that fills the queue does not change, so every queued
embedding is what that tower would make of its text now: a large set of negatives without MoCo's
stale keys and without an EMA copy. When the phase turns the memory is emptied (it held the other
side); ``queue_phase`` records which phase filled it, so a resumed run knows. Queued queries carry
their pair's document id and group, so false negatives are masked in both phases. Under DDP the
batch's embeddings are all-gathered in rank order before they are enqueued, so every rank holds the
same queue. The tower out of training gets no gradient in its phase, so DDP must allow unused
parameters (``unused_parameters``: train.py's strategy sets it).
"""
from __future__ import annotations

import torch
from torch import Tensor

from moco_retrieval.config import ICoLConfig
from moco_retrieval.objectives.base import Objective
from moco_retrieval.objectives.direction import Direction, Keys, gathered_keys
from moco_retrieval.objectives.memory import KeyMemory
from moco_retrieval.objectives.step import Enqueue, StepInput, View

# each phase's views: "q" and "k" are the batch's queries and documents; one side carries gradient
QUERY_PHASE = {"q": View("query"), "k": View("doc", grad=False), "neg": View("neg", grad=False)}
DOC_PHASE = {"q": View("query", grad=False), "k": View("doc")}


class ICoLObjective(Objective):
    """Iterative contrastive learning of a dual encoder (``model.shared_tower=false``), one tower at a
    time. For ``phase_steps`` optimizer steps the query tower learns, with gradient, against documents
    the document tower embeds without gradient: each query's positive, the batch's other documents,
    its hard negatives, and a queue of this phase's document embeddings. Then the document tower
    learns the same way against the query tower's embeddings of the queries and a queue of them, and so
    on, starting with the queries. Candidates sharing the positive's document id or group are masked.

    Args:
        cfg: ``ICoLConfig``. Defaults, and why: ``phase_steps`` 128 and ``queue_size`` 4,096 (a phase
            at batch 32 fills the queue once; at larger batches it holds the newest 4,096);
            ``temperature`` 0.05. No guided masking and no logQ correction (refused: the queue's
            side changes every phase). A shared tower cannot take turns: refused too.
        dim: the embedding dimension.

    References:
        - Xu et al., "LaPraDoR: Unsupervised Pretrained Dense Retriever for Zero-Shot Text
          Retrieval", Findings of ACL 2022 (Iterative Contrastive Learning).

    Parts: one ``Direction`` per step (the phase's trained side as anchors); one ``KeyMemory``, ``memory``.

    Relations:
        - ``MoCoObjective`` keeps its queue fresh with an EMA encoder instead of turns.
    """

    VIEWS = QUERY_PHASE  # (the first phase's; views_for(step) gives each step's)
    unused_parameters = True  # the tower out of training gets no gradient
    LEGACY_KEYS = {**Objective.LEGACY_KEYS, "queue.": "memory.queue."}

    def __init__(self, cfg: ICoLConfig, dim: int):
        super().__init__(cfg)
        if self.guide.on or self.scoring.logq is not None:
            raise ValueError("objective=icol takes no guide and no logq_correction: its queue changes side every phase")
        self.phase_steps = int(cfg.phase_steps)
        self.batch_negatives = bool(cfg.batch_negatives)
        self.memory = KeyMemory.of(cfg, dim)
        # which phase filled the queue (-1: none yet); host mirror restored after a load
        self.register_buffer("queue_phase", torch.tensor(-1, dtype=torch.long))
        self._queue_phase = -1
        self.register_load_state_dict_post_hook(_sync_phase)

    @classmethod
    def build(cls, cfg: ICoLConfig, encoder, guide_dim: int | None, sources: int = 1) -> "ICoLObjective":
        if encoder.shared_tower:  # (TrainConfig refuses the combination first)
            raise ValueError("objective=icol needs model.shared_tower=false: it trains the two towers in turns")
        return cls(cfg, encoder.dim)

    def phase(self, step: int) -> int:
        """0: the query tower trains at ``step``; 1: the document tower."""
        return (step // self.phase_steps) % 2

    def views_for(self, step: int) -> dict[str, View]:
        return QUERY_PHASE if self.phase(step) == 0 else DOC_PHASE

    def forward(self, batch: StepInput) -> tuple[Tensor, dict]:
        phase = self.phase(batch.step)
        with torch.autocast(device_type=batch.q.device.type, enabled=False):  # logits in fp32
            tau = self.scoring.temperature()
            anchors, positives = (batch.q, batch.k) if phase == 0 else (batch.k, batch.q)  # the trained side, the other
            a, p = anchors.float() / tau, positives.detach().float()
            ids, groups = batch.doc_id, batch.group
            keys = gathered_keys(p, ids, groups) if self.batch_negatives else None
            hard = Keys(batch.neg.detach().float(), batch.neg_id, batch.neg_group) if phase == 0 and batch.neg is not None else None
            memory = self.memory if self._queue_phase == phase else None  # this phase's queue only
            loss, stats = Direction(self.scoring, a, p, ids, groups).add_keys(keys, hard, memory).loss(tau)
        stats.update(loss=loss.detach())
        gathered = keys is not None  # forward gathered them already
        self.hold(self.memory, Enqueue(*(keys if gathered else (p, ids, groups)), batch.step, gathered=gathered))
        return loss, stats

    @torch.no_grad()
    def after_backward(self) -> None:
        """Enqueue the untrained side's embeddings of the last batch; a new phase empties the queue first."""
        pending = self.memory.pending
        if pending is None:
            return
        phase = self.phase(pending.step)
        if self._queue_phase != phase:
            self.memory.reset()
            self._queue_phase = phase
            self.queue_phase.fill_(phase)
        self.memory.commit()

    def stats(self, step: int) -> dict[str, float]:
        return {**super().stats(step), "trained_side_is_doc": float(self.phase(step))}

    def unsynced_state(self) -> dict[str, Tensor]:
        return {**super().unsynced_state(), "queue_phase": self.queue_phase}


def _sync_phase(module: ICoLObjective, incompatible_keys) -> None:
    module._queue_phase = int(module.queue_phase)
