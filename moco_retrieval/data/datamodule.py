"""The Lightning data module: loading by ``data.kind``, the collate, and the batch sampler.

Batches follow the contract in ``docs/design.md``. The training batch sampler
(:class:`RetrievalBatchSampler`) shuffles with a seed, shards across ranks itself (run Lightning
with ``use_distributed_sampler=False``), keeps a document id or a group out of a batch twice, and
resumes mid-epoch.

Position in the epoch (resume). :meth:`RetrievalDataModule.state_dict` returns
``{"epoch", "batches_done"}``; Lightning stores it in every checkpoint and hands it back to
:meth:`RetrievalDataModule.load_state_dict` before the training dataloader is iterated, so the
resumed epoch yields exactly the batches that were not trained on yet. Under a Lightning fit,
``batches_done`` is derived from the fit loop (``batch_progress.current.processed``: batches whose
training step finished, which is right for checkpoints saved in ``on_train_batch_end``, at
validation and at the end of an epoch), so the lightning module need not call anything. Outside
Lightning (a hand-written loop) call :meth:`RetrievalDataModule.on_train_batch_end` after each
trained batch (or ``sampler.advance()``). The training DataLoader also implements
``state_dict``/``load_state_dict`` (the same state), which tells Lightning it is resumable.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .formats import (
    DataError,
    EvalSet,
    Negative,
    Pair,
    beir_train_pairs,
    read_beir,
    read_beir_splits,
    read_pairs_jsonl_located,
)
from .ids import NO_GROUP

Tokenize = Callable[[list[str], str], dict]
KINDS = ("debian", "jsonl", "beir")


# ------------------------------------------------------------------------------------- tokenize


class HFTokenize:
    """``tokenize(texts, kind)`` from a Hugging Face tokenizer: truncation to the kind's max length
    (queries and documents apart) and dynamic padding to the longest text of the batch."""

    def __init__(self, tokenizer: Any, query_max_len: int = 32, doc_max_len: int = 128):
        self.tokenizer = tokenizer
        self.max_len = {"query": int(query_max_len), "doc": int(doc_max_len)}

    def __call__(self, texts: list[str], kind: str) -> dict[str, torch.Tensor]:
        if kind not in self.max_len:
            raise ValueError(f"kind={kind!r}: expected 'query' or 'doc'")
        enc = self.tokenizer(
            list(texts),
            max_length=self.max_len[kind],
            truncation=True,
            padding="longest",
            return_tensors="pt",
            return_token_type_ids=False,
        )
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


# --------------------------------------------------------------------------------------- collate


class PairDataset(Dataset):
    """Items are ``(row index, Pair)`` so the collate knows each row's index."""

    def __init__(self, pairs: Sequence[Pair]):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[int, Pair]:
        return i, self.pairs[i]


def _side(texts: list[str], kind: str, tokenize: Optional[Tokenize]) -> dict:
    side: dict[str, Any] = {"texts": texts}
    if tokenize is not None:
        side.update(dict(tokenize(texts, kind)))
    return side


def _describe(index: int, pair: Pair, where: Optional[str] = None) -> str:
    q = pair.query if len(pair.query) <= 60 else pair.query[:57] + "..."
    qid = f", query_id {pair.query_id!r}" if pair.query_id is not None else ""
    loc = f"{where}: " if where else ""
    return f"{loc}training example {index}{qid} (query {q!r})"


def select_negatives(pair: Pair, index: int, n: int, seed: int = 0, where: Optional[str] = None) -> list[Negative]:
    """``n`` hard negatives of a row: its first ``n``; a row with fewer is padded by sampling its own
    negatives with replacement (generator seeded by ``(seed, index)``: the same every time)."""
    negs = pair.negatives
    if not negs:
        raise DataError(
            f"{_describe(index, pair, where)} has no negatives, but {n} hard negatives per row were requested "
            "(give every row a 'negatives' list, or train without hard negatives)"
        )
    if len(negs) >= n:
        return list(negs[:n])
    rng = np.random.default_rng([int(seed), int(index)])
    extra = rng.integers(0, len(negs), size=n - len(negs))
    return list(negs) + [negs[int(j)] for j in extra]


def collate(
    items: Sequence[tuple[int, Pair]],
    tokenize: Optional[Tokenize] = None,
    n_negatives: Optional[int] = None,
    seed: int = 0,
) -> dict:
    """``(index, Pair)`` items -> the batch dict of docs/design.md."""
    idx = [int(i) for i, _ in items]
    pairs = [p for _, p in items]
    batch: dict[str, Any] = {
        "query": _side([p.query for p in pairs], "query", tokenize),
        "doc": _side([p.positive for p in pairs], "doc", tokenize),
        "doc_id": torch.tensor([p.doc_id for p in pairs], dtype=torch.long),
        "group": torch.tensor([p.group for p in pairs], dtype=torch.long),
        "index": torch.tensor(idx, dtype=torch.long),
    }
    if n_negatives:
        negs = [neg for i, p in zip(idx, pairs) for neg in select_negatives(p, i, n_negatives, seed)]
        batch["neg"] = _side([n.text for n in negs], "doc", tokenize)
        batch["neg_id"] = torch.tensor([n.doc_id for n in negs], dtype=torch.long)
        batch["neg_group"] = torch.tensor([n.group for n in negs], dtype=torch.long)
    return batch


class Collator:
    """Picklable ``collate`` with its settings (for DataLoader workers)."""

    def __init__(self, tokenize: Optional[Tokenize] = None, n_negatives: Optional[int] = None, seed: int = 0):
        self.tokenize, self.n_negatives, self.seed = tokenize, n_negatives, seed

    def __call__(self, items: Sequence[tuple[int, Pair]]) -> dict:
        return collate(items, self.tokenize, self.n_negatives, self.seed)


class EvalItems(Dataset):
    """The eval pool as ``(kind, id, text)`` items: every document, then every query."""

    def __init__(self, eval_set: EvalSet):
        self.items = [("doc", i, t) for i, t in eval_set.corpus.items()] + [
            ("query", i, t) for i, t in eval_set.queries.items()
        ]
        self.n_docs = len(eval_set.corpus)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[str, str, str]:
        return self.items[i]

    def batches(self, batch_size: int) -> list[list[int]]:
        """Index batches of one kind each: documents first, then queries."""
        n = len(self.items)
        out = [list(range(s, min(s + batch_size, self.n_docs))) for s in range(0, self.n_docs, batch_size)]
        out += [list(range(s, min(s + batch_size, n))) for s in range(self.n_docs, n, batch_size)]
        return out


class EvalCollator:
    def __init__(self, tokenize: Optional[Tokenize] = None):
        self.tokenize = tokenize

    def __call__(self, items: Sequence[tuple[str, str, str]]) -> dict:
        kinds = {k for k, _, _ in items}
        assert len(kinds) == 1, "an eval batch holds one kind"
        kind = kinds.pop()
        out: dict[str, Any] = {"kind": kind, "ids": [i for _, i, _ in items]}
        out.update(_side([t for _, _, t in items], kind, self.tokenize))
        return out


# --------------------------------------------------------------------------------------- sampler


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


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
            d_rank, d_world = _dist_rank_world()
            rank = d_rank if rank is None else rank
            world_size = d_world if world_size is None else world_size
        elif rank is None:
            rank, world_size = _dist_rank_world()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        self.doc_ids = [int(x) for x in doc_ids]
        self.groups = [int(x) for x in groups]
        self.batch_size = int(batch_size)
        self.seed, self.shuffle, self.unique_in_batch = int(seed), bool(shuffle), bool(unique_in_batch)
        self.rank, self.world_size = int(rank), int(world_size)
        self.epoch = 0
        self.batches_done = 0
        self._cache: Optional[tuple[int, list[list[int]]]] = None
        # Lightning calls set_epoch on ``dataloader.sampler`` and ``dataloader.batch_sampler.sampler``,
        # not on the batch sampler itself: this attribute routes it here.
        self.sampler = _EpochSetter(self)

    # -- epoch plan
    def order(self, epoch: int) -> np.ndarray:
        n = len(self.doc_ids)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(n)

    def global_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' batches of ``epoch`` (each ``batch_size * world_size`` rows)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        gb = self.batch_size * self.world_size
        order = self.order(epoch).tolist()
        if not self.unique_in_batch:
            batches = [order[s : s + gb] for s in range(0, len(order) - gb + 1, gb)]
        else:
            batches = self._unique_batches(order, gb)
        self._cache = (epoch, batches)
        return batches

    def _unique_batches(self, order: list[int], gb: int) -> list[list[int]]:
        ids, groups = self.doc_ids, self.groups
        batches: list[list[int]] = []
        pending: list[int] = []
        stream = iter(order)
        while True:
            batch: list[int] = []
            used_ids: set[int] = set()
            used_groups: set[int] = set()

            def fits(i: int) -> bool:
                return ids[i] not in used_ids and (groups[i] == NO_GROUP or groups[i] not in used_groups)

            def add(i: int) -> None:
                batch.append(i)
                used_ids.add(ids[i])
                if groups[i] != NO_GROUP:
                    used_groups.add(groups[i])

            still: list[int] = []
            for k, i in enumerate(pending):
                if len(batch) == gb:
                    still.extend(pending[k:])
                    break
                if fits(i):
                    add(i)
                else:
                    still.append(i)
            pending = still
            while len(batch) < gb:
                i = next(stream, None)
                if i is None:
                    break
                if fits(i):
                    add(i)
                else:
                    pending.append(i)
            if len(batch) < gb:
                return batches  # the stream is exhausted: drop the partial batch and the deferred rows
            batches.append(batch)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
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
            yield list(batch)

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


class _ResumableDataLoader(DataLoader):
    """A DataLoader with the sampler's position as its state, so Lightning treats it as resumable."""

    def __init__(self, *args, state_fn: Callable[[], dict], load_fn: Callable[[dict], None], **kwargs):
        super().__init__(*args, **kwargs)
        self._state_fn, self._load_fn = state_fn, load_fn

    def state_dict(self) -> dict:
        return self._state_fn()

    def load_state_dict(self, state: dict) -> None:
        self._load_fn(state)


# ----------------------------------------------------------------------------------- datamodule


class RetrievalDataModule(L.LightningDataModule):
    """Training pairs and the evaluation set for ``cfg.kind`` (debian | jsonl | beir).

    * ``debian``: :func:`~.debian.ensure_debian_dataset` -> ``train.jsonl`` + ``eval/`` (split ``test``).
    * ``jsonl``: ``cfg.train_path`` pairs; ``cfg.eval_dir`` BEIR folder, split ``cfg.eval_split``.
    * ``beir``: ``cfg.dir``; train from ``qrels/<train_split>.tsv``, eval from ``qrels/<eval_split>.tsv``.

    Caps (deterministic from ``cfg.seed``, original order kept): ``max_train_examples`` rows;
    ``max_eval_queries`` queries; ``max_eval_docs`` documents, always keeping every relevant
    (score > 0) document of the kept queries.

    ``tokenize(texts, "query"|"doc") -> {"input_ids", "attention_mask"}`` pads dynamically; None
    gives text-only batches. ``n_negatives``: hard negatives per row in each batch (every row
    needs at least one; fewer are padded, see :func:`select_negatives`).
    """

    def __init__(
        self,
        cfg: Any,
        tokenize: Optional[Tokenize] = None,
        n_negatives: Optional[int] = None,
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.tokenize = tokenize
        self.n_negatives = int(n_negatives) if n_negatives else None
        self._rank, self._world_size = rank, world_size
        self._train_pairs: Optional[list[Pair]] = None
        self._eval_set: Optional[EvalSet] = None
        self._sampler: Optional[RetrievalBatchSampler] = None
        self._pending_state: Optional[dict] = None
        self.data_dir: Optional[Path] = None  # the built Debian folder (kind=debian)

    # -- loading
    def prepare_data(self) -> None:
        if self.cfg.kind == "debian":
            from .debian import ensure_debian_dataset

            ensure_debian_dataset(self.cfg)

    def setup(self, stage: Optional[str] = None) -> None:
        if self._train_pairs is None:
            self._load()

    @property
    def train_pairs(self) -> list[Pair]:
        if self._train_pairs is None:
            self._load()
        assert self._train_pairs is not None
        return self._train_pairs

    @property
    def eval_set(self) -> EvalSet:
        if self._eval_set is None:
            self._load()
        assert self._eval_set is not None
        return self._eval_set

    def _load(self) -> None:
        cfg = self.cfg
        kind = cfg.kind
        if kind == "debian":
            from .debian import ensure_debian_dataset

            d = ensure_debian_dataset(cfg)
            self.data_dir = d
            located = read_pairs_jsonl_located(d / "train.jsonl")
            where = [f"{d / 'train.jsonl'}:{line}" for line, _ in located]
            pairs = [p for _, p in located]
            eval_set = read_beir(d / "eval", "test")
        elif kind == "jsonl":
            train_path = _need(cfg, "train_path", kind, "a JSONL file of training pairs", file=True)
            eval_dir = _need(cfg, "eval_dir", kind, "a BEIR-layout folder for validation", file=False)
            located = read_pairs_jsonl_located(train_path)
            where = [f"{train_path}:{line}" for line, _ in located]
            pairs = [p for _, p in located]
            eval_set = read_beir(eval_dir, cfg.eval_split)
        elif kind == "beir":
            d = _need(cfg, "dir", kind, "a BEIR folder with corpus.jsonl, queries.jsonl, qrels/", file=False)
            splits = read_beir_splits(d, [cfg.train_split, cfg.eval_split])
            pairs = beir_train_pairs(splits[cfg.train_split])
            where = [f"{d / 'qrels' / (cfg.train_split + '.tsv')} (query {p.query_id!r})" for p in pairs]
            eval_set = splits[cfg.eval_split]
        else:
            raise DataError(f"data.kind={kind!r}: expected one of {', '.join(KINDS)}")
        if not pairs:
            raise DataError(f"data={kind}: no training pairs")
        keep = _subset(len(pairs), cfg.max_train_examples, [cfg.seed, 1])
        if keep is not None:
            pairs = [pairs[i] for i in keep]
            where = [where[i] for i in keep]
        if self.n_negatives:
            for i, p in enumerate(pairs):
                select_negatives(p, i, self.n_negatives, cfg.seed, where=where[i])  # raises on a row without any
        self._train_pairs = pairs
        self._eval_set = cap_eval_set(eval_set, cfg.max_eval_queries, cfg.max_eval_docs, cfg.seed)

    # -- loaders
    @property
    def batch_sampler(self) -> RetrievalBatchSampler:
        """The training batch sampler (created on first use; its rank and world size come from the
        constructor or, when not given, from torch.distributed, re-read if the process group
        appeared after the sampler was created)."""
        if self._sampler is not None and self._rank is None and self._world_size is None:
            if (self._sampler.rank, self._sampler.world_size) != _dist_rank_world():
                self._pending_state, self._sampler = self._sampler.state_dict(), None
        if self._sampler is None:
            pairs = self.train_pairs
            cfg = self.cfg
            self._sampler = RetrievalBatchSampler(
                [p.doc_id for p in pairs],
                [p.group for p in pairs],
                cfg.batch_size,
                seed=cfg.seed,
                shuffle=cfg.shuffle,
                unique_in_batch=cfg.unique_in_batch,
                rank=self._rank,
                world_size=self._world_size,
            )
            if self._pending_state is not None:
                self._sampler.load_state_dict(self._pending_state)
                self._pending_state = None
            if len(self._sampler) == 0:
                raise DataError(
                    f"data: {len(pairs)} training pairs make no full batch of data.batch_size={cfg.batch_size} "
                    f"x {self._sampler.world_size} rank(s)"
                )
        return self._sampler

    def train_dataloader(self) -> DataLoader:
        return _ResumableDataLoader(
            PairDataset(self.train_pairs),
            batch_sampler=self.batch_sampler,
            collate_fn=Collator(self.tokenize, self.n_negatives, self.cfg.seed),
            num_workers=self.cfg.num_workers,
            state_fn=self.state_dict,
            load_fn=self.load_state_dict,
        )

    def val_dataloader(self) -> DataLoader:
        """The whole eval pool on every rank (no sharding): documents, then queries."""
        items = EvalItems(self.eval_set)
        return DataLoader(
            items,
            batch_sampler=items.batches(self.cfg.eval_batch_size),
            collate_fn=EvalCollator(self.tokenize),
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

    def state_dict(self) -> dict[str, int]:
        if self._sampler is None:
            return dict(self._pending_state or {"epoch": 0, "batches_done": 0})
        state = self._sampler.state_dict()
        done = self._fit_progress()
        if done is not None:
            state["batches_done"] = done
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state = {"epoch": int(state_dict.get("epoch", 0)), "batches_done": int(state_dict.get("batches_done", 0))}
        if self._sampler is None:
            self._pending_state = state
        else:
            self._sampler.load_state_dict(state)

    def on_train_batch_end(self) -> None:
        """Count one more trained batch (hand-written loops; under Lightning the fit loop is used)."""
        self.batch_sampler.advance(1)


def _need(cfg: Any, key: str, kind: str, what: str, file: bool) -> Path:
    value = getattr(cfg, key, None)
    if not value:
        raise DataError(f"data.{key} is required with data={kind} ({what})")
    p = Path(value).expanduser()
    if file and not p.is_file():
        raise DataError(f"data.{key}={value}: no such file ({what})")
    if not file and not p.is_dir():
        raise DataError(f"data.{key}={value}: no such directory ({what})")
    return p


def _subset(n: int, cap: Optional[int], seed: list[int]) -> Optional[list[int]]:
    """Sorted indices of a seeded subset of ``cap`` of ``n`` rows (None: keep all)."""
    if cap is None or cap >= n:
        return None
    if cap < 1:
        raise DataError(f"caps must be >= 1, got {cap}")
    return sorted(np.random.default_rng(seed).permutation(n)[:cap].tolist())


def cap_eval_set(
    ev: EvalSet, max_queries: Optional[int] = None, max_docs: Optional[int] = None, seed: int = 0
) -> EvalSet:
    """A deterministic smaller eval set: ``max_queries`` queries, ``max_docs`` documents (every
    relevant document of the kept queries is kept, even beyond ``max_docs``)."""
    if max_queries is None and max_docs is None:
        return ev
    qids = list(ev.queries)
    keep_q = _subset(len(qids), max_queries, [seed, 2])
    if keep_q is not None:
        qids = [qids[i] for i in keep_q]
    qrels = {q: ev.qrels[q] for q in qids}
    corpus = ev.corpus
    if max_docs is not None:
        relevant = {d for q in qids for d, s in ev.qrels[q].items() if s > 0}
        if len(relevant) > max_docs:
            print(
                f"[moco_retrieval] data.max_eval_docs={max_docs} is below the {len(relevant)} relevant documents "
                "of the kept queries; keeping those",
                file=sys.stderr,
            )
        others = [d for d in ev.corpus if d not in relevant]
        room = max(0, max_docs - len(relevant))
        if room == 0:
            chosen = relevant
        else:
            pick = _subset(len(others), room, [seed, 3])
            chosen = relevant | (set(others) if pick is None else {others[i] for i in pick})
        corpus = {d: t for d, t in ev.corpus.items() if d in chosen}
        qrels = {q: {d: s for d, s in rel.items() if d in corpus} for q, rel in qrels.items()}
    groups = None if ev.doc_groups is None else {d: g for d, g in ev.doc_groups.items() if d in corpus}
    return EvalSet(corpus=corpus, queries={q: ev.queries[q] for q in qids}, qrels=qrels, doc_groups=groups)


__all__ = [
    "HFTokenize",
    "PairDataset",
    "collate",
    "Collator",
    "select_negatives",
    "EvalItems",
    "EvalCollator",
    "RetrievalBatchSampler",
    "RetrievalDataModule",
    "cap_eval_set",
]
