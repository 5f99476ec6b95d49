"""Guided false-negative masking and logQ correction: each rule against a loop reference, the
frequency estimator on a planted Zipf stream, corrected logits against a reference, the queue
and two gloo ranks, and the module's guide encoder."""
from __future__ import annotations

import math

import pytest
import torch
from tests.helpers import Given, excluded, labels, momentum_step, unit

from moco_retrieval.config import ConfigError
from moco_retrieval.objectives.guided import GuidedMask
from moco_retrieval.objectives.inbatch import InBatchConfig, InBatchObjective
from moco_retrieval.objectives.logq import StreamingFrequency
from moco_retrieval.objectives.moco import MoCoConfig, MoCoObjective
from moco_retrieval.objectives.two_queue import TwoQueueConfig, TwoQueueObjective

TAU, D = 0.07, 8


def ref_guided(gq, gpos, gcand, margin, threshold):
    out = set()
    for i in range(gq.shape[0]):
        p = float(gq[i] @ gpos[i])
        for j in range(gcand.shape[0]):
            s = float(gq[i] @ gcand[j])
            if s > p - margin or (threshold is not None and s > threshold):
                out.add((i, j))
    return out


@pytest.mark.parametrize("margin,threshold", [(0.0, None), (0.2, None), (-0.1, 0.4), (5e-3, 0.1)])
def test_guided_mask_equals_loops(margin, threshold):
    gq, gpos, gcand = unit(5, D, seed=1), unit(5, D, seed=2), unit(30, D, seed=3)
    rows, cols = GuidedMask(margin, threshold).pairs(gq, gpos, gcand)
    got = set(zip(rows.tolist(), cols.tolist()))
    assert got == ref_guided(gq, gpos, gcand, margin, threshold)
    assert 0 < len(got) < 150  # the planted scores exercise the rule


def test_guide_settings_out_of_range_are_refused_with_the_config():
    with pytest.raises(ConfigError, match="guide_threshold=1.5: must be in"):
        MoCoConfig(guide_threshold=1.5)
    with pytest.raises(ConfigError, match="guide_margin=3.0: must be in"):
        MoCoConfig(guide_margin=3.0)


# ------------------------------------------------------------------ MoCo with every rule

IDS = torch.tensor([10, 11, 12, 13, 14, 15])
GROUPS = torch.tensor([1, 2, 2, -1, 1, -1])
Q_IDS = torch.tensor([10, 99, 12, 98, 97, 96, 13, 95, 14, 93])
Q_GROUPS = torch.tensor([-1, 2, -1, -1, 1, -1, -1, 5, -1, -1])


def moco(mask=True, guide="none", margin=0.0, threshold=None, logq=False, cls=MoCoObjective, cfg_cls=MoCoConfig):
    cfg = cfg_cls(queue_size=20, temperature=TAU, mask_false_negatives=mask, guide=guide, guide_margin=margin,
                  guide_threshold=threshold, logq_correction=logq, logq_alpha=0.5, logq_buckets=64)
    obj = cls(cfg, D, guide_dim=D if guide not in ("none", "momentum") else None)
    obj.train()
    obj.docs.queue.enqueue(unit(10, D, seed=5), Q_IDS, Q_GROUPS, step=0)
    if obj.docs.guide is not None:
        obj.docs.guide.enqueue(unit(10, D, seed=6), Q_IDS, Q_GROUPS, step=0)
    if logq:  # a planted history: some documents seen often, others once
        for s in range(8):
            obj.scoring.logq.observe(torch.tensor([10, 12, 99] + ([11, 95] if s % 3 == 0 else [])), step=s)
    return obj


def ref_moco(obj, q, k, gq, gk, g_queue, mask, margin, threshold, logq):
    """-log softmax over [positive | other batch keys | queue], loops over every candidate."""
    keys, q_ids, q_groups = obj.docs.queue.keys(), obj.docs.queue.ids(), obj.docs.queue.groups()
    lq = (lambda i: float(obj.scoring.logq.log_q(torch.tensor([i]))[0])) if logq else (lambda i: 0.0)
    losses, masked = [], {"id": 0, "group": 0, "guide": 0}

    def rule(i, j_id, j_group, g_j):
        if mask and j_id == IDS[i]:
            return "id"
        if mask and excluded(i, IDS, GROUPS, j_id, j_group):
            return "group"
        if gq is not None:
            p, s = float(gq[i] @ gk[i]), float(gq[i] @ g_j)
            if s > p - margin or (threshold is not None and s > threshold):
                return "guide"
        return None

    for i in range(q.shape[0]):
        logits = [q[i] @ k[i] / TAU - lq(int(IDS[i]))]
        cands = [(k[j], IDS[j], GROUPS[j], gk[j] if gk is not None else None) for j in range(len(k)) if j != i]
        cands += [(keys[j], q_ids[j], q_groups[j], g_queue[j] if g_queue is not None else None) for j in range(len(keys))]
        for vec, j_id, j_group, g_j in cands:
            r = rule(i, j_id, j_group, g_j)
            if r:
                masked[r] += 1
            else:
                logits.append(q[i] @ vec / TAU - lq(int(j_id)))
        losses.append(torch.logsumexp(torch.stack(logits), 0) - logits[0])
    return torch.stack(losses).mean(), {f"masked_by_{r}": n / q.shape[0] for r, n in masked.items()}


@pytest.mark.parametrize("mask,margin,threshold,logq", [
    (True, None, None, False),  # ids and groups only
    (False, 0.05, None, False),  # the relative guide rule alone
    (False, 2.0, 0.3, False),  # the absolute rule (the relative one with margin 2 never fires)
    (True, 0.0, 0.5, True),  # everything together, with logQ
    (False, None, None, True),  # logQ alone
])
def test_moco_loss_gradient_and_counts_equal_loops(mask, margin, threshold, logq):
    guided = margin is not None
    obj = moco(mask, "fixed" if guided else "none", margin or 0.0, threshold, logq)
    q0, k = unit(6, D, seed=7), unit(6, D, seed=8)
    gq, gk = (unit(6, D, seed=9), unit(6, D, seed=10)) if guided else (None, None)
    meta = {"doc_id": IDS, "group": GROUPS}
    if guided:
        meta.update(g_q=gq, g_k=gk)
    g_queue = obj.docs.guide.keys().clone() if guided else None
    q = q0.clone().requires_grad_()
    loss, stats = momentum_step(obj, q, k, meta, 8)
    (grad,) = torch.autograd.grad(loss, q)
    q2 = q0.clone().requires_grad_()
    ref, counts = ref_moco(obj, q2, k, gq, gk, g_queue, mask, margin or 0.0, threshold, logq)
    (ref_grad,) = torch.autograd.grad(ref, q2)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-4)
    for name, v in counts.items():
        if (mask and name != "masked_by_guide") or (guided and name == "masked_by_guide"):
            assert float(stats[name]) == pytest.approx(v), name
        else:  # a rule that is off logs no count
            assert name not in stats
    if guided:
        assert counts["masked_by_guide"] > 0  # the guide found candidates ids missed
    obj.after_backward()
    if guided:  # the guide's embeddings of this batch are queued slot for slot with the keys
        assert obj.docs.guide.fill == obj.docs.queue.fill == 16
        torch.testing.assert_close(obj.docs.guide.keys()[10:], gk)
        assert torch.equal(obj.docs.guide.ids(), obj.docs.queue.ids())


def test_logq_raises_each_logit_by_the_log_of_its_documents_interval():
    """The planted history (``moco(logq=True)``, alpha 0.5): ids 10, 12, 99 seen at every step (an
    interval of 1 step: no correction), 11 at steps 0, 3 and 6 (interval 1, then 0.5 x 1 + 0.5 x 3 = 2,
    then 0.5 x 2 + 0.5 x 3 = 2.5); 5 never (no correction). Each logit is corrected by -log q = +log interval."""
    obj = moco(logq=True)
    logits = unit(3, 5, seed=1)
    ids = torch.tensor([10, 12, 99, 11, 5])
    want = logits + torch.tensor([0.0, 0.0, 0.0, math.log(2.5), 0.0])
    torch.testing.assert_close(obj.scoring.corrected(logits, ids), want)
    torch.testing.assert_close(obj.scoring.corrected(logits[:, 3], ids[[3, 4, 3]]), logits[:, 3] + torch.tensor([math.log(2.5), 0.0, math.log(2.5)]))  # positives: [B]
    assert moco(logq=False).scoring.corrected(logits, ids) is logits


def test_momentum_guide_uses_the_ema_query_keys_and_queue():
    obj = moco(mask=False, guide="momentum", margin=0.05)
    assert obj.docs.guide is None
    q0, k, q_key = unit(6, D, seed=7), unit(6, D, seed=8), unit(6, D, seed=11)
    embed = Given(1, query=q0, doc_key=k, query_key=q_key)
    loss, stats = obj(labels(IDS, GROUPS), embed)
    assert ("query", "momentum", False) in embed.asked  # the EMA query keys: the guide's anchors
    ref, counts = ref_moco(obj, q0, k, q_key, k, obj.docs.queue.keys(), False, 0.05, None, False)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert float(stats["masked_by_guide"]) == pytest.approx(counts["masked_by_guide"]) and counts["masked_by_guide"] > 0


def test_two_queue_guides_both_directions_and_queues_guide_embeddings():
    obj = moco(mask=True, guide="fixed", margin=0.05, cls=TwoQueueObjective, cfg_cls=TwoQueueConfig)
    obj.queries.queue.enqueue(unit(10, D, seed=12), Q_IDS, Q_GROUPS, step=0)
    obj.queries.guide.enqueue(unit(10, D, seed=13), Q_IDS, Q_GROUPS, step=0)
    q, k, d, q_key, gq, gk = (unit(6, D, seed=s) for s in range(20, 26))
    meta = {"doc_id": IDS, "group": GROUPS, "d": d, "q_key": q_key, "g_q": gq, "g_k": gk}
    loss, _ = momentum_step(obj, q, k, meta, 1)
    # the document -> query direction: anchors are the guide's documents, candidates its queries
    unguided = moco(mask=True, cls=TwoQueueObjective, cfg_cls=TwoQueueConfig)
    unguided.queries.queue.enqueue(unit(10, D, seed=12), Q_IDS, Q_GROUPS, step=0)
    assert float(loss) != pytest.approx(float(momentum_step(unguided, q, k, meta, 1)[0]))
    obj.after_backward()
    assert obj.queries.guide.fill == 16
    torch.testing.assert_close(obj.queries.guide.keys()[10:], gq)


def ref_guided_in_batch(q, docs, gq, gk, margin):
    """In-batch InfoNCE of q against docs, candidate j of row i dropped when the guide scores it
    above the positive less ``margin``; loops. Returns the loss and the number dropped."""
    ref, n = [], 0
    for i in range(q.shape[0]):
        logits = [q[i] @ docs[i] / TAU]
        for j in range(q.shape[0]):
            if j == i:
                continue
            if float(gq[i] @ gk[j]) > float(gq[i] @ gk[i]) - margin:
                n += 1
            else:
                logits.append(q[i] @ docs[j] / TAU)
        ref.append(torch.logsumexp(torch.stack(logits), 0) - logits[0])
    return torch.stack(ref).mean(), n


@pytest.mark.parametrize("batch_negatives", [True, False])
def test_two_queue_in_batch_term_masks_what_the_guide_masks(batch_negatives):
    """The in-batch term's candidates are the batch's documents: the query -> document guide
    masks the same ones there, with or without batch negatives in the queue softmaxes."""
    cfg = TwoQueueConfig(queue_size=20, temperature=TAU, mask_false_negatives=False, guide="fixed", guide_margin=0.02,
                         inbatch_weight=1.0, batch_negatives=batch_negatives)
    obj = TwoQueueObjective(cfg, D, guide_dim=D)
    obj.train()
    q, k, d, q_key, gq, gk = (unit(6, D, seed=s) for s in range(40, 46))
    meta = {"doc_id": IDS, "group": GROUPS, "d": d, "q_key": q_key, "g_q": gq, "g_k": gk}
    _, stats = momentum_step(obj, q, k, meta, 1)
    ref, n = ref_guided_in_batch(q, d, gq, gk, 0.02)
    assert n > 0  # the planted guide scores mask something
    torch.testing.assert_close(stats["loss_in_batch"], ref, atol=1e-5, rtol=1e-5)


def test_momentum_guide_needs_an_ema_encoder():
    with pytest.raises(ConfigError, match="guide=momentum needs the keys of both sides"):
        InBatchConfig(guide="momentum")  # refused with the config


def test_inbatch_guided_mask_equals_loops():
    obj = InBatchObjective(InBatchConfig(temperature=TAU, guide="fixed", guide_margin=0.02, mask_false_negatives=False))
    q, k, gq, gk = (unit(6, D, seed=s) for s in range(30, 34))
    loss, stats = obj(labels(IDS, GROUPS), Given(query=q, doc=k, guide_query=gq, guide_doc=gk))
    ref, n = ref_guided_in_batch(q, k, gq, gk, 0.02)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert float(stats["masked_by_guide"]) == pytest.approx(n / 6) and n > 0


# ------------------------------------------------------------------ the frequency estimator


def test_frequency_estimator_converges_on_a_zipf_stream():
    """Items drawn from a Zipf law, 16 a step: the estimate of each frequent item's probability
    of appearing in a step approaches the true one (1 - (1 - p)^16)."""
    n, batch, steps = 500, 16, 6000
    p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.1
    p /= p.sum()
    est = StreamingFrequency(buckets=4096, alpha=0.01)
    g = torch.Generator().manual_seed(0)
    for s in range(steps):
        est.observe(torch.multinomial(p, batch, replacement=True, generator=g) * 7919 + 3, s)  # arbitrary ids
    ids = torch.arange(20) * 7919 + 3
    truth = 1 - (1 - p[:20]) ** batch
    got = est.log_q(ids).double().exp()
    rel = ((got - truth) / truth).abs()
    assert float(rel.median()) < 0.1 and float(rel.max()) < 0.35
    # ordering by popularity is recovered
    assert float(got[0]) > float(got[5]) > float(got[19])


def test_frequency_estimator_first_sighting_and_state_dict():
    est = StreamingFrequency(buckets=16, alpha=0.5)
    est.observe(torch.tensor([3, 3, 4]), step=9)  # first sighting at step 9: once in 10 steps
    assert float(est.log_q(torch.tensor([3]))) == pytest.approx(-math.log(10))
    est.observe(torch.tensor([3]), step=11)  # gap 2: 0.5 * 10 + 0.5 * 2
    assert float(est.log_q(torch.tensor([3]))) == pytest.approx(-math.log(6))
    assert float(est.log_q(torch.tensor([5]))) == 0.0  # never seen: no correction
    other = StreamingFrequency(buckets=16, alpha=0.5)
    other.load_state_dict(est.state_dict())
    assert torch.equal(other.log_q(torch.arange(16)), est.log_q(torch.arange(16)))


# ------------------------------------------------------------------ two gloo ranks

W, B, STEPS = 2, 3, 3


def make_steps():
    return [dict(q=unit(W * B, D, seed=40 + s), k=unit(W * B, D, seed=50 + s), gq=unit(W * B, D, seed=60 + s),
                 gk=unit(W * B, D, seed=70 + s), ids=torch.tensor([1, 2, 3, 1, 5, 2]) + 3 * s,
                 groups=torch.tensor([7, -1, 7, -1, -1, 8])) for s in range(STEPS)]


def run(steps, rank, world):
    per = B if world > 1 else W * B
    sl = slice(rank * per, (rank + 1) * per)
    cfg = MoCoConfig(queue_size=16, temperature=TAU, guide="fixed", guide_margin=0.05, logq_correction=True,
                     logq_alpha=0.3, logq_buckets=128)
    obj = MoCoObjective(cfg, D, guide_dim=D)
    obj.train()
    out = {"loss": [], "grad": []}
    for s, st in enumerate(steps):
        q = st["q"][sl].clone().requires_grad_()
        meta = {"doc_id": st["ids"][sl], "group": st["groups"][sl], "g_q": st["gq"][sl], "g_k": st["gk"][sl]}
        loss, _ = momentum_step(obj, q, st["k"][sl], meta, s)
        loss.backward()
        obj.after_backward()
        out["loss"].append(loss.item())
        out["grad"].append(q.grad)
    out["state"] = {k: v.clone() for k, v in obj.state_dict().items()}
    return out


def test_two_gloo_ranks_equal_one_process_with_guide_and_logq(tmp_path):
    from tests.helpers import on_ranks

    steps = make_steps()
    ranks = on_ranks(run, (steps,), W, tmp_path)
    single = run(steps, 0, 1)
    assert {"docs.guide.queue_keys", "scoring.logq.logq_interval", "scoring.logq.logq_last"} <= set(single["state"])
    for key, v in single["state"].items():  # queue, guide queue and frequency estimates
        for r in ranks:
            assert torch.equal(r["state"][key], v), key
    for s in range(STEPS):
        assert sum(r["loss"][s] for r in ranks) / W == pytest.approx(single["loss"][s], abs=1e-5)
        for r, res in enumerate(ranks):
            torch.testing.assert_close(res["grad"][s], W * single["grad"][s][r * B:(r + 1) * B], atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ the module's guide encoder


def test_module_builds_a_frozen_guide_outside_the_checkpoint(tiny_dir):
    from tests.helpers import SyntheticData, make_module

    m = make_module(tiny_dir, MoCoConfig(queue_size=16, temperature=0.1, momentum=0.9, guide="base",
                                         guide_threshold=0.99, logq_correction=True))
    m.train()
    guide = m._guide[0]
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    batch = next(iter(SyntheticData(m.encoder.tokenize, batch_size=4).train_dataloader()))
    loss, stats = m.shared_step(batch)
    loss.backward()
    m.on_after_backward()
    assert {"masked_by_guide", "masked_by_id", "masked_by_group"} <= set(stats)
    assert m.objective.docs.guide.fill == 4
    with torch.no_grad():  # the guide is the untrained backbone, mean-pooled and normalised, no head
        torch.testing.assert_close(m.objective.docs.guide.keys(), guide(batch["doc"], "doc"))
    assert all(torch.equal(v, guide.state_dict()[k]) for k, v in before.items())
    assert not any(k.startswith("_guide") for k in m.state_dict())
    assert "objective.docs.guide.queue_keys" in m.state_dict()
