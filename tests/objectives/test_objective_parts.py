"""The objectives' structure: one registry read by the builder, the config store, the model card and
the user guide; every piece of state DDP does not synchronise declared and fingerprinted; the config
schemas composed, not inherited; evaluation writes nothing."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from tests.helpers import REPO, encoder_stub, momentum_step, unit

from moco_retrieval.config import ConfigError
from moco_retrieval.objectives.base import Objective, ObjectiveConfig
from moco_retrieval.objectives.feature_memory import FeatureMemoryConfig
from moco_retrieval.objectives.inbatch import InBatchConfig
from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.objectives.registry import OBJECTIVES, build_objective, objective_config, objectives_table
from moco_retrieval.objectives.two_queue import TwoQueueConfig, TwoQueueObjective

D = 8


# every objective with as much state as it can have: guide queues, refresh buffers, logQ
FULL = {
    "moco": (MoCoConfig(queue_size=8, guide="base", queue_refresh=2, logq_correction=True, logq_buckets=16),
             encoder_stub(D, 2 * D)),
    "two_queue": (TwoQueueConfig(queue_size=8, guide="base", queue_refresh=2, logq_correction=True, logq_buckets=16),
                  encoder_stub(D, 2 * D)),
    "inbatch": (InBatchConfig(logq_correction=True, logq_buckets=16), encoder_stub(D, 2 * D)),
    "feature_memory": (FeatureMemoryConfig(queue_size=8, guide="base", logq_correction=True, logq_buckets=16),
                       encoder_stub(D, 2 * D, frozen=True)),
}


def full(name):
    cfg, enc = FULL[name]
    return build_objective(cfg, enc, SimpleNamespace(dim=D) if cfg.guide != "none" else None)


def test_registry_is_the_one_list_of_objectives():
    """Builder, config store and presets agree with the registry; no objective (or schema) is
    another's subclass."""
    from hydra.core.config_store import ConfigStore

    from moco_retrieval.command import register_configs

    register_configs()
    stored = ConfigStore.instance().repo["objective"]
    assert set(OBJECTIVES) == set(FULL) == {name.removesuffix(".yaml") for name in stored}
    assert not (REPO / "conf" / "objective").exists()  # objective=NAME is the schema itself: no yaml restates it
    for name, entry in OBJECTIVES.items():
        assert entry.config().name == name
        assert type(full(name)) is entry.objective
        assert objective_config({"name": name}).__class__ is entry.config
        others = [e for n, e in OBJECTIVES.items() if n != name]
        assert not any(issubclass(entry.objective, e.objective) for e in others), name
        assert not any(issubclass(entry.config, e.config) for e in others), name
        assert entry.description and "\n" not in entry.description


def test_option_groups_check_their_own_ranges_and_stay_strict():
    with pytest.raises(ConfigError, match=r"objective.momentum=1.5: must be in \[0, 1\]"):
        TwoQueueConfig(momentum=1.5)
    with pytest.raises(ConfigError, match=r"objective.queue_max_age=0: must be >= 1"):  # MomentumOptions's, kept by
        TwoQueueConfig(queue_max_age=0)  # TwoQueueConfig's own default for it    with pytest.raises(ConfigError, match="queue_size"):  # a queue option the in-batch objective lacks
        objective_config({"name": "inbatch", "queue_size": 16})
    with pytest.raises(ConfigError, match="enqueue_hard_negatives"):  # MoCo's own option, not two_queue's
        objective_config({"name": "two_queue", "enqueue_hard_negatives": True})
    assert not isinstance(TwoQueueConfig(), MoCoConfig) and isinstance(TwoQueueConfig(), ObjectiveConfig)


def test_guide_table_and_model_card_read_the_registry():
    guide = (REPO / "docs" / "guide" / "objectives.md").read_text(encoding="utf-8")
    table = re.search(r"<!-- objectives table: begin -->\n(.*?)\n<!-- objectives table: end -->", guide, re.S)
    assert table and table.group(1) == objectives_table(), (
        "docs/guide/objectives.md's table of objectives is stale: regenerate it with "
        "`python docs/tools/config_reference.py`")
    from moco_retrieval.export.card import model_card

    for name, entry in OBJECTIVES.items():
        card = model_card({"dim": D}, {"pooling": "mean"}, "query", {"objective": {"name": name}}, None, "out")
        assert f"- Objective: {entry.description} (`objective={name}`)" in card


@pytest.mark.parametrize("name", list(FULL))
def test_unsynced_state_is_every_buffer_and_the_fingerprint_covers_it(name):
    """Every persistent buffer of an objective (queues, query queue, guide queues, refresh tokens
    and steps, logQ estimates) is declared; changing any one changes the rank's fingerprint
    (training/checkpoints.py)."""
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


def test_eval_forward_holds_nothing_back():
    """Only a training forward's keys are written after backward."""
    obj = TwoQueueObjective(TwoQueueConfig(queue_size=8, guide="base"), D, guide_dim=D).eval()
    meta = dict(doc_id=torch.arange(3), group=torch.full((3,), -1), d=unit(3, D, seed=3), q_key=unit(3, D, seed=4),
                g_q=unit(3, D, seed=5), g_k=unit(3, D, seed=6))
    momentum_step(obj, unit(3, D, seed=1), unit(3, D, seed=2), meta)
    obj.after_backward()
    assert [m.fill for m in obj.memories()] == [0, 0]
    momentum_step(obj.train(), unit(3, D, seed=1), unit(3, D, seed=2), meta)
    obj.after_backward()
    assert [m.fill for m in obj.memories()] == [3, 3]
    assert isinstance(obj, Objective)
