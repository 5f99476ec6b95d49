"""objective=two_queue: loss and gradient against a loop reference, masking in both queues and the
batch, the module's wiring, and two gloo ranks against one process on the global batch."""
from __future__ import annotations


import pytest
import torch
from tests.helpers import excluded, momentum_step, momentum_steps, ref_direction, train_steps, unit

from moco_retrieval.objectives.two_queue import TwoQueueConfig, TwoQueueObjective

TAU, D = 0.07, 8


@pytest.fixture
def data():
    B = 6
    ids = torch.tensor([10, 11, 12, 13, 10, 15])  # rows 0 and 4 share a positive document
    groups = torch.tensor([1, 2, 2, -1, 1, -1])  # rows 1 and 2 are duplicates of each other
    return dict(q=unit(B, D, seed=1), k=unit(B, D, seed=2), d=unit(B, D, seed=3), q_key=unit(B, D, seed=4),
                ids=ids, groups=groups)


def filled(warmup=0, mask=True, inbatch=0.0):
    obj = TwoQueueObjective(TwoQueueConfig(queue_size=20, temperature=TAU, queue_warmup_steps=warmup,
                                           mask_false_negatives=mask, inbatch_weight=inbatch), D)
    obj.train()
    # queued keys carry the positives' ids (10, 12, 13) and groups (1, 2): they must be masked
    qd_ids = torch.tensor([10, 99, 12, 98, 97, 96, 13, 95, 94, 93])
    qd_groups = torch.tensor([-1, 2, -1, -1, 1, -1, -1, 5, -1, -1])
    obj.docs.queue.enqueue(unit(10, D, seed=5), qd_ids, qd_groups, step=0)
    obj.queries.queue.enqueue(unit(10, D, seed=6), qd_ids.flip(0), qd_groups.flip(0), step=0)
    return obj


@pytest.mark.parametrize("inbatch", [0.0, 0.5])
@pytest.mark.parametrize("mask", [True, False])
def test_loss_and_gradient_equal_loop_reference(data, inbatch, mask):
    """The mean of the two directions' losses; with ``inbatch_weight``, plus that much of the in-batch
    loss of queries against the trained documents (own row the positive, false negatives masked)."""
    obj = filled(mask=mask, inbatch=inbatch)
    q, d = data["q"].clone().requires_grad_(), data["d"].clone().requires_grad_()
    hard, hard_ids, hard_groups = unit(4, D, seed=9), torch.tensor([200, 11, 202, 203]), torch.tensor([-1, -1, 1, -1])
    meta = {"doc_id": data["ids"], "group": data["groups"], "d": d, "q_key": data["q_key"],
            "neg": hard, "neg_id": hard_ids, "neg_group": hard_groups}
    dq, qq = obj.docs.queue, obj.queries.queue
    doc_queue = (dq.keys().clone(), dq.ids().clone(), dq.groups().clone())
    query_queue = (qq.keys().clone(), qq.ids().clone(), qq.groups().clone())
    loss, stats = momentum_step(obj, q, data["k"], meta, 3)
    got = torch.autograd.grad(loss, [q, d])

    q2, d2 = data["q"].clone().requires_grad_(), data["d"].clone().requires_grad_()
    ids, groups = data["ids"], data["groups"]
    l_qd = ref_direction(q2, data["k"], data["k"], ids, groups, [(hard, hard_ids, hard_groups), doc_queue], TAU, mask)
    l_dq = ref_direction(d2, data["q_key"], data["q_key"], ids, groups, [query_queue], TAU, mask)
    l_ib = ref_direction(q2, d2, d2, ids, groups, [], TAU, mask)
    ref = (l_qd + l_dq) / 2 + inbatch * l_ib
    want = torch.autograd.grad(ref, [q2, d2])
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    if inbatch:
        assert stats["loss_in_batch"].item() == pytest.approx(l_ib.item(), abs=1e-5)
    else:
        assert "loss_in_batch" not in stats
    assert stats["loss_query_to_doc"].item() == pytest.approx(l_qd.item(), abs=1e-5)
    assert stats["loss_doc_to_query"].item() == pytest.approx(l_dq.item(), abs=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert got[1].abs().sum() > 0  # the document side is trained (MoCo's is not)


def test_same_side_negatives_equal_loop_reference(data):
    """same_side_negatives: each query also against the other query keys and the query queue, each
    document against the other document keys and the document queue (own key and false negatives masked)."""
    obj = filled()
    obj.same_side_negatives = True
    q, d = data["q"].clone().requires_grad_(), data["d"].clone().requires_grad_()
    meta = {"doc_id": data["ids"], "group": data["groups"], "d": d, "q_key": data["q_key"]}
    dq, qq = obj.docs.queue, obj.queries.queue
    doc_queue = (dq.keys().clone(), dq.ids().clone(), dq.groups().clone())
    query_queue = (qq.keys().clone(), qq.ids().clone(), qq.groups().clone())
    loss, _ = momentum_step(obj, q, data["k"], meta, 3)
    got = torch.autograd.grad(loss, [q, d])
    ids, groups = data["ids"], data["groups"]

    def others(keys):  # the batch's other rows, as an extra block (row i's own key left out by the mask)
        return [(keys, ids, groups)]

    q2, d2 = data["q"].clone().requires_grad_(), data["d"].clone().requires_grad_()
    # ids/groups mask the own row too (same id), so passing the whole batch as an extra block is exact
    l_qd = ref_direction(q2, data["k"], data["k"], ids, groups, [doc_queue] + others(data["q_key"]) + [query_queue], TAU)
    l_dq = ref_direction(d2, data["q_key"], data["q_key"], ids, groups, [query_queue] + others(data["k"]) + [doc_queue], TAU)
    ref = (l_qd + l_dq) / 2
    want = torch.autograd.grad(ref, [q2, d2])
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    obj.same_side_negatives = False
    assert momentum_step(obj, data["q"], data["k"], meta, 3)[0].item() < loss.item() - 1e-3  # more negatives, higher loss


def test_own_id_and_group_masked_in_both_queues_and_the_batch(data):
    """For each pair alone: copies of its own keys, and of a duplicate's (another id, the same
    group), in both queues change nothing when masked, and raise the loss when not."""
    for i in range(len(data["ids"])):
        one = {k: v[i : i + 1] for k, v in data.items()}
        one["k"], one["q_key"] = one["q"], one["d"]  # confident positives: a copy's share of the softmax shows
        meta = {"doc_id": one["ids"], "group": one["groups"], "d": one["d"], "q_key": one["q_key"]}
        results = {}
        for mask in (True, False):
            for copies in (False, True):
                obj = filled(mask=mask)
                if copies:
                    dup_group = one["groups"] if one["groups"][0] >= 0 else torch.tensor([-1])
                    dup_id = torch.tensor([77]) if one["groups"][0] >= 0 else one["ids"]
                    for queue, key in ((obj.docs.queue, one["k"]), (obj.queries.queue, one["q_key"])):
                        queue.enqueue(key, one["ids"], one["groups"], step=0)
                        queue.enqueue(key, dup_id, dup_group, step=0)
                results[mask, copies] = momentum_step(obj, one["q"], one["k"], meta, 1)[0].item()
        assert results[True, True] == pytest.approx(results[True, False], abs=1e-6)
        assert results[False, True] > results[False, False] + 0.05


def count_masked(ids, groups, cand_ids, cand_groups, skip_own=False):
    """Per row: (by id, by group only) among the candidates, a row's own batch entry left out."""
    by_id, by_group = [], []
    for i in range(len(ids)):
        js = [j for j in range(len(cand_ids)) if not (skip_own and j == i)]
        by_id.append(sum(int(cand_ids[j] == ids[i]) for j in js))
        by_group.append(sum(int(cand_ids[j] != ids[i] and excluded(i, ids, groups, cand_ids[j], cand_groups[j])) for j in js))
    return torch.tensor(by_id, dtype=torch.float), torch.tensor(by_group, dtype=torch.float)


@pytest.mark.parametrize("batch_negatives", [True, False])
def test_masked_counts_are_per_direction(data, batch_negatives):
    """masked_by_id / masked_by_group count query -> document's candidates only (as under MoCo),
    not both directions summed; each other softmax reports its own masked_per_query (own entry included)."""
    obj = filled(inbatch=1.0)
    obj.batch_negatives = batch_negatives
    hard_ids, hard_groups = torch.tensor([200, 11, 202, 203]), torch.tensor([-1, -1, 1, -1])
    meta = {"doc_id": data["ids"], "group": data["groups"], "d": data["d"], "q_key": data["q_key"],
            "neg": unit(4, D, seed=9), "neg_id": hard_ids, "neg_group": hard_groups}
    ids, groups = data["ids"], data["groups"]
    dq, qq = obj.docs.queue, obj.queries.queue
    batch = count_masked(ids, groups, ids, groups, skip_own=True)
    zero = (torch.zeros(len(ids)),) * 2
    qd = [count_masked(ids, groups, dq.ids(), dq.groups()), count_masked(ids, groups, hard_ids, hard_groups),
          batch if batch_negatives else zero]
    dq_masked = count_masked(ids, groups, qq.ids(), qq.groups())
    _, stats = momentum_step(obj, data["q"], data["k"], meta, 3)
    assert stats["masked_by_id"].item() == pytest.approx(sum(c[0] for c in qd).mean().item())
    assert stats["masked_by_group"].item() == pytest.approx(sum(c[1] for c in qd).mean().item())
    own = 1.0 if batch_negatives else 0.0
    want_dq = (dq_masked[0] + dq_masked[1] + (batch[0] + batch[1] if batch_negatives else 0)).mean().item() + own
    assert stats["masked_per_query_doc_to_query"].item() == pytest.approx(want_dq)
    # the in-batch term always has the batch, whether or not the momentum blocks hold it
    assert stats["masked_per_query_in_batch"].item() == pytest.approx((batch[0] + batch[1]).mean().item() + 1)
    assert stats["masked_per_query_in_batch"].item() > 1  # the fixture has false negatives in the batch


def test_keys_enqueued_after_backward_with_ids_and_warmup(data):
    obj = filled(warmup=5)
    meta = {"doc_id": data["ids"], "group": data["groups"], "d": data["d"], "q_key": data["q_key"]}
    _, early = momentum_step(obj, data["q"], data["k"], meta, 4)
    obj.after_backward()
    _, late = momentum_step(obj, data["q"], data["k"], meta, 5)
    # before warm-up ends only the batch counts (6 rows, own + false negatives masked); after, 16 queued more
    assert early["negatives_per_query"].item() < 6 < late["negatives_per_query"].item()
    assert obj.docs.queue.fill == obj.queries.queue.fill == 16
    assert torch.equal(obj.docs.queue.ids()[10:], data["ids"]) and torch.equal(obj.queries.queue.ids()[10:], data["ids"])
    torch.testing.assert_close(obj.docs.queue.keys()[10:], data["k"])
    torch.testing.assert_close(obj.queries.queue.keys()[10:], data["q_key"])
    assert set(obj.stats(5)) == {"queue_fill", "queue_age", "query_queue_fill", "query_queue_age"}


def test_max_age_equals_a_queue_of_that_many_steps_keys():
    """``queue_max_age`` N at batch B trains as a queue of N * B keys: the same losses and gradients
    step after step, while the ring is longer (what B6's K 4,096 run at batch 32 stands for)."""
    B, age = 4, 3
    def make(size, max_age):
        obj = TwoQueueObjective(TwoQueueConfig(queue_size=size, queue_max_age=max_age, temperature=TAU), D)
        return obj.train()
    bounded, small = make(64, age), make(age * B, None)
    for step in range(8):
        ids = torch.arange(step * B, step * B + B) % 10  # ids repeat: masks in the queues matter
        q, d = unit(B, D, seed=10 * step + 1), unit(B, D, seed=10 * step + 2)
        k, q_key = unit(B, D, seed=10 * step + 3), unit(B, D, seed=10 * step + 4)
        out = []
        for obj in (bounded, small):
            qg, dg = q.clone().requires_grad_(), d.clone().requires_grad_()
            meta = {"doc_id": ids, "group": ids % 3, "d": dg, "q_key": q_key}
            loss, stats = momentum_step(obj, qg, k, meta, step)
            out.append((loss, *torch.autograd.grad(loss, [qg, dg]), stats["negatives_per_query"]))
            obj.after_backward()
        for got, want in zip(*out):
            torch.testing.assert_close(got, want)
    assert bounded.docs.queue.fill == bounded.queries.queue.fill == age * B
    assert int(bounded.docs.queue.queue_fill) == 8 * B  # the ring still holds every key written


def test_module_serves_both_sides_from_both_encoders(tiny_dir):
    from tests.helpers import SyntheticData, make_module

    m = make_module(tiny_dir, TwoQueueConfig(queue_size=16, temperature=0.1, momentum=0.9))
    m.train()
    batch = next(iter(SyntheticData(m.encoder.tokenize, batch_size=4).train_dataloader()))
    loss, stats = m.shared_step(batch)
    loss.backward()
    m.on_after_backward()
    assert m.key_encoder is not None and all(p.grad is None for p in m.key_encoder.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.encoder.parameters())
    assert m.objective.docs.queue.fill == m.objective.queries.queue.fill == 4
    with torch.no_grad():  # the query queue holds the EMA encoder's query keys
        torch.testing.assert_close(m.objective.queries.queue.keys(), m.key_encoder(batch["query"], "query"))
        torch.testing.assert_close(m.objective.docs.queue.keys(), m.key_encoder(batch["doc"], "doc"))
    assert any(k.startswith("objective.queries.queue.") for k in m.state_dict())


# ------------------------------------------------------------------ two gloo ranks

W, B, STEPS = 2, 3, 3


def run(steps, inbatch, rank, world):
    obj = TwoQueueObjective(TwoQueueConfig(queue_size=16, temperature=TAU, inbatch_weight=inbatch), D)
    return train_steps(obj, steps, B, rank, world)


@pytest.mark.parametrize("inbatch", [0.0, 1.0])
def test_two_gloo_ranks_hold_identical_queues_equal_to_one_process(tmp_path, inbatch):
    """With the in-batch term too: its documents are gathered with gradient, as in-batch negatives' are."""
    from tests.helpers import on_ranks

    steps = momentum_steps(STEPS, W * B, D, torch.tensor([7, -1, 7, -1, -1, 8]))
    ranks = on_ranks(run, (steps, inbatch), W, tmp_path)
    single = run(steps, inbatch, 0, 1)
    for key, v in single["state"].items():  # both queues: keys, ids, groups, steps, pointer, fill
        for r in ranks:
            assert torch.equal(r["state"][key], v), key
    assert int(single["state"]["queries.queue.queue_fill"]) == 16 and int(single["state"]["queries.queue.queue_ptr"]) == STEPS * W * B % 16  # wrapped
    for s in range(STEPS):
        assert sum(r["loss"][s] for r in ranks) / W == pytest.approx(single["loss"][s], abs=1e-5)
        for r, res in enumerate(ranks):  # local gradients = W x the global loss's, on this rank's rows
            for g in ("gq", "gd"):
                torch.testing.assert_close(res[g][s], W * single[g][s][r * B:(r + 1) * B], atol=1e-5, rtol=1e-4)
