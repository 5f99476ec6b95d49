"""The MoCo negative queue: a FIFO ring buffer of past keys with their document ids, groups and
the step at which each was enqueued.

After lightly's ``MemoryBankModule`` (a small module of its own) and MoCo's queue (He et al.,
2020), with two differences that matter for retrieval:

* every slot carries the document id and group of its key, so the objective can mask false
  negatives (the query's own positive is in a 65,536-key queue about twice per epoch on a
  36k-document set);
* slots never written are not negatives: only the first ``fill`` slots are used until the ring
  is full (no random initial vectors), and any batch size works (writes wrap around).

Everything lives in persistent buffers whose names contain ``queue``, so checkpoints carry and
restore it. The fill and write pointer are mirrored in Python ints, so reading them (every step,
for the filled prefix and the logged stats) never waits for the device. Under DDP keys are
all-gathered from every rank in rank order before they are written, so every rank holds the
identical queue.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from moco_retrieval.distributed import all_gather_no_grad

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NegativeQueue(nn.Module):
    """Ring buffer of ``size`` keys of dimension ``dim``.

    Args:
        size: number of slots K (must be > 0).
        dim: key dimension d.
        dtype: storage dtype of the keys ("float32" default; "bfloat16"/"float16" halve memory at
            scale). Logits are always computed in float32 (see :meth:`logits`).
        logits_chunk: with low-precision storage, keys are cast to float32 this many at a time,
            so no K x d float32 copy is made per step.
    """

    def __init__(self, size: int, dim: int, dtype: str = "float32", logits_chunk: int = 16384):
        super().__init__()
        if size <= 0:
            raise ValueError(f"objective.queue_size must be > 0 for the queue, got {size}")
        if dtype not in DTYPES:
            raise ValueError(f"objective.queue_dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.size, self.dim, self.logits_chunk = size, dim, logits_chunk
        self.register_buffer("queue_keys", torch.zeros(size, dim, dtype=DTYPES[dtype]))
        self.register_buffer("queue_ids", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("queue_groups", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("queue_steps", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue_fill", torch.zeros((), dtype=torch.long))
        self._fill = self._ptr = 0  # host mirrors of queue_fill / queue_ptr
        self.register_load_state_dict_post_hook(_sync_counters)

    # The filled slots are always the prefix [0, fill): the ring is written from slot 0 and only
    # wraps once full. So these are views, never copies.
    @property
    def fill(self) -> int:
        return self._fill

    def keys(self) -> Tensor:
        return self.queue_keys[: self.fill]

    def ids(self) -> Tensor:
        return self.queue_ids[: self.fill]

    def groups(self) -> Tensor:
        return self.queue_groups[: self.fill]

    def logits(self, q: Tensor) -> Tensor:
        """fp32 scores ``q @ keys^T`` over the filled slots, shape [B, fill] (differentiable in q)."""
        keys, q = self.keys(), q.float()
        if keys.dtype == torch.float32:
            return q @ keys.T
        # low-precision storage: cast a chunk at a time (no K x d fp32 copy)
        chunks = [q @ keys[i : i + self.logits_chunk].float().T for i in range(0, keys.shape[0], self.logits_chunk)]
        return torch.cat(chunks, dim=1) if chunks else q.new_zeros(q.shape[0], 0)

    def mean_age(self, step: int) -> float:
        """Mean age, in optimizer steps, of the keys in the filled slots."""
        fill = self.fill
        if fill == 0:
            return 0.0
        # an integer sum: no K-sized float copy of the steps on the per-step path
        return step - int(self.queue_steps[:fill].sum()) / fill

    @torch.no_grad()
    def enqueue(self, keys: Tensor, ids: Tensor, groups: Tensor, step: int, gather: bool = True) -> None:
        """Write a batch of keys (oldest slots are overwritten first).

        With ``gather`` and an initialised process group, every rank's keys, ids and groups are
        all-gathered first, in rank order, so all ranks write the same thing.
        """
        if gather:
            keys, ids, groups = all_gather_no_grad(keys.detach()), all_gather_no_grad(ids), all_gather_no_grad(groups)
        n = keys.shape[0]
        if n > self.size:  # only the newest `size` keys can survive anyway
            keys, ids, groups, n = keys[-self.size :], ids[-self.size :], groups[-self.size :], self.size
        ptr = self._ptr
        slots = (torch.arange(n, device=keys.device) + ptr) % self.size
        self.queue_keys[slots] = keys.to(self.queue_keys.dtype)
        self.queue_ids[slots] = ids.to(torch.long)
        self.queue_groups[slots] = groups.to(torch.long)
        self.queue_steps[slots] = step
        self._ptr, self._fill = (ptr + n) % self.size, min(self.size, self._fill + n)
        self.queue_ptr.fill_(self._ptr)
        self.queue_fill.fill_(self._fill)

    @torch.no_grad()
    def reset(self) -> None:
        """Empty the queue: no slot is a negative until written again."""
        self._fill = self._ptr = 0
        self.queue_fill.zero_()
        self.queue_ptr.zero_()
        self.queue_ids.fill_(-1)
        self.queue_groups.fill_(-1)
        self.queue_steps.fill_(-1)

    def stats(self, step: int, prefix: str = "queue") -> dict[str, float]:
        """``{prefix}_fill`` (filled slots) and ``{prefix}_age`` (mean age in steps), for logging."""
        return {f"{prefix}_fill": float(self.fill), f"{prefix}_age": self.mean_age(step)}

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.dim}, dtype={self.queue_keys.dtype}"


def _sync_counters(module: NegativeQueue, incompatible_keys) -> None:
    """After load_state_dict: the host mirrors follow the loaded buffers (one read, at load time)."""
    module._fill, module._ptr = int(module.queue_fill), int(module.queue_ptr)
