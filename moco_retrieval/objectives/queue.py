"""The MoCo negative queue: a FIFO ring buffer of past keys with their document ids, groups and
the step at which each was enqueued.

After lightly's ``MemoryBankModule`` (a small module of its own) and MoCo's queue (He et al.,
2020), with two differences that matter for retrieval:

* every slot carries the document id and group of its key, so the objective can mask false
  negatives (the query's own positive is in a 65,536-key queue about twice per epoch on a
  36k-document set);
* slots never written are not negatives: only the first ``fill`` slots are used until the ring
  is full (no random initial vectors), and any batch size works (writes wrap around);
* ``max_age`` can bound the queue's span in optimizer steps: only the keys written in the newest
  ``max_age`` steps are negatives. Queued keys come from past key encoders; once they are older
  than the EMA's time constant 1/(1-m), the current embeddings can lower their logits by
  drifting together away from them, and the space narrows into a cone. A bound in steps,
  unlike ``size``, means the same at every global batch: at batch 32, 128 steps are 4,096 keys;
  at 512, the full 65,536.

Everything lives in persistent buffers whose names contain ``queue``, so checkpoints carry and
restore it. The fill, write pointer and window are mirrored in Python ints, so reading them (every
step, for the negatives' slots and the logged stats) never waits for the device. Under DDP keys are
all-gathered from every rank in rank order before they are written, so every rank holds the
identical queue.
"""
from __future__ import annotations

import os
from collections import deque

import torch
from torch import Tensor, nn

from moco_retrieval.distributed import all_gather_no_grad
from moco_retrieval.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SLOT_METADATA_BYTES = 3 * 8  # id, group and step of each slot (int64)


def queue_bytes(size: int, dim: int, dtype: str) -> int:
    """The memory a queue of ``size`` keys of dimension ``dim`` takes (keys and their slots' metadata)."""
    return size * (dim * DTYPES[dtype].itemsize + SLOT_METADATA_BYTES)


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (Linux's MemAvailable; else free pages; None: unknown)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_queue_fits(size: int, dim: int, dtype: str, available: int | None = None) -> None:
    """ConfigError naming objective.queue_size when the queue cannot fit in the memory available
    (checked before allocating it: an allocation that large fails with a traceback, or not at all
    until the machine swaps)."""
    need = queue_bytes(size, dim, dtype)
    available = available_memory() if available is None else available
    if available is not None and need > available:
        raise ConfigError(
            f"objective.queue_size={size:,}: the queue needs {need:,} bytes ({_human(need)}: {size:,} keys x "
            f"({dim} x {DTYPES[dtype].itemsize} bytes of {dtype} + {SLOT_METADATA_BYTES} bytes of id, group and step)), "
            f"more than the {_human(available)} of memory available; lower objective.queue_size "
            "(objective.queue_dtype=bfloat16 halves the keys)")


def check_queues_fit(queues: list[tuple[int, int, str]], available: int | None = None) -> None:
    """``check_queue_fits`` for all of an objective's queues together (``(size, dim, dtype)`` each:
    key queues, guide queues, one set per source), before any is allocated."""
    if len(queues) == 1:
        return check_queue_fits(*queues[0], available)
    need = sum(queue_bytes(*q) for q in queues)
    available = available_memory() if available is None else available
    if available is not None and need > available:
        parts = " + ".join(f"{size:,} x ({dim} x {DTYPES[dtype].itemsize} + {SLOT_METADATA_BYTES}) bytes"
                           for size, dim, dtype in queues)
        raise ConfigError(
            f"objective.queue_size={queues[0][0]:,}: the objective's {len(queues)} queues need {need:,} bytes "
            f"({_human(need)}: {parts}), more than the {_human(available)} of memory available; lower "
            "objective.queue_size (objective.queue_dtype=bfloat16 halves the keys)")


def _human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:,.1f} {unit}" if unit != "bytes" else f"{int(n)} bytes"
        n /= 1000
    return f"{n:.1f} PB"


class NegativeQueue(nn.Module):
    """Ring buffer of ``size`` keys of dimension ``dim``.

    Args:
        size: number of slots K (must be > 0).
        dim: key dimension d.
        dtype: storage dtype of the keys ("float32" default; "bfloat16"/"float16" halve memory at
            scale). Logits are always computed in float32 (see :meth:`logits`).
        logits_chunk: with low-precision storage, keys are cast to float32 this many at a time,
            so no K x d float32 copy is made per step.
        max_age: only keys written in the newest ``max_age`` optimizer steps are negatives (None:
            every filled slot).
    """

    def __init__(self, size: int, dim: int, dtype: str = "float32", logits_chunk: int = 16384,
                 max_age: int | None = None):
        super().__init__()
        if size <= 0:
            raise ValueError(f"objective.queue_size must be > 0 for the queue, got {size}")
        if max_age is not None and max_age <= 0:
            raise ValueError(f"objective.queue_max_age must be > 0 (or null: no bound), got {max_age}")
        if dtype not in DTYPES:
            raise ValueError(f"objective.queue_dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        check_queue_fits(size, dim, dtype)
        self.size, self.dim, self.logits_chunk, self.max_age = size, dim, logits_chunk, max_age
        self.register_buffer("queue_keys", torch.zeros(size, dim, dtype=DTYPES[dtype]))
        self.register_buffer("queue_ids", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("queue_groups", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("queue_steps", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue_fill", torch.zeros((), dtype=torch.long))
        self._fill = self._ptr = 0  # host mirrors of queue_fill / queue_ptr
        self._window = 0  # the negatives: the newest `_window` slots (all filled ones without max_age)
        self._writes: deque[list[int]] = deque()  # [step, keys written] of the steps inside max_age
        self.register_load_state_dict_post_hook(_sync_counters)

    @property
    def fill(self) -> int:
        """The number of negatives: filled slots (within ``max_age`` steps when it is set)."""
        return self._window

    def window(self, buffer: Tensor) -> Tensor:
        """The negatives' rows of ``buffer`` (a [size, ...] buffer of this queue)."""
        n, ptr = self._window, self._ptr
        # The filled slots are the prefix [0, fill): the ring is written from slot 0 and wraps only
        # once full. So the whole window is a view; a window bounded by max_age ends at the write
        # pointer and is a copy only when it wraps.
        if n == self._fill:
            return buffer[:n]
        if n <= ptr:
            return buffer[ptr - n : ptr]
        return torch.cat([buffer[self.size - (n - ptr) :], buffer[:ptr]])

    def keys(self) -> Tensor:
        return self.window(self.queue_keys)

    def window_slots(self) -> Tensor:
        """The slot of each negative, in the order ``keys()`` returns them."""
        return self.window(torch.arange(self.size, device=self.queue_ids.device))

    def ids(self) -> Tensor:
        return self.window(self.queue_ids)

    def groups(self) -> Tensor:
        return self.window(self.queue_groups)

    def logits(self, q: Tensor, transform=None) -> Tensor:
        """fp32 scores ``q @ keys^T`` over the negatives, shape [B, fill] (differentiable in q);
        ``transform``: a function of a chunk of fp32 keys applied first (e.g. a Matryoshka prefix)."""
        keys, q = self.keys(), q.float()
        if keys.dtype == torch.float32 and transform is None:
            return q @ keys.T
        transform = transform or (lambda k: k)
        # low-precision storage or a transform: a chunk at a time (no K x d fp32 copy)
        chunks = [q @ transform(keys[i : i + self.logits_chunk].float()).T
                  for i in range(0, keys.shape[0], self.logits_chunk)]
        return torch.cat(chunks, dim=1) if chunks else q.new_zeros(q.shape[0], 0)

    def mean_age(self, step: int) -> float:
        """Mean age, in optimizer steps, of the negatives' keys."""
        if self.fill == 0:
            return 0.0
        # an integer sum: no K-sized float copy of the steps on the per-step path
        return step - int(self.window(self.queue_steps).sum()) / self.fill

    @torch.no_grad()
    def enqueue(self, keys: Tensor, ids: Tensor, groups: Tensor, step: int, gather: bool = True) -> Tensor:
        """Write a batch of keys (oldest slots are overwritten first); returns the slots written,
        one per kept key in order (a batch larger than the queue keeps only its last ``size``).

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
        self._count_write(step, n)
        return slots

    @torch.no_grad()
    def overwrite(self, slots: Tensor, keys: Tensor) -> None:
        """Replace the keys in ``slots`` (re-encoded documents: refresh.py); their ids, groups and
        enqueue steps, hence the ``max_age`` window, stay as they were."""
        self.queue_keys[slots] = keys.to(self.queue_keys.dtype)

    def _count_write(self, step: int, n: int) -> None:
        """Update the window after ``n`` keys were written at ``step``."""
        if self.max_age is None:
            self._window = self._fill
            return
        if self._writes and self._writes[-1][0] == step:  # several writes in one step (accumulation)
            self._writes[-1][1] += n
        else:
            self._writes.append([step, n])
        while self._writes[0][0] <= step - self.max_age:
            self._writes.popleft()
        self._window = min(self._fill, sum(count for _, count in self._writes))

    @torch.no_grad()
    def reset(self) -> None:
        """Empty the queue: no slot is a negative until written again."""
        self._fill = self._ptr = self._window = 0
        self._writes.clear()
        self.queue_fill.zero_()
        self.queue_ptr.zero_()
        self.queue_ids.fill_(-1)
        self.queue_groups.fill_(-1)
        self.queue_steps.fill_(-1)

    def stats(self, step: int, prefix: str = "queue") -> dict[str, float]:
        """``{prefix}_fill`` (negatives) and ``{prefix}_age`` (their mean age in steps), for logging."""
        return {f"{prefix}_fill": float(self.fill), f"{prefix}_age": self.mean_age(step)}

    def extra_repr(self) -> str:
        age = "" if self.max_age is None else f", max_age={self.max_age}"
        return f"size={self.size}, dim={self.dim}, dtype={self.queue_keys.dtype}{age}"


def _sync_counters(module: NegativeQueue, incompatible_keys) -> None:
    """After load_state_dict: the host mirrors follow the loaded buffers (one read, at load time)."""
    module._fill, module._ptr = int(module.queue_fill), int(module.queue_ptr)
    module._writes.clear()
    module._window = module._fill
    if module.max_age is None or module._fill == 0:
        return
    # the per-step write counts inside the window, from the slots' steps; a step partly
    # overwritten counts fewer keys, which only happens once the window is the whole ring anyway
    steps, counts = torch.unique(module.queue_steps[: module._fill].cpu(), return_counts=True)
    for step, count in zip(steps.tolist(), counts.tolist()):
        module._writes.append([step, count])
    module._count_write(int(steps[-1]), 0)
