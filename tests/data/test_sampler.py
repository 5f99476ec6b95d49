"""The batch sampler's epoch, computed a block at a time: a keyed permutation, every row at most once,
duplicate-free global batches, rank slices, resume from any batch, and memory that does not grow
with the rows."""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

import moco_retrieval.data.sampler as sampler_module
from moco_retrieval.data.sampler import (KeyedPermutation, MultiSourceBatchSampler, RetrievalBatchSampler, apportion,
                                         arrange, interleave_prefix)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few batches, so a small set has many of them (and their boundaries are tested)."""
    monkeypatch.setattr(sampler_module, "_BLOCK_ROWS", 64)
    monkeypatch.setattr(sampler_module, "_MIN_BLOCK_BATCHES", 4)


def _data(n=2000, seed=0):
    """Doc ids repeated (about 2 rows each), groups of about 4 rows on half the rows."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, n // 2, n).astype(np.int64)
    groups = np.where(rng.random(n) < 0.5, -1, rng.integers(0, n // 8, n)).astype(np.int64)
    return ids, groups


def _clean(batch, ids, groups):
    g = [x for x in groups[batch].tolist() if x != -1]
    return len(set(ids[batch].tolist())) == len(batch) and len(set(g)) == len(g)


def test_keyed_permutation_is_a_permutation_of_its_key():
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        p = KeyedPermutation(n, [3, 1])(np.arange(n))
        assert sorted(p.tolist()) == list(range(n)), n
    a, b = KeyedPermutation(1000, [3, 1]), KeyedPermutation(1000, [3, 2])
    pos = np.arange(200, 300)
    assert np.array_equal(a(pos), KeyedPermutation(1000, [3, 1])(pos))  # a function of the key
    assert not np.array_equal(a(pos), b(pos))
    assert np.array_equal(a(pos), a(np.arange(1000))[200:300])  # any positions, alone
    assert np.corrcoef(np.arange(1000), a(np.arange(1000)))[0, 1] ** 2 < 0.01  # no trace of the order


def test_interleave_prefix_is_the_sorted_interleave():
    for counts in ([3, 1, 2], [5, 5], [1, 7, 2, 9], [10, 0, 3], [4], [997, 13, 250]):
        slots = sorted(((k + 0.5) / c, s) for s, c in enumerate(counts) for k in range(c))
        for x in range(sum(counts) + 1):
            want = np.bincount([s for _, s in slots[:x]], minlength=len(counts)).tolist()
            assert interleave_prefix(counts, x) == want, (counts, x)


@pytest.mark.parametrize("world", [1, 3])
def test_epoch_draws_each_row_once_and_all_but_a_batch(small_blocks, world):
    ids, groups = _data()
    s = RetrievalBatchSampler(ids, groups, 4, seed=7, rank=0, world_size=world)
    gb = 4 * world
    assert s.n_blocks > 10  # many blocks: boundaries are crossed
    for epoch in range(3):
        batches = list(s.global_batches(epoch))
        assert len(batches) == len(s) == len(ids) // gb and all(len(g) == gb for g in batches)
        assert all(_clean(g, ids, groups) for g in batches)
        flat = np.concatenate(batches)
        assert len(np.unique(flat)) == len(flat) == len(ids) // gb * gb  # once each; only the last partial batch not drawn
    assert not np.array_equal(np.concatenate(list(s.global_batches(0))), np.concatenate(list(s.global_batches(1))))
    # the order is the permutation's: not the rows' own, and not a block's rows together
    first = np.concatenate(list(s.global_batches(0))[:8])
    assert np.ptp(first) > 0.7 * len(ids)


def test_without_the_rule_the_same_data_clashes(small_blocks):
    ids, groups = _data()
    free = RetrievalBatchSampler(ids, groups, 12, seed=7, unique_in_batch=False, rank=0, world_size=1)
    assert not all(_clean(g, ids, groups) for g in free.global_batches(0))


def test_rank_slices_partition_each_global_batch(small_blocks):
    ids, groups = _data(600)
    ranks = [RetrievalBatchSampler(ids, groups, 3, seed=2, rank=r, world_size=3) for r in range(3)]
    for r in ranks:
        r.set_epoch(4)
    draws = [list(r) for r in ranks]
    assert len({len(d) for d in draws}) == 1 and len(draws[0]) == 600 // 9
    for step, (a, b, c) in enumerate(zip(*draws)):
        assert a.step == b.step == c.step == step and a.epoch == 4
        assert a + b + c == ranks[0].global_batch(4, step).tolist()
        assert len(set(a) | set(b) | set(c)) == 9


@pytest.mark.parametrize("multi", [False, True])
def test_resume_from_every_batch_gives_exactly_the_rest(small_blocks, multi):
    ids, groups = _data(400, seed=3)

    def make():
        if multi:
            return MultiSourceBatchSampler(ids, groups, [0, 250, 330, 400], 4, weights=[1, 2, 1], seed=5, rank=1,
                                           world_size=2)
        return RetrievalBatchSampler(ids, groups, 4, seed=5, rank=1, world_size=2)

    full = make()
    full.set_epoch(3)
    want = [(d.step, list(d)) for d in full]
    assert len(want) == len(full) > 20
    for k in range(len(want) + 1):
        s = make()  # a new process: nothing cached
        s.load_state_dict({"epoch": 3, "batches_done": k})
        assert [(d.step, list(d)) for d in s] == want[k:], k
        assert len(s) == len(want)


def test_no_shuffle_keeps_the_order(small_blocks):
    n = 500
    s = RetrievalBatchSampler(np.arange(n), np.full(n, -1), 6, shuffle=False, rank=0, world_size=1)
    assert [g.tolist() for g in s.global_batches(0)] == [list(range(i, i + 6)) for i in range(0, n // 6 * 6, 6)]


def test_a_clashing_row_waits_for_the_next_batch_that_takes_it():
    # ids 0..11 in order, row 2 has row 1's doc id: it goes to the next batch, the rest keep their order
    ids = [0, 1, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert arrange(ids, [-1] * len(ids), 3, 4) == [[0, 1, 3, 4], [2, 5, 6, 7], [8, 9, 10, 11]]
    # a group twice: the same
    assert arrange(list(range(8)), [-1, 5, 5, -1, -1, -1, -1, -1], 2, 4) == [[0, 1, 3, 4], [2, 5, 6, 7]]


def test_rows_left_at_a_block_end_are_moved_in():
    # row 6 (doc id 4) clashes with the open batch's row 4, and the full batch has no room: it takes the
    # place of row 1, which moves on to the open batch (row 0 could not: its id is row 5's)
    ids = [0, 1, 2, 3, 4, 0, 4, 5]
    assert arrange(ids, [-1] * 8, 2, 4) == [[0, 6, 2, 3], [4, 5, 7, 1]]


def test_tight_sets_are_packed_without_a_repeat():
    """7 doc ids, batches of 7: only a perfect arrangement has no repeat; the end-of-block moves find it."""
    n = 70
    ids, groups = np.arange(n) % 7, np.where(np.arange(n) % 2 == 1, np.arange(n) % 5, -1)
    for seed in range(20):
        s = RetrievalBatchSampler(ids, groups, 7, seed=seed, rank=0, world_size=1)
        flat = np.concatenate(list(s.global_batches(0)))
        assert sorted(flat.tolist()) == list(range(n)), seed


def test_a_too_frequent_group_repeats_rows_and_too_few_ids_is_an_error():
    n = 400
    ids = np.arange(n)
    groups = np.where(np.arange(n) % 4 == 0, 9, -1)  # a quarter of the rows in one group: one a batch at most
    s = RetrievalBatchSampler(ids, groups, 8, seed=1, rank=0, world_size=1)
    batches = list(s.global_batches(0))
    assert len(batches) == n // 8 and all(_clean(g, ids, groups) for g in batches)
    flat = np.concatenate(batches)
    assert (groups[flat] == 9).sum() == len(batches)  # every batch takes one of the group
    assert len(np.unique(flat)) < len(flat)  # the places of the group's other rows: rows drawn twice
    with pytest.raises(ValueError, match="distinct doc ids and groups"):
        RetrievalBatchSampler(np.arange(40) % 3, np.full(40, -1), 4, rank=0, world_size=1).check()


def test_weighted_schedule_in_runs_is_exact_and_even(monkeypatch):
    monkeypatch.setattr(sampler_module, "_SCHEDULE_BLOCK", 7)
    ids, groups = _data(1200)
    s = MultiSourceBatchSampler(ids, groups, [0, 700, 1000, 1200], 5, weights=[1, 1, 3], seed=4, rank=0, world_size=1)
    steps = list(s.steps(0))
    counts = apportion(140 + 60 + 40, [1, 1, 3])  # the sources' batches a pass, split 1:1:3
    assert len(steps) == len(s) == sum(counts) and s.counts() == counts
    for src in range(3):  # each source's batches in order, each once
        assert [j for t, j in steps if t == src] == list(range(counts[src]))
    for a in range(0, len(steps) - 7, 7):  # every run of 7 steps keeps the proportions (within 2 of its share)
        run = [t for t, _ in steps[a : a + 7]]
        assert abs(run.count(2) - 7 * 3 / 5) < 2 and abs(run.count(0) - 7 / 5) < 2
    assert [t for t, _ in steps] != [t for t, _ in s.steps(1)]
    assert steps[100:] == list(s.steps(0, 100))  # from a step on: the same


def _first_batches(make, n_batches):
    tracemalloc.start()
    t0 = time.perf_counter()
    it = iter(make())
    for _ in range(n_batches):
        next(it)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, seconds


def test_memory_and_time_to_the_first_batches_do_not_grow_with_the_rows():
    """1M and 10M rows (arrays made before measuring, as a memory map would be): the same peak and time."""
    out = {}
    for n in (1_000_000, 10_000_000):
        ids = np.arange(n, dtype=np.int64) // 2  # every doc id twice: rows clash
        groups = np.broadcast_to(np.int64(-1), (n,))
        out[n] = _first_batches(lambda: RetrievalBatchSampler(ids, groups, 64, seed=1, rank=0, world_size=2), 300)
        del ids
    (p1, t1), (p10, t10) = out[1_000_000], out[10_000_000]
    assert p10 < 20e6 and p10 < 1.5 * p1 + 1e6, out
    assert t10 < 3 * t1 + 0.5, out  # the old whole-epoch plan: 10 times longer


def test_multisource_memory_does_not_grow_with_the_rows():
    out = {}
    for n in (400_000, 4_000_000):
        ids = np.arange(n, dtype=np.int64)
        groups = np.broadcast_to(np.int64(-1), (n,))
        off = [0, n // 4, n]
        out[n] = _first_batches(lambda: MultiSourceBatchSampler(ids, groups, off, 64, weights=[3, 1], seed=2, rank=0,
                                                                world_size=1), 100)
        del ids
    assert out[4_000_000][0] < 20e6 and out[4_000_000][0] < 1.5 * out[400_000][0] + 1e6, out
