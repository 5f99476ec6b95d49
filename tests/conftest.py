"""Test-wide settings: never reach the network, keep CPU threads modest, one data cache per session."""
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

REPO = Path(__file__).resolve().parents[1]
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
