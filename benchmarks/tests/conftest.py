"""The benchmark tests' own fixture; the settings and fixtures both test trees share (network off,
threads, one data cache, the Debian snapshot, the tiny BERT) are in the repository's conftest.py,
the shared helpers in tests/helpers.py."""
import pytest


@pytest.fixture
def synthetic_data():
    """tests.helpers' ``SyntheticData``: ``synthetic_data(tokenize, batch_size=4)`` is a data module
    in the batch contract of docs/design.md; its ``train_dataloader()`` works without a trainer too."""
    from tests.helpers import SyntheticData

    return SyntheticData
