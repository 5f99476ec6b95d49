"""MoCo for retrieval (``MoCoObjective``): one direction, queries -> documents, and one key memory.

Design notes. Queries come from the trained encoder; documents (positives, hard negatives) from its
EMA copy, without gradient. For query i the candidates are, in this order: its positive k_i+ (the
target), the other keys of the current (global) batch, the batch's hard negatives (shared by every
query of the batch), every negative of the queue. The loss is computed before this batch's keys are
enqueued, so a query never sees its own key in the queue within the step that produced it: the
keys are held and written after backward (the queue logits' backward still needs the queue as it
was, and copying a K x d queue every step to avoid that is what this design avoids).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moco_retrieval.objectives.base import Objective, ObjectiveConfig, hard_keys
from moco_retrieval.objectives.infonce import Direction, gathered_keys
from moco_retrieval.objectives.memory import (Enqueue, MomentumOptions, QueueOptions, batch_enqueue, build_with_memories,
                                              side_memories)


@dataclass
class MoCoConfig(MomentumOptions, QueueOptions, ObjectiveConfig):
    """``objective=moco``: queries against an EMA key encoder's keys and a queue of its past keys."""

    name: str = "moco"
    enqueue_hard_negatives: bool = False  # also enqueue the batch's mined hard negatives' keys


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
        dim, guide_dim, max_len, sources: as ``TwoQueueObjective``'s.

    References:
        - He et al., "Momentum Contrast for Unsupervised Visual Representation Learning", CVPR 2020.
        - Izacard et al., "Unsupervised Dense Information Retrieval with Contrastive Learning"
          (Contriever), 2021; facebookresearch/contriever ``src/moco.py``.

    Relations: ``TwoQueueObjective`` adds the document -> query direction and a query memory, so both
    inputs train; in fine-tuning MoCo alone falls far below in-batch negatives (benchmarks B6, B11).
    """

    def __init__(self, cfg: MoCoConfig, dim: int, guide_dim: int | None = None, max_len: dict | None = None,
                 sources: int = 1):
        super().__init__(cfg)
        (self.docs,) = side_memories(cfg, dim, sources, ("doc",), guide_dim if self.guide.fixed else None, max_len)
        self.batch_negatives = bool(cfg.batch_negatives)
        self.enqueue_hard_negatives = bool(cfg.enqueue_hard_negatives)

    build = classmethod(build_with_memories)

    def directions(self, batch: dict, embed) -> dict[str, Direction]:
        step, ids, groups = embed.step, batch["doc_id"], batch["group"]
        docs = self.docs.for_source(self.docs.source_of(batch))  # (the batch's source's, with queue_per_source)
        docs.refresh_keys(embed, self.keys)
        q, k = embed("query"), embed("doc", self.keys, grad=False)
        keys = gathered_keys(k, ids, groups) if self.batch_negatives else None
        self.scoring.observe(keys.ids if keys is not None else None, ids, step)
        hard = hard_keys(batch, embed, self.keys)
        guide = self.guide.scores(embed, "query", memory=docs, batch_keys=keys.vectors if keys is not None else None,
                                  hard=True)
        qd = Direction(self.scoring, q.float() / self.scoring.temperature(), k, ids, groups, guide).add_keys(keys, hard, docs)
        fixed = self.guide.fixed
        if self.enqueue_hard_negatives and hard is not None:
            self.hold(docs, Enqueue(torch.cat([k.float(), hard.vectors.float()]), torch.cat([ids, hard.ids]),
                                    torch.cat([groups, hard.groups]), step,
                                    guide_keys=torch.cat([self.guide.embedding(embed, s) for s in ("doc", "neg")])
                                    if fixed else None,
                                    tokens=[batch[s] for s in ("doc", "neg")]))
        else:
            self.hold(docs, batch_enqueue(batch, step, "doc", k, keys, self.guide.embedding(embed, "doc") if fixed else None,
                                          guide.candidates.get("batch") if fixed else None))
        return {"query_to_doc": qd}
