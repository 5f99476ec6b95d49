"""docs/configuration.md, the configuration reference, is generated from the schemas
(docs/tools/config_reference.py): it must match them, list every key with its meaning, and
say how to regenerate it when it does not."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from moco_retrieval import config as C
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "config_reference", Path(__file__).resolve().parents[1] / "docs" / "tools" / "config_reference.py")
_ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ref)
OUTPUT, REGENERATE, field_comments, main, meaning, reference = (
    _ref.OUTPUT, _ref.REGENERATE, _ref.field_comments, _ref.main, _ref.meaning, _ref.reference)
from moco_retrieval.objectives.registry import OBJECTIVES


def test_docs_configuration_md_is_up_to_date():
    current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.is_file() else ""
    assert current == reference(), (
        f"docs/configuration.md is stale (a schema, a comment beside a key, or a preset changed): "
        f"regenerate it with `{REGENERATE}` and commit it")


def _rows(text: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*$", text, re.M)}


def test_every_key_of_every_schema_has_a_row_with_a_meaning():
    rows = _rows(reference())
    expected = {}
    sections = [("", C.TrainConfig)] + [(k + ".", s) for k, s in
                                        [("model", C.ModelConfig), ("model.lora", C.LoraConfig), ("optim", C.OptimConfig),
                                         ("data", C.DataConfig), ("data.columns", C.ColumnsConfig),
                                         ("data.prompts", C.PromptsConfig), ("data.sources[]", C.SourceConfig),
                                         ("trainer", C.TrainerConfig), ("logger", C.LoggerConfig),
                                         ("eval", C.EvalConfig)]]
    for prefix, schema in sections:
        for f in dataclasses.fields(schema):
            expected[prefix + f.name] = schema
    for entry in OBJECTIVES.values():
        for f in dataclasses.fields(entry.config):
            if f.name != "name":
                expected["objective." + f.name] = entry.config
    commands = {}  # each command's own keys (its model / data / eval sections are the ones above)
    for command in ("evaluate", "export", "search", "mine"):
        schema = C.COMMAND_SCHEMAS[command]
        section = reference().split(f"## `{command}`")[1].split("\n## ")[0]
        for f in dataclasses.fields(schema):
            if f.name not in ("model", "data", "eval"):
                assert re.search(rf"^\| `{f.name}` \|", section, re.M), f"{command}: {f.name} has no row"
                commands[f"{command} {f.name}"] = meaning(schema, f.name)
    assert not [k for k, v in commands.items() if not v], "command keys with no comment in config.py"
    missing = sorted(k for k in expected if k not in rows)
    assert not missing, f"keys without a row in the reference: {missing}"
    sections_only = [k for k in expected if "see [" in rows[k] or "the objective group" in rows[k]]
    undocumented = sorted(k for k, s in expected.items()
                          if k not in sections_only and not meaning(s, k.rsplit(".", 1)[-1]))
    assert not undocumented, f"keys with no comment in moco_retrieval/config.py: {undocumented}"


def test_command_keys_and_presets_show_the_values_the_commands_compose():
    text = reference()
    rows = _rows(text)
    # trainer=auto (conf/train.yaml's default group) sets what the schema leaves at cpu / 32-true
    assert "`cpu`; train: `auto`" in rows["trainer.accelerator"]
    assert "`32-true`; train: `auto`" in rows["trainer.precision"]
    # each objective's column: its own default, or - where it has no such option
    queue_size = rows["objective.queue_size"]
    assert "| `65536` (2^16) | `65536` (2^16) | - | `16384` |" in queue_size
    assert "| `0.995` | `0.999` | - | - |" in rows["objective.momentum"]
    assert "one of `float32`, `bfloat16`, `float16`" in rows["objective.queue_dtype"]  # an Enum's members
    # the commands' own keys, required ones said so
    mine = text[text.index("## `mine`"):]
    assert "| `output` | str | required |" in mine and "| `range_max` |" in mine
    assert "one of `top`, `random`" in mine


@dataclass
class _Base:
    # the first line
    # and the second
    size: int = 1  # and the end of the line
    plain: str = "a # not a comment"


@dataclass
class _Derived(_Base):
    size: int = 2  # the derived default's own note


def test_comments_above_and_beside_a_field_are_its_meaning_and_a_base_class_says_it_first():
    assert field_comments(_Base) == {"size": "the first line and the second and the end of the line"}
    assert field_comments(_Derived) == {"size": "the derived default's own note"}
    assert meaning(_Derived, "size") == "the first line and the second and the end of the line"


def test_check_names_the_command_when_stale_and_writing_fixes_both_files(tmp_path, capsys):
    out, guide = tmp_path / "configuration.md", tmp_path / "objectives.md"
    out.write_text("old\n")
    guide.write_text("before\n<!-- objectives table: begin -->\n| old |\n<!-- objectives table: end -->\nafter\n")
    args = ["--out", str(out), "--guide", str(guide)]
    assert main(["--check", *args]) == 1
    err = capsys.readouterr().err
    assert f"{out} is stale" in err and f"{guide} is stale" in err and REGENERATE in err
    assert main(args) == 0 and main(["--check", *args]) == 0
    text = guide.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "| `two_queue` |" in text and "| old |" not in text
