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
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

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
from moco_retrieval.data.sources import check_paths, debian_folder, load_eval_pool, load_training_rows
from moco_retrieval.data.store import ConcatStores, PairList, PairRows, PairRowsDataset


class RetrievalDataModule(L.LightningDataModule):
    """Training pairs and the evaluation set for ``cfg.kind`` (debian | jsonl | beir), read by
    :func:`.sources.load` on first use (``prepare_data`` builds the Debian set), or given already
    loaded (:meth:`from_loaded`).

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
        self._eval_set: Optional[EvalSet] = None
        self._sampler: Optional[RetrievalBatchSampler] = None
        self._pending_state: Optional[dict] = None
        self.data_dir: Optional[Path] = None  # the built Debian folder (kind=debian, when loaded here)
        self.source_offsets = None  # data.sources: source s is rows [offsets[s], offsets[s + 1]) (multisource.py)
        self.store_dir: Optional[Path] = None  # the converted store of the training pairs (one source, when loaded here)

    @classmethod
    def from_loaded(
        cls,
        cfg: Any,
        train_pairs: Sequence[Pair],
        eval_set: EvalSet,
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
        its batch, sampler and worker settings apply. ``where``: each pair's source location, for
        the message about a row without negatives."""
        dm = cls(cfg, tokenize, n_negatives, teacher_scores=teacher_scores, rank=rank, world_size=world_size)
        dm._set_data(PairRows(PairList(train_pairs, where)), eval_set)
        return dm

    # -- loading
    def prepare_data(self) -> None:
        if self._train_rows is None and self.cfg.kind == "debian":  # nothing to build once loaded (or given)
            debian_folder(self.cfg)

    def setup(self, stage: Optional[str] = None) -> None:
        if self._train_rows is None:
            self._load()

    @property
    def train_rows(self) -> PairRows:
        """The training rows: ids, groups and negative counts as arrays, texts read on demand."""
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
    def eval_set(self) -> EvalSet:
        if self._eval_set is None:
            self._load()
        assert self._eval_set is not None
        return self._eval_set

    def _load(self) -> None:
        if has_sources(self.cfg):  # one row space over every source's store (multisource.py)
            pool = load_eval_pool(self.cfg)  # (a missing eval_dir before any source converts)
            rows, self.source_offsets = load_source_rows(self.cfg)
            self._set_data(rows, pool.eval_set)
            return
        check_paths(self.cfg)  # every required path, before any file is read
        train = load_training_rows(self.cfg)
        self.data_dir, self.store_dir = train.folder, train.store
        self._set_data(train.rows, load_eval_pool(self.cfg, train.folder).eval_set)

    def data_keys(self) -> dict[str, Optional[str]]:
        """Each training source's store key (convert.py: a hash of its content and conversion options),
        by source name ("data": a single source); None for rows read without a store (beir)."""
        rows = self.train_rows
        parts = rows.source.sources if isinstance(rows.source, ConcatStores) else [rows]
        names = source_names(self.cfg) if has_sources(self.cfg) else ["data"]
        return {n: (Path(p.source.folder).name if hasattr(p.source, "folder") else None) for n, p in zip(names, parts)}

    def _set_data(self, rows: PairRows, eval_set: EvalSet) -> None:
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
        self._train_rows, self._eval_set = rows, eval_set

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
            rows = self.train_rows
            cfg = self.cfg
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

    def train_dataloader(self) -> DataLoader:
        self.train_rows.open()  # mapped before the workers fork: they share the maps
        return ResumableDataLoader(
            self._dataset(),
            batch_sampler=self.batch_sampler,
            collate_fn=Collator(self.tokenize, self.n_negatives, self.cfg.seed, self.source_offsets, self.prompts,
                                source_prompts(self.cfg) if self.source_offsets is not None else None,
                                self.teacher_scores),
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

    def eval_shard(self) -> tuple[int, int]:
        """``(rank, world size)`` that validation splits the eval pool over: each rank encodes its
        block of the documents and of the queries, and the module gathers them. ``(0, 1)`` (every
        rank the whole pool) on one process, or when the pool has fewer documents or queries than
        there are ranks: a rank without a batch would skip the validation loop and the gather."""
        rank, world = rank_and_world()
        if world == 1 or min(len(self.eval_set.corpus), len(self.eval_set.queries)) < world:
            return 0, 1
        return rank, world

    def val_dataloader(self) -> DataLoader:
        """This rank's share of the eval pool (:meth:`eval_shard`): documents, then queries."""
        items = EvalItems(self.eval_set)
        return DataLoader(
            items,
            batch_sampler=items.batches(self.cfg.eval_batch_size, *self.eval_shard()),
            collate_fn=EvalCollator(self.tokenize, self.prompts),
            num_workers=self.cfg.num_workers,
        )

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
