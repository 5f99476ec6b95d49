"""The benchmarks: measurements, not tests. Each script runs from the repository root as
``python -m benchmarks.NAME`` and imports only the harness (``benchmarks.harness``), never another
script; their tests are in ``benchmarks/tests``. See benchmarks/README.md.
"""
