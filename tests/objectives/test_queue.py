import pytest
import torch

from moco_retrieval.config import ConfigError
from moco_retrieval.objectives.memory import NegativeQueue
from moco_retrieval.objectives.moco import MoCoConfig


def test_fifo_order_with_wrap():
    q = NegativeQueue(size=7, dim=2)
    written = []
    for step in range(5):  # batches of 3 do not divide 7
        keys = torch.full((3, 2), float(step * 3)) + torch.arange(3).float().unsqueeze(1)
        ids = torch.arange(step * 3, step * 3 + 3)
        q.enqueue(keys, ids, ids % 2, step=step)
        written.extend(ids.tolist())
    assert q.fill == 7
    # the ring holds the 7 newest ids; slot order is the write order modulo 7
    expect = [None] * 7
    for pos, i in enumerate(written):
        expect[pos % 7] = i
    assert q.queue_ids.tolist() == expect
    assert int(q.queue_ptr) == len(written) % 7
    assert sorted(q.ids().tolist()) == written[-7:]
    assert torch.equal(q.queue_keys[:, 0].long(), q.queue_ids)
    assert q.queue_steps.tolist() == [w // 3 for w in expect]


def test_unfilled_slots_take_no_part():
    q = NegativeQueue(size=10, dim=4)
    assert q.logits(torch.randn(2, 4)).shape == (2, 0)
    q.enqueue(torch.eye(4)[:3], torch.tensor([1, 2, 3]), torch.tensor([-1, -1, -1]), step=4)
    assert q.fill == 3 and q.keys().shape == (3, 4)
    assert q.logits(torch.eye(4)).shape == (4, 3)
    assert q.mean_age(10) == pytest.approx(6.0)


def test_batch_larger_than_queue_keeps_newest():
    q = NegativeQueue(size=4, dim=1)
    q.enqueue(torch.arange(6).float().unsqueeze(1), torch.arange(6), torch.arange(6), step=0)
    assert sorted(q.ids().tolist()) == [2, 3, 4, 5]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_storage_gives_fp32_logits(dtype):
    q = NegativeQueue(size=50, dim=16, dtype=dtype, logits_chunk=7)
    keys = torch.nn.functional.normalize(torch.randn(50, 16), dim=1)
    q.enqueue(keys, torch.arange(50), torch.arange(50), step=0)
    x = torch.randn(3, 16, requires_grad=True)
    out = q.logits(x)
    assert out.dtype == torch.float32
    ref = x @ q.queue_keys.float().T
    assert torch.allclose(out, ref, atol=1e-5)
    out.sum().backward()  # the query side still gets its gradient
    assert torch.allclose(x.grad, q.queue_keys.float().sum(0).expand(3, -1), atol=1e-4)
    assert q.queue_keys.element_size() == 2


def test_state_dict_names_and_round_trip():
    q = NegativeQueue(size=5, dim=3)
    q.enqueue(torch.randn(4, 3), torch.arange(4), torch.arange(4), step=2)
    sd = q.state_dict()
    assert all("queue" in name for name in sd)
    r = NegativeQueue(size=5, dim=3)
    r.load_state_dict(sd)
    assert r.fill == 4 and int(r.queue_ptr) == 4 and torch.equal(r.keys(), q.keys())


def test_a_queue_of_no_slots_is_refused_with_the_config():
    with pytest.raises(ConfigError, match="queue_size=0: must be >= 1"):
        MoCoConfig(queue_size=0)


def write_steps(q, steps, per_step, dim=2, start_id=0):
    """Enqueue ``per_step`` keys at each of ``steps``; key rows and ids count up from ``start_id``."""
    i = start_id
    for step in steps:
        ids = torch.arange(i, i + per_step)
        q.enqueue(ids.float().unsqueeze(1).expand(-1, dim), ids, ids % 3, step=step)
        i += per_step
    return i


def test_max_age_keeps_only_the_newest_steps_keys():
    q = NegativeQueue(size=20, dim=2, max_age=3)
    write_steps(q, range(6), per_step=4)  # ids 0..23 over steps 0..5; the ring wrapped once
    assert q.fill == 12  # steps 3, 4, 5
    assert q.ids().tolist() == list(range(12, 24))
    assert torch.equal(q.keys()[:, 0].long(), q.ids()) and torch.equal(q.groups(), q.ids() % 3)
    assert q.mean_age(6) == pytest.approx(2.0)  # ages 3, 2, 1
    assert q.logits(torch.ones(1, 2)).shape == (1, 12)
    assert q.stats(6) == {"queue_fill": 12.0, "queue_age": 2.0}
    # without the bound the same writes leave every filled slot a negative
    r = NegativeQueue(size=20, dim=2)
    write_steps(r, range(6), per_step=4)
    assert r.fill == 20 and sorted(r.ids().tolist()) == list(range(4, 24))


def test_max_age_window_across_the_ring_end():
    q = NegativeQueue(size=10, dim=2, max_age=2)
    write_steps(q, range(4), per_step=3)  # ids 0..11: 10, 11 wrapped into slots 0, 1
    assert int(q.queue_ptr) == 2
    assert q.ids().tolist() == [6, 7, 8, 9, 10, 11]  # in write order, across the end of the ring
    assert q.keys()[:, 0].long().tolist() == [6, 7, 8, 9, 10, 11]


def test_max_age_counts_steps_not_writes():
    """Two writes in one optimizer step (gradient accumulation) are one step of the window; a bound
    larger than the ring leaves the whole ring."""
    q = NegativeQueue(size=100, dim=2, max_age=2)
    write_steps(q, [0, 0, 1, 1, 2, 2], per_step=5)
    assert q.ids().tolist() == list(range(10, 30))
    big = NegativeQueue(size=8, dim=2, max_age=50)
    write_steps(big, range(5), per_step=3)
    assert big.fill == 8 and sorted(big.ids().tolist()) == list(range(7, 15))


def test_max_age_window_survives_load_state_dict():
    q = NegativeQueue(size=10, dim=2, max_age=3)
    nxt = write_steps(q, range(5), per_step=3)  # the window spans steps 2-4 and wraps
    r = NegativeQueue(size=10, dim=2, max_age=3)
    r.load_state_dict(q.state_dict())
    assert r.fill == q.fill == 9 and torch.equal(r.ids(), q.ids()) and r.mean_age(5) == q.mean_age(5)
    for a in (q, r):  # and both go on identically
        write_steps(a, [5], per_step=3, start_id=nxt)
    assert torch.equal(r.ids(), q.ids()) and r.ids().tolist() == list(range(9, 18))


def test_max_age_must_be_positive():
    with pytest.raises(ConfigError, match="queue_max_age=0: must be >= 1"):
        MoCoConfig(queue_max_age=0)
