"""The training batch sampler: seeded, rank-sharded, duplicate-free within a global batch, resumable
mid-epoch (see :class:`RetrievalBatchSampler`), and the DataLoader that reports its position to
Lightning (:class:`ResumableDataLoader`).
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .ids import NO_GROUP


def dist_rank_world() -> tuple[int, int]:
    """``(rank, world size)`` of the torch.distributed process group, ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


_ROWS_CHUNK = 1 << 16  # rows whose ids and groups the duplicate-free plan holds as Python ints at once


class RetrievalBatchSampler(Sampler[list[int]]):
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
            d_rank, d_world = dist_rank_world()
            rank = d_rank if rank is None else rank
            world_size = d_world if world_size is None else world_size
        elif rank is None:
            rank, world_size = dist_rank_world()
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
        for batch in self.epoch_batches(epoch)[start:]:
            yield batch.tolist()

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


class _EpochSetter:
    def __init__(self, owner: RetrievalBatchSampler):
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


__all__ = ["RetrievalBatchSampler", "ResumableDataLoader", "dist_rank_world"]
