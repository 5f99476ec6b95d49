"""The Lightning data module: training pairs and the evaluation pool of a data config, served by
the batch sampler (:mod:`.sampler`) and the collate (:mod:`.collate`).

Training rows come from a store converted once per input content (:mod:`.convert`, :mod:`.store`):
the sampler works on its memory-mapped ids and groups, and the DataLoader reads each batch's rows
from its Arrow table, so no process holds the pairs as Python objects.

Loading by ``data.kind``, subsets and caps live in :mod:`.sources`. Batches follow the contract in
``docs/design.md``. The training batch sampler shuffles with a seed, shards across ranks itself
(run Lightning with ``use_distributed_sampler=False``), keeps a document id or a group out of a
batch twice, and resumes mid-epoch.

Position in the epoch (resume). :meth:`RetrievalDataModule.state_dict` returns
``{"epoch", "batches_done"}`` (with ``data.sources`` also ``"sources"``: names, weights and mode,
which fix the schedule; a resume under others is refused, see :mod:`.multisource`); Lightning
stores it in every checkpoint and hands it back to :meth:`RetrievalDataModule.load_state_dict`
before the training dataloader is iterated, so the resumed epoch yields exactly the batches that were not trained on yet. Under a Lightning fit,
``batches_done`` is derived from the fit loop (``batch_progress.current.processed``: batches whose
training step finished, which is right for checkpoints saved in ``on_train_batch_end``, at
validation and at the end of an epoch), so the lightning module need not call anything. Outside
Lightning (a hand-written loop) call :meth:`RetrievalDataModule.on_train_batch_end` after each
trained batch (or ``sampler.advance()``). The training DataLoader also implements
``state_dict``/``load_state_dict`` (the same state), which tells Lightning it is resumable.

Streaming (``data.stream``): the rows come from litdata chunks instead (:mod:`.stream` opens or
prepares them; :mod:`.stream_batches` makes this rank's batches with the same collate), the position
is the same ``{"epoch", "batches_done"}``, and the rows' checks read the chunks' manifest.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from moco_retrieval.distributed import rank_and_world

from moco_retrieval.data.collate import Collator, EvalCollator, EvalItems, Tokenize, describe_row, select_negatives
from moco_retrieval.data.formats import DataError, EvalSet, Pair
from moco_retrieval.data.documents import DocumentViews
from moco_retrieval.data.multisource import (check_same_schedule, has_sources, load_source_rows, schedule_record, source_names,
                          source_prompts, source_views, source_weights)
from moco_retrieval.data.prompts import to_prompts
from moco_retrieval.data.sampler import MultiSourceBatchSampler, ResumableDataLoader, RetrievalBatchSampler
from moco_retrieval.data.sources import check_paths, debian_folder, load_eval_pools, load_training_rows, store_root
from moco_retrieval.data.store import ConcatStores, PairList, PairRows, PairRowsDataset
from moco_retrieval.data.stream import open_stream, stream_names
from moco_retrieval.data.stream_batches import StreamBatches, StreamLoader


class RetrievalDataModule(L.LightningDataModule):
    """Training pairs and the evaluation sets for ``cfg.kind`` (debian | jsonl | beir), read by
    :mod:`.sources` on first use (``prepare_data`` builds the Debian set), or given already
    loaded (:meth:`from_loaded`). One evaluation pool (``eval_set``), or one set per folder of
    ``data.eval_dirs`` (``eval_sets``, by name, each its own validation DataLoader).

    Caps (deterministic from ``cfg.seed``, original order kept, see :mod:`.sources`):
    ``max_train_examples`` rows; ``max_eval_queries`` queries; ``max_eval_docs`` documents, always
    keeping every relevant (score > 0) document of the kept queries.

    ``tokenize(texts, "query"|"doc") -> {"input_ids", "attention_mask"}`` pads dynamically; None
    gives text-only batches. ``n_negatives``: hard negatives per row in each batch (every row
    needs at least one; fewer are padded, see :func:`.collate.select_negatives`). ``teacher_scores``
    (``objective.distill``): batches carry the teacher's scores, and every row must have them
    (refused here, naming the first row without, before any model loads).
    """

    def __init__(
        self,
        cfg: Any,
        tokenize: Optional[Tokenize] = None,
        n_negatives: Optional[int] = None,
        *,
        teacher_scores: bool = False,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.tokenize = tokenize
        self.n_negatives = int(n_negatives) if n_negatives else None
        self.teacher_scores = bool(teacher_scores)
        if self.teacher_scores and not self.n_negatives:
            raise ValueError("teacher scores are those of the hard negatives: give n_negatives")
        self._rank, self._world_size = rank, world_size
        self._train_rows: Optional[PairRows] = None
        self._eval_sets: Optional[dict[str, EvalSet]] = None
        self._sampler: Optional[RetrievalBatchSampler] = None
        self._pending_state: Optional[dict] = None
        self.data_dir: Optional[Path] = None  # the built Debian folder (kind=debian, when loaded here)
        self.source_offsets = None  # data.sources: source s is rows [offsets[s], offsets[s + 1]) (multisource.py)
        self.store_dir: Optional[Path] = None  # the converted store of the training pairs (one source, when loaded here)
        self.stream: Optional[dict] = None  # data.stream: the manifest of the chunks it trains on (stream.py)

    @classmethod
    def from_loaded(
        cls,
        cfg: Any,
        train_pairs: Sequence[Pair],
        eval_set: EvalSet | Mapping[str, EvalSet],
        tokenize: Optional[Tokenize] = None,
        n_negatives: Optional[int] = None,
        *,
        teacher_scores: bool = False,
        where: Optional[Sequence[str]] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> "RetrievalDataModule":
        """A data module over pairs and an eval set loaded already (e.g. once for many runs, with
        :func:`.sources.load`): used as given, ``cfg``'s kind, paths and caps are not read again;
        its batch, sampler and worker settings apply. ``eval_set``: one pool, or several sets by name.
        ``where``: each pair's source location, for the message about a row without negatives."""
        dm = cls(cfg, tokenize, n_negatives, teacher_scores=teacher_scores, rank=rank, world_size=world_size)
        sets = {"eval": eval_set} if isinstance(eval_set, EvalSet) else dict(eval_set)
        dm._set_data(PairRows(PairList(train_pairs, where)), sets)
        return dm

    # -- loading
    def prepare_data(self) -> None:
        if self._train_rows is None and self.cfg.kind == "debian":  # nothing to build once loaded (or given)
            debian_folder(self.cfg)

    def setup(self, stage: Optional[str] = None) -> None:
        if self._eval_sets is None:
            self._load()

    @property
    def train_rows(self) -> PairRows:
        """The training rows: ids, groups and negative counts as arrays, texts read on demand."""
        if self.cfg.stream:
            raise RuntimeError("data.stream=true: the training rows are read from the chunks a batch at a time")
        if self._train_rows is None:
            self._load()
        assert self._train_rows is not None
        return self._train_rows

    @property
    def train_pairs(self) -> list[Pair]:
        """Every training row as a Pair (small sets and tests; training reads a batch at a time)."""
        return self.train_rows.pairs()

    def train_texts(self, field: str) -> list[str]:
        """One text field (``query`` or ``positive``) of every training row, in order."""
        return self.train_rows.column(field)

    @property
    def eval_sets(self) -> dict[str, EvalSet]:
        """The evaluation sets by name, in ``data.eval_dirs`` order (one: the pool, named by its folder)."""
        if self._eval_sets is None:
            self._load()
        assert self._eval_sets is not None
        return self._eval_sets

    @property
    def eval_set(self) -> EvalSet:
        """The one evaluation pool (several ``data.eval_dirs``: a ValueError; read ``eval_sets``)."""
        sets = self.eval_sets
        if len(sets) != 1:
            raise ValueError(f"{len(sets)} evaluation sets ({', '.join(sets)}): read eval_sets")
        return next(iter(sets.values()))

    def _load(self) -> None:
        if self.cfg.stream:  # the chunks' manifest (chunks prepared first when missing) and the pool
            pools = load_eval_pools(self.cfg, debian_folder(self.cfg) if self.cfg.kind == "debian" and
                                    not has_sources(self.cfg) else None)
            self._eval_sets = {name: pool.eval_set for name, pool in pools.items()}
            self.stream = open_stream(self.cfg)
            self._check_stream(self.stream)
            rows = [self.stream["sources"][n]["rows"] for n in stream_names(self.cfg)]
            self.source_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64) if has_sources(self.cfg) else None
            return
        if has_sources(self.cfg):  # one row space over every source's store (multisource.py)
            pools = load_eval_pools(self.cfg)  # (a missing eval_dir before any source converts)
            rows, self.source_offsets = load_source_rows(self.cfg)
            self._set_data(rows, {name: pool.eval_set for name, pool in pools.items()})
            return
        check_paths(self.cfg)  # every required path, before any file is read
        train = load_training_rows(self.cfg)
        self.data_dir, self.store_dir = train.folder, train.store
        pools = load_eval_pools(self.cfg, train.folder)
        self._set_data(train.rows, {name: pool.eval_set for name, pool in pools.items()})

    def data_keys(self) -> dict[str, Optional[str]]:
        """Each training source's store key (convert.py: a hash of its content and conversion options),
        by source name ("data": a single source); None for rows read without a store (beir)."""
        if self.cfg.stream:
            self.setup()
            return {n: self.stream["sources"][n]["store"] for n in stream_names(self.cfg)}
        rows = self.train_rows
        parts = rows.source.sources if isinstance(rows.source, ConcatStores) else [rows]
        names = source_names(self.cfg) if has_sources(self.cfg) else ["data"]
        return {n: (Path(p.source.folder).name if hasattr(p.source, "folder") else None) for n, p in zip(names, parts)}

    def _check_stream(self, manifest: dict) -> None:
        """The checks of :meth:`_set_data`, from the counts the manifest keeps (no row is read)."""
        for name in stream_names(self.cfg):
            m = manifest["sources"][name]
            for on, key, what, fix in (
                    (self.n_negatives, "without_negatives", "no hard negatives",
                     f"data.n_negatives={self.n_negatives} trains each row with hard negatives (give every row a "
                     "'negatives' list, or train without hard negatives)"),
                    (self.teacher_scores, "unscored", "no teacher scores",
                     "objective.distill trains on them (python -m moco_retrieval.mine teacher=MODEL writes them)")):
                if on and m[key]:
                    first = m[f"first_{key}"]
                    raise DataError(f"{first['where'] + ': ' if first['where'] else ''}training example {first['index']} "
                                    f"(query {first['query']!r}) of the stream {self.cfg.stream_dir} ({name}) has {what} "
                                    f"({m[key]:,} of {m['rows']:,} rows lack them), but {fix}")

    def _set_data(self, rows: PairRows, eval_sets: dict[str, EvalSet]) -> None:
        if self.n_negatives:
            empty = np.flatnonzero(rows.negative_counts == 0)
            if len(empty):  # the first row without negatives, named as select_negatives names it
                i = int(empty[0])
                select_negatives(rows.take([i])[0], i, self.n_negatives, self.cfg.seed, where=rows.where(i))
        if self.teacher_scores:
            unscored = np.flatnonzero(~np.asarray(rows.scored, dtype=bool))
            if len(unscored):
                i = int(unscored[0])
                raise DataError(f"{describe_row(i, rows.take([i])[0], rows.where(i))} has no teacher scores "
                                f"({len(unscored):,} of {len(rows):,} rows lack them), but objective.distill trains on "
                                "them: give every row a 'positive_score' and a score for each negative "
                                "('negative_scores', or each negative's 'score'; python -m moco_retrieval.mine "
                                "teacher=MODEL writes them)")
        self._train_rows, self._eval_sets = rows, eval_sets

    # -- loaders
    @property
    def batch_sampler(self) -> RetrievalBatchSampler:
        """The training batch sampler (created on first use; its rank and world size come from the
        constructor or, when not given, from torch.distributed, re-read if the process group
        appeared after the sampler was created)."""
        if self._sampler is not None and self._rank is None and self._world_size is None:
            if (self._sampler.rank, self._sampler.world_size) != rank_and_world():
                self._pending_state, self._sampler = self._sampler.state_dict(), None
        if self._sampler is None:
            cfg = self.cfg
            if cfg.stream:
                self.setup()
                self._sampler = self._stream_batches()
                if self._pending_state is not None:
                    self._sampler.load_state_dict(self._pending_state)
                    self._pending_state = None
                len(self._sampler)  # (a source too small for a batch: refused here)
                return self._sampler
            rows = self.train_rows
            self._sampler = self._new_sampler(rows)
            if self._pending_state is not None:
                self._sampler.load_state_dict(self._pending_state)
                self._pending_state = None
            try:
                n_batches = len(self._sampler)
                if n_batches:
                    self._sampler.check()  # said now, not at the first training step
            except ValueError as exc:  # a source too small for a batch, or too few distinct doc ids / groups for one
                prefix = "" if self.source_offsets is not None else f"data: {len(rows)} training pairs: "
                raise DataError(prefix + str(exc)) from None
            if n_batches == 0:
                raise DataError(
                    f"data: {len(rows)} training pairs make no full batch of data.batch_size={cfg.batch_size} "
                    f"x {self._sampler.world_size} rank(s)"
                )
        return self._sampler

    def _new_sampler(self, rows: PairRows) -> RetrievalBatchSampler | MultiSourceBatchSampler:
        """One source: RetrievalBatchSampler; ``data.sources``: MultiSourceBatchSampler over them."""
        cfg = self.cfg
        kw = dict(seed=cfg.seed, shuffle=cfg.shuffle, unique_in_batch=cfg.unique_in_batch, rank=self._rank,
                  world_size=self._world_size)
        if self.source_offsets is None:
            return RetrievalBatchSampler(rows.doc_ids, rows.groups, cfg.batch_size, **kw)
        # each source's sampler slices its own (memory-mapped) ids and groups: no joined copy per rank
        ids, groups = rows.source.segments("doc_id"), rows.source.segments("group")
        names = [f"data.sources[{i}] ({n})" for i, n in enumerate(source_names(cfg))]
        return MultiSourceBatchSampler(ids, groups, self.source_offsets, cfg.batch_size, weights=source_weights(cfg),
                                       mode=cfg.source_mode, names=names, **kw)

    def _stream_batches(self) -> StreamBatches:
        """The stream's batches of this rank (stream_batches.py): the same collate as the store's."""
        cfg, names = self.cfg, stream_names(self.cfg)
        rank, world = rank_and_world()
        rank = self._rank if self._rank is not None else rank
        world = self._world_size if self._world_size is not None else world
        return StreamBatches(cfg.stream_dir, names, [self.stream["sources"][n]["rows"] for n in names], cfg.batch_size,
                             self._collator(), seed=cfg.seed, shuffle=cfg.shuffle,
                             weights=source_weights(cfg) if has_sources(cfg) else None, mode=str(cfg.source_mode),
                             rank=rank, world_size=world, cache_dir=str(store_root(cfg).parent / "stream-cache"))

    def _collator(self) -> Collator:
        return Collator(self.tokenize, self.n_negatives, self.cfg.seed, self.source_offsets, self.prompts,
                        source_prompts(self.cfg) if self.source_offsets is not None else None, self.teacher_scores)

    def _fit_epoch(self) -> Optional[int]:
        """The fit loop's epoch (what a stream's loader starts), None outside a fit."""
        trainer = getattr(self, "trainer", None)
        return None if trainer is None else int(trainer.current_epoch)

    def train_dataloader(self) -> DataLoader:
        if self.cfg.stream:
            return StreamLoader(self.batch_sampler, self.cfg.num_workers, self._fit_epoch, state_fn=self.state_dict,
                                load_fn=self.load_state_dict)
        self.train_rows.open()  # mapped before the workers fork: they share the maps
        return ResumableDataLoader(
            self._dataset(),
            batch_sampler=self.batch_sampler,
            collate_fn=self._collator(),
            num_workers=self.cfg.num_workers,
            state_fn=self.state_dict,
            load_fn=self.load_state_dict,
        )

    def _dataset(self) -> PairRowsDataset:
        """The training rows as items; a source of documents makes each row's pair as it is drawn."""
        if self.source_offsets is None:
            views = [self.cfg.views if str(self.cfg.kind) == "documents" else None]
            offsets = [0, len(self.train_rows)]
        else:
            views, offsets = source_views(self.cfg), self.source_offsets
        if all(v is None for v in views):
            return PairRowsDataset(self.train_rows)
        return DocumentViews(self.train_rows, views, offsets, self.cfg.seed)

    @property
    def prompts(self):
        """``data.prompts`` (:mod:`.prompts`): the collate puts them before the texts."""
        return to_prompts(getattr(self.cfg, "prompts", None))

    def eval_shard(self, index: int = 0) -> tuple[int, int]:
        """``(rank, world size)`` that validation splits evaluation set ``index`` (of ``eval_sets``)
        over: each rank encodes its block of the documents and of the queries, and the module
        gathers them. ``(0, 1)`` (every rank the whole set) on one process, or when the set has fewer
        documents or queries than there are ranks: a rank without a batch would skip the validation
        loop and the gather."""
        ev = list(self.eval_sets.values())[index]
        rank, world = rank_and_world()
        if world == 1 or min(len(ev.corpus), len(ev.queries)) < world:
            return 0, 1
        return rank, world

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """This rank's share of the eval pool (:meth:`eval_shard`): documents, then queries; with
        several evaluation sets, one such DataLoader per set, in order (Lightning's dataloader_idx)."""
        loaders = []
        for index, ev in enumerate(self.eval_sets.values()):
            items = EvalItems(ev)
            loaders.append(DataLoader(
                items,
                batch_sampler=items.batches(self.cfg.eval_batch_size, *self.eval_shard(index)),
                collate_fn=EvalCollator(self.tokenize, self.prompts),
                num_workers=self.cfg.num_workers,
            ))
        return loaders[0] if len(loaders) == 1 else loaders

    # -- position in the epoch
    def _fit_progress(self) -> Optional[int]:
        """Batches of the sampler's epoch whose training step finished, from a running fit loop."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or self._sampler is None:
            return None
        try:
            from lightning.pytorch.trainer.states import TrainerFn

            if trainer.state.fn != TrainerFn.FITTING:
                return None
            fit_loop = trainer.fit_loop
            if fit_loop.epoch_progress.current.started <= self._sampler.epoch:
                return 0  # the sampler's epoch has not started yet (e.g. in on_train_epoch_start)
            return int(fit_loop.epoch_loop.batch_progress.current.processed)
        except AttributeError:
            return None

    def state_dict(self) -> dict:
        if self._sampler is None:
            state = dict(self._pending_state or {"epoch": 0, "batches_done": 0})
        else:
            state = self._sampler.state_dict()
            done = self._fit_progress()
            if done is not None:
                state["batches_done"] = done
        record = schedule_record(self.cfg)
        return state if record is None else {**state, "sources": record}

    def load_state_dict(self, state_dict: dict) -> None:
        check_same_schedule(state_dict.get("sources"), schedule_record(self.cfg))
        state = {"epoch": int(state_dict.get("epoch", 0)), "batches_done": int(state_dict.get("batches_done", 0))}
        if self._sampler is None:
            self._pending_state = state
        else:
            self._sampler.load_state_dict(state)

    def on_train_batch_end(self) -> None:
        """Count one more trained batch (hand-written loops; under Lightning the fit loop is used)."""
        self.batch_sampler.advance(1)


__all__ = ["RetrievalDataModule"]
