"""Test-wide settings (never reach the network, keep CPU threads modest, one data cache per session)
and the fixtures many test files share; the functions they share are in helpers.py.

The folders mirror the package (tests/objectives/ for moco_retrieval/objectives/, ...); the tests of
the commands, of the ground floor and of the docs stay here. tests/ and each folder are packages:
a test file imports ``from tests.helpers import ...``, never from another test file, and gloo ranks
import a test module by its full name (tests.objectives.test_two_queue)."""
import os
import random

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import SHARED_DEBIAN, train_checkpoint  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


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


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory) -> dict:
    """The environment of a command run as a subprocess on the smoke experiment: the shared Debian
    snapshot (skips without it), the session's data cache, one thread, unbuffered output."""
    if not SHARED_DEBIAN.exists():
        pytest.skip(f"the shared Debian snapshot is not at {SHARED_DEBIAN} (needed by the smoke experiment)")
    cache = os.environ.get("MOCO_RETRIEVAL_CACHE") or str(tmp_path_factory.mktemp("moco_cache"))
    return dict(os.environ, MOCO_RETRIEVAL_DEBIAN_DIR=str(SHARED_DEBIAN), MOCO_RETRIEVAL_CACHE=cache,
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="session")
def beir_dir(tmp_path_factory) -> str:
    """A BEIR folder of 40 documents of 6 words and 20 queries, some relevance graded or several."""
    from moco_retrieval.data.formats import EvalSet, write_beir

    words = ("file system network server image audio video text editor library python tool command line "
             "package manager compress archive backup font color terminal shell mail web browser").split()
    rng = random.Random(0)
    corpus, queries, qrels = {}, {}, {}
    for i in range(40):
        picked = rng.sample(words, 6)
        corpus[f"doc-{i:02d}"] = " ".join(picked)
        if i % 2 == 0:
            queries[f"q-{i:02d}"] = " ".join(picked[:2])
            qrels[f"q-{i:02d}"] = {f"doc-{i:02d}": 1, f"doc-{(i + 1):02d}": 0}
    qrels["q-00"][f"doc-{39:02d}"] = 2  # graded, several relevant
    d = tmp_path_factory.mktemp("beir") / "tiny"
    write_beir(d, EvalSet(corpus=corpus, queries=queries, qrels=qrels), "test")
    return str(d)


@pytest.fixture(scope="session")
def moco_checkpoint(tiny_dir, tmp_path_factory) -> str:
    """A real Lightning checkpoint of 2 MoCo steps on the tiny model (query and key encoders differ)."""
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.objectives.moco import MoCoConfig

    return train_checkpoint(ModelConfig(backbone="tiny", path=tiny_dir),
                            MoCoConfig(queue_size=16, temperature=0.1, momentum=0.5), tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="session")
def two_tower_checkpoint(tiny_dir, tmp_path_factory) -> str:
    """2 in-batch steps on two towers of the tiny model: both towers trained, apart."""
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.objectives.inbatch import InBatchConfig

    return train_checkpoint(ModelConfig(backbone="tiny", path=tiny_dir, shared_tower=False, head="linear", head_dim=8),
                            InBatchConfig(temperature=0.1), tmp_path_factory.mktemp("run2"))
