"""The benchmark tests' settings and fixtures, on their own (they import nothing from tests/): never
reach the network, keep CPU threads modest, one data cache per session; the shared Debian snapshot,
a tiny random BERT, and a small synthetic data module in the module's batch contract."""
import os
import random
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

REPO = Path(__file__).resolve().parents[2]
SHARED_DEBIAN = REPO.parent / "shared" / "data" / "debian-bookworm"


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Built data sets and tiny models go to one cache per test session (the Debian set is built
    once, in seconds, from ../shared/data when it is there)."""
    os.environ.setdefault("MOCO_RETRIEVAL_CACHE", str(tmp_path_factory.mktemp("moco_cache")))
    if SHARED_DEBIAN.exists():
        os.environ.setdefault("MOCO_RETRIEVAL_DEBIAN_DIR", str(SHARED_DEBIAN))
    yield


@pytest.fixture
def debian_dir():
    if not SHARED_DEBIAN.exists():
        pytest.skip(f"the shared Debian snapshot is not at {SHARED_DEBIAN}")
    return SHARED_DEBIAN


@pytest.fixture
def one_thread():
    """Tiny models on a shared machine: one intra-op thread is many times faster than two busy ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random BERT (the package's ``model=tiny`` builder) in a folder of its own."""
    from moco_retrieval.model.tiny import build_tiny_bert

    return str(build_tiny_bert(tmp_path_factory.mktemp("tiny") / "bert"))


WORDS = "apple banana cherry delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


class SyntheticBatches(torch.utils.data.IterableDataset):
    """``batches`` batches of random word documents and their first three words as queries; batch
    b depends only on (seed, b, rank)."""

    def __init__(self, tokenize, batch_size: int, batches: int, seed: int, rank: int):
        self.tokenize, self.batch_size, self.batches, self.seed, self.rank = tokenize, batch_size, batches, seed, rank

    def __len__(self):
        return self.batches

    def __iter__(self):
        for b in range(self.batches):
            rng = random.Random(f"{self.seed}-0-{b}-{self.rank}")
            docs = [" ".join(rng.choices(WORDS, k=8)) for _ in range(self.batch_size)]
            queries = [" ".join(d.split()[:3]) for d in docs]
            yield {
                "query": {"texts": queries, **self.tokenize(queries, "query")},
                "doc": {"texts": docs, **self.tokenize(docs, "doc")},
                "doc_id": torch.tensor([rng.randrange(10_000) for _ in docs]),
                "group": torch.full((len(docs),), -1),
                "index": torch.arange(len(docs)),
            }


class SyntheticData(L.LightningDataModule):
    """A small deterministic data module in the batch contract of docs/design.md, for the harness's
    steps, which should not depend on the real data pipeline."""

    def __init__(self, tokenize, batch_size: int = 4, batches: int = 5, seed: int = 0):
        super().__init__()
        self.tokenize, self.batch_size, self.batches, self.seed = tokenize, batch_size, batches, seed

    def train_dataloader(self):
        rank = self.trainer.global_rank if self.trainer else 0
        dataset = SyntheticBatches(self.tokenize, self.batch_size, self.batches, self.seed, rank)
        return torch.utils.data.DataLoader(dataset, batch_size=None)


@pytest.fixture
def synthetic_data():
    """``SyntheticData``: ``synthetic_data(tokenize, batch_size=4)`` is a data module; its
    ``train_dataloader()`` works without a trainer too."""
    return SyntheticData
