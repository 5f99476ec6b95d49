"""objective.queue_per_source: one key memory (two_queue: one pair) per training source. A batch of
source S is scored against S's memory only (loop references built from that queue alone), enqueues
only there, two gloo ranks equal one process, a resumed run equals an uninterrupted one, the
preemption fingerprint covers every source's memory, and all the queues' memory is checked together."""
from __future__ import annotations

import csv
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.objectives.two_queue import TwoQueueConfig
from moco_retrieval.objectives.registry import objective_config
from moco_retrieval.errors import ConfigError
from moco_retrieval.objectives.memory import KeyMemory, PerSourceMemory
from moco_retrieval.objectives.moco import MoCoObjective
from moco_retrieval.objectives.two_queue import TwoQueueObjective
from tests.helpers import compose_cfg, momentum_step, momentum_steps, ref_direction, train_losses, train_steps, unit

TAU, D, B, SIZE = 0.07, 8, 4, 12


def moco(sources=2, **kw) -> MoCoObjective:
    obj = MoCoObjective(MoCoConfig(queue_size=SIZE, temperature=TAU, queue_per_source=True, **kw), D, sources=sources)
    return obj.train()


def two_queue(sources=2, **kw) -> TwoQueueObjective:
    cfg = TwoQueueConfig(queue_size=SIZE, temperature=TAU, queue_per_source=True, queue_max_age=None, **kw)
    return TwoQueueObjective(cfg, D, sources=sources).train()


def fill_each_source(obj, sides=("docs",)):
    """Distinct keys in every source's memories: source s's ids are 1000 * (s + 1) + j."""
    for side in sides:
        for s, memory in enumerate(getattr(obj, side).sources):
            n = 5 + 2 * s
            memory.queue.enqueue(unit(n, D, seed=50 + 10 * s + len(side)), torch.arange(n) + 1000 * (s + 1),
                                 torch.full((n,), -1), step=0)


def batch(seed=0, source=1, step=1, **extra) -> SimpleNamespace:
    """One step's queries q (with gradient), EMA keys k, labels and source (None: no source entry)."""
    ids = torch.arange(B) + 100 * seed
    return SimpleNamespace(q=unit(B, D, seed=seed + 1).requires_grad_(), k=unit(B, D, seed=seed + 2), doc_id=ids,
                           group=torch.full((B,), -1), step=step,
                           source=torch.full((B,), source) if source is not None else None, extra=extra)


def score(obj, x):
    meta = {"doc_id": x.doc_id, "group": x.group, **x.extra, **({"source": x.source} if x.source is not None else {})}
    return momentum_step(obj, x.q, x.k, meta, x.step)


def queue_of(memory: KeyMemory) -> tuple:
    q = memory.queue
    return q.keys().clone(), q.ids().clone(), q.groups().clone()


@pytest.mark.parametrize("source", [0, 1])
def test_moco_batch_scores_only_its_own_sources_queue(source):
    obj = moco()
    fill_each_source(obj)
    own, other = queue_of(obj.docs.sources[source]), queue_of(obj.docs.sources[1 - source])
    x = batch(source=source)
    loss, _ = score(obj, x)
    got = torch.autograd.grad(loss, x.q)[0]
    q = x.q.detach().clone().requires_grad_()
    ref = ref_direction(q, x.k, x.k, x.doc_id, x.group, [own], TAU)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    torch.testing.assert_close(got, torch.autograd.grad(ref, q)[0], atol=1e-5, rtol=1e-4)
    # the other source's keys would have changed it: the routing is what the reference checks
    mixed = ref_direction(q, x.k, x.k, x.doc_id, x.group, [own, other], TAU)
    assert abs(mixed.item() - ref.item()) > 1e-3


def test_two_queue_batch_scores_only_its_own_sources_pair_of_queues():
    obj = two_queue(inbatch_weight=0.0)
    fill_each_source(obj, ("docs", "queries"))
    docs, queries = queue_of(obj.docs.sources[1]), queue_of(obj.queries.sources[1])
    d, q_key = unit(B, D, seed=7).requires_grad_(), unit(B, D, seed=8)
    x = batch(source=1, d=d, q_key=q_key)
    loss, _ = score(obj, x)
    ref = (ref_direction(x.q, x.k, x.k, x.doc_id, x.group, [docs], TAU)
           + ref_direction(d, q_key, q_key, x.doc_id, x.group, [queries], TAU)) / 2
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    wrong = (ref_direction(x.q, x.k, x.k, x.doc_id, x.group, [queue_of(obj.docs.sources[0])], TAU)
             + ref_direction(d, q_key, q_key, x.doc_id, x.group, [queue_of(obj.queries.sources[0])], TAU)) / 2
    assert abs(wrong.item() - ref.item()) > 1e-3


@pytest.mark.parametrize("make,sides", [(moco, ("docs",)), (two_queue, ("docs", "queries"))])
def test_enqueue_lands_in_the_batchs_source_memory_only(make, sides):
    obj = make(sources=3)
    extra = dict(d=unit(B, D, seed=7).requires_grad_(), q_key=unit(B, D, seed=8)) if "queries" in sides else {}
    for step, source in enumerate([2, 0, 2]):
        x = batch(seed=step, source=source, step=step, **extra)
        loss, _ = score(obj, x)
        loss.backward()
        obj.after_backward()
    for side in sides:
        memories = getattr(obj, side).sources
        assert [m.fill for m in memories] == [B, 0, 2 * B]
        assert memories[2].ids().tolist() == list(range(B)) + list(range(200, 200 + B))  # steps 0 and 2's batches
        assert memories[0].ids().tolist() == list(range(100, 100 + B))
    stats = obj.stats(3)
    assert stats["queue_fill_source_0"] == B and stats["queue_fill_source_1"] == 0 and stats["queue_fill_source_2"] == 2 * B
    assert "queue_fill" not in stats
    if "queries" in sides:
        assert stats["query_queue_fill_source_2"] == 2 * B


@pytest.mark.parametrize("cls,cfg_cls", [(MoCoObjective, MoCoConfig), (TwoQueueObjective, TwoQueueConfig)])
def test_each_source_trains_as_a_plain_objective_on_its_own_batches(cls, cfg_cls):
    """With a fixed guide (its embeddings queued slot for slot): over steps of sources 0, 1, 1, 0, 1, the
    per-source objective's losses on source 1's steps, and source 1's memories (keys, guide embeddings),
    equal those of a plain objective that only ever saw source 1's batches."""
    cfg = cfg_cls(queue_size=SIZE, temperature=TAU, guide="base", guide_margin=0.02, queue_per_source=True)
    per = cls(cfg, D, guide_dim=D, sources=2).train()
    plain = cls(dataclasses.replace(cfg, queue_per_source=False), D, guide_dim=D).train()
    per_losses, plain_losses = [], []
    for step, source in enumerate([0, 1, 1, 0, 1]):
        meta = dict(doc_id=torch.arange(B) + 10 * step, group=torch.full((B,), -1), g_q=unit(B, D, seed=30 + step),
                    g_k=unit(B, D, seed=40 + step), d=unit(B, D, seed=50 + step), q_key=unit(B, D, seed=60 + step))
        q, k = unit(B, D, seed=10 + step), unit(B, D, seed=20 + step)
        for obj, out, src in ((per, per_losses, {"source": torch.full((B,), source)}), (plain, plain_losses, {})):
            if obj is plain and source != 1:
                continue
            loss, stats = momentum_step(obj, q, k, {**meta, **src}, step)
            obj.after_backward()
            out.append((loss.item(), float(stats["masked_by_guide"])))
    assert [per_losses[i] for i in (1, 2, 4)] == plain_losses
    assert plain_losses[-1][1] > 0  # the guide masked queued candidates
    for side in ("docs", "queries") if cls is TwoQueueObjective else ("docs",):
        mine, ref = getattr(per, side).sources[1].state_dict(), getattr(plain, side).state_dict()
        assert mine.keys() == ref.keys() and any(k.startswith("guide.") for k in ref)
        for k in ref:
            assert torch.equal(mine[k], ref[k]), (side, k)


def test_a_batch_must_come_from_one_known_source():
    obj = moco()
    mixed = batch()
    mixed.source = torch.tensor([0, 1, 1, 1])
    with pytest.raises(RuntimeError, match="from one source"):
        score(obj, mixed)
    with pytest.raises(ValueError, match="built for 2 source"):
        score(obj, batch(source=2))
    with pytest.raises(ValueError, match="no 'source' entry"):
        score(obj, batch(source=None))


def test_one_source_is_the_shared_queue_and_the_same_checkpoint():
    """With one source the option changes nothing (as sentence-transformers' multi-dataset options do
    on one dataset): one KeyMemory under the usual keys, and no source entry needed."""
    on, off = moco(sources=1), MoCoObjective(MoCoConfig(queue_size=SIZE, temperature=TAU), D).train()
    assert isinstance(on.docs, KeyMemory) and on.state_dict().keys() == off.state_dict().keys()
    x = batch(source=None)
    assert score(on, x)[0].item() == score(off, x)[0].item()
    # off, with several sources: one shared queue
    assert isinstance(MoCoObjective(MoCoConfig(queue_size=SIZE), D, sources=3).docs, KeyMemory)


def test_options_it_does_not_combine_with_are_refused():
    with pytest.raises(ConfigError, match="queue_per_source"):  # feature_memory has no such option
        objective_config({"name": "feature_memory", "queue_per_source": True})
    with pytest.raises(ValueError, match="queue_refresh"):
        MoCoObjective(MoCoConfig(queue_size=SIZE, queue_per_source=True, queue_refresh=2), D, {"doc": 8, "query": 8},
                      sources=2)
    with pytest.raises(ConfigError, match="objective.queue_per_source=true with objective.queue_refresh=2"):
        compose_cfg("train", ["objective=two_queue", "objective.queue_per_source=true", "objective.queue_refresh=2"],
                    to_object=True)


def test_all_the_queues_memory_is_checked_together(monkeypatch):
    """Each queue alone fits; two sources' two pairs of queues do not: refused before allocating."""
    from moco_retrieval.objectives import memory

    one = SIZE * (D * 4 + 24)  # a float32 queue's keys and its slots' id, group and step
    monkeypatch.setattr(memory, "available_memory", lambda: 3 * one - 1)
    TwoQueueObjective(TwoQueueConfig(queue_size=SIZE), D, sources=2)  # off: 2 queues
    with pytest.raises(ConfigError, match=rf"objective.queue_size={SIZE}: the objective's queues need {4 * one:,} bytes"):
        two_queue(sources=2)
    with pytest.raises(ConfigError, match=rf"the objective's queues need {3 * one:,} bytes"):
        moco(sources=3)
    moco(sources=2)


def test_the_fingerprint_covers_every_sources_memory():
    from moco_retrieval.training.checkpoints import rank_fingerprints

    obj = two_queue(sources=2)
    fill_each_source(obj, ("docs", "queries"))
    state = obj.unsynced_state()
    assert set(state) == set(obj.state_dict()) - {n for n, _ in obj.named_parameters()}
    assert {k.split(".queue.")[0] for k in state} == {"docs.sources.0", "docs.sources.1", "queries.sources.0",
                                                      "queries.sources.1"}
    module = SimpleNamespace(objective=obj, key_encoder=None)
    before = rank_fingerprints(module)["objective"]
    for key, t in state.items():
        with torch.no_grad():
            flat = t.view(-1)
            old = flat[-1].clone()
            flat[-1] = old + 1
        assert rank_fingerprints(module)["objective"] != before, key
        with torch.no_grad():
            flat[-1] = old


# ------------------------------------------------------------------ two gloo ranks

W, STEPS_SOURCES = 2, [0, 1, 1, 0, 1]


def run(steps, rank, world):
    obj = TwoQueueObjective(TwoQueueConfig(queue_size=SIZE, temperature=TAU, queue_per_source=True), D, sources=2)
    return train_steps(obj, steps, B, rank, world, extra=lambda st, rows: {"source": torch.full((rows,), st["source"])})


def run_disagreeing(rank, world):
    """Each rank's batch of another source: every rank refuses (no rank writes another's memory)."""
    obj = moco()
    try:
        score(obj, batch(source=rank))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_two_gloo_ranks_hold_identical_per_source_queues_equal_to_one_process(tmp_path):
    from tests.helpers import on_ranks

    steps = momentum_steps(len(STEPS_SOURCES), W * B, D, torch.tensor([7, -1, 7, -1, -1, 8, -1, -1]),
                           source=lambda s: STEPS_SOURCES[s])
    ranks = on_ranks(run, (steps,), W, tmp_path)
    single = run(steps, 0, 1)
    for key, v in single["state"].items():  # both sources' pairs of queues
        for r in ranks:
            assert torch.equal(r["state"][key], v), key
    assert int(single["state"]["docs.sources.1.queue.queue_fill"]) == SIZE  # 3 steps of 8 keys: wrapped
    assert int(single["state"]["queries.sources.0.queue.queue_ptr"]) == 2 * W * B % SIZE  # 2 steps of 8 keys
    for s in range(len(steps)):
        assert sum(r["loss"][s] for r in ranks) / W == pytest.approx(single["loss"][s], abs=1e-5)
        for r, res in enumerate(ranks):
            for g in ("gq", "gd"):
                torch.testing.assert_close(res[g][s], W * single[g][s][r * B:(r + 1) * B], atol=1e-5, rtol=1e-4)
    (tmp_path / "disagree").mkdir()
    messages = on_ranks(run_disagreeing, (), W, tmp_path / "disagree")
    assert all("every rank's batch of a step from one source" in m for m in messages), messages


# ------------------------------------------------------------------ a resumed run, on two sources

def test_resumed_run_with_per_source_queues_equals_the_uninterrupted_one(tmp_path, one_thread, monkeypatch):
    """Two sources (64 + 32 pairs, 16-pair batches: 6 steps); a SIGTERM during step 3 stops the run after
    it (preemption.py writes last.ckpt), resumed from last.ckpt: the losses and every source's queues
    equal the run that was not stopped."""
    import os
    import signal

    from tests.helpers import two_sources

    from moco_retrieval.training.module import RetrievalModule
    from moco_retrieval.training.preemption import Preempted
    from moco_retrieval.train import train

    data = two_sources(tmp_path / "data", n_a=64, n_b=32)
    sources = "[" + ", ".join(f"{{name: {s.name}, train_path: '{s.train_path}'}}" for s in data.sources) + "]"
    base = ["+experiment=smoke", "data=jsonl", f"data.sources={sources}", f"data.eval_dir={data.eval_dir}",
            "objective=two_queue", "objective.queue_size=24", "objective.queue_per_source=true",
            "objective.queue_max_age=2", "optim.schedule=constant", "trainer.val_check_interval=null",
            "trainer.log_every_n_steps=1"]

    def run_to(run_dir, *extra):
        train(compose_cfg("train", base + [f"run_dir={run_dir}", *extra], to_object=True), run_dir)

    run_to(tmp_path / "ref")
    step = RetrievalModule.training_step

    def preempted_in_step_3(module, batch, batch_idx):
        if module.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(module, batch, batch_idx)

    monkeypatch.setattr(RetrievalModule, "training_step", preempted_in_step_3)
    with pytest.raises(Preempted):
        run_to(tmp_path / "run")
    monkeypatch.setattr(RetrievalModule, "training_step", step)
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=False)["global_step"] == 3
    run_to(tmp_path / "run", "ckpt_path=last")
    ref = train_losses(tmp_path / "ref" / "csv" / "metrics.csv")
    got = {**train_losses(tmp_path / "run" / "csv" / "metrics.csv"),
           **train_losses(tmp_path / "run" / "csv" / "resume-1" / "metrics.csv")}
    assert sorted(ref) == list(range(1, 7)) and got.keys() == ref.keys()
    for step, value in ref.items():
        assert got[step] == pytest.approx(value, rel=1e-5, abs=1e-6), step
    a = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    b = torch.load(tmp_path / "ref" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert a.keys() == b.keys()
    for side in ("docs", "queries"):
        for s in (0, 1):
            assert int(b[f"objective.{side}.sources.{s}.queue.queue_fill"]) > 0  # both sources' memories were written
    for k, v in b.items():
        assert torch.allclose(a[k].double(), v.double(), rtol=1e-5, atol=1e-6), k
    rows = list(csv.DictReader((tmp_path / "ref" / "csv" / "metrics.csv").open()))
    assert any(r.get("train/queue_fill_source_1") for r in rows) and any(r.get("train/query_queue_age_source_0") for r in rows)
