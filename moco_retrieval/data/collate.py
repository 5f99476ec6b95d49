"""The collate: ``(index, Pair)`` items -> the training batch dict of ``docs/design.md``, and the
evaluation pool's items and batches (one kind, documents or queries, per batch).

``tokenize(texts, "query"|"doc") -> {"input_ids", "attention_mask"}`` (e.g. ``TextEncoder.tokenize``)
pads dynamically; None gives text-only batches. ``prompts`` (:mod:`.prompts`) prefix each side's
texts before they are tokenized: a side's ``texts`` are what the model sees.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from moco_retrieval.distributed import shard_range

from moco_retrieval.data.formats import DataError, EvalSet, Negative, Pair
from moco_retrieval.data.prompts import NO_PROMPTS, Prompts, apply_by_row, by_row
from moco_retrieval.data.sampler import source_of

Tokenize = Callable[[list[str], str], dict]


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


def describe_row(index: int, pair: Pair, where: Optional[str] = None) -> str:
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
            f"{describe_row(index, pair, where)} has no negatives, but {n} hard negatives per row were requested "
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
    source_offsets: Optional[Sequence[int]] = None,
    prompts: Prompts = NO_PROMPTS,
    source_prompts: Optional[Sequence[Prompts]] = None,
    scores: bool = False,
) -> dict:
    """``(index, Pair)`` items -> the batch dict of docs/design.md; with ``source_offsets`` (several
    sources, see :class:`.sampler.MultiSourceBatchSampler`) it holds each row's ``source`` too, and
    ``source_prompts`` (one :class:`.prompts.Prompts` per source) replace ``prompts``; ``scores``:
    the teacher's scores of the positives and of the chosen hard negatives (``pos_score``,
    ``neg_score``; every row must be scored, which the data module checks up front)."""
    idx = [int(i) for i, _ in items]
    pairs = [p for _, p in items]
    sources = None if source_offsets is None else source_of(idx, source_offsets)
    if source_prompts is not None and sources is None:
        raise ValueError("source_prompts need source_offsets")
    rows = [prompts] * len(idx) if source_prompts is None else by_row(source_prompts, sources)
    batch: dict[str, Any] = {
        "query": _side(apply_by_row(rows, [p.query for p in pairs], "query"), "query", tokenize),
        "doc": _side(apply_by_row(rows, [p.positive for p in pairs], "doc"), "doc", tokenize),
        "doc_id": torch.tensor([p.doc_id for p in pairs], dtype=torch.long),
        "group": torch.tensor([p.group for p in pairs], dtype=torch.long),
        "index": torch.tensor(idx, dtype=torch.long),
    }
    if sources is not None:
        batch["source"] = torch.as_tensor(sources, dtype=torch.long)
    if n_negatives:
        negs = [neg for i, p in zip(idx, pairs) for neg in select_negatives(p, i, n_negatives, seed)]
        neg_rows = [r for r in rows for _ in range(n_negatives)]
        batch["neg"] = _side(apply_by_row(neg_rows, [n.text for n in negs], "doc"), "doc", tokenize)
        batch["neg_id"] = torch.tensor([n.doc_id for n in negs], dtype=torch.long)
        batch["neg_group"] = torch.tensor([n.group for n in negs], dtype=torch.long)
        if scores:
            batch["pos_score"] = torch.tensor([p.positive_score for p in pairs], dtype=torch.float32)
            batch["neg_score"] = torch.tensor([n.score for n in negs], dtype=torch.float32)
    elif scores:
        raise ValueError("teacher scores are those of the hard negatives: collate them with n_negatives")
    return batch


class Collator:
    """Picklable ``collate`` with its settings (for DataLoader workers)."""

    def __init__(self, tokenize: Optional[Tokenize] = None, n_negatives: Optional[int] = None, seed: int = 0,
                 source_offsets: Optional[Sequence[int]] = None, prompts: Prompts = NO_PROMPTS,
                 source_prompts: Optional[Sequence[Prompts]] = None, scores: bool = False):
        self.tokenize, self.n_negatives, self.seed = tokenize, n_negatives, seed
        self.source_offsets, self.prompts, self.source_prompts = source_offsets, prompts, source_prompts
        self.scores = scores

    def __call__(self, items: Sequence[tuple[int, Pair]]) -> dict:
        return collate(items, self.tokenize, self.n_negatives, self.seed, self.source_offsets, self.prompts,
                       self.source_prompts, self.scores)


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

    def batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> list[list[int]]:
        """Index batches of one kind each: documents first, then queries; of rank ``rank``'s
        contiguous block of each (``distributed.shard_range``) when ``world_size > 1``."""
        n_queries = len(self.items) - self.n_docs
        d0, d1 = shard_range(self.n_docs, rank, world_size)
        q0, q1 = (self.n_docs + i for i in shard_range(n_queries, rank, world_size))
        out = [list(range(s, min(s + batch_size, d1))) for s in range(d0, d1, batch_size)]
        out += [list(range(s, min(s + batch_size, q1))) for s in range(q0, q1, batch_size)]
        return out


class EvalCollator:
    def __init__(self, tokenize: Optional[Tokenize] = None, prompts: Prompts = NO_PROMPTS):
        self.tokenize, self.prompts = tokenize, prompts

    def __call__(self, items: Sequence[tuple[str, str, str]]) -> dict:
        kinds = {k for k, _, _ in items}
        assert len(kinds) == 1, "an eval batch holds one kind"
        kind = kinds.pop()
        out: dict[str, Any] = {"kind": kind, "ids": [i for _, i, _ in items]}
        out.update(_side(self.prompts.apply([t for _, _, t in items], kind), kind, self.tokenize))
        return out


__all__ = [
    "Tokenize",
    "PairDataset",
    "describe_row",
    "select_negatives",
    "collate",
    "Collator",
    "EvalItems",
    "EvalCollator",
]
