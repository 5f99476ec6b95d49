"""A small deterministic data module in the batch contract of docs/design.md, for tests of the
training core that should not depend on the real data pipeline. Batch b of epoch e depends only
on (seed, e, b, rank), so runs are reproducible and resumable at epoch boundaries."""
from __future__ import annotations

import random

import lightning as L
import torch

WORDS = "apple banana cherry delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


class SyntheticBatches(torch.utils.data.IterableDataset):
    def __init__(self, tokenize, batch_size, batches, seed, rank, id_offset, epoch_fn=lambda: 0):
        self.tokenize, self.batch_size, self.batches = tokenize, batch_size, batches
        self.seed, self.rank, self.id_offset, self.epoch_fn = seed, rank, id_offset, epoch_fn

    def __len__(self):
        return self.batches

    def __iter__(self):
        epoch = self.epoch_fn()
        for b in range(self.batches):
            rng = random.Random(f"{self.seed}-{epoch}-{b}-{self.rank}")
            docs = [" ".join(rng.choices(WORDS, k=8)) for _ in range(self.batch_size)]
            queries = [" ".join(d.split()[:3]) for d in docs]
            ids = torch.tensor([self.id_offset + rng.randrange(10_000) for _ in docs])
            yield {
                "query": {"texts": queries, **self.tokenize(queries, "query")},
                "doc": {"texts": docs, **self.tokenize(docs, "doc")},
                "doc_id": ids,
                "group": torch.full((len(docs),), -1),
                "index": torch.arange(len(docs)),
            }


class SyntheticData(L.LightningDataModule):
    """``id_offset_per_rank`` makes each rank's document ids recognisable (rank r: r * offset + ...)."""

    def __init__(self, tokenize, batch_size=4, batches=5, seed=0, id_offset_per_rank=100_000):
        super().__init__()
        self.tokenize, self.batch_size, self.batches = tokenize, batch_size, batches
        self.seed, self.id_offset_per_rank = seed, id_offset_per_rank
        self.dataset = None

    def train_dataloader(self):
        trainer = self.trainer
        rank = trainer.global_rank if trainer else 0
        self.dataset = SyntheticBatches(self.tokenize, self.batch_size, self.batches, self.seed, rank,
                                        rank * self.id_offset_per_rank,
                                        epoch_fn=lambda: trainer.current_epoch if trainer else 0)
        return torch.utils.data.DataLoader(self.dataset, batch_size=None)
