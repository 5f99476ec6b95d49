"""The training batch samplers: seeded, rank-sharded, duplicate-free within a global batch, resumable
mid-epoch (see :class:`RetrievalBatchSampler`); several sources, each batch from one of them
(:class:`MultiSourceBatchSampler`, built from one :class:`RetrievalBatchSampler` per source); and the
DataLoader that reports its position to Lightning (:class:`ResumableDataLoader`).

Neither plans a whole epoch: an epoch's order is a keyed permutation computed where it is read
(:class:`KeyedPermutation`), its batches are arranged a block of rows at a time, and the number of
batches in each block is fixed in advance, so the memory and the time to the first batch do not grow
with the rows (a memory-mapped store's ids and groups are read a block at a time) and a resume jumps
straight to the block that holds its batch.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import numpy as np
from torch.utils.data import DataLoader, Sampler

from moco_retrieval.config import SourceMode
from moco_retrieval.distributed import rank_and_world

from moco_retrieval.data.ids import NO_GROUP


_BLOCK_ROWS = 1 << 15  # rows arranged into batches at once (about 4 MB of working memory while a block is planned)
_MIN_BLOCK_BATCHES = 8  # a block holds at least this many global batches: room to move a row that collides
_FEISTEL_ROUNDS = 6
_PERMUTATION_STREAM = 0x5A3B1E  # keeps the epoch permutation's keys apart from other seeded streams


class KeyedPermutation:
    """A pseudo-random permutation of ``[0, n)`` keyed by a seed sequence, computed for any positions
    in O(1) memory: a balanced Feistel network on the smallest even number of bits that holds ``n``
    (``_FEISTEL_ROUNDS`` rounds of a 64-bit mixing function), made a permutation of ``[0, n)`` by
    cycle-walking (a value ``>= n`` is permuted again until it falls inside)."""

    def __init__(self, n: int, key: Sequence[int]):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        bits = max(2, (int(n) - 1).bit_length())
        self.n, self.half = int(n), (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence([int(k) for k in key]).generate_state(_FEISTEL_ROUNDS, dtype=np.uint64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._rounds(np.asarray(positions, dtype=np.uint64))
        outside = np.flatnonzero(out >= self.n)
        while len(outside):
            out[outside] = self._rounds(out[outside])
            outside = outside[out[outside] >= self.n]
        return out.astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps, as it should here)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


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


def arrange(ids: Sequence[int], groups: Sequence[int], k: int, size: int) -> list[list[int]]:
    """``k`` batches of ``size`` of the positions ``0 .. len(ids) - 1`` (at least ``k * size`` of
    them, in the order given), no doc id and no group (other than NO_GROUP) twice in a batch.

    All ``k`` batches are open at once: each position goes to the first batch from the earliest
    open one that has room and no clash (starting after the last batch its doc id or group went to),
    so without clashes the batches are the positions in order. Positions that fit no batch are
    placed at the end: into an open batch, else into a full one in place of a row that moves on to
    an open batch. A position left out of that (its doc id or group already in every batch) is not
    drawn; only then a batch is completed with a position already in another batch (drawn twice).
    Raises ValueError if even that cannot complete it. Deterministic."""
    if k == 0:
        return []
    ids_a, groups_a = np.asarray(ids, dtype=np.int64), np.asarray(groups, dtype=np.int64)
    # a row whose doc id and group are the block's only ones clashes with nothing: it just takes the next place
    shared = (_repeated(ids_a) | (_repeated(groups_a) & (groups_a != NO_GROUP))).tolist()
    ids, groups = ids_a.tolist(), groups_a.tolist()
    batches: list[list[int]] = [[] for _ in range(k)]
    used_ids: list[set] = [set() for _ in range(k)]  # the doc ids and groups of the rows that share them
    used_groups: list[set] = [set() for _ in range(k)]
    after_id: dict[int, int] = {}  # one past the last batch a doc id / group went to
    after_group: dict[int, int] = {}

    def fits(x: int, b: int) -> bool:
        g = groups[x]
        return ids[x] not in used_ids[b] and (g == NO_GROUP or g not in used_groups[b])

    def put(x: int, b: int) -> None:
        batches[b].append(x)
        used_ids[b].add(ids[x])
        if groups[x] != NO_GROUP:
            used_groups[b].add(groups[x])

    first, spill = 0, []
    for x in range(len(ids)):
        if not shared[x]:
            batch = batches[first]
            batch.append(x)
            if len(batch) == size:
                while first < k and len(batches[first]) == size:
                    first += 1
                if first == k:
                    break
            continue
        i, g = ids[x], groups[x]
        b = max(first, after_id.get(i, 0), after_group.get(g, 0) if g != NO_GROUP else 0)
        while b < k and (len(batches[b]) == size or not fits(x, b)):
            b += 1
        if b == k:
            spill.append(x)
            continue
        put(x, b)
        after_id[i] = b + 1
        if g != NO_GROUP:
            after_group[g] = b + 1
        if b == first and len(batches[b]) == size:
            while first < k and len(batches[first]) == size:
                first += 1
            if first == k:
                break
    del after_id, after_group
    open_ = [b for b in range(k) if len(batches[b]) < size]
    if not open_:
        return batches
    rest = []
    for x in spill:  # a full search of the open batches (the loop above started after the last batch of its id)
        b = next((b for b in open_ if len(batches[b]) < size and fits(x, b)), None)
        if b is None:
            rest.append(x)
        else:
            put(x, b)
    open_ = [b for b in open_ if len(batches[b]) < size]
    relocate = _Relocate(batches, used_ids, used_groups, ids, groups, size, open_)
    hopeless: set[tuple[int, int]] = set()  # a doc id / group that no move could fit in
    for x in rest:
        if not relocate.open:
            break
        key = (1, groups[x]) if groups[x] != NO_GROUP else (0, ids[x])
        if key in hopeless or (0, ids[x]) in hopeless:
            continue
        if not relocate(x):
            hopeless.add(key)
        relocate.open = [b for b in relocate.open if len(batches[b]) < size]
    open_ = relocate.open
    for o in open_:  # only rows whose doc id or group is in every batch are left: complete with rows drawn already
        for b in range(k):
            for y in batches[b] if b != o else ():
                if len(batches[o]) == size:
                    break
                if fits(y, o):
                    put(y, o)
        if len(batches[o]) < size:
            raise ValueError(f"no batch of {size} rows with distinct doc ids and groups: too few distinct ones "
                             f"among {len(ids)} rows")
    return batches


class _Relocate:
    """Fits a row into a block's full batches in place of a row that moves on (to an open batch, or
    one step further in the same way), each try counted against a budget: the few rows left at a
    block's end, without a search that grows with the square of the block."""

    def __init__(self, batches, used_ids, used_groups, ids, groups, size, open_):
        self.batches, self.used_ids, self.used_groups = batches, used_ids, used_groups
        self.ids, self.groups, self.size, self.open = ids, groups, size, open_

    def fits(self, x: int, b: int) -> bool:
        g = self.groups[x]
        return self.ids[x] not in self.used_ids[b] and (g == NO_GROUP or g not in self.used_groups[b])

    def _take(self, b: int, x: int, add: bool) -> None:
        ids, groups = (self.used_ids[b], self.used_groups[b])
        if add:
            ids.add(self.ids[x])
            if self.groups[x] != NO_GROUP:
                groups.add(self.groups[x])
        else:
            ids.discard(self.ids[x])
            if self.groups[x] != NO_GROUP:
                groups.discard(self.groups[x])

    def __call__(self, x: int, depth: int = 2, budget: int = 50_000) -> bool:
        self.budget = budget
        return self._place(x, depth, frozenset())

    def _place(self, x: int, depth: int, avoid: frozenset) -> bool:
        for o in self.open:
            if o not in avoid and len(self.batches[o]) < self.size and self.fits(x, o):
                self.batches[o].append(x)
                self._take(o, x, True)
                return True
        if depth == 0:
            return False
        i, g = self.ids[x], self.groups[x]
        for b, batch in enumerate(self.batches):
            if len(batch) < self.size or b in avoid:
                continue
            if self.fits(x, b):
                spots = range(self.size)
            else:  # x clashes with one row only: that row is the one to move
                spots = [t for t, y in enumerate(batch) if self.ids[y] == i or (g != NO_GROUP and self.groups[y] == g)]
                if len(spots) != 1:
                    continue
            for t in spots:
                self.budget -= 1
                if self.budget < 0:
                    return False
                y = batch[t]
                self._take(b, y, False)
                if self.fits(x, b):
                    batch[t] = x
                    self._take(b, x, True)
                    if self._place(y, depth - 1, avoid | {b}):
                        return True
                    self._take(b, x, False)
                    batch[t] = y
                self._take(b, y, True)
        return False


def _repeated(values: np.ndarray) -> np.ndarray:
    """Whether each value occurs more than once."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    return counts[inverse] > 1


def _numbers(values: Sequence[int]) -> np.ndarray:
    """Integer arrays as they are (a memory map stays mapped: only a block's rows are ever read), anything else
    as int64."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values
    return np.asarray(values, dtype=np.int64)


class RetrievalBatchSampler(EpochPosition, Sampler[list[int]]):
    """Seeded, rank-sharded, duplicate-free, resumable batch sampler whose memory and time to the
    first batch do not grow with the rows.

    An epoch is ``len(rows) // (batch_size * world_size)`` *global* batches of ``batch_size *
    world_size`` rows, every epoch the same number; rank ``r`` takes the ``r``-th slice of
    ``batch_size`` of each, so shards are disjoint and every rank steps in step. The rows are taken
    in the order of a keyed permutation of ``(seed, epoch)`` (:class:`KeyedPermutation`; the row order
    itself when ``shuffle`` is False), cut into blocks of ``per_block`` global batches' rows (about
    ``_BLOCK_ROWS``; the last block also takes the rows after the last whole block). Each block is
    arranged into its batches on its own (:func:`arrange`), so batch ``i`` is computed from its block
    alone: a resume jumps to it, and the memory is one block's whatever the set's size. The rows of
    the last block beyond its whole batches (fewer than a global batch) are not drawn this epoch.

    With ``unique_in_batch`` no doc id and no group (other than -1) appears twice in a global
    batch: a clashing row goes to the next batch of its block that can take it, and the few rows
    that no batch of the block can take at its end are fitted in by moving a row of a full batch.
    So every row is drawn at most once an epoch and all are drawn but fewer than a global batch,
    unless a doc id or group is so frequent that some block holds more of its rows than batches
    (more than about one row in ``batch_size * world_size`` of the set): the rows beyond that are
    left out of the epoch and their places taken by rows of the same block drawn a second time (in
    another batch). A block that cannot complete a batch at all (fewer distinct doc ids or groups
    than a batch's rows) is an error.

    ``len()`` is this rank's number of batches in an epoch; iteration yields the batches from
    ``batches_done`` on. ``state_dict()`` is ``{"epoch", "batches_done"}``; ``set_epoch(e)`` with a
    new epoch restarts at batch 0.
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
        # numbers, not Python objects, and not copied: a memory-mapped store's arrays stay mapped (each
        # block reads its rows), and nothing is copied into DataLoader workers page by page
        self.doc_ids, self.groups = _numbers(doc_ids), _numbers(groups)
        self.batch_size = int(batch_size)
        self.seed, self.shuffle, self.unique_in_batch = int(seed), bool(shuffle), bool(unique_in_batch)
        self.rank, self.world_size = int(rank), int(world_size)
        self.global_size = self.batch_size * self.world_size
        self.n_rows = len(self.doc_ids)
        self.per_block = max(_MIN_BLOCK_BATCHES, _BLOCK_ROWS // self.global_size)
        self.n_blocks = max(1, self.n_rows // (self.per_block * self.global_size))
        self.epoch = 0
        self.batches_done = 0
        self._block: Optional[tuple[int, int, np.ndarray]] = None  # (epoch, block, its global batches)
        # Lightning calls set_epoch on ``dataloader.sampler`` and ``dataloader.batch_sampler.sampler``,
        # not on the batch sampler itself: this attribute routes it here.
        self.sampler = _EpochSetter(self)

    # -- the epoch, a block at a time
    def batch_count(self) -> int:
        """Global batches in an epoch (every epoch)."""
        return self.n_rows // self.global_size

    def block_rows(self, epoch: int, block: int) -> np.ndarray:
        """The rows of ``block`` in ``epoch``, in the epoch's order."""
        rows_per = self.per_block * self.global_size
        start = block * rows_per
        end = self.n_rows if block == self.n_blocks - 1 else start + rows_per
        positions = np.arange(start, end, dtype=np.int64)
        if not self.shuffle:
            return positions
        return KeyedPermutation(self.n_rows, [self.seed, int(epoch), _PERMUTATION_STREAM])(positions)

    def block_batches(self, epoch: int, block: int) -> np.ndarray:
        """The global batches of ``block`` in ``epoch`` (``[batches, batch_size * world_size]`` rows)."""
        if self._block is not None and self._block[:2] == (epoch, block):
            return self._block[2]
        rows = self.block_rows(epoch, block)
        k = len(rows) // self.global_size
        if not self.unique_in_batch:
            plan = rows[: k * self.global_size].reshape(k, self.global_size)
        else:
            ids, groups = np.asarray(self.doc_ids[rows]), np.asarray(self.groups[rows])
            plan = rows[np.asarray(arrange(ids, groups, k, self.global_size), dtype=np.int64).reshape(k, -1)]
        self._block = (epoch, block, plan)
        return plan

    def global_batch(self, epoch: int, i: int) -> np.ndarray:
        """All ranks' rows of global batch ``i`` of ``epoch``."""
        if not 0 <= i < self.batch_count():
            raise IndexError(f"batch {i} of an epoch of {self.batch_count()}")
        block = min(i // self.per_block, self.n_blocks - 1)
        return self.block_batches(epoch, block)[i - block * self.per_block]

    def global_batches(self, epoch: int, start: int = 0) -> Iterator[np.ndarray]:
        """All ranks' batches of ``epoch`` from batch ``start`` on."""
        for i in range(start, self.batch_count()):
            yield self.global_batch(epoch, i)

    def epoch_batches(self, epoch: int) -> Iterator[np.ndarray]:
        """This rank's batches of ``epoch``."""
        for g in self.global_batches(epoch):
            yield self.rank_rows(g)

    def rank_rows(self, g: np.ndarray) -> np.ndarray:
        """This rank's slice of a global batch."""
        return g[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def check(self) -> None:
        """Arrange the current epoch's first block now (ValueError where it holds too few distinct doc
        ids or groups for a batch), not at the first training step."""
        if self.batch_count():
            self.block_batches(self.epoch, 0)

    # -- Sampler protocol
    def __len__(self) -> int:
        return self.batch_count()

    def __iter__(self) -> Iterator[list[int]]:
        # a generator: epoch and position are read at the first next(), i.e. after set_epoch
        epoch, start = self.epoch, self.batches_done
        for step, g in enumerate(self.global_batches(epoch, start), start):
            yield Draw(self.rank_rows(g).tolist(), epoch, step)


_PASS_STRIDE = 1 << 32  # a source's pass p of epoch e is its sampler's "epoch" e + p * _PASS_STRIDE
_SCHEDULE_STREAM = 0x5EED5  # keeps the schedule's random stream apart from the sources'
_SCHEDULE_BLOCK = 4096  # steps of the weighted schedule shuffled together


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


def interleave_prefix(counts: Sequence[int], x: int) -> list[int]:
    """How many batches of each source the first ``x`` steps of the even interleave hold: the ``k``-th
    of source ``s``'s ``counts[s]`` batches at ``(k + 0.5) / counts[s]`` of the epoch, ties to the lower
    source. Exact integer arithmetic and no list of the epoch's steps: a binary search per source
    over the steps ahead of its ``k``-th batch."""
    c = [int(v) for v in counts]

    def ahead(s2: int, k2: int) -> int:  # steps before source s2's k2-th batch
        n = 0
        for s, cs in enumerate(c):
            if cs:
                a, b = (2 * k2 + 1) * cs, c[s2]  # source s's k-th is before when (2k + 1) * b < a (<= for s < s2)
                n += min(cs, ((a // b + 1) if s < s2 else ((a - 1) // b + 1)) // 2)
        return n

    out = []
    for s2, cs2 in enumerate(c):
        lo, hi = 0, cs2
        while lo < hi:
            mid = (lo + hi) // 2
            if ahead(s2, mid) < x:
                lo = mid + 1
            else:
                hi = mid
        out.append(lo)
    return out


def schedule_counts(passes: Sequence[int], *, weights: Optional[Sequence[float]], mode: str) -> list[int]:
    """Each source's batches in an epoch, given each source's batches in one pass: the rule of
    :class:`MultiSourceBatchSampler` (and of streaming, stream_batches.py)."""
    if str(mode) == "round_robin":
        return [min(passes)] * len(passes)
    return apportion(sum(passes), weights if weights is not None else passes)


def schedule_steps(epoch: int, counts: Sequence[int], *, mode: str, seed: int, shuffle: bool,
                   start: int = 0) -> Iterator[tuple[int, int]]:
    """``(source, the source's batch number in the epoch)`` of each step of ``epoch`` from ``start``
    on, for sources of ``counts`` batches (:func:`schedule_counts`); a run of ``_SCHEDULE_BLOCK``
    steps at a time, so nothing grows with the epoch."""
    total, n_sources = sum(counts), len(counts)
    if str(mode) == "round_robin":
        for t in range(start, total):
            yield t % n_sources, t // n_sources
        return
    for run in range(start // _SCHEDULE_BLOCK, -(-total // _SCHEDULE_BLOCK)):
        a, b = run * _SCHEDULE_BLOCK, min(total, (run + 1) * _SCHEDULE_BLOCK)
        lo, hi = interleave_prefix(counts, a), interleave_prefix(counts, b)
        if shuffle:
            rng = np.random.default_rng([int(seed), int(epoch), _SCHEDULE_STREAM, run])
            order = rng.permutation(np.repeat(np.arange(n_sources), np.subtract(hi, lo))).tolist()
        else:
            order = [s for _, s in sorted(((k + 0.5) / counts[s], s) for s in range(n_sources)
                                          for k in range(lo[s], hi[s]))]
        taken = list(lo)
        for t, s in enumerate(order, a):
            j, taken[s] = taken[s], taken[s] + 1
            if t >= start:
                yield s, j


def source_schedule(epoch: int, passes: Sequence[int], *, weights: Optional[Sequence[float]], mode: str, seed: int,
                    shuffle: bool) -> list[int]:
    """The source of each step of ``epoch`` (a list of the epoch: streaming's plan)."""
    counts = schedule_counts(passes, weights=weights, mode=mode)
    return [s for s, _ in schedule_steps(epoch, counts, mode=mode, seed=seed, shuffle=shuffle)]


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
      The sources' batches are evenly interleaved over the epoch, and with ``shuffle`` the order
      within each run of ``_SCHEDULE_BLOCK`` steps is a seeded shuffle (so every stretch of the
      epoch keeps the proportions).
    * ``round_robin``: the sources in turn (0, 1, ..., S-1, 0, ...) until the smallest has used
      its batches: no batch repeats within an epoch; ``weights`` are not used.

    Nothing is planned for the whole epoch: the schedule is computed a run of steps at a time and
    each source's batches a block at a time, so the memory and the time to the first batch (or to a
    resumed one) do not grow with the rows. The position is :class:`RetrievalBatchSampler`'s
    (``{"epoch", "batches_done"}``): the schedule is fixed by ``(seed, epoch)``, so it also says which
    source comes next (:meth:`steps`).
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
        self.sampler = _EpochSetter(self)

    # -- the schedule
    def counts(self) -> list[int]:
        """Each source's global batches in an epoch (every epoch the same)."""
        passes = [src.batch_count() for src in self.sources]
        short = [s for s, n in enumerate(passes) if n == 0 and (self.mode == "round_robin" or self._weight(s) > 0)]
        if short:
            s = short[0]
            raise ValueError(
                f"{self.names[s]} has {self.offsets[s + 1] - self.offsets[s]} rows: no full batch of "
                f"{self.batch_size} x {self.world_size} rank(s)"
            )
        return schedule_counts(passes, weights=self.weights, mode=self.mode)

    def steps(self, epoch: int, start: int = 0) -> Iterator[tuple[int, int]]:
        """``(source, the source's batch number in the epoch)`` of each step of ``epoch`` from ``start`` on."""
        return schedule_steps(epoch, self.counts(), mode=self.mode, seed=self.seed, shuffle=self.shuffle, start=start)

    def batch_sources(self, epoch: int) -> list[int]:
        """The source of each batch of ``epoch`` (a list of the whole epoch: for looking, not training)."""
        return [s for s, _ in self.steps(epoch)]

    def _weight(self, s: int) -> float:
        return 1.0 if self.weights is None else self.weights[s]

    # -- batches
    def source_batch(self, s: int, epoch: int, j: int) -> np.ndarray:
        """Source ``s``'s ``j``-th global batch of ``epoch`` (rows of the source: add ``offsets[s]``),
        continuing into new passes (each its own permutation) past one pass's batches."""
        src = self.sources[s]
        p, i = divmod(j, src.batch_count())
        return src.global_batch(epoch + p * _PASS_STRIDE, i)

    def global_plan(self, epoch: int, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """``(source, global batch)`` of each step of ``epoch`` from ``start`` on (all ranks' rows,
        within the source: :meth:`epoch_batches` adds the source's offset)."""
        for s, j in self.steps(epoch, start):
            yield s, self.source_batch(s, epoch, j)

    def epoch_batches(self, epoch: int) -> Iterator[np.ndarray]:
        """This rank's batches of ``epoch`` (rows of the whole set)."""
        for s, g in self.global_plan(epoch):
            yield self._rank_rows(s, g)

    def _rank_rows(self, s: int, g: np.ndarray) -> np.ndarray:
        b, r = self.batch_size, self.rank
        return g[r * b : (r + 1) * b] + self.offsets[s]

    def check(self) -> None:
        """Every drawn source's first block arranged now (:meth:`RetrievalBatchSampler.check`), an
        error naming the source."""
        for s, n in enumerate(self.counts()):
            if n:
                try:
                    self.sources[s].check()
                except ValueError as exc:
                    raise ValueError(f"{self.names[s]}: {exc}") from None

    # -- Sampler protocol (the same position as RetrievalBatchSampler's)
    def __len__(self) -> int:
        return sum(self.counts())

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self.batches_done
        for step, (s, g) in enumerate(self.global_plan(epoch, start), start):  # each batch's rows made when it is drawn
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
    "KeyedPermutation",
    "MultiSourceBatchSampler",
    "RetrievalBatchSampler",
    "ResumableDataLoader",
    "apportion",
    "arrange",
    "check_offsets",
    "interleave_prefix",
    "schedule_counts",
    "schedule_steps",
    "source_of",
    "source_schedule",
    "source_seed",
]
