"""Configs as the commands and checkpoints load them: coercion to the schemas (config.to_config), and
the command configs in conf/ (state-dict prefixes: tests/model/test_momentum.py)."""
from __future__ import annotations

import dataclasses

import tomllib
from fnmatch import fnmatch

import pytest
from omegaconf import OmegaConf

from moco_retrieval.config import COMMAND_SCHEMAS, EvalConfig, ExportConfig, ModelConfig, to_config
from tests.helpers import REPO, compose_cfg


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
    yaml_file = REPO / "conf" / f"{command}.yaml"
    assert yaml_file.is_file()
    assert OmegaConf.load(yaml_file).defaults[0] == f"{command}_schema"
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["moco_retrieval.conf"]
    assert any(fnmatch(yaml_file.name, g) for g in globs)
    cfg = compose_cfg(command)
    schema = COMMAND_SCHEMAS[command]
    assert OmegaConf.get_type(cfg) is schema  # strict: composed on the structured schema
    assert set(cfg) == {f.name for f in dataclasses.fields(schema)}  # (not its ClassVars: RANGES, ...)


def test_every_choice_list_pickles_by_name_for_spawned_ranks():
    """DDP's spawned ranks unpickle the config: an Enum made by choices() must be found again
    under the module and name it claims (KeySource once claimed moco_retrieval.config)."""
    import enum
    import importlib
    import pickle
    import pkgutil

    import moco_retrieval

    found = []
    for info in pkgutil.walk_packages(moco_retrieval.__path__, "moco_retrieval."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, enum.StrEnum) and value is not enum.StrEnum:
                member = next(iter(value))
                assert pickle.loads(pickle.dumps(member)) is member, f"{info.name}.{value.__name__}"
                found.append(value.__name__)
    assert {"Dtype", "KeySource", "Pooling"} <= set(found)
