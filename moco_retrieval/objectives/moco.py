"""MoCo objective: InfoNCE against the momentum encoder's keys and a FIFO queue of past keys.

He et al., "Momentum Contrast for Unsupervised Visual Representation Learning" (CVPR 2020),
as adapted to retrieval by Izacard et al., "Unsupervised Dense Information Retrieval with
Contrastive Learning" (Contriever, 2021; facebookresearch/contriever ``src/moco.py``).

For query i with key-encoder positive k_i+ the candidates are, in this order:

* its positive k_i+ (the target);
* the other keys of the current (global) batch, when ``batch_negatives`` (default on);
* the batch's hard negatives, shared by every query of the batch, when the batch carries them;
* every filled slot of the queue.

A candidate with the positive's document id or group is masked out (``mask_false_negatives``,
default on). The loss is computed before this batch's keys are enqueued, so a query never sees
its own key in the queue as a negative within the step that produced it. In training mode the
keys are held back by ``forward`` and written by ``commit()``, which the trainer calls after the
backward pass: the queue logits' backward still needs the queue as it was (and copying a K x d
queue every step to avoid that is what this design avoids).

Re-projected feature queue (``reproject_features``, frozen-backbone mode only; config
``objective.queue_reproject``): the queue stores the keys' *backbone features* instead of the keys,
and every step they are projected by the current key head (``meta["project_keys"]``, given by the
Lightning module) before scoring. With a frozen backbone a key is a function of (feature, key
head) only, so a re-projected queue holds exactly the keys the current key encoder would give:
no stale keys, whatever the queue's age. The cost is one K x hidden x d projection per step.

Keys with gradient (``key_grad``; config ``objective.key_grad``, with a re-projected queue and
``model.key_encoder=query``): the batch's keys and the queue's projections keep their graph, so the
loss is in-batch InfoNCE over the batch's queries against batch + K documents with both sides
trained: a cross-batch memory (Wang et al., "Cross-Batch Memory for Embedding Learning", CVPR
2020) made exact, since XBM stores embeddings and relies on their slow drift. Without re-projection
only the batch's keys could carry gradient; the pull on positives would then not be balanced by the
queue's push, so the Lightning module refuses it (B1's exploration, 1 epoch: gradient through the
batch's keys but not the queue's gave recall@1 .49, against .63 with neither).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from moco_retrieval.distributed import all_gather_no_grad, all_gather_with_grad, rank
from moco_retrieval.model.queue import _DTYPES as _QUEUE_DTYPES, NegativeQueue
from moco_retrieval.objectives.contrastive import Block, Temperature, info_nce
from moco_retrieval.objectives.masking import false_negative_pairs, merge_pairs, own_pairs


class MoCoObjective(nn.Module):
    """Args:
    dim: key dimension.
    queue_size: K slots (> 0; use the in-batch objective for no queue).
    queue_dtype: storage dtype of the queue ("float32"; "bfloat16"/"float16" halve memory).
    temperature / learn_temperature / temperature_min / temperature_max: see ``Temperature``.
    label_smoothing: target mass spread over unmasked candidates (default 0).
    batch_negatives: also use the current batch's other keys as negatives (default True).
    mask_false_negatives: mask candidates sharing the positive's id or group (default True).
    enqueue_hard_negatives: also enqueue the batch's hard-negative keys (default False: they are
        chosen per query and would make the queue less representative of the corpus).
    key_grad: keys (batch and, with a re-projected queue, queued) carry gradient into the trained
        tower (default False: MoCo's keys are constants). Set by ``reproject_features(..., key_grad=True)``.
    """

    keys_from_key_encoder = True

    def __init__(
        self,
        dim: int,
        queue_size: int = 65536,
        queue_dtype: str = "float32",
        temperature: float = 0.05,
        learn_temperature: bool = False,
        temperature_min: float = 0.01,
        temperature_max: float = 1.0,
        label_smoothing: float = 0.0,
        batch_negatives: bool = True,
        mask_false_negatives: bool = True,
        enqueue_hard_negatives: bool = False,
    ):
        super().__init__()
        if queue_size <= 0:
            raise ValueError(
                f"objective.queue_size must be > 0 under objective=moco (got {queue_size}); "
                "use objective=inbatch to train without a queue"
            )
        self.queue = NegativeQueue(queue_size, dim, queue_dtype)
        self.temperature = Temperature(temperature, learn_temperature, temperature_min, temperature_max)
        self.label_smoothing = label_smoothing
        self.batch_negatives = batch_negatives
        self.mask_false_negatives = mask_false_negatives
        self.enqueue_hard_negatives = enqueue_hard_negatives
        self.reproject = False
        self.key_grad = False

    def reproject_features(self, feature_dim: int, key_grad: bool = False) -> None:
        """Make the queue hold backbone features of dimension ``feature_dim`` (re-projected by the
        current key head every step) instead of keys. Call before training; the queue restarts empty.
        ``key_grad``: the keys, queued ones included, carry gradient (see the module docstring)."""
        q = self.queue
        dtype = {v: k for k, v in _QUEUE_DTYPES.items()}[q.queue_keys.dtype]
        self.queue = NegativeQueue(q.size, int(feature_dim), dtype, logits_chunk=q.logits_chunk)
        self.reproject = True
        self.key_grad = bool(key_grad)

    def _queue_logits(self, q: Tensor, meta: dict) -> Tensor:
        if not self.reproject:
            return self.queue.logits(q)
        project = meta.get("project_keys")
        if project is None:
            raise ValueError(
                "objective.queue_reproject: meta needs 'project_keys' (features -> keys with the current key "
                "head) and 'key_features'; the Lightning module provides them in frozen-backbone mode"
            )
        # the current key head, so nothing is stale; with key_grad its gradient flows through every queued key
        with torch.set_grad_enabled(self.key_grad and torch.is_grad_enabled()):
            keys = project(self.queue.keys()).float()
        return q @ keys.T

    def _mask(self, meta: dict, ids: Tensor, groups: Tensor):
        if not self.mask_false_negatives:
            return None
        return false_negative_pairs(meta["doc_id"], meta["group"], ids, groups)

    def forward(self, q: Tensor, k: Tensor, meta: dict, *, step: int = 0) -> tuple[Tensor, dict]:
        with torch.autocast(device_type=q.device.type, enabled=False):  # logits in fp32
            tau = self.temperature()
            # q scaled once: every block arrives as logits
            q, k = q.float() / tau, (k.float() if self.key_grad else k.detach().float())
            pos = (q * k).sum(dim=1)
            blocks, gathered = [], None
            if self.batch_negatives:
                gather_k = all_gather_with_grad if self.key_grad else all_gather_no_grad
                gathered = (gather_k(k), all_gather_no_grad(meta["doc_id"]), all_gather_no_grad(meta["group"]))
                keys, ids, groups = gathered
                masked = own_pairs(q.shape[0], rank() * q.shape[0], q.device)
                fn = self._mask(meta, ids, groups)
                blocks.append(Block(q @ keys.T, masked if fn is None else merge_pairs(masked, fn, keys.shape[0])))
            if meta.get("neg") is not None:
                h = meta["neg"].float() if self.key_grad else meta["neg"].detach().float()
                blocks.append(Block(q @ h.T, self._mask(meta, meta["neg_id"], meta["neg_group"])))
            if self.queue.fill > 0:
                blocks.append(Block(self._queue_logits(q, meta), self._mask(meta, self.queue.ids(), self.queue.groups())))
            loss, stats = info_nce(pos, blocks, tau, self.label_smoothing)
        stats["queue_fill"] = torch.tensor(float(self.queue.fill))
        stats["queue_age"] = torch.tensor(self.queue.mean_age(step))
        self._pending = (k, meta, step, gathered) if self.training else None
        return loss, stats

    @torch.no_grad()
    def commit(self) -> None:
        """Enqueue the keys of the last training ``forward`` (call after backward)."""
        if getattr(self, "_pending", None) is None:
            return
        k, meta, step, gathered = self._pending
        self._pending = None
        keys, ids, groups = k, meta["doc_id"], meta["group"]
        plain = not self.reproject and not (self.enqueue_hard_negatives and meta.get("neg") is not None)
        if plain and gathered is not None:  # forward already all-gathered them
            self.queue.enqueue(*gathered, step, gather=False)
            return
        if self.reproject:  # store what the keys are projected from
            keys = meta["key_features"]
        if self.enqueue_hard_negatives and meta.get("neg") is not None:
            neg = meta["neg_features"] if self.reproject else meta["neg"]
            keys = torch.cat([keys, neg.float()])
            ids = torch.cat([ids, meta["neg_id"]])
            groups = torch.cat([groups, meta["neg_group"]])
        self.queue.enqueue(keys, ids, groups, step)
