"""objective.queue_refresh (objectives/refresh.py): queued texts kept as tokens, a few re-encoded a
step by the key encoder and written over their keys; the draw, the module's wiring, and two gloo
ranks against one process on the global batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import Given, compose_cfg, labels, momentum_steps

from moco_retrieval.objectives.memory import NegativeQueue
from moco_retrieval.objectives.refresh import QueueRefresh, side_of, token_rows
from moco_retrieval.objectives.two_queue import TwoQueueConfig, TwoQueueObjective

D, VOCAB, WIDTH = 8, 50, 6
TABLE = F.normalize(torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(0)), dim=-1)


def fake_side(n, seed, width=WIDTH):
    """n right-padded token rows of random lengths (1..width)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    longest = int(lengths.max())
    mask = (torch.arange(longest)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (n, longest), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask}


def fake_encode(side):
    """A deterministic per-row 'encoder' of a token side: the normalized sum of its tokens' rows."""
    return F.normalize((TABLE[side["input_ids"]] * side["attention_mask"][..., None]).sum(1), dim=-1)


def test_stored_tokens_give_back_the_batch_side():
    side = fake_side(5, seed=1)
    rows = token_rows(side, WIDTH)
    assert rows.shape == (5, WIDTH) and rows.dtype == torch.int32
    back = side_of(rows)
    assert torch.equal(back["attention_mask"], side["attention_mask"])
    assert torch.equal(back["input_ids"], side["input_ids"])
    with pytest.raises(ValueError, match="at most 3"):
        token_rows(side, 3)


def filled_queue(steps=4, per=5, max_age=None):
    queue = NegativeQueue(64, D, max_age=max_age)
    refresh = QueueRefresh(queue, 3, WIDTH, "doc")
    for s in range(steps):
        side = fake_side(per, seed=100 + s)
        slots = queue.enqueue(fake_encode(side), torch.arange(per) + 10 * s, torch.full((per,), -1), s)
        refresh.store(slots, [side], s)
    return queue, refresh


def test_draw_depends_on_the_step_only_and_stays_in_the_window():
    queue, refresh = filled_queue(max_age=2)  # 20 keys written, the newest 2 steps' 10 are negatives
    window = set(queue.window_slots().tolist())
    assert window == set(range(10, 20))
    first = refresh.draw(7)
    assert len(set(first.tolist())) == 3 and set(first.tolist()) <= window
    again = QueueRefresh(queue, 3, WIDTH, "doc")  # e.g. after a resume: the same draw at the same step
    assert torch.equal(again.draw(7), first)
    assert not torch.equal(refresh.draw(7), first)  # a second micro-batch of step 7 draws afresh
    assert not torch.equal(again.draw(8), first)
    assert QueueRefresh(queue, 50, WIDTH, "doc").draw(7).numel() == 10  # never more than the negatives


def test_write_replaces_only_the_drawn_keys_and_keeps_ids_groups_steps():
    queue, refresh = filled_queue()
    before = {k: v.clone() for k, v in queue.state_dict().items()}
    side = refresh.inputs(step=9)
    drawn = refresh.drawn.clone()
    new = -fake_encode(side)  # any new keys: they must land in the drawn slots, in order
    refresh.write(new, step=9)
    assert refresh.drawn is None
    torch.testing.assert_close(queue.queue_keys[drawn], new)
    untouched = torch.ones(queue.size, dtype=torch.bool)
    untouched[drawn] = False
    assert torch.equal(queue.queue_keys[untouched], before["queue_keys"][untouched])
    for name in ("queue_ids", "queue_groups", "queue_steps", "queue_ptr", "queue_fill"):
        assert torch.equal(queue.state_dict()[name], before[name]), name
    assert refresh.queue_encoded_steps[drawn].eq(9).all()
    # the texts in the drawn slots are those enqueued there: their fresh encoding is the original key
    torch.testing.assert_close(fake_encode(side), before["queue_keys"][drawn])
    enqueued = before["queue_steps"][:20]  # steps 0..3, five keys each; three are now encoded at step 9
    want = (9 * 20 - (int(enqueued.sum()) - int(before["queue_steps"][drawn].sum()) + 3 * 9)) / 20
    assert refresh.stats(9)["queue_key_age"] == pytest.approx(want)
    assert queue.stats(9)["queue_age"] == pytest.approx(9 - int(enqueued.sum()) / 20)  # since enqueue: unchanged
    with pytest.raises(RuntimeError, match="without a draw"):
        refresh.write(new, step=9)


def test_module_refreshes_with_the_key_encoder_before_the_logits(tiny_dir):
    from tests.helpers import SyntheticData, make_module

    m = make_module(tiny_dir, TwoQueueConfig(queue_size=16, temperature=0.1, momentum=0.5, queue_refresh=3))
    m.train()
    assert m.objective.docs.refresh is not None and m.objective.queries.refresh is not None
    batches = iter(SyntheticData(m.encoder.tokenize, batch_size=4).train_dataloader())
    first = next(batches)
    loss, _ = m.shared_step(first)  # empty queues: nothing to refresh yet
    loss.backward()
    m.on_after_backward()
    with torch.no_grad():  # the key encoder moves: every queued key is now stale
        for p in m.encoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
        m.key_encoder.update(m.encoder, 0.5)
        fresh = {"doc": m.key_encoder(first["doc"], "doc"), "query": m.key_encoder(first["query"], "query")}
    stale = {"doc": m.objective.docs.queue.keys().clone(), "query": m.objective.queries.queue.keys().clone()}
    m.shared_step(next(batches))
    for kind, queue in (("doc", m.objective.docs.queue), ("query", m.objective.queries.queue)):
        now = queue.keys()
        refreshed = [i for i in range(4) if not torch.allclose(now[i], stale[kind][i])]
        assert len(refreshed) == 3, kind
        torch.testing.assert_close(now[refreshed], fresh[kind][refreshed], atol=1e-5, rtol=1e-4)
    state = m.state_dict()
    assert "objective.docs.refresh.queue_tokens" in state and "objective.queries.refresh.queue_tokens" in state
    assert not any(k.startswith("objective.docs.refresh.queue.") for k in state)  # the queue is saved once
    assert {"queue_key_age", "query_queue_key_age"} <= set(m.objective.stats(0))


def test_frozen_backbone_with_refresh_is_a_config_error():
    from omegaconf import OmegaConf

    from moco_retrieval.errors import ConfigError

    cfg = compose_cfg("train", ["objective=two_queue", "objective.queue_refresh=4", "model.frozen_backbone=true"])
    with pytest.raises(ConfigError, match="queue_refresh=4 with model.frozen_backbone=true"):
        OmegaConf.to_object(cfg)
    with pytest.raises(Exception, match="queue_refresh"):  # a range error: negative counts make no sense
        compose_cfg("train", ["objective=moco", "objective.queue_refresh=-1"], to_object=True)


# ------------------------------------------------------------------ two gloo ranks

W, B, STEPS = 2, 3, 4


def run(steps, rank, world):
    per = B if world > 1 else W * B
    sl = slice(rank * per, (rank + 1) * per)
    obj = TwoQueueObjective(TwoQueueConfig(queue_size=16, temperature=0.07, queue_refresh=3), D,
                            max_len={"query": WIDTH, "doc": WIDTH})
    obj.train()
    out = {"loss": [], "gq": []}
    for s, st in enumerate(steps):
        doc = {k: v[sl] for k, v in st["doc"].items()}
        query = {k: v[sl] for k, v in st["query"].items()}
        q = st["q"][sl].clone().requires_grad_()
        # the stored texts this rank draws (3 a step: blocks of 2 and 1) embed as fake_encode does
        embed = Given(s, query=q, doc=st["d"][sl].clone().requires_grad_(), doc_key=fake_encode(doc),
                      query_key=fake_encode(query), tokens=lambda side, kind: fake_encode(side))
        loss, _ = obj(labels(st["ids"][sl], st["groups"][sl], doc=doc, query=query), embed)
        loss.backward()
        obj.after_backward()
        out["loss"].append(loss.item())
        out["gq"].append(q.grad)
    out["state"] = {k: v.clone() for k, v in obj.state_dict().items()}
    return out


def test_two_gloo_ranks_refresh_identically_to_one_process(tmp_path):
    from tests.helpers import on_ranks

    steps = momentum_steps(STEPS, W * B, D, torch.tensor([7, -1, 7, -1, -1, 8]),
                           doc=lambda s: fake_side(W * B, seed=50 + s), query=lambda s: fake_side(W * B, seed=70 + s))
    ranks = on_ranks(run, (steps,), W, tmp_path)
    single = run(steps, 0, 1)
    assert "docs.refresh.queue_tokens" in single["state"] and "queries.refresh.queue_encoded_steps" in single["state"]
    # keys were refreshed: some slots were encoded after the step that enqueued them
    assert (single["state"]["docs.refresh.queue_encoded_steps"] > single["state"]["docs.queue.queue_steps"]).any()
    for key, v in single["state"].items():  # both queues and both token stores
        for r in ranks:
            assert torch.equal(r["state"][key], v), key
    for s in range(STEPS):
        assert sum(r["loss"][s] for r in ranks) / W == pytest.approx(single["loss"][s], abs=1e-5)
        for r, res in enumerate(ranks):
            torch.testing.assert_close(res["gq"][s], W * single["gq"][s][r * B:(r + 1) * B], atol=1e-5, rtol=1e-4)
