"""``python -m moco_retrieval.data``: bad input ends it as every command ends (one message naming
what is wrong, status 2; Ctrl-C status 130), a bug keeps its traceback, and ``prepare --help`` lists
the data kinds as the commands' ``--help`` lists a group's options."""
from __future__ import annotations

import pytest

from moco_retrieval.data import __main__ as data_command
from moco_retrieval.errors import INTERRUPTED_STATUS, USER_ERROR_STATUS


def stopped(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        data_command.main(argv)
    return stop.value.code, " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("value", ["1.5", "0", "half"])
def test_an_eval_fraction_outside_0_1_is_refused_before_building(tmp_path, capsys, value):
    status, err = stopped(["pydoc", "--out", str(tmp_path / "o"), "--eval-fraction", value], capsys)
    assert status == USER_ERROR_STATUS
    assert f"argument --eval-fraction: expected a number in (0, 1), got" in err and value in err
    assert not (tmp_path / "o").exists()


def test_prepare_names_the_closest_key_and_refuses_other_overrides(capsys):
    status, err = stopped(["prepare", "data=jsonl", "data.trian_path=pairs.jsonl"], capsys)
    assert status == USER_ERROR_STATUS
    assert err.startswith("data prepare: error: data.trian_path: unknown key") and "did you mean data.train_path?" in err
    assert "Traceback" not in err
    status, err = stopped(["prepare", "data=jsonl", "+model.foo=1"], capsys)
    assert status == USER_ERROR_STATUS
    assert err == "data prepare: error: prepare takes data=KIND, data.KEY=VALUE and workers=N overrides only, got +model.foo=1"
    status, err = stopped(["prepare", "data=nosuch"], capsys)
    assert status == USER_ERROR_STATUS and err.startswith("data prepare: error: In 'train': Could not find 'data/nosuch'")
    assert "jsonl" in err and "_schema" not in err


def test_ctrl_c_is_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(data_command, "build_stdlib_docs", interrupted)
    status, err = stopped(["pydoc", "--out", str(tmp_path / "o")], capsys)
    assert status == INTERRUPTED_STATUS and err == "data pydoc: interrupted (Ctrl-C) before it finished"


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def bug(*args, **kwargs):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr(data_command, "build_stdlib_docs", bug)
    with pytest.raises(ValueError, match="a bug"):
        data_command.main(["pydoc", "--out", str(tmp_path / "o")])


def test_prepare_help_lists_the_data_kinds(capsys):
    with pytest.raises(SystemExit) as stop:
        data_command.main(["prepare", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    kinds = next(line for line in out.splitlines() if line.strip().startswith("data: "))
    assert set(kinds.split(":", 1)[1].replace(",", " ").split()) == {"beir", "csv", "debian", "documents", "hf", "jsonl", "parquet"}
    assert "A key that does not exist is an error." in out


def test_top_level_help_is_the_module_docstring(capsys):
    with pytest.raises(SystemExit):
        data_command.main(["--help"])
    out = capsys.readouterr().out
    for sub in ("debian --out DIR", "pydoc --out DIR", "prepare data=KIND"):
        assert f"python -m moco_retrieval.data {sub}" in out
