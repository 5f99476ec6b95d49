"""The benchmarks' shared harness (lightly's ``benchmarks/`` is the model): a benchmark script is an
experiment table (its ``RUNS``) plus a report; what every script needs lives here, once.

* ``cli``: the options every script shares (``--out``, ``--threads``, ``--only``, ``--seeds``,
  ``--report``, ``--deadline``, ``--debian-dir`` / ``--cache``) and the data locations they set.
* ``runs``: the run cache (a JSONL file of finished runs: skipped when present, appended when done,
  cut past a deadline) and the result writer (``<name>.md`` + ``<name>.json``).
* ``steps``: one training step of our module outside Lightning, in the module's order, and one
  sentence-transformers peer trainer.
"""
