"""Each objective's loss against a reference written as explicit loops over candidates."""
import math

import pytest
import torch
import torch.nn.functional as F
from tests.helpers import Given, excluded, labels, unit

from moco_retrieval.config import ConfigError
from moco_retrieval.objectives.inbatch import InBatchConfig, InBatchObjective
from moco_retrieval.objectives.infonce import info_nce
from moco_retrieval.objectives.moco import MoCoConfig, MoCoObjective

TAU = 0.07


def ref_loss(q, pos_vecs, cand_lists, tau=TAU, smoothing=0.0):
    """cand_lists[i]: negatives of query i (a list of vectors). Loops, no vectorisation."""
    total = 0.0
    for i in range(q.shape[0]):
        logits = [float(q[i] @ pos_vecs[i]) / tau] + [float(q[i] @ c) / tau for c in cand_lists[i]]
        m = max(logits)
        lse = m + math.log(sum(math.exp(l - m) for l in logits))
        nll = lse - logits[0]
        if smoothing:
            nll = (1 - smoothing) * nll + smoothing * sum(lse - l for l in logits) / len(logits)
        total += nll
    return total / q.shape[0]


@pytest.fixture
def batch():
    B, d = 6, 8
    q, k = unit(B, d, seed=1), unit(B, d, seed=2)
    ids = torch.tensor([10, 11, 12, 13, 10, 15])  # rows 0 and 4 share a positive document
    groups = torch.tensor([1, 2, 2, -1, 1, -1])  # rows 1 and 2 are duplicates of each other
    return q, k, ids, groups


@pytest.mark.parametrize("mask", [True, False])
def test_inbatch_matches_loops(batch, mask):
    q, k, ids, groups = batch
    obj = InBatchObjective(InBatchConfig(temperature=TAU, mask_false_negatives=mask))
    loss, stats = obj(labels(ids, groups), Given(query=q, doc=k))
    cands = []
    for i in range(len(q)):
        cands.append([k[j] for j in range(len(q)) if j != i and not (mask and excluded(i, ids, groups, ids[j], groups[j]))])
    assert loss.item() == pytest.approx(ref_loss(q, k, cands), abs=1e-5)
    assert stats["negatives_per_query"].item() == pytest.approx(sum(map(len, cands)) / len(q))


def test_inbatch_symmetric_matches_loops(batch):
    q, k, ids, groups = batch
    obj = InBatchObjective(InBatchConfig(temperature=TAU, symmetric=True))
    loss, _ = obj(labels(ids, groups), Given(query=q, doc=k))
    n = len(q)
    fwd = ref_loss(q, k, [[k[j] for j in range(n) if j != i and not excluded(i, ids, groups, ids[j], groups[j])] for i in range(n)])
    bwd = ref_loss(k, q, [[q[j] for j in range(n) if j != i and not excluded(i, ids, groups, ids[j], groups[j])] for i in range(n)])
    assert loss.item() == pytest.approx((fwd + bwd) / 2, abs=1e-5)


def test_label_smoothing_matches_loops(batch):
    q, k, ids, groups = batch
    obj = InBatchObjective(InBatchConfig(temperature=TAU, label_smoothing=0.1, mask_false_negatives=False))
    loss, _ = obj(labels(ids, groups), Given(query=q, doc=k))
    cands = [[k[j] for j in range(len(q)) if j != i] for i in range(len(q))]
    assert loss.item() == pytest.approx(ref_loss(q, k, cands, smoothing=0.1), abs=1e-5)
    # and it equals torch's own cross-entropy with label smoothing on the unmasked logit matrix
    logits = (q @ k.T) / TAU
    assert loss.item() == pytest.approx(F.cross_entropy(logits, torch.arange(len(q)), label_smoothing=0.1).item(), abs=1e-5)


def _moco(batch_negatives, mask, K=20, d=8):
    obj = MoCoObjective(MoCoConfig(queue_size=K, temperature=TAU, batch_negatives=batch_negatives, mask_false_negatives=mask), d)
    obj.train()
    return obj


def _fill_queue(obj, n, seed, ids, groups):
    obj.docs.queue.enqueue(unit(n, obj.docs.queue.dim, seed=seed), ids, groups, step=0)


@pytest.mark.parametrize("batch_negatives", [True, False])
@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize("with_hard", [True, False])
def test_moco_matches_loops(batch, batch_negatives, mask, with_hard):
    q, k, ids, groups = batch
    obj = _moco(batch_negatives, mask)
    q_ids = torch.tensor([10, 99, 12, 98, 97, 96, 13, 95, 94, 93, 92, 91])  # holds positives 10, 12, 13
    q_groups = torch.tensor([-1, 2, -1, -1, 1, -1, -1, 5, -1, -1, -1, -1])  # and duplicates of groups 1, 2
    _fill_queue(obj, 12, 5, q_ids, q_groups)
    queue = obj.docs.queue.keys().clone()
    meta = {}
    hard = hard_ids = hard_groups = None
    if with_hard:
        hard = unit(12, 8, seed=9)
        hard_ids = torch.arange(200, 212)
        hard_ids[3] = 11  # row 1's positive as a "hard negative" of someone else
        hard_groups = torch.full((12,), -1)
        hard_groups[5] = 1
        meta.update(neg_id=hard_ids, neg_group=hard_groups)
    loss, stats = obj(labels(ids, groups, **meta), Given(query=q, doc_key=k, neg_key=hard))
    cands = []
    for i in range(len(q)):
        c = []
        if batch_negatives:
            c += [k[j] for j in range(len(q)) if j != i and not (mask and excluded(i, ids, groups, ids[j], groups[j]))]
        if with_hard:
            c += [hard[j] for j in range(12) if not (mask and excluded(i, ids, groups, hard_ids[j], hard_groups[j]))]
        c += [queue[j] for j in range(12) if not (mask and excluded(i, ids, groups, q_ids[j], q_groups[j]))]
        cands.append(c)
    assert loss.item() == pytest.approx(ref_loss(q, k, cands), abs=1e-5)
    assert stats["negatives_per_query"].item() == pytest.approx(sum(map(len, cands)) / len(q))
    # the loss is computed before the batch's keys are enqueued; they are there afterwards
    assert obj.docs.queue.fill == 12
    obj.after_backward()
    assert obj.docs.queue.fill == 18
    assert torch.equal(obj.docs.queue.ids()[12:], ids)


def test_positive_copy_in_queue_is_masked(batch):
    """A copy of a query's positive key in the queue changes nothing with masking on, and raises
    the loss with it off (the query is pushed away from its own document)."""
    q, k, ids, groups = batch
    for i in range(len(q)):
        results = {}
        for mask in (True, False):
            for with_copy in (False, True):
                obj = _moco(False, mask)
                _fill_queue(obj, 10, 5, torch.arange(100, 110), torch.full((10,), -1))
                if with_copy:
                    obj.docs.queue.enqueue(k[i : i + 1], ids[i : i + 1], groups[i : i + 1], step=0)
                results[mask, with_copy] = obj(labels(ids[i : i + 1], groups[i : i + 1]),
                                               Given(query=q[i : i + 1], doc_key=k[i : i + 1]))[0].item()
        assert results[True, True] == pytest.approx(results[True, False], abs=1e-6)
        # unmasked, the copy adds exp(s+/tau) to the denominator: loss grows by log(1 + p(positive))
        base = results[False, False]
        assert results[False, True] == pytest.approx(base + math.log1p(math.exp(-base)), abs=1e-5)


def test_gradients_reach_query_only(batch):
    q, k, ids, groups = batch
    q = q.clone().requires_grad_(True)
    k = k.clone().requires_grad_(True)
    obj = _moco(True, True)
    _fill_queue(obj, 10, 5, torch.arange(100, 110), torch.full((10,), -1))
    loss, _ = obj(labels(ids, groups), Given(query=q, doc_key=k))
    loss.backward()
    obj.after_backward()  # after backward, as the Lightning module does
    assert q.grad is not None and q.grad.abs().sum() > 0
    assert k.grad is None
    assert obj.docs.queue.fill == 16


def test_learnable_temperature_is_clamped_and_trained(batch):
    q, k, ids, groups = batch
    obj = InBatchObjective(InBatchConfig(temperature=0.5, learn_temperature=True, temperature_min=0.1, temperature_max=1.0))
    loss, stats = obj(labels(ids, groups), Given(query=q, doc=k))
    loss.backward()
    assert obj.scoring.temperature.log_tau.grad is not None and obj.scoring.temperature.log_tau.grad.abs() > 0
    with torch.no_grad():
        obj.scoring.temperature.log_tau.fill_(math.log(0.001))
    assert obj.scoring.temperature().item() == pytest.approx(0.1)


def test_an_empty_queue_is_refused_with_the_config():
    with pytest.raises(ConfigError, match=r"objective.queue_size=0: must be >= 1"):
        MoCoConfig(queue_size=0)


def test_masked_counts_are_the_loss_own_blocks(batch):
    """A loss counts only the masks of the blocks it is given: a mask built for another softmax,
    before or after, is not counted in it, and a mask shared by two losses is counted in each."""
    q, k, ids, groups = batch
    obj = InBatchObjective(InBatchConfig(temperature=TAU, mask_false_negatives=True))
    cand_ids, cand_groups = torch.tensor([10, 10, 99, 12, 98]), torch.tensor([1, 5, -1, 2, 2])
    other = obj.scoring.mask(ids, groups, ids, groups)  # built for a softmax that is not computed here
    mine = obj.scoring.mask(ids, groups, cand_ids, cand_groups)
    want_id = sum(int(cand_ids[j] == ids[i]) for i in range(len(ids)) for j in range(len(cand_ids)))
    want_all = sum(int(excluded(i, ids, groups, cand_ids[j], cand_groups[j])) for i in range(len(ids)) for j in range(len(cand_ids)))
    pos = (q * k).sum(1) / TAU
    for _ in range(2):  # the same mask in two losses: counted in each, nothing drained
        _, stats = info_nce(pos, [(q @ unit(5, 8, seed=3).T / TAU, mine)], torch.tensor(TAU))
        assert float(stats["masked_by_id"]) == pytest.approx(want_id / len(ids))
        assert float(stats["masked_by_group"]) == pytest.approx((want_all - want_id) / len(ids))
    assert want_id > 0 and want_all > want_id and int(other.counts["id"]) > 0
