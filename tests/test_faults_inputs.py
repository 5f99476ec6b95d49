"""Bad inputs a command must refuse before it works, with one message and status 2 (docs/faults.md,
the issue-33 block "inputs and outputs"): non-finite and unknown values, unknown keys with or without
a +, Hydra's composition errors, a queue too large for memory; mine never eating its input and
keeping ids; export and search arguments."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from moco_retrieval.config import PRECISIONS, TrainerConfig
from moco_retrieval.errors import USER_ERROR_STATUS, ConfigError, OutputExistsError
from tests.helpers import compose_cfg

pytestmark = pytest.mark.usefixtures("one_thread")


def cli(command: str, args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", f"moco_retrieval.{command}", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def one_message(out: subprocess.CompletedProcess, command: str) -> str:
    """The command's error, unwrapped; asserts status 2 and no traceback."""
    assert out.returncode == USER_ERROR_STATUS, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Set the environment variable HYDRA_FULL_ERROR" not in out.stderr
    err = " ".join(out.stderr.split())
    assert err.startswith(f"{command}: error: "), out.stderr[-3000:]
    return err


# ---- non-finite numbers and text options, refused when the config is read --------------------------------

@pytest.mark.parametrize("override, says", [
    ("optim.lr=inf", "optim.lr=inf: must be a finite number > 0"),
    ("objective.temperature=inf", "objective.temperature=inf: must be a finite number > 0"),
    ("objective.momentum=nan", "objective.momentum=nan: must be a finite number in [0, 1]"),
    ("optim.weight_decay=inf", "optim.weight_decay=inf: must be a finite number >= 0"),
    ("trainer.gradient_clip_val=inf", "trainer.gradient_clip_val=inf: must be a finite number"),
    ("objective.temperature_max=-inf", "objective.temperature_max=-inf: must be a finite number"),
])
def test_infinity_and_nan_are_refused_naming_the_key(override, says):
    with pytest.raises(ConfigError) as err:
        OmegaConf.to_object(compose_cfg("train", ["+experiment=smoke", override]))
    assert says in str(err.value)


@pytest.mark.parametrize("override, key, allowed", [
    ("trainer.precision=17-bogus", "trainer.precision='17-bogus'", "32-true"),
    ("trainer.devices=abc", "trainer.devices='abc'", "auto"),
    ("trainer.devices=0", "trainer.devices=0", "-1: all"),
])
def test_unknown_text_options_are_refused_with_the_allowed_values(override, key, allowed):
    with pytest.raises(ConfigError) as err:
        OmegaConf.to_object(compose_cfg("train", ["+experiment=smoke", override]))
    assert str(err.value).startswith(key) and allowed in str(err.value)


@pytest.mark.parametrize("override, says", [
    ("objective.queue_dtype=int8", "objective.queue_dtype='int8': expected one of float32, bfloat16, float16"),
    ("optim.schedule=bogus", "optim.schedule='bogus': expected one of linear, cosine, constant"),
    ("model.pooling=max", "model.pooling='max': expected one of mean, cls, last"),
    ("data.kind=xml", "data.kind='xml': expected one of debian, jsonl, parquet, csv, hf, beir, documents"),
    ("format=xml", "format='xml': expected one of text, json"),
])
def test_an_option_not_among_its_choices_is_one_message_naming_them(override, says):
    """Each choice list is an Enum in the schema: OmegaConf refuses the value while composing, and
    the command reports it as the ranges are reported."""
    from hydra.errors import HydraException

    from moco_retrieval.command import composition_message

    command = "search" if override.startswith("format") else "train"
    with pytest.raises(HydraException) as err:
        compose_cfg(command, ["+experiment=smoke", override] if command == "train" else [override])
    assert composition_message(err.value) == says


def test_a_path_given_alone_is_told_to_be_key_value(tmp_path):
    """``export RUN/last.ckpt`` (no key): Hydra's grammar error named no key; ours says what to write."""
    from moco_retrieval.command import composition_message

    from hydra.errors import HydraException

    with pytest.raises(HydraException) as err:
        compose_cfg("export", ["/runs/a/checkpoints/last.ckpt"])
    says = composition_message(err.value)
    assert says.startswith("'/runs/a/checkpoints/last.ckpt' is not key=value")
    assert "checkpoint=/runs/a/checkpoints/last.ckpt" in says


def test_every_precision_we_allow_is_one_lightning_takes():
    """PRECISIONS mirrors Lightning's own list (not identifiers, so no Enum): each builds a Trainer."""
    import lightning as L

    for precision in PRECISIONS:
        if precision == "auto":  # ours: train.trainer_kwargs picks one
            continue
        if precision.startswith("transformer-engine") or precision.startswith("16") or precision == "64-true":
            continue  # (a GPU, or a package, needed to build; named by Lightning's own list below)
        L.Trainer(accelerator="cpu", devices=1, precision=precision, logger=False, enable_checkpointing=False)
    from lightning.fabric.connector import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS
    from typing import get_args

    assert set(PRECISIONS) - {"auto"} <= set(get_args(_PRECISION_INPUT_STR)) | set(get_args(_PRECISION_INPUT_STR_ALIAS))
    for devices in (1, 4, -1, "auto", "2", "0,1", [0, 1]):
        TrainerConfig(devices=devices)


def test_bad_text_option_stops_the_command_before_the_run_directory_is_written(tmp_path):
    run = tmp_path / "run"
    out = cli("train", ["+experiment=smoke", "objective.queue_dtype=int8", f"run_dir={run}",
                        f"hydra.run.dir={tmp_path / 'hydra'}"], tmp_path)
    err = one_message(out, "train")
    assert "objective.queue_dtype='int8': expected one of float32, bfloat16, float16" in err
    assert not run.exists() or not any(run.iterdir())  # no config.yaml, no csv/
    assert not (tmp_path / "hydra").exists()  # a refused start leaves no Hydra folder behind


# ---- the queue's memory, estimated before it is allocated -------------------------------------------------

def test_a_queue_larger_than_memory_is_refused_naming_the_bytes():
    from moco_retrieval.objectives.memory import check_queues_fit
    from moco_retrieval.objectives.moco import MoCoConfig, MoCoObjective
    from moco_retrieval.objectives.two_queue import TwoQueueConfig, TwoQueueObjective

    with pytest.raises(ConfigError) as err:
        check_queues_fit([(65536, 384, "bfloat16")], available=5 * 10**7)
    msg = str(err.value)
    assert msg.startswith("objective.queue_size=65,536: the objective's queue needs 51,904,512 bytes (51.9 MB: "
                          "65,536 x (384 x 2 bytes of bfloat16 + 24 bytes of id, group and step))")
    assert "more than the 50.0 MB of memory available" in msg
    check_queues_fit([(65536, 384, "bfloat16")], available=6 * 10**7)
    with pytest.raises(ConfigError, match=r"the objective's queues need 103,809,024 bytes"):  # both sides together
        check_queues_fit([(65536, 384, "bfloat16")] * 2, available=6 * 10**7)
    with pytest.raises(ConfigError, match=r"objective.queue_size=1,000,000,000,000: the objective's queue needs "
                                          r"1,560,000,000,000,000 bytes"):
        MoCoObjective(MoCoConfig(queue_size=10**12), 384)  # (refused before torch tries to allocate 1.5 PB)
    with pytest.raises(ConfigError, match=r"the objective's queues need 3,120,000,000,000,000 bytes"):
        TwoQueueObjective(TwoQueueConfig(queue_size=10**12), 384)


# ---- strictness: unknown keys with or without +, Hydra's composition errors -------------------------------

@pytest.mark.parametrize("command, overrides, says", [
    ("train", ["+experiment=smoke", "+trainer.max_step=10"], "trainer.max_step: unknown key"),
    ("train", ["+experiment=smoke", "+objective.temprature=0.1"], "did you mean objective.temperature?"),
    ("evaluate", ["+chekpoint=x.ckpt"], "chekpoint: unknown key"),
    ("export", ["out_dir=x", "+overwrit=true"], "did you mean overwrite?"),
    ("search", ["+qurey=x"], "did you mean query?"),
    ("mine", ["output=x.jsonl", "+data.train_pth=x"], "did you mean data.train_path?"),
])
def test_a_key_added_with_plus_is_refused_by_every_command(command, overrides, says, capsys, monkeypatch):
    import importlib

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    module = f"moco_retrieval.{command}" + (".__main__" if command == "export" else "")
    task = importlib.import_module(module).main.__wrapped__  # what Hydra runs, checks included
    with pytest.raises(SystemExit) as stop:
        task(compose_cfg(command, overrides))
    assert stop.value.code == USER_ERROR_STATUS
    assert says in " ".join(capsys.readouterr().err.split())


def test_plus_typo_on_the_command_line_fails_naming_the_close_key(tmp_path):
    out = cli("train", ["+experiment=smoke", "+trainer.max_step=10", f"run_dir={tmp_path / 'run'}",
                        f"hydra.run.dir={tmp_path / 'hydra'}"], tmp_path)
    err = one_message(out, "train")
    assert "trainer.max_step: unknown key" in err and "did you mean trainer.max_steps?" in err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("command, args, says", [
    ("train", ["objective=bogus"], "Could not find 'objective/bogus'"),
    ("train", ["objective.temprature=0.1"], "did you mean objective.temperature?"),
    ("evaluate", ["data=bogus"], "Could not find 'data/bogus'"),
    ("export", ["out_dir=x", "overwrite=[1,"], "no viable alternative at input '[1,'"),
    ("search", ["~model.nothing"], "Could not delete from config. 'model.nothing' does not exist"),
    ("mine", ["output=x.jsonl", "model=bogus"], "Could not find 'model/bogus'"),
])
def test_hydra_composition_errors_exit_2_with_one_message(command, args, says, tmp_path):
    err = one_message(cli(command, [*args, f"hydra.run.dir={tmp_path / 'hydra'}"], tmp_path), command)
    assert says in err
    assert "To append to your config use" not in err and "_schema" not in err
    assert not (tmp_path / "hydra").exists()  # the command never started


# ---- mine: never over an input, nor over an existing file unless asked -----------------------------------

def _pairs_file(path: Path, n: int = 12) -> Path:
    """Rows 0-8 of one group ("g": 3 other documents to rank), the rest each of their own (11 to rank)."""
    rows = [{"query": f"query {i} about topic {i % 4}", "positive": f"document {i} on topic {i % 4} and more",
             "doc_id": f"d{i}", "group": "g" if i < 9 else f"s{i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mine_args(tmp_path: Path, pairs: Path, *more: str) -> list[str]:
    return ["model=tiny", f"model.path={tmp_path / 'tiny'}", "data=jsonl", f"data.train_path={pairs}",
            "progress=false", *more]


@pytest.mark.parametrize("extra", [[], ["overwrite=true"]])
def test_mine_never_writes_over_its_training_pairs(tmp_path, extra):
    pairs = _pairs_file(tmp_path / "pairs.jsonl")
    before = pairs.read_bytes()
    err = one_message(cli("mine", _mine_args(tmp_path, pairs, f"output={pairs}", *extra), tmp_path), "mine")
    assert f"output={pairs} is data.train_path, an input of this command" in err
    assert pairs.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"]


def test_mine_refuses_an_existing_output_a_link_to_an_input_and_a_directory(tmp_path):
    from moco_retrieval.mine import check_mine_outputs

    pairs = _pairs_file(tmp_path / "pairs.jsonl")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n')
    old = tmp_path / "old.jsonl"
    old.write_text("mine\n")

    def check(*overrides):
        cfg = OmegaConf.to_object(compose_cfg("mine", _mine_args(tmp_path, pairs, f"data.eval_dir={tmp_path / 'eval'}",
                                                                  *overrides)))
        return check_mine_outputs(cfg)

    with pytest.raises(OutputExistsError, match=r"output=.*old.jsonl exists; overwrite=true replaces it"):
        check(f"output={old}")
    assert check(f"output={old}", "overwrite=true") == (old, tmp_path / "old.stats.json")
    os.link(pairs, tmp_path / "hard.jsonl")
    with pytest.raises(OutputExistsError, match="is data.train_path"):
        check(f"output={tmp_path / 'hard.jsonl'}", "overwrite=true")
    (tmp_path / "soft.jsonl").symlink_to(tmp_path / "eval" / "corpus.jsonl")
    with pytest.raises(OutputExistsError, match=r"is data.eval_dir \(.*corpus.jsonl\)"):
        check(f"output={tmp_path / 'soft.jsonl'}", "overwrite=true")
    with pytest.raises(ConfigError, match=r"output=.*: a directory; expected the path of the file to write"):
        check(f"output={tmp_path}")
    with pytest.raises(OutputExistsError, match="stats_path=.* is data.train_path"):
        check(f"output={tmp_path / 'new.jsonl'}", f"stats_path={pairs}", "overwrite=true")
    assert old.read_text() == "mine\n"


def test_mine_output_dir_on_the_command_line_is_one_message(tmp_path):
    pairs = _pairs_file(tmp_path / "pairs.jsonl")
    err = one_message(cli("mine", _mine_args(tmp_path, pairs, f"output={tmp_path}"), tmp_path), "mine")
    assert f"output={tmp_path}: a directory" in err


def _mine(tmp_path: Path, pairs: Path, *more: str):
    from moco_retrieval.mine import run_mine, to_mine_config

    return run_mine(to_mine_config(compose_cfg("mine", _mine_args(tmp_path, pairs, *more))))


def test_mine_keeps_ids_as_given_and_says_what_it_dropped(tmp_path, capsys):
    from moco_retrieval.data.formats import read_pairs_jsonl

    pairs = _pairs_file(tmp_path / "pairs.jsonl")
    out = tmp_path / "mined.jsonl"
    # ranks 5-10: rows of group g (3 other documents: ranks 0-2) get none, whatever the model's scores
    window = ["n_negatives=2", "range_min=5", "range_max=10", "relative_margin=null"]
    res = _mine(tmp_path, pairs, f"output={out}", *window)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    dropped = res.stats["queries_without_negatives"]
    assert dropped == 9 and len(rows) == 3
    given = {json.loads(line)["positive"]: json.loads(line) for line in pairs.read_text().splitlines()}
    for row in rows:
        assert row["doc_id"] == given[row["positive"]]["doc_id"] and row["group"] == given[row["positive"]]["group"]
        assert len(row["negatives"]) == 2
        for neg in row["negatives"]:
            assert neg["doc_id"] in {f"d{i}" for i in range(12)} and neg["group"] in {"g", "s9", "s10", "s11"}
    assert [p.doc_id for p in read_pairs_jsonl(out)] == [p.doc_id for p in res.pairs]  # same hashed ids as read
    captured = capsys.readouterr()
    err, stdout = " ".join(captured.err.split()), captured.out
    kept = 12 - dropped
    assert ("warning: 9 of 12 training pairs (75.0%) got no hard negative: the filters removed every candidate they "
            "had (108 candidates; removed by group 72, rank_window 27, positive 9).") in err  # 9 rows x 12 documents
    assert f"They are left out: {out} holds {kept} rows, {100 * kept / 12:.1f}% of the pairs. keep_empty=true" in err
    assert f"train with (on {kept} of your 12 training pairs, {100 * kept / 12:.1f}%: only the rows that got negatives)" in stdout
    stats = json.loads((tmp_path / "mined.stats.json").read_text())
    assert stats["candidates_of_queries_without_negatives"]["considered"] > 0

    res = _mine(tmp_path, pairs, f"output={out}", "overwrite=true", "keep_empty=true", *window)
    assert len(out.read_text().splitlines()) == 12 and sum(not p.negatives for p in res.pairs) == dropped


def test_mine_writes_its_output_atomically(tmp_path, monkeypatch):
    from moco_retrieval import mine

    pairs = _pairs_file(tmp_path / "pairs.jsonl")
    out = tmp_path / "mined.jsonl"
    out.write_text("an earlier output\n")

    def cut_short(path, result):
        Path(path).write_text('{"query": "half a li')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mine, "write_mined", cut_short)
    with pytest.raises(OSError):
        _mine(tmp_path, pairs, f"output={out}", "overwrite=true", "n_negatives=1")
    assert out.read_text() == "an earlier output\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["mined.jsonl", "pairs.jsonl"]


def test_mine_filters_must_be_finite():
    from moco_retrieval.mining import MiningFilters

    with pytest.raises(ConfigError, match="max_score=nan: expected a finite number"):
        MiningFilters(max_score=math.nan).check()
    with pytest.raises(ConfigError, match="margin=inf"):
        OmegaConf.to_object(compose_cfg("mine", ["output=x", "margin=inf"]))


# ---- export: an existing folder, and what overwrite=true may delete -----------------------------------------

def test_export_onto_an_existing_folder_is_one_message(tmp_path):
    out_dir = tmp_path / "model"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("mine")
    err = one_message(cli("export", ["model=tiny", f"model.path={tmp_path / 'tiny'}", f"out_dir={out_dir}"], tmp_path),
                      "export")
    assert f"out_dir={out_dir} exists and is not empty: overwrite=true replaces an earlier export there" in err
    assert [p.name for p in out_dir.iterdir()] == ["notes.txt"] and not (tmp_path / "tiny").exists()  # no model loaded


def test_export_overwrite_replaces_only_what_an_export_wrote(tiny_dir, tmp_path):
    from moco_retrieval.config import ModelConfig
    from moco_retrieval.export.writer import export_encoder
    from moco_retrieval.model.encoder import build_encoder
    from moco_retrieval.model.loading import META_FILE

    out = tmp_path / "model"
    export_encoder(build_encoder(ModelConfig(backbone="tiny", path=tiny_dir)), out)  # Pooling, Normalize
    first = set(json.loads((out / META_FILE).read_text())["files"])
    assert first == {p.name for p in out.iterdir()} and "2_Normalize" in first
    (out / "notes.txt").write_text("the user's")
    (out / "eval").mkdir()
    with pytest.raises(OutputExistsError, match="exists and is not empty"):
        export_encoder(build_encoder(ModelConfig(backbone="tiny", path=tiny_dir)), out)
    mlp = build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, head="mlp", head_dim=8, normalize=False))
    export_encoder(mlp, out, overwrite=True)  # Pooling, Dense, Dense: no Normalize any more
    second = set(json.loads((out / META_FILE).read_text())["files"])
    assert {p.name for p in out.iterdir()} == second | {"notes.txt", "eval"}
    assert "2_Normalize" not in second and (out / "notes.txt").read_text() == "the user's"

    other = tmp_path / "not-an-export"
    other.mkdir()
    (other / "data.jsonl").write_text("x\n")
    with pytest.raises(OutputExistsError, match="holds files but no export of this project, so overwrite=true does not touch it"):
        export_encoder(mlp, other, overwrite=True)
    assert [p.name for p in other.iterdir()] == ["data.jsonl"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".moco-export-")]  # no staging folder left


# ---- search: k and the query -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, says", [
    (["k=0", "query=x"], "k=0: must be >= 1"),
    (["k=-3", "query=x"], "k=-3: must be >= 1"),
    (["query='   '"], "query='   ': a blank query"),
    (["query="], "query='': a blank query"),  # (not a cue to read standard input)
    (["queries=[apt,' ']"], "queries[1]=' ': a blank query"),
])
def test_search_refuses_a_bad_k_or_a_blank_query_before_reading_anything(overrides, says, tmp_path):
    from moco_retrieval.search import run_search

    cfg = compose_cfg("search", ["model=tiny", f"model.path={tmp_path / 'tiny'}", f"corpus={tmp_path / 'none'}",
                                 *overrides])
    with pytest.raises(ConfigError) as err:
        run_search(cfg)
    assert says in str(err.value)
    assert not (tmp_path / "tiny").exists()


def test_search_k_0_on_the_command_line(tmp_path):
    err = one_message(cli("search", ["model=tiny", f"model.path={tmp_path / 'tiny'}", "k=0", "query=apt"], tmp_path),
                      "search")
    assert "k=0: must be >= 1" in err
