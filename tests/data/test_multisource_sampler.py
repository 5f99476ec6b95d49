"""MultiSourceBatchSampler: one source per batch, proportions, rank shards, exact mid-epoch resume."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from moco_retrieval.data.collate import collate
from moco_retrieval.data.formats import Pair
from moco_retrieval.data.sampler import (MultiSourceBatchSampler, RetrievalBatchSampler, apportion, source_of,
                                         source_seed)

SIZES = (400, 120, 60)  # three sources


def _data(sizes=SIZES, dup_every=0):
    """doc ids unique over the whole set, except (``dup_every``) repeated ids within each source;
    groups: every 5 rows of a source share one."""
    ids, groups = [], []
    for s, n in enumerate(sizes):
        for i in range(n):
            ids.append(s * 10_000 + (i // 2 if dup_every and i % dup_every == 0 else i + 5_000))
            groups.append(s * 10_000 + i // 5)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return np.asarray(ids, dtype=np.int64), np.asarray(groups, dtype=np.int64), offsets


def _source_of_batch(batch, offsets):
    srcs = set(source_of(batch, offsets).tolist())
    assert len(srcs) == 1, f"a batch spans sources {srcs}"
    return srcs.pop()


def test_every_batch_from_one_source_without_duplicates():
    ids, groups, off = _data(dup_every=3)
    sampler = MultiSourceBatchSampler(ids, groups, off, 8, seed=3, rank=0, world_size=1)
    batches = list(sampler)
    assert batches and all(len(b) == 8 for b in batches)
    sources = [_source_of_batch(b, off) for b in batches]
    assert sources == sampler.batch_sources(0)
    assert len(set(sources)) == 3  # the schedule mixes them
    for b in batches:
        assert len(set(ids[b].tolist())) == len(b)
        assert len(set(groups[b].tolist())) == len(b)
    # one pass (weights None: proportional to size): no row twice in the epoch
    rows = [i for b in batches for i in b]
    assert len(rows) == len(set(rows))


def test_weighted_proportions_and_upsampled_source_repeats():
    ids, groups, off = _data()
    sampler = MultiSourceBatchSampler(ids, groups, off, 10, weights=[1, 1, 2], seed=0, rank=0, world_size=1)
    sources = sampler.batch_sources(0)
    counts = Counter(sources)
    total = len(sources)
    assert total == sum(len(s) for s in sampler.sources)  # the sources' batches together
    assert [counts[s] for s in range(3)] == apportion(total, [1, 1, 2])
    for s, share in enumerate((0.25, 0.25, 0.5)):
        assert abs(counts[s] / total - share) <= 1 / total
    # source 2 holds 6 batches a pass but is given half the epoch: it continues into new passes,
    # each a new permutation, and never repeats a row within a batch
    rows2 = [b.tolist() for b, s in zip(sampler.epoch_batches(0), sources) if s == 2]
    assert len(rows2) > 6
    assert rows2[:6] != rows2[6:12]
    # the first half of the epoch keeps the proportions too (a seeded shuffle, not blocks of one source)
    first = Counter(sources[: total // 2])
    assert abs(first[2] / (total // 2) - 0.5) < 0.2


def test_even_interleave_without_shuffle():
    ids, groups, off = _data()
    sampler = MultiSourceBatchSampler(ids, groups, off, 20, weights=[2, 1, 1], shuffle=False, unique_in_batch=False,
                                      rank=0, world_size=1)
    sources = sampler.batch_sources(0)
    for k in range(4, len(sources) + 1, 4):  # every prefix of 4 batches: 2, 1, 1
        c = Counter(sources[:k])
        assert abs(c[0] - k / 2) <= 1 and abs(c[1] - k / 4) <= 1 and abs(c[2] - k / 4) <= 1


def test_round_robin_turns_until_the_smallest_is_used():
    ids, groups, off = _data()
    sampler = MultiSourceBatchSampler(ids, groups, off, 10, mode="round_robin", rank=0, world_size=1)
    smallest = min(len(s) for s in sampler.sources)
    assert sampler.batch_sources(0) == [0, 1, 2] * smallest
    rows = [i for b in sampler.epoch_batches(0) for i in b.tolist()]
    assert len(rows) == len(set(rows))


def test_resume_mid_epoch_yields_exactly_the_remaining_batches():
    ids, groups, off = _data(dup_every=4)
    kw = dict(weights=[1, 2, 3], seed=11, rank=0, world_size=1)
    full = MultiSourceBatchSampler(ids, groups, off, 6, **kw)
    full.set_epoch(2)
    expected = list(full)
    run = MultiSourceBatchSampler(ids, groups, off, 6, **kw)
    run.set_epoch(2)
    it = iter(run)
    for _ in range(7):
        next(it)
        run.advance()
    state = run.state_dict()
    assert state == {"epoch": 2, "batches_done": 7}
    resumed = MultiSourceBatchSampler(ids, groups, off, 6, **kw)
    resumed.load_state_dict(state)
    assert list(resumed) == expected[7:]
    assert len(resumed) == len(expected)
    resumed.set_epoch(3)
    assert list(resumed) != expected  # a new epoch: another schedule and other batches


def test_two_ranks_disjoint_and_in_step():
    ids, groups, off = _data(dup_every=3)
    ranks = [MultiSourceBatchSampler(ids, groups, off, 4, weights=[3, 1, 1], seed=5, rank=r, world_size=2)
             for r in (0, 1)]
    b0, b1 = list(ranks[0]), list(ranks[1])
    assert len(b0) == len(b1) > 0
    assert ranks[0].batch_sources(0) == ranks[1].batch_sources(0)
    for x, y in zip(b0, b1):
        assert not set(x) & set(y)
        assert _source_of_batch(x, off) == _source_of_batch(y, off)  # the global batch is of one source
        assert len(set(ids[x + y].tolist())) == 8  # duplicate-free across the global batch


def test_one_source_is_its_retrieval_batch_sampler():
    """Composition: a single source gives exactly that source's RetrievalBatchSampler's batches."""
    ids, groups, _ = _data(sizes=(300,), dup_every=3)
    multi = MultiSourceBatchSampler(ids, groups, [0, 300], 8, seed=4, rank=1, world_size=2)
    single = RetrievalBatchSampler(ids, groups, 8, seed=source_seed(4, 0), rank=1, world_size=2)
    assert list(multi) == list(single)


def test_bad_inputs_are_named():
    ids, groups, off = _data()
    with pytest.raises(ValueError, match="source_offsets"):
        MultiSourceBatchSampler(ids, groups, [0, 100], 8, rank=0, world_size=1)
    with pytest.raises(ValueError, match="source 1 has no rows"):
        MultiSourceBatchSampler(ids, groups, [0, 400, 400, 580], 8, rank=0, world_size=1)
    with pytest.raises(ValueError, match="weights"):
        MultiSourceBatchSampler(ids, groups, off, 8, weights=[1, 1], rank=0, world_size=1)
    too_big = MultiSourceBatchSampler(ids, groups, off, 100, unique_in_batch=False, rank=0, world_size=1)
    with pytest.raises(ValueError, match="source 2 has 60 rows: no full batch of 100"):
        len(too_big)
    # a source with weight 0 may be too small: it is never drawn
    skip = MultiSourceBatchSampler(ids, groups, off, 100, weights=[1, 1, 0], unique_in_batch=False, rank=0,
                                   world_size=1)
    assert 2 not in skip.batch_sources(0)


def test_collate_carries_each_rows_source():
    pairs = [(i, Pair(query=f"q{i}", positive=f"d{i}", doc_id=i)) for i in (0, 3, 4, 9)]
    batch = collate(pairs, source_offsets=[0, 4, 9, 12])
    assert batch["source"].tolist() == [0, 0, 1, 2]
    assert "source" not in collate(pairs)
