"""docs/design.md's house section is generated from the rooms' own docstrings (docs/tools/house.py):
it must match the package, and every room of the package must have its place in it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "docs" / "tools" / "house.py"


def load():
    spec = importlib.util.spec_from_file_location("house", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_house_section_is_up_to_date():
    assert load().main(["--check"]) == 0, "docs/design.md's house section is stale: python docs/tools/house.py"


def test_a_new_room_without_a_place_is_refused(tmp_path, monkeypatch):
    house = load()
    (tmp_path / "newroom.py").write_text('"""A room nobody placed."""\n')
    for name in house.ORDER:  # the package as it is, plus one module
        (tmp_path / name).mkdir() if not name.endswith(".py") else (tmp_path / name).write_text('"""x."""\n')
        if not name.endswith(".py"):
            (tmp_path / name / "__init__.py").write_text('"""x."""\n')
    monkeypatch.setattr(house, "PACKAGE", tmp_path)
    try:
        house.rooms()
    except SystemExit as stop:
        assert "newroom.py" in str(stop)
    else:
        raise AssertionError("a room outside ORDER was not refused")
