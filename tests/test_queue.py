import pytest
import torch

from moco_retrieval.objectives.queue import NegativeQueue


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


def test_zero_size_rejected():
    with pytest.raises(ValueError, match="queue_size"):
        NegativeQueue(0, 8)
