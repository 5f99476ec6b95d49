"""The fixtures many test files share (the settings and fixtures this tree shares with
benchmarks/tests/ are in the repository's conftest.py); the functions they share are in helpers.py.

The folders mirror the package (tests/objectives/ for moco_retrieval/objectives/, ...); the tests of
the commands, of the ground floor and of the docs stay here. tests/ and each folder are packages:
a test file imports ``from tests.helpers import ...``, never from another test file, and gloo ranks
import a test module by its full name (tests.objectives.test_two_queue)."""
import os
import random

import pytest

from tests.helpers import SHARED_DEBIAN, train_checkpoint


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
