"""B14's table (benchmarks/queue_cost.py): every row composes as a strict config of the main job's
protocol, and each is a memory of online keys (no EMA key encoder to pay for)."""
from __future__ import annotations

from benchmarks import queue_cost
from benchmarks.harness import equal_data
from benchmarks.harness.training import compose_cfg


def test_every_row_is_an_online_memory_at_its_batch():
    for name, (kind, batch, overrides, _) in queue_cost.RUNS.items():
        obj = compose_cfg(equal_data.BASE + list(overrides) + [f"data.batch_size={batch}"]).objective
        assert kind == "ours" and obj.keys == "online", name
        steps = min(obj.queue_size // batch, obj.queue_max_age or obj.queue_size)  # a key's life in steps
        assert steps * batch == 128 * 32 and obj.queue_size == 4096, name  # the main job's span of pairs
    xbm = compose_cfg(equal_data.BASE + list(queue_cost.RUNS["xbm-32"][2])).objective
    assert xbm.name == "moco" and xbm.batch_negatives  # one document bank beside the batch
