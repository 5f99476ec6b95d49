"""Model loading pieces shared by the training module and the commands: state-dict prefixes,
config coercion, the command configs in conf/."""
from __future__ import annotations

import dataclasses

import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from moco_retrieval.config import COMMAND_SCHEMAS, EvalConfig, ExportConfig, ModelConfig, OptimConfig, to_config
from moco_retrieval.command import register_configs
from moco_retrieval.objectives.registry import objective_config
from moco_retrieval.training.module import RetrievalModule
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.model.momentum import state_dict_prefix
from moco_retrieval.model.tiny import build_tiny_bert

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_bert(tmp_path_factory.mktemp("tiny") / "bert"))


def module(tiny_dir, objective="moco", **model_kw):
    model = ModelConfig(backbone="tiny", path=tiny_dir, **model_kw)
    obj = {"name": objective, **({"queue_size": 8} if objective != "inbatch" else {})}
    return RetrievalModule(model, objective_config(obj), OptimConfig())


# --------------------------------------------------------------------------- state_dict_prefix


@pytest.mark.parametrize("shared_tower", [True, False])
def test_state_dict_prefix_matches_the_training_module(tiny_dir, shared_tower):
    m = module(tiny_dir, shared_tower=shared_tower, head="linear")
    state = m.state_dict()
    expected = set(build_encoder(m.model_cfg).state_dict())
    for which in ("query", "key"):
        prefix = state_dict_prefix(which)
        inner = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        assert set(inner) == expected, which  # exactly one whole TextEncoder under the prefix
        enc = build_encoder(m.model_cfg)
        enc.load_state_dict(inner, strict=True)
    with torch.no_grad():  # the key prefix is the momentum copy, not a second view of the query encoder
        m.key_encoder.key_encoder.tower_for("query").head.weight.add_(1.0)
    head = "tower.head.weight" if shared_tower else "query_tower.head.weight"
    key, query = state_dict_prefix("key") + head, state_dict_prefix("query") + head
    assert not torch.equal(m.state_dict()[key], m.state_dict()[query])
    assert state_dict_prefix("query") == "encoder." and state_dict_prefix("key") == "key_encoder.key_encoder."
    with pytest.raises(ValueError, match="encoder='doc'"):
        state_dict_prefix("doc")


def test_no_key_prefix_without_a_momentum_encoder(tiny_dir):
    state = module(tiny_dir, objective="inbatch").state_dict()
    assert any(k.startswith(state_dict_prefix("query")) for k in state)
    assert not any(k.startswith(state_dict_prefix("key")) for k in state)


# --------------------------------------------------------------------------- to_config


def test_to_config_from_dataclass_dictconfig_dict_and_none():
    cfg = ModelConfig(head="linear", head_dim=8)
    assert to_config(ModelConfig, cfg) is cfg
    from_dict = to_config(ModelConfig, {"head": "linear", "head_dim": 8})
    from_node = to_config(ModelConfig, OmegaConf.create({"head": "linear", "head_dim": 8}))
    assert from_dict == from_node == cfg and isinstance(from_node, ModelConfig)
    assert to_config(EvalConfig, None) == EvalConfig() == to_config(EvalConfig, {})
    # interpolations are resolved
    node = OmegaConf.create({"len": 7, "model": {"query_max_len": "${len}"}})
    assert to_config(ModelConfig, node.model).query_max_len == 7


def test_to_config_rejects_unknown_keys_bad_values_and_missing():
    with pytest.raises(ValueError, match="(?s)ModelConfig.*not_a_key"):
        to_config(ModelConfig, {"not_a_key": 1})
    with pytest.raises(ValueError, match="(?s)ModelConfig.*query_max_len"):
        to_config(ModelConfig, {"query_max_len": "long"})
    with pytest.raises(ValueError, match="(?s)ExportConfig.*out_dir"):
        to_config(ExportConfig, {})  # out_dir is required
    with pytest.raises(TypeError, match="ModelConfig"):
        to_config(ModelConfig, ["backbone", "tiny"])


# --------------------------------------------------------------------------- command configs


@pytest.mark.parametrize("command", sorted(COMMAND_SCHEMAS))
def test_every_command_has_a_yaml_on_its_schema_and_ships_it(command):
    from hydra import compose, initialize_config_module

    yaml_file = ROOT / "conf" / f"{command}.yaml"
    assert yaml_file.is_file()
    assert OmegaConf.load(yaml_file).defaults[0] == f"{command}_schema"
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["moco_retrieval.conf"]
    assert any(fnmatch(yaml_file.name, g) for g in globs)
    register_configs()  # what each command module does on import
    with initialize_config_module(config_module="moco_retrieval.conf", version_base="1.3"):
        cfg = compose(config_name=command)
    schema = COMMAND_SCHEMAS[command]
    assert OmegaConf.get_type(cfg) is schema  # strict: composed on the structured schema
    assert set(cfg) == {f.name for f in dataclasses.fields(schema)}  # (not its ClassVars: RANGES, ...)
