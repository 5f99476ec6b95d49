"""A key memory: a queue of past keys (queue.py) with what travels slot for slot with it.

* the queue: keys with their documents' ids, groups and enqueue steps, and its age window;
* optionally a fixed guide's embeddings of the same texts (guided.py), so the guide can score the
  queued candidates without re-encoding them;
* optionally the texts themselves, as tokens, and a few re-encodings per step (refresh.py);
* the keys a forward pass holds back (an ``Enqueue``) until ``commit()``, called after the
  backward pass (the memory's logits' backward needs the memory as it was).

MoCo owns one (documents), the two-queue objective two (documents, queries), ICoL one per phase
(emptied when the phase turns), the feature memory one (backbone features, re-projected every
step). With ``objective.queue_per_source`` and several training sources, MoCo and the two-queue
objective hold a ``PerSourceMemory`` in place of each: one memory per source, of which a batch (every
rank's rows come from one source: the multi-source sampler draws one per global batch) reads and
writes only its own source's, so its negatives are texts of its own kind. Everything it remembers is in buffers (checkpointed), identical on every rank because every
write is all-gathered in rank order first: state DDP does not synchronise.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from moco_retrieval.distributed import all_gather_no_grad
from moco_retrieval.objectives.queue import NegativeQueue, check_queues_fit
from moco_retrieval.objectives.refresh import QueueRefresh
from moco_retrieval.objectives.step import MOMENTUM, Enqueue, StepInput, View

# the view (a StepInput field) that carries a refreshing memory's re-encoded keys, by kind
FRESH_VIEW = {"doc": "k_fresh", "query": "q_key_fresh"}


class KeyMemory(nn.Module):
    """``size`` keys of ``dim`` (storage ``dtype``; only those of the newest ``max_age`` steps are
    negatives). ``kind``: "doc" or "query", what its keys embed; ``prefix``: its logged stats' prefix.
    ``guide_dim``: keep a fixed guide's embeddings too. ``refresh`` N > 0: keep the texts
    (``width`` tokens each) and re-encode N negatives a step with the EMA key encoder."""

    def __init__(self, size: int, dim: int, dtype: str = "float32", max_age: int | None = None, *,
                 kind: str = "doc", prefix: str = "queue", guide_dim: int | None = None, refresh: int = 0,
                 width: int | None = None):
        super().__init__()
        self.kind, self.prefix = kind, prefix
        self.queue = NegativeQueue(size, dim, dtype, max_age=max_age)
        self.guide = NegativeQueue(size, guide_dim, dtype, max_age=max_age) if guide_dim is not None else None
        self.refresh = None
        if refresh:
            if width is None:
                raise ValueError("objective.queue_refresh needs the encoder's max_len per kind (texts are stored as tokens)")
            self.refresh = QueueRefresh(self.queue, refresh, width, kind)
        self._pending: Enqueue | None = None

    @classmethod
    def of(cls, cfg, dim: int, *, kind: str = "doc", prefix: str = "queue", guide_dim: int | None = None,
           max_len: dict | None = None) -> "KeyMemory":
        """The memory ``cfg`` (an objective config with the queue options) describes; the momentum
        options (``queue_max_age``, ``queue_refresh``) where the config has them."""
        if cfg.queue_size <= 0:
            raise ValueError(
                f"objective.queue_size must be > 0 under objective={cfg.name} (got {cfg.queue_size}); "
                "use objective=inbatch to train without a queue"
            )
        refresh = getattr(cfg, "queue_refresh", 0)
        return cls(cfg.queue_size, dim, cfg.queue_dtype, getattr(cfg, "queue_max_age", None), kind=kind,
                   prefix=prefix, guide_dim=guide_dim, refresh=refresh,
                   width=max_len[kind] if refresh and max_len is not None else None)

    def for_batch(self, batch: StepInput) -> "KeyMemory":
        """The memory ``batch`` reads and writes: this one (``PerSourceMemory`` picks by source)."""
        return self

    def source_of(self, batch: StepInput) -> None:
        """The batch's source as the memory sees it: none (one memory for every source)."""
        return None

    def for_source(self, source: int | None) -> "KeyMemory":
        return self

    # ---- what the objective's directions read
    @property
    def fill(self) -> int:
        return self.queue.fill

    def keys(self) -> Tensor:
        return self.queue.keys()

    def ids(self) -> Tensor:
        return self.queue.ids()

    def groups(self) -> Tensor:
        return self.queue.groups()

    def logits(self, anchors: Tensor, transform=None) -> Tensor:
        """fp32 ``anchors @ keys^T`` over the negatives (``transform``: applied to the keys first,
        a chunk at a time, e.g. a Matryoshka prefix)."""
        return self.queue.logits(anchors, transform)

    def guide_keys(self) -> Tensor:
        return self.guide.keys()

    # ---- refresh: the module embeds the drawn texts (a view), the forward writes them first
    @property
    def views(self) -> dict[str, View]:
        if self.refresh is None:
            return {}
        return {FRESH_VIEW[self.kind]: View(f"stored_{self.kind}", MOMENTUM, grad=False)}

    def stored_inputs(self, step: int) -> dict | None:
        return self.refresh.inputs(step)

    def write_fresh(self, batch: StepInput) -> None:
        """Write this step's re-encoded keys (before any logits), when some were drawn."""
        if self.refresh is not None:
            fresh = getattr(batch, FRESH_VIEW[self.kind])
            if fresh is not None:
                self.refresh.write(fresh, batch.step)

    # ---- writes
    @property
    def pending(self) -> Enqueue | None:
        return self._pending

    def hold(self, enqueue: Enqueue | None) -> None:
        """Keep ``enqueue`` for ``commit`` (a later forward's replaces it; None: nothing to write)."""
        self._pending = enqueue

    @torch.no_grad()
    def commit(self) -> None:
        """Write the held keys (and the guide's embeddings, and the texts), all-gathered unless
        forward gathered them already."""
        p, self._pending = self._pending, None
        if p is None:
            return
        slots = self.queue.enqueue(p.keys, p.ids, p.groups, p.step, gather=not p.gathered)
        if self.guide is not None:
            self.guide.enqueue(p.guide_keys, p.ids, p.groups, p.step, gather=not p.gathered)
        if self.refresh is not None:
            if not p.tokens:
                raise ValueError(f"the {self.prefix} refreshes its keys and needs their texts: StepInput.tokens "
                                 f"has no {self.kind!r} side")
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
    """One ``KeyMemory`` per training source (``objective.queue_per_source``): ``for_batch`` is the
    memory of the batch's source, the only one its forward scores against and holds keys for. State-dict
    keys ``<name>.sources.<S>.queue...``; logged stats ``{prefix}_fill_source_<S>`` (and ``_age``)."""

    def __init__(self, memories: list[KeyMemory]):
        super().__init__()
        self.sources = nn.ModuleList(memories)

    def for_batch(self, batch: StepInput) -> KeyMemory:
        return self.for_source(self.source_of(batch))

    def source_of(self, batch: StepInput) -> int:
        """The step's one source (checked across ranks: one all-gather; an objective with two sides
        asks once and hands the answer to both with ``for_source``)."""
        return batch_source(batch, len(self.sources))

    def for_source(self, source: int | None) -> KeyMemory:
        return self.sources[source]

    def stats(self, step: int) -> dict[str, float]:
        return {f"{k}_source_{s}": v for s, memory in enumerate(self.sources) for k, v in memory.stats(step).items()}


def batch_source(batch: StepInput, sources: int) -> int:
    """The one source of ``batch``: every row of every rank's batch must come from it (per-source
    memories all-gather their writes, so all ranks must write the same source's memory)."""
    if batch.source is None:
        raise ValueError("objective.queue_per_source: the batch has no 'source' entry (a run on several "
                         "data.sources collates one)")
    ends = all_gather_no_grad(torch.stack([batch.source.min(), batch.source.max()]).long()).tolist()
    if len(set(ends)) != 1:
        raise RuntimeError(f"objective.queue_per_source needs every rank's batch of a step from one source; "
                           f"the ranks' (min, max) sources are {list(zip(ends[::2], ends[1::2]))}")
    if not 0 <= ends[0] < sources:
        raise ValueError(f"a batch of source {ends[0]}, but the objective was built for {sources} source(s)")
    return ends[0]


def memory_queues(cfg, dim: int, guide_dim: int | None = None) -> list[tuple[int, int, str]]:
    """``(size, dim, dtype)`` of each queue one memory of ``cfg`` allocates (keys, and a guide's)."""
    return [(cfg.queue_size, d, cfg.queue_dtype) for d in (dim, guide_dim) if d is not None]


def memories_per_side(cfg, sources: int) -> int:
    """How many memories an objective keeps per side: one per source with ``queue_per_source`` (one
    source: one, the same memory and checkpoint as without it)."""
    return sources if getattr(cfg, "queue_per_source", False) else 1


def side_memory(cfg, dim: int, sources: int, **kwargs) -> "KeyMemory | PerSourceMemory":
    """One side's memory (``KeyMemory.of``'s arguments), or one per source (see ``memories_per_side``)."""
    n = memories_per_side(cfg, sources)
    if n == 1:
        return KeyMemory.of(cfg, dim, **kwargs)
    if getattr(cfg, "queue_refresh", 0):
        raise ValueError("objective.queue_refresh does not refresh per-source queues: set objective.queue_refresh=0 "
                         "or objective.queue_per_source=false")
    return PerSourceMemory([KeyMemory.of(cfg, dim, **kwargs) for _ in range(n)])


def check_memories_fit(cfg, dim: int, guide_dim: int | None, sides: int, sources: int) -> None:
    """All the queues of ``sides`` memories (each per source when asked) fit in memory together:
    checked before any is allocated."""
    check_queues_fit(memory_queues(cfg, dim, guide_dim) * (sides * memories_per_side(cfg, sources)))


def batch_enqueue(batch: StepInput, side: str, keys: Tensor, gathered=None, guide_keys: Tensor | None = None,
                  gathered_guide: Tensor | None = None) -> Enqueue:
    """The batch's keys of one ``side`` ("doc" or "query") for a memory: the all-gathered ones
    (``gathered``: Keys, with the fixed guide's ``gathered_guide``) when forward gathered them as batch
    negatives, else this rank's ``keys`` (with ``guide_keys``), labelled by the batch's positives."""
    tokens = [batch.tokens[side]] if side in batch.tokens else []
    if gathered is not None:
        return Enqueue(*gathered, batch.step, gathered=True, guide_keys=gathered_guide, tokens=tokens)
    return Enqueue(keys, batch.doc_id, batch.group, batch.step, guide_keys=guide_keys, tokens=tokens)


__all__ = ["KeyMemory", "PerSourceMemory", "batch_enqueue", "batch_source", "check_memories_fit", "side_memory",
           "FRESH_VIEW"]
