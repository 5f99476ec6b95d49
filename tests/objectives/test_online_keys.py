"""objective.keys=online: the queued keys and the positives' keys are the trained pass's own
embeddings, detached (XBM, ContAccum): no EMA key encoder is built, asked, updated or saved."""
from __future__ import annotations

import pytest
import torch
from tests.helpers import Given, labels, momentum_steps, ref_direction, train_steps, unit

from moco_retrieval.config import ConfigError
from moco_retrieval.objectives.moco import MoCoConfig, MoCoObjective
from moco_retrieval.objectives.two_queue import TwoQueueConfig, TwoQueueObjective

TAU, D, B = 0.07, 8, 6
IDS = torch.tensor([10, 11, 12, 13, 10, 15])  # rows 0 and 4 share a positive document
GROUPS = torch.tensor([1, 2, 2, -1, 1, -1])
Q_IDS = torch.tensor([10, 99, 12, 98, 97, 96, 13, 95, 94, 93])
Q_GROUPS = torch.tensor([-1, 2, -1, -1, 1, -1, -1, 5, -1, -1])


def two_queue(**kw) -> TwoQueueObjective:
    obj = TwoQueueObjective(TwoQueueConfig(queue_size=20, temperature=TAU, keys="online", **kw), D).train()
    obj.docs.queue.enqueue(unit(10, D, seed=5), Q_IDS, Q_GROUPS, step=0)
    obj.queries.queue.enqueue(unit(10, D, seed=6), Q_IDS.flip(0), Q_GROUPS.flip(0), step=0)
    return obj


@pytest.mark.parametrize("inbatch", [0.0, 1.0])
def test_two_queue_online_loss_and_gradient_equal_the_loop_reference(inbatch):
    """The keys are the trained q and d themselves, detached: the loss is the loop reference's with
    k = d and q_key = q, the gradient reaches q and d through the anchors (and the in-batch term's
    documents) only, and the encoder asked is the trained one alone."""
    obj = two_queue(inbatch_weight=inbatch)
    q, d = unit(B, D, seed=1).requires_grad_(), unit(B, D, seed=2).requires_grad_()
    hard, hard_ids, hard_groups = unit(4, D, seed=9), torch.tensor([200, 11, 202, 203]), torch.tensor([-1, -1, 1, -1])
    embed = Given(3, query=q, doc=d, neg=hard)
    docs = (obj.docs.queue.keys().clone(), Q_IDS, Q_GROUPS)
    queries = (obj.queries.queue.keys().clone(), Q_IDS.flip(0), Q_GROUPS.flip(0))
    loss, stats = obj(labels(IDS, GROUPS, neg_id=hard_ids, neg_group=hard_groups), embed)
    got = torch.autograd.grad(loss, [q, d])
    assert {e for _, e, _ in embed.asked} == {"trained"}  # no EMA encoder
    assert ("doc", "trained", False) in embed.asked and ("neg", "trained", False) in embed.asked

    q2, d2 = q.detach().clone().requires_grad_(), d.detach().clone().requires_grad_()
    k, q_key = d2.detach(), q2.detach()  # the keys: constants
    l_qd = ref_direction(q2, k, k, IDS, GROUPS, [(hard, hard_ids, hard_groups), docs], TAU)
    l_dq = ref_direction(d2, q_key, q_key, IDS, GROUPS, [queries], TAU)
    ref = (l_qd + l_dq) / 2 + inbatch * ref_direction(q2, d2, d2, IDS, GROUPS, [], TAU)
    want = torch.autograd.grad(ref, [q2, d2])
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    obj.after_backward()  # the batch's detached embeddings are what is queued
    torch.testing.assert_close(obj.docs.queue.keys()[10:], d.detach())
    torch.testing.assert_close(obj.queries.queue.keys()[10:], q.detach())


def test_moco_online_keys_are_a_no_gradient_pass_of_the_trained_encoder():
    obj = MoCoObjective(MoCoConfig(queue_size=20, temperature=TAU, keys="online"), D).train()
    embed = Given(1, query=unit(B, D, seed=1), doc=unit(B, D, seed=2))
    obj(labels(IDS, GROUPS), embed)
    assert embed.asked[:2] == [("query", "trained", True), ("doc", "trained", False)]
    assert obj.momentum is None


def test_the_momentum_guide_scores_with_the_online_keys():
    obj = two_queue(guide="momentum", guide_margin=0.05)
    embed = Given(1, query=unit(B, D, seed=1), doc=unit(B, D, seed=2))
    _, stats = obj(labels(IDS, GROUPS), embed)
    assert {e for _, e, _ in embed.asked} == {"trained"} and "masked_by_guide" in stats


def test_key_encoder_dropout_with_online_keys_is_refused():
    with pytest.raises(ConfigError, match="key_encoder_dropout=true with objective.keys=online"):
        TwoQueueConfig(keys="online", key_encoder_dropout=True)
    with pytest.raises(ConfigError, match="objective.keys='ema': expected one of momentum, online"):
        TwoQueueConfig(keys="ema")


# ------------------------------------------------------------------ two gloo ranks

W, STEPS = 2, 3


def run(steps, rank, world):
    """Online keys: the steps' "k" and "q_key" are their own "d" and "q" (train_steps serves them)."""
    for st in steps:
        st["k"], st["q_key"] = st["d"], st["q"]
    obj = TwoQueueObjective(TwoQueueConfig(queue_size=16, temperature=TAU, keys="online"), D)
    return train_steps(obj, steps, 3, rank, world)


def test_two_gloo_ranks_hold_identical_queues_equal_to_one_process(tmp_path):
    from tests.helpers import on_ranks

    steps = momentum_steps(STEPS, W * 3, D, torch.tensor([7, -1, 7, -1, -1, 8]))
    ranks = on_ranks(run, (steps,), W, tmp_path)
    single = run(steps, 0, 1)
    for key, v in single["state"].items():
        for r in ranks:
            assert torch.equal(r["state"][key], v), key
    for s in range(STEPS):
        assert sum(r["loss"][s] for r in ranks) / W == pytest.approx(single["loss"][s], abs=1e-5)


# ------------------------------------------------------------------ the module

def test_the_module_builds_no_key_encoder_and_saves_none(tiny_dir):
    from tests.helpers import SyntheticData, make_module

    m = make_module(tiny_dir, TwoQueueConfig(queue_size=16, temperature=0.1, keys="online")).train()
    assert m.key_encoder is None and not any(k.startswith("key_encoder.") for k in m.state_dict())
    batch = next(iter(SyntheticData(m.encoder.tokenize, batch_size=4).train_dataloader()))
    calls = []
    real = m.encode

    def spy(*a):
        out = real(*a)
        calls.append((a[0], a[2], out))
        return out

    m.encode = spy
    loss, _ = m.shared_step(batch)
    loss.backward()
    m.on_after_backward()
    assert sorted((c[0], c[1]) for c in calls) == [("trained", "doc"), ("trained", "query")]  # one pass per side
    passes = {kind: out for _, kind, out in calls}  # the queued keys are that pass's embeddings, detached
    torch.testing.assert_close(m.objective.docs.queue.keys(), passes["doc"].detach())
    torch.testing.assert_close(m.objective.queries.queue.keys(), passes["query"].detach())


def test_a_resume_that_switches_the_keys_is_refused():
    from moco_retrieval.errors import CheckpointError
    from moco_retrieval.training.resume_check import check_resumable
    from tests.helpers import compose_cfg

    from omegaconf import OmegaConf

    trained = compose_cfg("train", ["objective.keys=momentum"], to_object=True)
    objective = OmegaConf.to_container(OmegaConf.structured(trained.objective), enum_to_str=True)
    ckpt = {"hyper_parameters": {"objective": objective}}
    check_resumable(ckpt, "last.ckpt", trained)
    with pytest.raises(CheckpointError, match=r"trained with objective\.keys=momentum, but this run's config has "
                                              r"objective\.keys=online"):
        check_resumable(ckpt, "last.ckpt", compose_cfg("train", ["objective.keys=online"], to_object=True))
