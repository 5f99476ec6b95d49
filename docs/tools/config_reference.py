"""docs/configuration.md: every configuration key, its type, default, valid values and meaning,
generated from the schemas (config.py's dataclasses, the objectives' through their registry) and
the defaults the commands compose (conf/); and the table of objectives in docs/guide/objectives.md
(between its marker comments), from the registry. Regenerate after changing a schema or a preset:

    python docs/tools/config_reference.py            # writes both
    python docs/tools/config_reference.py --check    # status 1 when either is stale

A key's meaning is the comment written beside it (or on the lines just above it) in config.py,
so the reference says what the code says; tests/test_config_reference.py holds the file to it.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

from moco_retrieval import config as C

REPO = Path(__file__).resolve().parents[2]
OUTPUT = REPO / "docs" / "configuration.md"
OBJECTIVES_GUIDE = REPO / "docs" / "guide" / "objectives.md"
TABLE_BEGIN, TABLE_END = "<!-- objectives table: begin -->\n", "\n<!-- objectives table: end -->"
REGENERATE = "python docs/tools/config_reference.py"

# train's sections: (key, schema); objective has one schema per objective and its own table
TRAIN_SECTIONS: list[tuple[str, type]] = [
    ("model", C.ModelConfig), ("model.lora", C.LoraConfig), ("optim", C.OptimConfig), ("data", C.DataConfig),
    ("data.columns", C.ColumnsConfig), ("data.prompts", C.PromptsConfig), ("data.views", C.ViewsConfig),
    ("data.sources[]", C.SourceConfig),
    ("trainer", C.TrainerConfig), ("logger", C.LoggerConfig), ("eval", C.EvalConfig),
]
COMMANDS = ("evaluate", "export", "search", "mine")  # besides train: their own top-level keys
SECTION_OF = {schema.__name__: key for key, schema in TRAIN_SECTIONS if "[]" not in key}  # a nested schema's section


# ---- comments beside fields, read from the source


@lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} for the fields ``cls`` itself defines: the comment lines right above a
    field joined to the one at the end of its line (``# `` removed)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whole line)
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            whole = not lines[row - 1][: tok.start[1]].strip()
            comments[row] = (tok.string.lstrip("#").strip(), whole)
    body = ast.parse(source).body[0]
    out: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        inline = [comments[r][0] for r in range(node.lineno, node.end_lineno + 1)
                  if r in comments and not comments[r][1]]
        text = " ".join(above + inline).strip()
        if text:
            out[node.target.id] = text
    return out


def meaning(schema: type, name: str) -> str:
    """The field's comment from the first class in ``schema``'s MRO (base first) that comments it:
    the general meaning, not an override's note on its own default."""
    for klass in reversed(schema.__mro__):
        if dataclasses.is_dataclass(klass) and name in klass.__dict__.get("__annotations__", {}):
            text = field_comments(klass).get(name)
            if text:
                return text
    return ""


# ---- types, defaults, valid values


def enum_of(schema: type, name: str) -> Optional[type]:
    """The Enum a field's value is one of (Optional[...] or not), else None."""
    hint = typing.get_type_hints(schema).get(name)
    for t in (hint, *typing.get_args(hint)):
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return t
    return None


def type_text(annotation: Any, schema: type = None, name: str = "") -> str:
    """``Optional[int]`` -> ``int or null``; an Enum -> ``str``; a nested schema's name stays (its own
    section says more)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if text.startswith("Optional[") and text.endswith("]"):
        return f"{type_text(text[len('Optional['):-1], schema, name)} or null"
    if text.endswith(" | None"):
        return f"{type_text(text[: -len(' | None')], schema, name)} or null"
    if schema is not None and enum_of(schema, name) is not None:
        return "str"
    return {"Any": "any"}.get(text, text)


def value_text(value: Any) -> str:
    if value is None:
        return "`null`"
    if value == MISSING or value == "???":
        return "required"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if value == "":
        return '`""`'
    if isinstance(value, int) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"`{value}` (2^{value.bit_length() - 1})"
    return f"`{value}`"


def schema_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        made = f.default_factory()  # type: ignore[misc]
        return None if dataclasses.is_dataclass(made) else made
    return MISSING


def valid_text(schema: type, name: str) -> str:
    ranges = schema.ranges() if hasattr(schema, "ranges") else {}
    choices = schema.choices() if hasattr(schema, "choices") else {}
    options = enum_of(schema, name)
    if options is not None:
        return "one of " + ", ".join(f"`{c.value}`" for c in options)
    if name in choices:
        return "one of " + ", ".join(f"`{c}`" for c in choices[name])
    if name in ranges:
        return str(ranges[name])
    return ""


# ---- the defaults each command composes (conf/<command>.yaml and its default groups)


def composed(command: str, overrides: tuple[str, ...] = ()) -> dict:
    """``conf/<command>.yaml`` composed with ``overrides``, interpolations left as written."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from moco_retrieval.command import CONFIG_PATH, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(CONFIG_PATH.removeprefix("pkg://"), version_base="1.3"):
            cfg = compose(command, overrides=list(overrides))
        return OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    finally:
        GlobalHydra.instance().clear()


def lookup(tree: Optional[dict], path: str) -> Any:
    """The value at ``a.b`` in a composed config; ``...`` when it is not there."""
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return ...
        node = node[part]
    return node


def default_text(schema_value: Any, command_value: Any, command: str) -> str:
    """The schema's default, and what ``command`` composes when its presets set another value."""
    text = value_text(schema_value)
    if isinstance(schema_value, tuple):  # (a tuple default composes as a list)
        schema_value = list(schema_value)
    same = command_value == schema_value
    if command_value is ... or isinstance(command_value, dict) or same:
        return text
    if schema_value is MISSING:
        return f"{value_text(command_value)} ({command})"
    return f"{text}; {command}: {value_text(command_value)}"


# ---- tables


def cell(text: str) -> str:
    """Text safe in a Markdown table cell (a <word> would read as an HTML tag)."""
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def section_table(prefix: str, schema: type, tree: Optional[dict], command: str) -> list[str]:
    rows = [HEADER]
    for f in dataclasses.fields(schema):
        key = f"{prefix}.{f.name}" if prefix else f.name
        nested = schema_default(f) is None and f.default_factory is not dataclasses.MISSING  # type: ignore[misc]
        what = meaning(schema, f.name)
        if nested:
            section = SECTION_OF.get(type_text(f.type).removesuffix(" or null"), key)
            what = f"see [`{section}`](#{anchor(section)})" + (f"; {what}" if what else "")
        composed_value = lookup(tree, key.replace("[]", "")) if tree is not None and "[]" not in key else ...
        default = "(section)" if nested else default_text(schema_default(f), composed_value, command)
        rows.append(row(key, type_text(f.type, schema, f.name), default, valid_text(schema, f.name), what))
    return rows


def anchor(key: str) -> str:
    """GitHub's anchor of a ``## `key` `` heading."""
    return "".join(ch for ch in key.lower() if ch.isalnum() or ch in "-_ ").replace(" ", "-")


def objective_table(trees: dict[str, dict]) -> list[str]:
    """One row per objective option, one column per objective: its default there, or - where that
    objective has no such option (giving it is an error)."""
    from moco_retrieval.objectives.registry import OBJECTIVES

    names = list(OBJECTIVES)
    keys: list[tuple[str, type]] = []
    for name in names:
        for f in dataclasses.fields(OBJECTIVES[name].config):
            if f.name != "name" and f.name not in [k for k, _ in keys]:
                keys.append((f.name, OBJECTIVES[name].config))
    rows = ["| key | type | " + " | ".join(f"`{n}`" for n in names) + " | valid | meaning |",
            "|---|---|" + "---|" * len(names) + "---|---|"]
    for key, first in keys:
        cells = []
        for name in names:
            schema = OBJECTIVES[name].config
            fields = {f.name: f for f in dataclasses.fields(schema)}
            if key not in fields:
                cells.append("-")
                continue
            cells.append(cell(default_text(schema_default(fields[key]), lookup(trees[name], f"objective.{key}"),
                                           "yaml")))
        typ = type_text(next(f.type for f in dataclasses.fields(first) if f.name == key), first, key)
        rows.append(f"| `objective.{key}` | {cell(typ)} | " + " | ".join(cells)
                    + f" | {cell(valid_text(first, key))} | {cell(meaning(first, key))} |")
    return rows


def doc_summary(schema: type) -> str:
    doc = schema.__doc__ or ""
    if doc.startswith(schema.__name__ + "("):  # dataclasses' generated signature: no docstring
        return ""
    return " ".join(textwrap.dedent(doc).strip().split()).replace("``", "`")


HEADER = "| key | type | default | valid | meaning |\n|---|---|---|---|---|"
INTRO = f"""# Configuration reference

<!-- generated by `{REGENERATE}` from moco_retrieval/config.py and objectives/registry.py; \
do not edit: tests/test_config_reference.py fails when this file is stale -->

Every command's configuration is a strict schema (the dataclasses of `moco_retrieval/config.py`): a key \
that is not listed here is an error, with or without a `+`, and values are checked against the *valid* \
column before any data or model loads (status 2). Set a key as `section.key=value`, pick a preset of a \
group as `group=option` (`model=tiny`, `objective=moco`, `data=jsonl`, `trainer=gpu`, `logger=csv`) and \
a whole experiment as `+experiment=NAME`; `python -m moco_retrieval.train --cfg job [overrides]` prints \
the result.

*default* is the schema's; where the command's own config (`conf/train.yaml` and the default groups it \
names) composes another value, that follows (`train: ...`). Presets in `+experiment=` change more (see \
`conf/experiment/`).
"""


def row(key: str, typ: str, default: str, valid: str, what: str) -> str:
    return f"| `{key}` | {cell(typ)} | {cell(default)} | {cell(valid)} | {cell(what)} |"


def top_level_section(train: dict) -> list[str]:
    """train's own keys: the sections, and seed / ckpt_path / run_dir."""
    from moco_retrieval.objectives.registry import OBJECTIVES

    rows = ["## (top level)", "", "`python -m moco_retrieval.train`'s own keys.", "", HEADER]
    for f in dataclasses.fields(C.TrainConfig):
        if f.name == "objective":
            rows.append(row("objective", "section", f"`{train['objective']['name']}`",
                            ", ".join(f"`{n}`" for n in OBJECTIVES),
                            "the objective group (`objective=NAME`); its keys: [`objective`](#objective)"))
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            rows.append(row(f.name, "section", "", "", f"see [`{f.name}`](#{anchor(f.name)})"))
        else:
            rows.append(row(f.name, type_text(f.type), default_text(f.default, train.get(f.name, ...), "train"), "",
                            meaning(C.TrainConfig, f.name)))
    return rows


def objective_section() -> list[str]:
    from moco_retrieval.objectives.registry import OBJECTIVES

    trees = {name: composed("train", (f"objective={name}",)) for name in OBJECTIVES}
    return ["## `objective`", "",
            "One schema per objective (`objective=NAME`), so an option the chosen objective does not have "
            "(`-` below) is an error. Defaults are each objective's preset (`conf/objective/NAME.yaml`); "
            "`; yaml:` marks where the preset sets another value than the schema.", "",
            *[f"- `{name}` (`{e.config.__name__}`): {e.description}" for name, e in OBJECTIVES.items()],
            "", *objective_table(trees)]


def schema_section(key: str, schema: type, train: dict) -> list[str]:
    summary = doc_summary(schema)
    return [f"## `{key}`", "", *([summary, ""] if summary else []), *section_table(key, schema, train, "train")]


def command_section(command: str) -> list[str]:
    """A command's own keys; its model / data / eval sections are training's."""
    schema, tree = C.COMMAND_SCHEMAS[command], composed(command)
    shared = [f.name for f in dataclasses.fields(schema) if f.name in ("model", "data", "eval")]
    also = ("Also the sections " + ", ".join(f"[`{s}`](#{anchor(s)})" for s in shared) + " (as in training)."
            if shared else "")
    rows = [f"## `{command}`", "", f"{doc_summary(schema)} {also}".strip(), "", HEADER]
    rows += [row(f.name, type_text(f.type, schema, f.name), default_text(schema_default(f), lookup(tree, f.name), command),
                 valid_text(schema, f.name), meaning(schema, f.name))
             for f in dataclasses.fields(schema) if f.name not in shared]
    return rows


def reference() -> str:
    """The whole of docs/configuration.md."""
    train = composed("train")
    index = ("Sections: " + ", ".join(f"[`{k}`](#{anchor(k)})" for k in
                                      ["(top level)", "objective", *(k for k, _ in TRAIN_SECTIONS)])
             + "; commands: " + ", ".join(f"[`{c}`](#{anchor(c)})" for c in COMMANDS) + ".")
    parts = [INTRO.rstrip("\n").split("\n"), [index], top_level_section(train), objective_section()]
    parts += [schema_section(key, schema, train) for key, schema in TRAIN_SECTIONS]
    parts += [command_section(command) for command in COMMANDS]
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def with_objectives_table(text: str) -> str:
    """``text`` with the Markdown between the objectives table's markers replaced by the registry's table."""
    from moco_retrieval.objectives.registry import objectives_table

    start, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    return text[:start] + objectives_table() + text[end:]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/tools/config_reference.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare: status 1 when the file is stale")
    parser.add_argument("--out", type=Path, default=OUTPUT)
    parser.add_argument("--guide", type=Path, default=OBJECTIVES_GUIDE, help="the page holding the objectives table")
    args = parser.parse_args(argv)
    guide = args.guide.read_text(encoding="utf-8")
    wanted = {args.out: reference(), args.guide: with_objectives_table(guide)}
    if args.check:
        stale = [path for path, text in wanted.items()
                 if (path.read_text(encoding="utf-8") if path.is_file() else "") != text]
        for path in stale:
            print(f"{path} is stale: regenerate it with `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in wanted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["reference", "with_objectives_table", "field_comments", "meaning", "main", "OUTPUT", "OBJECTIVES_GUIDE",
           "REGENERATE"]
