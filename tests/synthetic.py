"""SyntheticData for tests/test_bench_harness.py, which imports it from here and moves beside the
benchmarks (issue 43, point 6). Everything else imports it from helpers.py; delete this file with
that move."""
from helpers import SyntheticData  # noqa: F401
