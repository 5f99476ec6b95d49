"""The objectives' structure (issue 34): one registry read by the builder, the config store, the
model card and the user guide; every piece of state DDP does not synchronise declared and fingerprinted;
checkpoints of the earlier layout still load; the config schemas composed, not inherited."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moco_retrieval.config import (
    ConfigError, FeatureMemoryConfig, ICoLConfig, InBatchConfig, MoCoConfig, ObjectiveConfig, TwoQueueConfig,
    objective_config,
)
from moco_retrieval.objectives import OBJECTIVES, build_objective
from moco_retrieval.objectives.base import Objective
from moco_retrieval.objectives.two_queue import TwoQueueObjective
from moco_retrieval.objectives.registry import objectives_table
from moco_retrieval.objectives.step import StepInput, View, check_views

ROOT = Path(__file__).resolve().parents[1]
D = 8


def unit(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g), dim=-1)


def encoder(frozen=False, shared_tower=True):
    return SimpleNamespace(dim=D, hidden_size=2 * D, frozen=frozen, shared_tower=shared_tower,
                           max_len=lambda kind: 6)


# every objective with as much state as it can have: guide queues, refresh buffers, logQ
FULL = {
    "moco": (MoCoConfig(queue_size=8, guide="base", queue_refresh=2, logq_correction=True, logq_buckets=16), encoder()),
    "two_queue": (TwoQueueConfig(queue_size=8, guide="base", queue_refresh=2, logq_correction=True, logq_buckets=16),
                  encoder()),
    "inbatch": (InBatchConfig(logq_correction=True, logq_buckets=16), encoder()),
    "feature_memory": (FeatureMemoryConfig(queue_size=8, guide="base", logq_correction=True, logq_buckets=16),
                       encoder(frozen=True)),
    "icol": (ICoLConfig(queue_size=8), encoder(shared_tower=False)),
}


def full(name):
    cfg, enc = FULL[name]
    return build_objective(cfg, enc, SimpleNamespace(dim=D) if cfg.guide != "none" else None)


def test_registry_is_the_one_list_of_objectives():
    """Builder, config store and presets agree with the registry; no objective (or schema) is
    another's subclass."""
    from hydra.core.config_store import ConfigStore

    from moco_retrieval.config import register_configs

    register_configs()
    assert set(OBJECTIVES) == set(FULL) == {p.stem for p in (ROOT / "conf" / "objective").glob("*.yaml")}
    stored = ConfigStore.instance().repo["objective"]
    for name, entry in OBJECTIVES.items():
        assert entry.config().name == name and f"{name}_schema.yaml" in stored
        assert type(full(name)) is entry.objective
        assert objective_config({"name": name}).__class__ is entry.config
        others = [e for n, e in OBJECTIVES.items() if n != name]
        assert not any(issubclass(entry.objective, e.objective) for e in others), name
        assert not any(issubclass(entry.config, e.config) for e in others), name
        assert entry.description and "\n" not in entry.description


def test_option_groups_check_their_own_ranges_and_stay_strict():
    with pytest.raises(ConfigError, match=r"objective.momentum=1.5: must be in \[0, 1\]"):
        TwoQueueConfig(momentum=1.5)
    with pytest.raises(ConfigError, match=r"objective.phase_steps=0"):
        ICoLConfig(phase_steps=0)
    with pytest.raises(ConfigError, match="queue_size"):  # a queue option the in-batch objective lacks
        objective_config({"name": "inbatch", "queue_size": 16})
    with pytest.raises(ConfigError, match="enqueue_hard_negatives"):  # MoCo's own option, not two_queue's
        objective_config({"name": "two_queue", "enqueue_hard_negatives": True})
    assert not isinstance(TwoQueueConfig(), MoCoConfig) and isinstance(TwoQueueConfig(), ObjectiveConfig)


def test_guide_table_and_model_card_read_the_registry():
    guide = (ROOT / "docs" / "guide" / "objectives.md").read_text(encoding="utf-8")
    table = re.search(r"<!-- objectives table: begin -->\n(.*?)\n<!-- objectives table: end -->", guide, re.S)
    assert table and table.group(1) == objectives_table(), (
        "docs/guide/objectives.md's table of objectives is stale: regenerate it with "
        "`python docs/tools/config_reference.py`")
    from moco_retrieval.export.card import model_card

    for name, entry in OBJECTIVES.items():  # icol included (the card's own list lacked it)
        card = model_card({"dim": D}, {"pooling": "mean"}, "query", {"objective": {"name": name}}, None, "out")
        assert f"- Objective: {entry.description} (`objective={name}`)" in card


@pytest.mark.parametrize("name", list(FULL))
def test_unsynced_state_is_every_buffer_and_the_fingerprint_covers_it(name):
    """Every persistent buffer of an objective (queues, query queue, guide queues, refresh tokens
    and steps, logQ estimates, ICoL's phase) is declared; changing any one changes the rank's
    fingerprint (fingerprints.py), which before covered the document queue only."""
    from moco_retrieval.training.checkpoints import rank_fingerprints

    obj = full(name)
    params = {n for n, _ in obj.named_parameters()}
    state = obj.unsynced_state()
    assert set(state) == set(obj.state_dict()) - params and state
    module = SimpleNamespace(objective=obj, key_encoder=None)
    before = rank_fingerprints(module)["objective"]
    for key, t in state.items():
        with torch.no_grad():
            flat = t.view(-1)
            old = flat[0].clone()
            flat[0] = old + 1 if t.dtype != torch.bool else ~old
        assert rank_fingerprints(module)["objective"] != before, key
        with torch.no_grad():
            flat[0] = old
    assert rank_fingerprints(module)["objective"] == before


def legacy(state: dict, renames: dict) -> dict:
    """``state`` with its keys as the objectives wrote them before they were composed."""
    out = {}
    for key, v in state.items():
        for new, old in renames.items():
            if key.startswith(new):
                key = old + key[len(new):]
                break
        out[key] = v
    return out


@pytest.mark.parametrize("name,renames", [
    ("two_queue", {"docs.queue.": "queue.", "docs.guide.": "guide_queue.", "docs.refresh.": "doc_refresh.",
                   "queries.queue.": "query_queue.", "queries.guide.": "query_guide_queue.",
                   "queries.refresh.": "query_refresh.", "scoring.logq.": "logq."}),
    ("feature_memory", {"memory.queue.": "queue.", "memory.guide.": "guide_queue.", "scoring.logq.": "logq."}),
    ("icol", {"memory.queue.": "queue."}),
])
def test_checkpoints_of_the_earlier_layout_load(name, renames):
    obj = full(name)
    for memory in obj.memories():
        n = 5
        memory.queue.enqueue(unit(n, memory.queue.dim, seed=1), torch.arange(n), torch.arange(n) % 2, step=3)
        if memory.guide is not None:
            memory.guide.enqueue(unit(n, D, seed=2), torch.arange(n), torch.arange(n) % 2, step=3)
    if obj.scoring.logq is not None:
        obj.scoring.logq.observe(torch.tensor([1, 2, 3]), step=2)
    old = legacy(obj.state_dict(), renames)
    assert set(old).isdisjoint(obj.state_dict()) or name == "icol"  # (icol's phase buffer kept its name)
    fresh = full(name)
    fresh.load_state_dict(old)
    for key, v in obj.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], v), key
    assert [m.fill for m in fresh.memories()] == [m.fill for m in obj.memories()] == [5] * len(obj.memories())


def test_a_view_without_a_step_field_is_refused():
    check_views("ok", {"q": View("query"), "q_key_fresh": View("stored_query", "momentum", grad=False)})
    with pytest.raises(TypeError, match=r"declares views \['queries'\]"):
        check_views("Bad", {"queries": View("query")})


def test_eval_forward_holds_nothing_back():
    """Only a training forward's keys are written after backward."""
    obj = TwoQueueObjective(TwoQueueConfig(queue_size=8, guide="base"), D, guide_dim=D).eval()
    step = StepInput(unit(3, D, seed=1), unit(3, D, seed=2), torch.arange(3), torch.full((3,), -1),
                     d=unit(3, D, seed=3), q_key=unit(3, D, seed=4), g_q=unit(3, D, seed=5), g_k=unit(3, D, seed=6))
    obj(step)
    obj.after_backward()
    assert [m.fill for m in obj.memories()] == [0, 0]
    obj.train()(step)
    obj.after_backward()
    assert [m.fill for m in obj.memories()] == [3, 3]
    assert isinstance(obj, Objective)
