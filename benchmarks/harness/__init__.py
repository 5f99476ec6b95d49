"""The benchmarks' one library (lightly's ``benchmarks/`` is the model): a benchmark script is an
experiment table (its ``RUNS``) plus a report; what more than one script needs lives here, once.
Scripts import from here and never from each other.

* ``cli``: the options every script shares (``--out``, ``--threads``, ``--only``, ``--seeds``,
  ``--report``, ``--deadline``, ``--debian-dir`` / ``--cache``), the data locations they set, and
  the repository's paths.
* ``runs``: the run cache (a JSONL file of finished runs: skipped when present, appended when done,
  cut past a deadline, a retired run refused) and the result writer (``<name>.md`` + ``<name>.json``).
* ``report``: medians and spreads, the table cells, the environment a result was measured in, plots.
* ``training``: a config through Hydra's compose API, and many quiet Lightning runs in one process
  (the Debian set read once, frozen features cached once).
* ``equal_data``: B6's protocol, which B7, B11, B12 and B13 reuse: every run the same pairs in the
  same order, scored along the way; B6's run table.
* ``side_by_side``: one step of each run of a table in turn, side by side (seconds per pair), and each
  run's training memory on a CPU.
* ``steps``: one training step of our module outside Lightning, in the module's order, and one
  sentence-transformers peer trainer; ``step_memory``: a step's memory on a CPU.

Importing the harness sets the offline defaults every benchmark runs with (no W&B, no model hub)
and the data locations' defaults (``cli.set_locations``); it loads no torch (``index_scale``'s
measuring children rely on that; ``training``, ``equal_data``, ``side_by_side`` and ``steps`` do).
"""
import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.harness.cli import set_locations  # noqa: E402

set_locations()  # the defaults before any script loads data; cli.apply(args) applies its flags
