"""The training batch samplers: seeded, rank-sharded, duplicate-free within a global batch, resumable
mid-epoch (see :class:`RetrievalBatchSampler`); several sources, each batch from one of them
(:class:`MultiSourceBatchSampler`, built from one :class:`RetrievalBatchSampler` per source); and the
DataLoader that reports its position to Lightning (:class:`ResumableDataLoader`).
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import numpy as np
from torch.utils.data import DataLoader, Sampler

from moco_retrieval.config import SourceMode
from moco_retrieval.distributed import rank_and_world

from moco_retrieval.data.ids import NO_GROUP


_ROWS_CHUNK = 1 << 16  # rows whose ids and groups the duplicate-free plan holds as Python ints at once


class Draw(list):
    """One batch's rows as the samplers yield them, with the epoch and the step of the epoch it is
    drawn at: what a dataset needs to make the batch's items as a function of the draw
    (documents.DocumentViews), resumed or not. (A list subclass pickles with its attributes, so
    DataLoader workers receive them.)"""

    def __init__(self, rows: Sequence[int], epoch: int, step: int):
        super().__init__(rows)
        self.epoch, self.step = int(epoch), int(step)


class EpochPosition:
    """A batch sampler's resumable position: the epoch and the batches of it already trained.
    ``state_dict()`` is ``{"epoch", "batches_done"}``; ``set_epoch(e)`` with a new epoch restarts
    at batch 0. Both samplers below keep it; their batches are a function of (seed, epoch) alone,
    so the position is all a resume needs."""

    epoch: int = 0
    batches_done: int = 0

    def set_epoch(self, epoch: int) -> None:
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch, self.batches_done = epoch, 0

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more batches of the current epoch as trained (hand-written loops)."""
        self.batches_done += int(n)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state.get("epoch", 0))
        self.batches_done = int(state.get("batches_done", 0))
        if self.batches_done < 0:
            raise ValueError(f"batches_done must be >= 0, got {self.batches_done}")


class RetrievalBatchSampler(EpochPosition, Sampler[list[int]]):
    """Seeded, rank-sharded, duplicate-free, resumable batch sampler.

    Each epoch: a permutation of the rows from ``(seed, epoch)`` (identity when ``shuffle`` is
    False) is cut into *global* batches of ``batch_size * world_size`` rows; rank ``r`` takes the
    ``r``-th slice of ``batch_size`` of each, so shards are disjoint and every rank gets the same
    number of batches. The incomplete last global batch is dropped (so is the tail of deferred
    rows, below): all ranks step together and every batch is full.

    With ``unique_in_batch`` no doc id and no group (other than -1) appears twice in a global
    batch: a conflicting row is deferred, in order, and placed first into the next batch that
    can take it. Deterministic. With it the epoch's length may differ from
    ``len(rows) // (batch_size * world_size)`` by a batch or so, and from epoch to epoch.

    ``len()`` is this rank's number of batches in the current epoch (the full epoch, also after a
    resume); iteration yields the batches from ``batches_done`` on. ``state_dict()`` is
    ``{"epoch", "batches_done"}``; ``set_epoch(e)`` with a new epoch restarts at batch 0.
    """

    def __init__(
        self,
        doc_ids: Sequence[int],
        groups: Sequence[int],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        unique_in_batch: bool = True,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        if len(doc_ids) != len(groups):
            raise ValueError("doc_ids and groups differ in length")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if (rank is None) != (world_size is None):
            d_rank, d_world = rank_and_world()
            rank = d_rank if rank is None else rank
            world_size = d_world if world_size is None else world_size
        elif rank is None:
            rank, world_size = rank_and_world()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        # numbers, not Python objects: a memory-mapped store's arrays stay mapped, and nothing here is
        # copied into DataLoader workers page by page as their garbage collector touches it
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.groups = np.asarray(groups, dtype=np.int64)
        self.batch_size = int(batch_size)
        self.seed, self.shuffle, self.unique_in_batch = int(seed), bool(shuffle), bool(unique_in_batch)
        self.rank, self.world_size = int(rank), int(world_size)
        self.epoch = 0
        self.batches_done = 0
        self._cache: Optional[tuple[int, list[np.ndarray]]] = None
        # Lightning calls set_epoch on ``dataloader.sampler`` and ``dataloader.batch_sampler.sampler``,
        # not on the batch sampler itself: this attribute routes it here.
        self.sampler = _EpochSetter(self)

    # -- epoch plan
    def order(self, epoch: int) -> np.ndarray:
        n = len(self.doc_ids)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(n)

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """All ranks' batches of ``epoch`` (each ``batch_size * world_size`` rows; views into one array)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        gb = self.batch_size * self.world_size
        order = self.order(epoch)
        if not self.unique_in_batch:
            plan = order[: len(order) // gb * gb].reshape(-1, gb)
        else:
            plan = self._unique_batches(order, gb)
        batches = list(plan)
        self._cache = (epoch, batches)
        return batches

    def _rows(self, order: np.ndarray) -> Iterator[tuple[int, int, int]]:
        """``(row, doc id, group)`` in ``order``, read a chunk at a time (no Python int per row of the
        whole set at once: at 10M rows that would be about 1 GB in every rank)."""
        for s in range(0, len(order), _ROWS_CHUNK):
            idx = order[s : s + _ROWS_CHUNK]
            yield from zip(idx.tolist(), self.doc_ids[idx].tolist(), self.groups[idx].tolist())

    def _unique_batches(self, order: np.ndarray, gb: int) -> np.ndarray:
        plan = np.empty((len(order) // gb, gb), dtype=np.int64)
        done = 0
        pending: list[tuple[int, int, int]] = []
        stream = self._rows(order)
        while True:
            batch: list[int] = []
            used_ids: set[int] = set()
            used_groups: set[int] = set()

            def fits(row: tuple[int, int, int]) -> bool:
                return row[1] not in used_ids and (row[2] == NO_GROUP or row[2] not in used_groups)

            def add(row: tuple[int, int, int]) -> None:
                batch.append(row[0])
                used_ids.add(row[1])
                if row[2] != NO_GROUP:
                    used_groups.add(row[2])

            still: list[tuple[int, int, int]] = []
            for k, row in enumerate(pending):
                if len(batch) == gb:
                    still.extend(pending[k:])
                    break
                if fits(row):
                    add(row)
                else:
                    still.append(row)
            pending = still
            while len(batch) < gb:
                row = next(stream, None)
                if row is None:
                    break
                if fits(row):
                    add(row)
                else:
                    pending.append(row)
            if len(batch) < gb:
                return plan[:done]  # the stream is exhausted: drop the partial batch and the deferred rows
            plan[done] = batch
            done += 1

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of ``epoch``."""
        b, r = self.batch_size, self.rank
        return [g[r * b : (r + 1) * b] for g in self.global_batches(epoch)]

    # -- Sampler protocol
    def __len__(self) -> int:
        return len(self.global_batches(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        # a generator: epoch and position are read at the first next(), i.e. after set_epoch
        epoch, start = self.epoch, self.batches_done
        for step, batch in enumerate(self.epoch_batches(epoch)[start:], start):
            yield Draw(batch.tolist(), epoch, step)


_PASS_STRIDE = 1 << 32  # a source's pass p of epoch e is its sampler's "epoch" e + p * _PASS_STRIDE
_SCHEDULE_STREAM = 0x5EED5  # keeps the schedule's random stream apart from the sources' ([seed, epoch])


def source_seed(seed: int, source: int) -> int:
    """The seed of source ``source``'s own sampler: independent streams per source."""
    return int(np.random.SeedSequence([int(seed), int(source)]).generate_state(1)[0])


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders, ties to the lower index)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    rest = total - int(counts.sum())
    if rest:
        order = sorted(range(len(w)), key=lambda s: (-(exact[s] - counts[s]), s))
        counts[order[:rest]] += 1
    return counts.tolist()


def check_offsets(source_offsets: Sequence[int], n_rows: int) -> np.ndarray:
    """``source_offsets`` as int64 ``[S + 1]``: from 0 to ``n_rows``, every source non-empty."""
    off = np.asarray(source_offsets, dtype=np.int64)
    if off.ndim != 1 or len(off) < 2 or off[0] != 0 or off[-1] != n_rows:
        raise ValueError(f"source_offsets must run from 0 to the {n_rows} rows ([S + 1] values), got {off.tolist()[:8]}")
    empty = np.flatnonzero(np.diff(off) <= 0)
    if len(empty):
        raise ValueError(f"source {int(empty[0])} has no rows (source_offsets must increase strictly)")
    return off


def source_of(rows: Sequence[int], source_offsets: Sequence[int]) -> np.ndarray:
    """The source index of each row (int64), from the offsets of :func:`check_offsets`."""
    return np.searchsorted(np.asarray(source_offsets), np.asarray(rows, dtype=np.int64), side="right") - 1


def source_schedule(epoch: int, passes: Sequence[int], *, weights: Optional[Sequence[float]], mode: str, seed: int,
                    shuffle: bool) -> list[int]:
    """The source of each global batch of ``epoch``, given each source's batches in one pass: the rule
    of :class:`MultiSourceBatchSampler` (and of streaming, stream_batches.py)."""
    n_sources = len(passes)
    if str(mode) == "round_robin":
        return list(range(n_sources)) * min(passes)
    counts = apportion(sum(passes), weights if weights is not None else passes)
    if shuffle:
        order = np.repeat(np.arange(n_sources), counts)
        return np.random.default_rng([int(seed), int(epoch), _SCHEDULE_STREAM]).permutation(order).tolist()
    # even interleave: the k-th batch of source s at (k + 0.5) / counts[s] of the epoch
    slots = [((k + 0.5) / c, s) for s, c in enumerate(counts) for k in range(c)]
    return [s for _, s in sorted(slots)]


class MultiSourceBatchSampler(EpochPosition, Sampler[list[int]]):
    """Batches from several sources, every global batch from one source (its in-batch negatives are
    of one kind). Source ``s`` is rows ``[source_offsets[s], source_offsets[s + 1])``.

    Each source has its own :class:`RetrievalBatchSampler` (seed :func:`source_seed`), which cuts
    it into duplicate-free global batches and gives rank ``r`` its slice; this sampler only decides
    which source each step draws from (the *schedule*), a function of ``(seed, epoch)``:

    * ``weighted``: an epoch has as many batches as the sources make together (one pass over every
      source when ``weights`` is None, i.e. proportional to size), split among the sources in
      proportion to ``weights`` (largest remainders: exact per epoch); a source given more batches
      than one pass holds continues with a new pass (re-shuffled), one given fewer stops early.
      The order of the sources is a seeded shuffle (``shuffle``), else evenly interleaved.
    * ``round_robin``: the sources in turn (0, 1, ..., S-1, 0, ...) until the smallest has used
      its batches: no batch repeats within an epoch; ``weights`` are not used.

    The position is :class:`RetrievalBatchSampler`'s (``{"epoch", "batches_done"}``): the schedule
    is fixed by ``(seed, epoch)``, so it also says which source comes next (:meth:`batch_sources`).
    """

    def __init__(
        self,
        doc_ids: Sequence[int],
        groups: Sequence[int],
        source_offsets: Sequence[int],
        batch_size: int,
        *,
        weights: Optional[Sequence[float]] = None,
        mode: SourceMode = SourceMode.weighted,
        seed: int = 0,
        shuffle: bool = True,
        unique_in_batch: bool = True,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        names: Optional[Sequence[str]] = None,
    ):
        if len(doc_ids) != len(groups):
            raise ValueError("doc_ids and groups differ in length")
        self.offsets = check_offsets(source_offsets, len(doc_ids))
        n_sources = len(self.offsets) - 1
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            if w.shape != (n_sources,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
                raise ValueError(f"weights must be {n_sources} non-negative numbers, not all 0, got {list(weights)}")
        self.weights = None if weights is None else [float(x) for x in weights]
        self.names = [f"source {s}" for s in range(n_sources)] if names is None else [str(n) for n in names]
        self.mode, self.seed, self.shuffle = str(mode), int(seed), bool(shuffle)
        self.sources = [
            RetrievalBatchSampler(
                doc_ids[a:b], groups[a:b], batch_size, seed=source_seed(seed, s), shuffle=shuffle,
                unique_in_batch=unique_in_batch, rank=rank, world_size=world_size,
            )
            for s, (a, b) in enumerate(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist()))
        ]
        self.batch_size = int(batch_size)
        self.rank, self.world_size = self.sources[0].rank, self.sources[0].world_size
        self.epoch = 0
        self.batches_done = 0
        self._cache: Optional[tuple[int, list[tuple[int, list[int]]]]] = None
        self.sampler = _EpochSetter(self)

    # -- epoch plan
    def schedule(self, epoch: int, passes: Sequence[int]) -> list[int]:
        """The source of each global batch of ``epoch``, given each source's batches in one pass."""
        return source_schedule(epoch, passes, weights=self.weights, mode=self.mode, seed=self.seed, shuffle=self.shuffle)

    def _source_batches(self, s: int, epoch: int, n: int) -> list[np.ndarray]:
        """The first ``n`` global batches of source ``s`` in ``epoch`` (rows of the source: add
        ``offsets[s]``), continuing into new passes when one pass holds fewer. Views into the source
        sampler's plan, no copy: at 10M rows a copy (or Python ints) would be 100s of MB per rank."""
        src = self.sources[s]
        out: list[np.ndarray] = []
        p = 0
        while len(out) < n:
            more = src.global_batches(epoch + p * _PASS_STRIDE)
            if not more:
                raise ValueError(f"{self.names[s]} makes no full batch in pass {p} of epoch {epoch}")
            out.extend(more[: n - len(out)])
            p += 1
        return out

    def global_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """``(source, global batch)`` of every step of ``epoch`` (all ranks' rows, within the source:
        :meth:`epoch_batches` adds the source's offset)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        passes = [len(src.global_batches(epoch)) for src in self.sources]
        short = [s for s, n in enumerate(passes) if n == 0 and (self.mode == "round_robin" or self._weight(s) > 0)]
        if short:
            s = short[0]
            raise ValueError(
                f"{self.names[s]} has {self.offsets[s + 1] - self.offsets[s]} rows: no full batch of "
                f"{self.batch_size} x {self.world_size} rank(s)"
                + (" with distinct doc ids and groups" if self.sources[s].unique_in_batch else "")
            )
        plan_sources = self.schedule(epoch, passes)
        per_source = {s: iter(self._source_batches(s, epoch, plan_sources.count(s))) for s in set(plan_sources)}
        plan = [(s, next(per_source[s])) for s in plan_sources]
        self._cache = (epoch, plan)
        return plan

    def _weight(self, s: int) -> float:
        return 1.0 if self.weights is None else self.weights[s]

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` (rows of the whole set)."""
        return [self._rank_rows(s, g) for s, g in self.global_plan(epoch)]

    def _rank_rows(self, s: int, g: np.ndarray) -> np.ndarray:
        b, r = self.batch_size, self.rank
        return g[r * b : (r + 1) * b] + self.offsets[s]

    def batch_sources(self, epoch: int) -> list[int]:
        """The source of each batch of ``epoch``."""
        return [s for s, _ in self.global_plan(epoch)]

    # -- Sampler protocol (the same position as RetrievalBatchSampler's)
    def __len__(self) -> int:
        return len(self.global_plan(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self.batches_done
        for step, (s, g) in enumerate(self.global_plan(epoch)[start:], start):  # each batch's rows made when it is drawn
            yield Draw(self._rank_rows(s, g).tolist(), epoch, step)


class _EpochSetter:
    def __init__(self, owner: "RetrievalBatchSampler | MultiSourceBatchSampler"):
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)


class ResumableDataLoader(DataLoader):
    """A DataLoader with the sampler's position as its state, so Lightning treats it as resumable."""

    def __init__(self, *args, state_fn: Callable[[], dict], load_fn: Callable[[dict], None], **kwargs):
        super().__init__(*args, **kwargs)
        self._state_fn, self._load_fn = state_fn, load_fn

    def state_dict(self) -> dict:
        return self._state_fn()

    def load_state_dict(self, state: dict) -> None:
        self._load_fn(state)


__all__ = [
    "Draw",
    "MultiSourceBatchSampler",
    "RetrievalBatchSampler",
    "ResumableDataLoader",
    "apportion",
    "check_offsets",
    "source_of",
    "source_schedule",
    "source_seed",
]
