"""``--help`` of every command: what it does, its option groups and presets, its main options.

Hydra's own page lists the structured-config schemas (``objective: moco, moco_schema, ...``) among
a group's options, which are internal (the base each option's yaml extends), and says nothing of
the command; this one reads the command's docstring and the config it composes. Hydra's page stays
behind ``--hydra-help``; ``--cfg job`` prints every key.
"""
from __future__ import annotations

import textwrap
from typing import Optional

SCHEMA_SUFFIX = "_schema"  # ConfigStore names of the schemas (config.register_configs)
PRESETS = "experiment"  # the group of presets, added with a +


def asks_for_help(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def summary(doc: Optional[str]) -> str:
    """The docstring's first paragraph and the example lines right after it."""
    paragraphs = textwrap.dedent((doc or "").strip("\n")).split("\n\n")
    # (a one-line first paragraph is a usage line: the next one says what the command does)
    kept = paragraphs[:1] + [p for p in paragraphs[1:2] if p.startswith("    ") or "\n" not in paragraphs[0]]
    return "\n\n".join(kept).replace("``", "`").strip()


def groups_and_options(name: str) -> tuple[dict[str, list[str]], list[tuple[str, object]]]:
    """({group: options, schemas left out}, [(top-level key, default)]) of ``conf/<name>.yaml``."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from moco_retrieval.command import CONFIG_PATH

    module = CONFIG_PATH.removeprefix("pkg://")
    GlobalHydra.instance().clear()
    with initialize_config_module(module, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        cfg = compose(name)
        used = set(cfg.keys()) | {PRESETS}
        groups = {g: [o for o in loader.get_group_options(g) if not o.endswith(SCHEMA_SUFFIX)]
                  for g in loader.list_groups("") if g in used}
    values = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    main = [(k, "(required)" if v == "???" else v) for k, v in values.items() if not isinstance(v, dict)]
    return {g: o for g, o in groups.items() if o}, main


def help_text(name: str, doc: Optional[str]) -> str:
    groups, main = groups_and_options(name)
    lines = [f"python -m moco_retrieval.{name} [group=option ...] [key=value ...]", "", summary(doc), ""]
    presets = groups.pop(PRESETS, None)
    if presets and name == "train":  # (the presets are the main job's)
        lines += ["Presets (+experiment=NAME, first on the line):", "  " + ", ".join(presets), ""]
    if groups:
        lines += ["Option groups (group=option; then group.key=value sets one key):"]
        lines += [f"  {g}: {', '.join(o)}" for g, o in groups.items()]
        lines.append("")
    if main:
        lines += ["Main options (key=value; defaults shown):"]
        lines += [f"  {k}={'null' if v is None else v}" for k, v in main]
        lines.append("")
    lines += [f"Every key and its value: python -m moco_retrieval.{name} --cfg job [overrides]. "
              "A key that does not exist is an error.", "Hydra's own options: --hydra-help."]
    return "\n".join(lines)


__all__ = ["asks_for_help", "help_text", "summary"]
