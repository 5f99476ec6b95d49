"""What both test trees (tests/ and benchmarks/tests/) share: never reach the network, keep CPU
threads modest, one data cache per session; the shared Debian snapshot and a tiny random BERT.
Each tree's own fixtures are in its conftest.py, the functions tests share in tests/helpers.py."""
import os
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

SHARED_DEBIAN = Path(__file__).resolve().parent.parent / "shared" / "data" / "debian-bookworm"


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


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """The tiny random BERT (model/tiny.py; the same files for the same arguments), built once: tests
    read it, none writes into it."""
    from moco_retrieval.model.tiny import build_tiny_bert

    return str(build_tiny_bert(tmp_path_factory.mktemp("tiny") / "bert"))
