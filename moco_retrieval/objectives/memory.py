"""Key memories: FIFO queues of past keys, what the queue objectives contrast against.

A ``NegativeQueue`` is a ring buffer of keys (after MoCo's queue, He et al. 2020, and lightly's
``MemoryBankModule``), with two differences that matter for retrieval:

* every slot carries its key's document id and group, so false negatives are masked (the query's own
  positive sits in a 65,536-key queue about twice per epoch on a 36k-document set);
* slots never written are not negatives (no random initial vectors), any batch size works (writes
  wrap around), and ``max_age`` bounds the negatives to the keys of the newest N optimizer steps:
  queued keys come from past key encoders, and once they are older than the EMA's time constant
  1/(1-m) the current embeddings can lower their logits by drifting together away from them, so the
  space narrows into a cone. A bound in steps means the same at every global batch.

A ``KeyMemory`` is one queue plus what travels slot for slot with it: a fixed guide's embeddings of
the same texts (guided.py) and, with ``queue_refresh``, the texts themselves (refresh.py). A forward
pass hands it the batch's keys (``hold``) and it writes them in ``commit``, after backward: the
memory logits' backward needs the memory as it was. Every write is all-gathered in rank order first,
so every rank holds the same memory (state DDP does not synchronise: fingerprinted in checkpoints).
With ``queue_per_source`` and several training sources a ``PerSourceMemory`` keeps one memory per
source; a batch (every rank's rows of one source) reads and writes only its own source's.

Everything lives in persistent buffers (checkpointed); the fill, write pointer and window are
mirrored in Python ints, so reading them never waits for the device.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from moco_retrieval.config import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, ConfigError, Dtype, choices, setting
from moco_retrieval.distributed import all_gather_no_grad
from moco_retrieval.objectives.refresh import QueueRefresh

SLOT_METADATA_BYTES = 3 * 8  # id, group and step of each slot (int64)
KeySource = choices("KeySource", "momentum online")


@dataclass
class QueueOptions:
    """Option group: a FIFO queue of past keys and the batch's other keys."""

    queue_size: int = setting(65536, AT_LEAST_ONE)  # keys the queue holds (per queue; the oldest is overwritten)
    queue_dtype: Dtype = Dtype.float32  # storage of the keys (bfloat16 halves them); logits stay fp32
    batch_negatives: bool = True  # the other documents of the current batch are negatives too


@dataclass
class MomentumOptions:
    """Option group: who makes the keys that fill the queues (an EMA key encoder, or the trained
    encoder's own pass), their age bound and refresh."""

    # momentum: an EMA copy of the encoder embeds the keys (MoCo); online: the trained encoder's own
    # embeddings, detached, with no second encoder pass and no EMA copy (XBM, ContAccum)
    keys: KeySource = KeySource.momentum
    momentum: float = setting(0.999, FRACTION)  # EMA of the key encoder, per optimizer step (keys=momentum)
    # only keys written in the newest this-many optimizer steps are negatives (null: every queued
    # key); bounds the queue's span against the EMA's time constant 1/(1-momentum)
    queue_max_age: Optional[int] = setting(None, AT_LEAST_ONE)
    key_encoder_dropout: bool = False  # False: the EMA key encoder stays in eval mode (no dropout)
    # queued keys (of each queue) re-encoded per step by the encoder that makes the keys, replacing their
    # stale versions: the negative cache's refresh (objectives/refresh.py); 0: off
    queue_refresh: int = setting(0, NON_NEGATIVE)
    # several training sources (data.sources): one queue (two_queue: one pair) per source, each batch
    # scored against and enqueued into its own source's; one source: no change
    queue_per_source: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keys == KeySource.online and self.key_encoder_dropout:
            raise ConfigError("objective.key_encoder_dropout=true with objective.keys=online: there is no key encoder; "
                              "the online keys are the trained pass's, with its dropout")
        if self.queue_per_source and self.queue_refresh:
            raise ConfigError(
                f"objective.queue_per_source=true with objective.queue_refresh={self.queue_refresh}: the refresh of "
                "per-source queues is not supported; set objective.queue_refresh=0 or objective.queue_per_source=false")


def check_queues_fit(queues: list[tuple[int, int, Dtype]], available: int | None = None) -> None:
    """ConfigError naming objective.queue_size when an objective's queues (``(size, dim, dtype)``
    each) cannot fit in the memory ``available`` (default: this machine's) together: checked before
    any is allocated (an allocation that large fails with a traceback, or not at all until the
    machine swaps)."""
    need = sum(size * (dim * getattr(torch, dtype).itemsize + SLOT_METADATA_BYTES) for size, dim, dtype in queues)
    available = available_memory() if available is None else available
    if available is not None and need > available:
        parts = " + ".join(f"{size:,} x ({dim} x {getattr(torch, dtype).itemsize} bytes of {dtype} + "
                           f"{SLOT_METADATA_BYTES} bytes of id, group and step)" for size, dim, dtype in queues)
        raise ConfigError(
            f"objective.queue_size={queues[0][0]:,}: the objective's {'queue needs' if len(queues) == 1 else 'queues need'} "
            f"{need:,} bytes ({_human(need)}: {parts}), more than the {_human(available)} of memory available; "
            "lower objective.queue_size (objective.queue_dtype=bfloat16 halves the keys)")


def _human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "bytes" else f"{int(n)} bytes"
        n /= 1000
    return f"{n:,.1f} PB"


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


class NegativeQueue(nn.Module):
    """Ring buffer of ``size`` keys of dimension ``dim``, stored as ``dtype``; only those written in the
    newest ``max_age`` optimizer steps are negatives (None: every filled slot). With low-precision
    storage, or a ``view`` of the keys, logits are computed ``logits_chunk`` keys at a time (no K x d
    fp32 copy per step)."""

    def __init__(self, size: int, dim: int, dtype: Dtype = Dtype.float32, max_age: int | None = None,
                 logits_chunk: int = 16384):
        super().__init__()
        self.size, self.dim, self.logits_chunk, self.max_age = size, dim, logits_chunk, max_age
        self.register_buffer("queue_keys", torch.zeros(size, dim, dtype=getattr(torch, dtype)))
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

    def ids(self) -> Tensor:
        return self.window(self.queue_ids)

    def groups(self) -> Tensor:
        return self.window(self.queue_groups)

    def window_slots(self) -> Tensor:
        """The slot of each negative, in the order ``keys()`` returns them."""
        return self.window(torch.arange(self.size, device=self.queue_ids.device))

    def logits(self, q: Tensor, view=None) -> Tensor:
        """fp32 scores ``q @ keys^T`` over the negatives, [B, fill], differentiable in q; ``view``:
        a function of a chunk of fp32 keys applied first (e.g. a Matryoshka prefix)."""
        keys, q = self.keys(), q.float()
        if keys.dtype == torch.float32 and view is None:
            return q @ keys.T
        view = view or (lambda k: k)
        chunks = [q @ view(keys[i : i + self.logits_chunk].float()).T for i in range(0, keys.shape[0], self.logits_chunk)]
        return torch.cat(chunks, dim=1) if chunks else q.new_zeros(q.shape[0], 0)

    def mean_age(self, step: int) -> float:
        """Mean age, in optimizer steps, of the negatives' keys (an integer sum: no K-sized float copy)."""
        return step - int(self.window(self.queue_steps).sum()) / self.fill if self.fill else 0.0

    @torch.no_grad()
    def enqueue(self, keys: Tensor, ids: Tensor, groups: Tensor, step: int, gather: bool = True) -> Tensor:
        """Write a batch of keys over the oldest slots, every rank's in rank order with ``gather``;
        returns the slots written, one per kept key (a batch larger than the queue keeps its last ``size``)."""
        if gather:
            keys, ids, groups = all_gather_no_grad(keys.detach()), all_gather_no_grad(ids), all_gather_no_grad(groups)
        n = keys.shape[0]
        if n > self.size:
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
        """Replace the keys in ``slots`` (refresh.py); their ids, groups and steps stay."""
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
        for b in (self.queue_ids, self.queue_groups, self.queue_steps):
            b.fill_(-1)

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


@dataclass
class Enqueue:
    """Keys a forward pass holds back for a memory: rows, their documents' ids and groups, the step
    that made them; ``gathered``: all-gathered already (forward needed them as batch negatives);
    ``guide_keys``: a fixed guide's embeddings of the same rows; ``tokens``: the rows' texts as
    collated sides, for a memory that refreshes."""

    keys: Tensor
    ids: Tensor
    groups: Tensor
    step: int
    gathered: bool = False
    guide_keys: Tensor | None = None
    tokens: list[dict] = field(default_factory=list)


def batch_enqueue(batch: dict, step: int, side: str, keys: Tensor, gathered=None, guide_keys: Tensor | None = None,
                  gathered_guide: Tensor | None = None) -> Enqueue:
    """The batch's keys of one ``side`` ("doc" or "query"), labelled by the batch's positives: the
    all-gathered ``Keys`` (with the fixed guide's ``gathered_guide``) when forward gathered them,
    else this rank's ``keys`` (with ``guide_keys``)."""
    tokens = [batch[side]] if side in batch else []
    if gathered is not None:
        return Enqueue(*gathered, step, gathered=True, guide_keys=gathered_guide, tokens=tokens)
    return Enqueue(keys, batch["doc_id"], batch["group"], step, guide_keys=guide_keys, tokens=tokens)


class KeyMemory(nn.Module):
    """A queue of ``size`` keys of ``dim`` (see the module docstring). ``kind``: "doc" or "query", what
    its keys embed; ``prefix``: its logged stats' prefix; ``guide_dim``: keep a fixed guide's
    embeddings too; ``refresh`` N > 0: keep the texts (``width`` tokens each) and re-encode N a step."""

    def __init__(self, size: int, dim: int, dtype: Dtype = Dtype.float32, max_age: int | None = None, *,
                 kind: str = "doc", prefix: str = "queue", guide_dim: int | None = None, refresh: int = 0,
                 width: int | None = None):
        super().__init__()
        self.kind, self.prefix = kind, prefix
        self.queue = NegativeQueue(size, dim, dtype, max_age)
        self.guide = NegativeQueue(size, guide_dim, dtype, max_age) if guide_dim is not None else None
        self.refresh = QueueRefresh(self.queue, refresh, width, kind) if refresh else None
        self._pending: Enqueue | None = None

    @classmethod
    def of(cls, cfg, dim: int, *, kind: str = "doc", prefix: str = "queue", guide_dim: int | None = None,
           max_len: dict | None = None) -> "KeyMemory":
        """The memory an objective config with the queue options describes (and the momentum options,
        ``queue_max_age`` and ``queue_refresh``, where it has them)."""
        refresh = getattr(cfg, "queue_refresh", 0)
        return cls(cfg.queue_size, dim, cfg.queue_dtype, getattr(cfg, "queue_max_age", None), kind=kind,
                   prefix=prefix, guide_dim=guide_dim, refresh=refresh, width=max_len[kind] if refresh else None)

    def for_source(self, source: int | None) -> "KeyMemory":
        """The memory a batch of ``source`` reads and writes: this one (``PerSourceMemory`` picks)."""
        return self

    def source_of(self, batch: dict) -> None:
        return None

    # ---- what the directions read
    @property
    def fill(self) -> int:
        return self.queue.fill

    def keys(self) -> Tensor:
        return self.queue.keys()

    def ids(self) -> Tensor:
        return self.queue.ids()

    def groups(self) -> Tensor:
        return self.queue.groups()

    def logits(self, anchors: Tensor, view=None) -> Tensor:
        return self.queue.logits(anchors, view)

    def guide_keys(self) -> Tensor:
        return self.guide.keys()

    # ---- writes
    @property
    def pending(self) -> Enqueue | None:
        return self._pending

    def refresh_keys(self, embed, encoder: str) -> None:
        """Refreshing: re-encode this step's draw of queued texts with ``encoder`` (the one that makes
        the keys) and write the new keys, before any logits (refresh.py)."""
        if self.refresh is not None:
            side = self.refresh.inputs(embed.step)
            if side is not None:
                self.refresh.write(embed.tokens(side, self.kind, encoder), embed.step)

    def hold(self, enqueue: Enqueue | None) -> None:
        """Keep ``enqueue`` for ``commit`` (a later forward's replaces it; None: nothing to write)."""
        self._pending = enqueue

    @torch.no_grad()
    def commit(self) -> None:
        """Write the held keys (with the guide's embeddings and the texts), all-gathered unless
        forward gathered them already."""
        p, self._pending = self._pending, None
        if p is None:
            return
        slots = self.queue.enqueue(p.keys, p.ids, p.groups, p.step, gather=not p.gathered)
        if self.guide is not None:
            self.guide.enqueue(p.guide_keys, p.ids, p.groups, p.step, gather=not p.gathered)
        if self.refresh is not None:
            self.refresh.store(slots, p.tokens, p.step)

    @torch.no_grad()
    def reset(self) -> None:
        """Empty it: no slot is a negative until written again."""
        self.queue.reset()
        if self.guide is not None:
            self.guide.reset()

    def stats(self, step: int) -> dict[str, float]:
        """``{prefix}_fill``, ``{prefix}_age`` and, refreshing, ``{prefix}_key_age``."""
        out = self.queue.stats(step, self.prefix)
        if self.refresh is not None:
            out.update(self.refresh.stats(step, self.prefix))
        return out


class PerSourceMemory(nn.Module):
    """One ``KeyMemory`` per training source (``objective.queue_per_source``); state-dict keys
    ``<name>.sources.<S>.queue...``, logged stats ``{prefix}_fill_source_<S>`` (and ``_age``)."""

    def __init__(self, memories: list[KeyMemory]):
        super().__init__()
        self.sources = nn.ModuleList(memories)

    def source_of(self, batch: dict) -> int:
        """The step's one source: every row of every rank's batch must come from it (the writes are
        all-gathered, so every rank must write the same source's memory); one all-gather."""
        if "source" not in batch:
            raise ValueError("objective.queue_per_source: the batch has no 'source' entry (a run on several "
                             "data.sources collates one)")
        source = batch["source"]
        ends = all_gather_no_grad(torch.stack([source.min(), source.max()]).long()).tolist()
        if len(set(ends)) != 1:
            raise RuntimeError(f"objective.queue_per_source needs every rank's batch of a step from one source; "
                               f"the ranks' (min, max) sources are {list(zip(ends[::2], ends[1::2]))}")
        if not 0 <= ends[0] < len(self.sources):
            raise ValueError(f"a batch of source {ends[0]}, but the objective was built for {len(self.sources)} source(s)")
        return ends[0]

    def for_source(self, source: int | None) -> KeyMemory:
        return self.sources[source]

    def stats(self, step: int) -> dict[str, float]:
        return {f"{k}_source_{s}": v for s, memory in enumerate(self.sources) for k, v in memory.stats(step).items()}


def build_with_memories(cls, cfg, encoder, guide_dim: int | None, sources: int = 1):
    """``cls(cfg, dim, guide_dim, max_len, sources)``: an objective whose memories hold ``encoder``'s
    keys; ``max_len``, the encoder's tokens per kind, is the width of a refreshing memory's texts."""
    max_len = {kind: encoder.max_len(kind) for kind in ("query", "doc")} if cfg.queue_refresh else None
    return cls(cfg, encoder.dim, guide_dim, max_len, sources)


def side_memories(cfg, dim: int, sources: int, sides: tuple[str, ...], guide_dim: int | None = None,
                  max_len: dict | None = None) -> list["KeyMemory | PerSourceMemory"]:
    """One memory per side ("doc" -> stats prefix "queue", "query" -> "query_queue"), or one per source
    and side with ``queue_per_source``; their queues checked to fit in memory together first."""
    n = sources if getattr(cfg, "queue_per_source", False) else 1
    per_memory = [(cfg.queue_size, d, cfg.queue_dtype) for d in (dim, guide_dim) if d is not None]
    check_queues_fit(per_memory * (len(sides) * n))
    out = []
    for kind in sides:
        make = lambda: KeyMemory.of(cfg, dim, kind=kind, prefix="queue" if kind == "doc" else "query_queue",  # noqa: E731
                                    guide_dim=guide_dim, max_len=max_len)
        out.append(make() if n == 1 else PerSourceMemory([make() for _ in range(n)]))
    return out


__all__ = ["KeySource", "QueueOptions", "MomentumOptions", "NegativeQueue", "Enqueue", "batch_enqueue", "KeyMemory",
           "PerSourceMemory", "side_memories", "build_with_memories", "check_queues_fit"]
