"""The training batches of a stream (``data.stream=true``, chunks from stream.py): each rank reads its
share of each source's chunks through a litdata ``StreamingDataset`` (shuffled with the source's
seed, ``drop_last``: every rank the same number of rows), ``batch_size`` rows at a time, into the
collate of the store path (ids, groups, sources, prompts, hard negatives, teacher scores).

Duplicates. Rows come in litdata's order: a document id or group twice in a batch is masked by the
objectives' false-negative masks (they compare the ids and groups the batch carries), not avoided
(``data.unique_in_batch`` is the store's sampler's).

Several sources. Every batch is drawn from one source, by the schedule of the store path
(sampler.source_schedule, from ``(seed, epoch)`` and each source's batches in one pass); a source
scheduled for more batches than one pass holds continues with another pass (litdata epoch
:func:`litdata_epoch`, shuffled anew).

Position and resume. The state is the store path's, ``{"epoch", "batches_done"}``
(sampler.EpochPosition, saved by the data module through the resumable loader): the schedule says
how many batches of each source, and so how many rows of this rank's share of it, came before. A
resumed epoch skips them with litdata's own replay of one worker and a batch of one row, built here
for this rank (``StreamingDataset.state_dict`` of that count). Not with litdata's
``StreamingDataLoader`` state: across ranks (Lightning-AI/litdata#248) and whenever its batch size
or workers differ from the state's, litdata resumes from a re-striped stream, which repeats and
skips rows; the count per rank, derived from the schedule, is exact.

Workers. litdata reads ahead in threads of its own; one DataLoader worker (``data.num_workers`` >= 1)
iterates the stream and collates, the training process only trains. A chunk that cannot be read
(removed, truncated, an unreachable store) ends the run with one message naming the folder.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
from torch.utils.data import IterableDataset

from moco_retrieval.data.formats import DataError
from moco_retrieval.data.sampler import EpochPosition, ResumableDataLoader, source_schedule, source_seed
from moco_retrieval.data.stream import brief, is_url, join, json_pair, litdata, storage_options

ERROR = "stream_error"  # the key of the one item a worker yields when a chunk cannot be read


def litdata_epoch(epoch: int, pass_: int) -> int:
    """litdata's epoch (from 1, below 2**32: it seeds numpy with it) of pass ``pass_`` of ``epoch``."""
    n = epoch + pass_
    return n * (n + 1) // 2 + pass_ + 1


class StreamBatches(EpochPosition, IterableDataset):
    """This rank's collated batches of the current epoch from the position on (see the module
    docstring). ``rows``: each source's rows (the manifest's), ``where``: the stream folder,
    ``names``: its source folders; ``collate``: ``(global index, Pair)`` items -> a batch."""

    def __init__(self, where: str, names: Sequence[str], rows: Sequence[int], batch_size: int, collate: Callable,
                 *, seed: int = 0, shuffle: bool = True, weights: Optional[Sequence[float]] = None,
                 mode: str = "weighted", rank: int = 0, world_size: int = 1, cache_dir: Optional[str] = None):
        self.where, self.names, self.collate = str(where), list(names), collate
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.batch_size, self.seed, self.shuffle = int(batch_size), int(seed), bool(shuffle)
        self.weights, self.mode = weights, str(mode)
        self.rank, self.world_size, self.cache_dir = int(rank), int(world_size), cache_dir
        self.epoch, self.batches_done = 0, 0
        self._batches: dict[tuple[int, int, int], int] = {}  # (source, epoch, pass) -> batches of every rank
        self.given_starts: Optional[dict] = None  # starts() made by the loader for its worker
        self.num_nodes: Optional[int] = None  # litdata's node count (dataset())

    # -- litdata
    def _seed(self, s: int) -> int:
        one = len(self.names) == 1
        return (self.seed if one else source_seed(self.seed, s)) % (1 << 32)

    def dataset(self, s: int, epoch: int, pass_: int, rank: Optional[int] = None) -> Any:
        """Source ``s``'s stream for pass ``pass_`` of ``epoch``, as rank ``rank`` (this one) reads it."""
        ld = litdata()
        from litdata.utilities.env import _DistributedEnv

        # litdata's info lines (its cache budget, how it reads a folder) come for every pass of every source
        logging.getLogger("litdata").setLevel(logging.WARNING)

        rank = self.rank if rank is None else rank
        try:
            ds = ld.StreamingDataset(join(self.where, self.names[s]), cache_dir=self.cache_dir, shuffle=self.shuffle,
                                     drop_last=True, seed=self._seed(s), storage_options=storage_options(self.where))
        except Exception as e:  # its index unreadable, an object store out of reach
            raise DataError(f"{join(self.where, self.names[s])}: cannot open the stream ({brief(e)})") from None
        if self.num_nodes is None:  # litdata's count under the process group (it shapes the shuffle), made once
            env = _DistributedEnv.detect()  # here: a DataLoader worker has no group and would count one node
            self.num_nodes = env.num_nodes if (env.world_size, env.global_rank) == (self.world_size, self.rank) else 1
        ds.distributed_env = _DistributedEnv(self.world_size, rank, self.num_nodes)
        ds.set_epoch(litdata_epoch(epoch, pass_))
        return ds

    def pass_batches(self, s: int, epoch: int, pass_: int) -> int:
        """Batches that every rank reads from one pass of source ``s`` (the fewest of any rank's share)."""
        key = (s, epoch, pass_)
        if key not in self._batches:
            ds = self.dataset(s, epoch, pass_)
            ds.get_len(1, 1)  # (creates its shuffler)
            env = type(ds.distributed_env)
            lengths = [ds.shuffler.get_len(env(self.world_size, r, self.num_nodes), 1, 1, ds.current_epoch)
                       for r in range(self.world_size)]
            self._batches[key] = min(lengths) // self.batch_size
            if self._batches[key] == 0:
                raise DataError(f"{join(self.where, self.names[s])}: {int(self.offsets[s + 1] - self.offsets[s])} rows "
                                f"make no full batch of {self.batch_size} x {self.world_size} rank(s)")
        return self._batches[key]

    def plan(self, epoch: int) -> list[int]:
        """The source of each batch of ``epoch``."""
        passes = [self.pass_batches(s, epoch, 0) for s in range(len(self.names))]
        if len(passes) == 1:
            return [0] * passes[0]
        return source_schedule(epoch, passes, weights=self.weights, mode=self.mode, seed=self.seed, shuffle=self.shuffle)

    # -- iteration
    def __len__(self) -> int:
        return len(self.plan(self.epoch))

    def starts(self) -> dict[int, tuple[int, int, Optional[dict]]]:
        """Where each source of the epoch resumes: ``(pass, batches done in it, litdata's replay state
        of this rank's rows read so far)``. Made in the training process (litdata makes a state only
        there) and sent with the dataset to a DataLoader worker."""
        epoch, start = self.epoch, self.batches_done
        plan, out = self.plan(epoch), {}
        for s in sorted(set(plan)):
            done, pass_ = plan[:start].count(s), 0
            while done >= self.pass_batches(s, epoch, pass_):
                done -= self.pass_batches(s, epoch, pass_)
                pass_ += 1
            state = None
            if done:  # litdata's replay of one worker, a batch of one row: this rank's rows read so far
                ds = self.dataset(s, epoch, pass_)
                state = ds.state_dict(num_samples_yielded=done * self.batch_size, num_workers=1, batch_size=1)
            out[s] = (pass_, done, state)
        return out

    def __iter__(self) -> Iterator[dict]:
        epoch, start = self.epoch, self.batches_done
        plan = self.plan(epoch)
        readers: dict[int, _Reader] = {}
        try:
            starts = self.given_starts if self.given_starts is not None else self.starts()
            for s, (pass_, done, state) in starts.items():  # each source from the row this rank reached in it
                readers[s] = _Reader(self, s, epoch, pass_, done, state)
            for s in plan[start:]:
                yield self.collate(readers[s].batch())
        except DataError as e:
            yield {ERROR: str(e)}
        except Exception as e:  # litdata's reads: a chunk removed or cut short, a store gone
            reach = ("its object store out of reach (check the endpoint and credentials), or "
                     if is_url(self.where) else "")
            yield {ERROR: f"{self.where}: cannot read the stream's chunks ({brief(e)}): {reach}chunks removed or cut "
                          "short: prepare it again (remove the folder, then `python -m moco_retrieval.data prepare "
                          "data.stream=true ...`)"}


class _Reader:
    """Source ``s``'s rows for this rank, ``batch_size`` at a time, from batch ``done`` of the epoch
    on, pass after pass."""

    def __init__(self, owner: StreamBatches, s: int, epoch: int, pass_: int, done: int, state: Optional[dict]):
        self.owner, self.s, self.epoch, self.pass_ = owner, s, epoch, pass_
        self._open(done, state)

    def _open(self, done: int, state: Optional[dict]) -> None:
        o = self.owner
        ds = o.dataset(self.s, self.epoch, self.pass_)
        if state is not None:
            ds.load_state_dict(dict(state))
        self.left = o.pass_batches(self.s, self.epoch, self.pass_) - done
        self.items = iter(ds)

    def batch(self) -> list:
        if self.left == 0:
            self.pass_ += 1
            self._open(0, None)
        self.left -= 1
        base = int(self.owner.offsets[self.s])
        return [(base + int(item["index"]), json_pair(item["pair"])) for item in
                (next(self.items) for _ in range(self.owner.batch_size))]


def _as_is(batch: dict) -> dict:
    return batch


class StreamLoader(ResumableDataLoader):
    """The DataLoader of a stream: batches made in one worker (or in this process), the epoch set
    from ``epoch_fn`` (the fit loop's: Lightning calls ``set_epoch`` on a sampler, which an iterable
    dataset's loader lacks), and a worker's read error raised here as one message."""

    def __init__(self, batches: StreamBatches, num_workers: int, epoch_fn: Callable[[], Optional[int]], **kwargs):
        super().__init__(batches, batch_size=None, collate_fn=_as_is, num_workers=min(int(num_workers), 1), **kwargs)
        self._epoch_fn = epoch_fn

    def __iter__(self) -> Iterator[dict]:
        epoch = self._epoch_fn()
        if epoch is not None:
            self.dataset.set_epoch(epoch)
        # (a worker cannot make litdata's replay state: made here, it travels with the dataset)
        self.dataset.given_starts = self.dataset.starts() if self.num_workers else None
        for batch in super().__iter__():
            if ERROR in batch:
                raise DataError(batch[ERROR])
            yield batch


__all__ = ["litdata_epoch", "StreamBatches", "StreamLoader"]
