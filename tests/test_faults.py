"""Failure behaviour a cluster user can trust (docs/faults.md is the table of these cases):
the run directory's lock, checkpoints that cannot be read or written, the fallback to the previous
checkpoint, range checks, known errors as one message with status 2, ids in the data."""
from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from moco_retrieval import files as checkpoint_file
from moco_retrieval.training.checkpoints import AtomicCheckpointIO
from moco_retrieval.files import atomic_torch_save, previous_of, read_checkpoint
from moco_retrieval.training.checkpoints import resolve_ckpt_path
from moco_retrieval.data.formats import DataError, EvalSet, read_beir, read_pairs_jsonl, write_beir, write_jsonl
from moco_retrieval.errors import (USER_ERROR_STATUS, CheckpointError, ConfigError, UserError,
                                   reports_user_errors)
from moco_retrieval.training.run_lock import LOCK_NAME, RunDirLocked, RunLock
from tests.helpers import REPO, compose_cfg, last_and_previous


# ---- the run directory's lock -------------------------------------------------------------------

HOLD = "import sys, time; from moco_retrieval.training.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"


def test_training_on_a_run_dir_another_process_holds_is_refused_before_anything_is_written(tmp_path):
    from moco_retrieval.train import train

    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = OmegaConf.to_object(compose_cfg("train", ["+experiment=smoke", "ckpt_path=last"]))
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} on host {re.escape(socket.gethostname())}"):
            train(cfg, tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]


@pytest.mark.slow  # ~30 s on a busy machine: the command's start-up
def test_second_training_on_a_locked_run_dir_stops_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = subprocess.run([sys.executable, "-m", "moco_retrieval.train", "+experiment=smoke", f"run_dir={run_dir}",
                              f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == USER_ERROR_STATUS, out.stderr[-2000:]
    err = " ".join(out.stderr.split())  # the message is wrapped
    assert f"pid {holder.pid} on host {socket.gethostname()}" in err and f"run_dir={run_dir}" in err
    assert "Traceback" not in out.stderr and "Error executing job" not in out.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # the other run's files untouched, none added


def test_lock_left_by_a_killed_process_is_taken_over(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()  # SIGKILL: no release, the lock file stays
    holder.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirLocked):  # held now: a second holder is refused
            RunLock(tmp_path).acquire()
    assert f"taking over the lock of a training that is gone (pid {holder.pid}" in capsys.readouterr().err
    assert not (tmp_path / LOCK_NAME).exists()  # a clean end leaves no lock behind


def _held_by(path: Path, **holder) -> int:
    """A lock held (flock) through another open file, as another process's would be."""
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps(holder).encode())
    return fd


def test_requeued_attempt_of_the_same_job_takes_the_lock_over(tmp_path, capsys):
    fd = _held_by(tmp_path, host="node-17", pid=4242, job_id="9001")
    try:
        with pytest.raises(RunDirLocked, match=r"pid 4242 on host node-17, job 9001"):
            RunLock(tmp_path, env={"SLURM_JOB_ID": "9002"}).acquire()
        with pytest.raises(RunDirLocked):
            RunLock(tmp_path, env={}).acquire()
        lock = RunLock(tmp_path, env={"SLURM_JOB_ID": "9001"}).acquire()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        os.close(fd)
    assert "from an earlier attempt of job 9001" in capsys.readouterr().err


def test_same_job_alive_on_this_host_is_still_refused(tmp_path):
    fd = _held_by(tmp_path, host=socket.gethostname(), pid=os.getpid(), job_id="9001")
    try:
        with pytest.raises(RunDirLocked):
            RunLock(tmp_path, env={"SLURM_JOB_ID": "9001"}).acquire()
    finally:
        os.close(fd)


# ---- checkpoints ----------------------------------------------------------------------------------

def _bad_files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "random.ckpt").write_bytes(os.urandom(4096))
    (tmp_path / "folder.ckpt").mkdir()
    atomic_torch_save({"state_dict": {"w": torch.zeros(1000)}}, tmp_path / "good.ckpt")
    data = (tmp_path / "good.ckpt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    return {k: tmp_path / f"{k}.ckpt" for k in ("empty", "random", "folder", "truncated")}


@pytest.mark.parametrize("kind, says", [("empty", "empty file"), ("random", "cannot read it as a checkpoint"),
                                        ("folder", "is a directory"), ("truncated", "cannot read it as a checkpoint")])
def test_unreadable_ckpt_path_is_one_error_naming_the_file(tmp_path, kind, says):
    path = _bad_files(tmp_path)[kind]
    with pytest.raises(CheckpointError) as err:
        resolve_ckpt_path(str(path), tmp_path)
    assert f"ckpt_path={path}: {says}" in str(err.value)
    assert "weights_only" not in str(err.value) and err.value.__cause__ is None


def test_last_keeps_its_predecessor(tmp_path):
    last = last_and_previous(tmp_path)
    assert read_checkpoint(last)["global_step"] == 4 and read_checkpoint(previous_of(last))["global_step"] == 2
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "last.prev.ckpt"]
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, tmp_path / "best-1.ckpt")
    AtomicCheckpointIO().save_checkpoint({"global_step": 6}, last)
    assert not (tmp_path / "best-1.prev.ckpt").exists()  # only last.ckpt keeps one
    assert read_checkpoint(previous_of(last))["global_step"] == 4


def test_ckpt_path_last_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    last = last_and_previous(tmp_path)
    last.write_bytes(last.read_bytes()[:100])  # truncated
    assert resolve_ckpt_path("last", tmp_path) == str(previous_of(last))
    err = capsys.readouterr().err
    assert f"ckpt_path={last}: cannot read it as a checkpoint" in err and "resuming from the previous checkpoint" in err
    previous_of(last).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"neither .*last\.ckpt nor .*last\.prev\.ckpt can be read"):
        resolve_ckpt_path("last", tmp_path)


def test_resuming_a_checkpoint_of_another_objective_names_the_override(tmp_path):
    """A MoCo run of +experiment=queue65k from before the main job became two_queue: its requeued
    ckpt_path=last must say what to add, before any model loads (not a state-dict traceback)."""
    from moco_retrieval.train import prepare_run_dir

    last = tmp_path / "checkpoints" / "last.ckpt"
    atomic_torch_save({"global_step": 3, "hyper_parameters": {"objective": {"name": "moco", "queue_size": 256}}}, last)
    cfg = OmegaConf.to_object(compose_cfg("train", ["+experiment=smoke", "objective=two_queue", "ckpt_path=last"]))
    with pytest.raises(CheckpointError) as err:
        prepare_run_dir(cfg, tmp_path)
    assert f"ckpt_path={last}: trained with objective=moco" in str(err.value)
    assert "this run's config has objective=two_queue; add objective=moco" in str(err.value)
    same = OmegaConf.to_object(compose_cfg("train", ["+experiment=smoke", "ckpt_path=last"]))  # smoke: moco
    assert prepare_run_dir(same, tmp_path) == str(last)


def test_resuming_under_changed_objective_options_names_the_trained_values(tmp_path):
    """A two-queue run from before inbatch_weight and queue_max_age existed (it trained without the
    term, with every queued key, at m 0.999) resumed under today's defaults, or with another
    temperature: refused before any model loads, with the overrides that resume it as trained;
    with them, it resumes."""
    from moco_retrieval.train import prepare_run_dir

    last = tmp_path / "checkpoints" / "last.ckpt"
    old = {"name": "two_queue", "queue_size": 256, "temperature": 0.05, "momentum": 0.999}  # an older run
    atomic_torch_save({"global_step": 3, "hyper_parameters": {"objective": old}}, last)

    def resume(*overrides):
        cfg = compose_cfg("train", ["+experiment=smoke", "objective=two_queue", "objective.queue_size=256", "ckpt_path=last",
                                    *overrides])
        return prepare_run_dir(OmegaConf.to_object(cfg), tmp_path)

    with pytest.raises(CheckpointError) as err:
        resume("objective.temperature=0.1")
    msg = str(err.value)
    assert (f"ckpt_path={last}: trained with objective.temperature=0.05, objective.momentum=0.999, "
            "objective.queue_max_age=null, objective.inbatch_weight=0.0") in msg
    assert ("this run's config has objective.temperature=0.1, objective.momentum=0.995, "
            "objective.queue_max_age=128, objective.inbatch_weight=1.0") in msg
    with pytest.raises(CheckpointError, match=r"trained with objective.queue_max_age=null, but this run's config "
                                              r"has objective.queue_max_age=128;"):
        resume("objective.inbatch_weight=0.0", "objective.momentum=0.999")
    assert resume("objective.inbatch_weight=0.0", "objective.momentum=0.999", "objective.queue_max_age=null") == str(last)

def test_ckpt_path_last_without_a_checkpoint_says_it_starts_from_step_0(tmp_path, capsys):
    assert resolve_ckpt_path("last", tmp_path / "typo") is None
    err = capsys.readouterr().err
    assert f"no checkpoint in {tmp_path / 'typo' / 'checkpoints'}: {tmp_path / 'typo'} does not exist" in err
    assert "training starts from step 0" in err and err.count("\n") == 1


def test_ckpt_path_last_after_a_run_lost_before_its_first_checkpoint_says_so(tmp_path, capsys):
    """A run killed before its first checkpoint left config.yaml and csv/: the notice says what was
    found, not that run_dir was mistyped."""
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "csv").mkdir()
    (tmp_path / "checkpoints").mkdir()
    assert resolve_ckpt_path("last", tmp_path) is None
    err = " ".join(capsys.readouterr().err.split())
    assert (f"no checkpoint in {tmp_path / 'checkpoints'}: {tmp_path} holds an earlier attempt (checkpoints/, "
            "config.yaml, csv/) that stopped before writing its first checkpoint; training starts from step 0") in err
    assert "check run_dir" not in err


def test_temporaries_of_killed_writes_are_removed_at_the_next_start(tmp_path, capsys):
    from moco_retrieval.train import prepare_run_dir

    last = last_and_previous(tmp_path)
    for i in range(3):
        (last.parent / f".last.ckpt.{i}abc.tmp").write_bytes(b"x" * 1000)
    cfg = OmegaConf.to_object(compose_cfg("train", ["+experiment=smoke", "ckpt_path=last"]))
    assert prepare_run_dir(cfg, tmp_path) == str(last)
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "last.prev.ckpt"]
    assert "removed 3 temporary file(s) of interrupted checkpoint writes" in capsys.readouterr().err


def test_disk_full_while_writing_is_one_message_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    last = last_and_previous(tmp_path)
    before = last.read_bytes()
    real_open = os.open
    # every write of this save goes to /dev/full, which fails as a full disk does (ENOSPC)
    monkeypatch.setattr(checkpoint_file.os, "open", lambda path, flags, mode=0o777: real_open("/dev/full", os.O_WRONLY))
    with pytest.raises(CheckpointError) as err:
        atomic_torch_save({"w": torch.zeros(100_000)}, last, keep_previous=True)
    monkeypatch.undo()
    msg = str(err.value)
    assert f"no space left on the device holding {last.parent}" in msg and "free)" in msg
    assert "the previous last.ckpt is kept" in msg and err.value.__cause__ is None and err.value.__suppress_context__
    assert last.read_bytes() == before
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "last.prev.ckpt"]


# ---- range checks when the config is read ----------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("objective.momentum=1.5", "objective.momentum"),
    ("objective.momentum=-0.1", "objective.momentum"),
    ("objective.temperature=0", "objective.temperature"),
    ("objective.temperature_max=-1", "objective.temperature_max"),
    ("objective.label_smoothing=1.0", "objective.label_smoothing"),
    ("objective.queue_size=0", "objective.queue_size"),
    ("optim.lr=-0.001", "optim.lr"),
    ("optim.warmup_ratio=1.5", "optim.warmup_ratio"),
    ("optim.betas=[0.9,1.5]", "optim.betas"),
    ("model.query_max_len=0", "model.query_max_len"),
    ("model.doc_max_len=-5", "model.doc_max_len"),
    ("data.batch_size=0", "data.batch_size"),
    ("trainer.process_group_timeout=0", "trainer.process_group_timeout"),
    ("trainer.keep_best_checkpoints=-1", "trainer.keep_best_checkpoints"),
])
def test_value_out_of_range_is_a_config_error_naming_the_key(override, key):
    cfg = compose_cfg("train", ["+experiment=smoke", override])
    with pytest.raises(ConfigError, match=re.escape(key) + "=.*: must be"):
        OmegaConf.to_object(cfg)


def test_learned_temperature_must_start_inside_its_bounds():
    cfg = compose_cfg("train", ["+experiment=smoke", "objective.learn_temperature=true", "objective.temperature=2"])
    with pytest.raises(ConfigError, match=r"objective.temperature=2.0: must be in \[objective.temperature_min"):
        OmegaConf.to_object(cfg)
    OmegaConf.to_object(compose_cfg("train", ["+experiment=smoke", "objective.temperature=2"]))  # fixed: fine


def test_defaults_and_presets_are_in_range():
    for preset in sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")):
        OmegaConf.to_object(compose_cfg("train", [f"+experiment={preset}"]))


# ---- known errors: one message, status 2 -------------------------------------------------------------

def test_known_error_prints_one_wrapped_message_and_exits_2(capsys, monkeypatch):
    long_path = "/data/" + "x" * 150 + ".jsonl"

    @reports_user_errors("train")
    def task():
        raise DataError(f"{long_path}:3: malformed JSON; " + "expected one JSON object per line " * 6)

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as stop:
        task()
    assert stop.value.code == USER_ERROR_STATUS
    err = capsys.readouterr().err
    assert " ".join(err.split()).startswith(f"train: error: {long_path}:3: malformed JSON") and "Traceback" not in err
    lines = err.rstrip("\n").splitlines()
    assert len(lines) > 2 and any(long_path in line for line in lines)  # wrapped; the path is never broken
    assert all(len(line) <= 100 for line in lines if long_path not in line)

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(DataError):  # the full traceback, as Hydra shows it
        task()


@pytest.mark.parametrize("rank,local_rank,printed", [("0", "0", True), ("1", "1", False), ("2", "0", False)])
def test_under_torchrun_a_known_error_prints_on_rank_0_alone(capsys, monkeypatch, rank, local_rank, printed):
    """Every rank meets the same bad input: one message (rank 0's), the same status everywhere."""
    @reports_user_errors("train")
    def task():
        raise ConfigError("data.batch_size=0: must be >= 1")

    @reports_user_errors("train")
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    for run, status in ((task, USER_ERROR_STATUS), (interrupted, 130)):
        with pytest.raises(SystemExit) as stop:
            run()
        assert stop.value.code == status
    err = capsys.readouterr().err
    expected = "train: error: data.batch_size=0: must be >= 1\ntrain: interrupted (Ctrl-C) before it finished\n"
    assert err == (expected if printed else "")


def test_a_bug_is_not_reported_as_a_known_error():
    @reports_user_errors("train")
    def task():
        raise KeyError("bug")

    with pytest.raises(KeyError):
        task()


def test_error_classes_share_one_base():
    from moco_retrieval.errors import ModelLoadError, ModelNotFoundError

    for cls in (DataError, ConfigError, CheckpointError, ModelLoadError, ModelNotFoundError, RunDirLocked):
        assert issubclass(cls, UserError), cls
    assert issubclass(DataError, ValueError) and issubclass(ConfigError, ValueError)  # as before
    assert issubclass(ModelNotFoundError, FileNotFoundError) and issubclass(CheckpointError, OSError)


@pytest.mark.parametrize("command, overrides", [  # each stops at a known error before any model loads
    ("train", ["+experiment=smoke", "objective.momentum=1.5"]),
    ("evaluate", ["data=beir", "data.dir={tmp}/beir", "checkpoint={empty}"]),
    ("export", ["checkpoint={empty}", "out_dir={tmp}/out"]),
    ("search", ["checkpoint={empty}", "query=x", "corpus={tmp}"]),
    ("mine", ["data=jsonl"]),
])
def test_every_command_reports_known_errors_with_status_2(command, overrides, tmp_path, capsys, monkeypatch):
    import importlib

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    (tmp_path / "empty.ckpt").write_bytes(b"")
    overrides = [o.format(empty=tmp_path / "empty.ckpt", tmp=tmp_path) for o in overrides]
    write_beir(tmp_path / "beir", EvalSet(corpus={"d1": "a document"}, queries={"q1": "a query"}, qrels={"q1": {"d1": 1}}))
    cfg = compose_cfg(command, overrides)
    module = f"moco_retrieval.{command}" + (".__main__" if command == "export" else "")
    task = importlib.import_module(module).main.__wrapped__  # what @hydra.main runs
    monkeypatch.setattr("hydra.core.hydra_config.HydraConfig.get", lambda: OmegaConf.create(
        {"runtime": {"output_dir": str(tmp_path / "hydra")}}))
    with pytest.raises(SystemExit) as stop:
        task(cfg)
    assert stop.value.code == USER_ERROR_STATUS
    err = capsys.readouterr().err
    assert f"{command}: error: " in " ".join(err.split()) and "Traceback" not in err


# ---- ids and paths in the data ------------------------------------------------------------------------

def test_one_doc_id_with_two_texts_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "pairs.jsonl"
    write_jsonl(path, [{"query": "q1", "positive": "apt tool", "doc_id": "d1"},
                       {"query": "q2", "positive": "other", "doc_id": "d2"},
                       {"query": "q3", "positive": "apt  tool ", "doc_id": "d1"},  # the same text, spaced: fine
                       {"query": "q4", "positive": "a different text", "doc_id": "d1"}])
    with pytest.raises(DataError, match=re.escape(f"{path}:4: doc_id 'd1' is also on line 1 with a different 'positive'")):
        read_pairs_jsonl(path)
    write_jsonl(path, [{"query": "q1", "positive": "same", "doc_id": 7}, {"query": "q2", "positive": "same", "doc_id": 7}])
    assert len(read_pairs_jsonl(path)) == 2


def test_directory_as_train_path_is_called_a_directory(tmp_path):
    from moco_retrieval.config import DataConfig
    from moco_retrieval.data.sources import load_training_pairs

    with pytest.raises(DataError, match=re.escape(f"data.train_path={tmp_path}: a directory, expected a JSONL file")):
        load_training_pairs(DataConfig(kind="jsonl", train_path=str(tmp_path)))


def test_beir_id_with_whitespace_is_refused_when_read(tmp_path):
    (tmp_path / "qrels").mkdir()
    write_jsonl(tmp_path / "corpus.jsonl", [{"_id": "d1", "text": "a"}, {"_id": "doc one", "text": "b"}])
    write_jsonl(tmp_path / "queries.jsonl", [{"_id": "q1", "text": "x"}])
    (tmp_path / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tdoc one\t1\n")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'corpus.jsonl'}:2: _id 'doc one' contains whitespace")):
        read_beir(tmp_path)


def test_malformed_json_message_reads_well(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"query": "q", "positive": "cut short')  # a truncated file
    with pytest.raises(DataError) as err:
        read_pairs_jsonl(tmp_path / "p.jsonl")
    assert "malformed JSON (Unterminated string starting at: column 28)" in str(err.value)
    assert "at at" not in str(err.value)


# ---- torchrun --------------------------------------------------------------------------------------------

def test_under_torchrun_devices_and_nodes_come_from_the_launcher(monkeypatch):
    from moco_retrieval.config import TrainerConfig
    from moco_retrieval.train import trainer_kwargs

    for k, v in {"RANK": "3", "GROUP_RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    kw = trainer_kwargs(TrainerConfig(devices=1, num_nodes=1))
    assert (kw["devices"], kw["num_nodes"]) == (2, 2)
    monkeypatch.delenv("GROUP_RANK")
    kw = trainer_kwargs(TrainerConfig(devices=1, num_nodes=1))
    assert (kw["devices"], kw["num_nodes"]) == (1, 1)


# ---- a truncated last.ckpt in a real run -----------------------------------------------------------------

@pytest.mark.slow  # two short trainings: ~40 s on a busy machine
def test_truncated_last_checkpoint_resumes_from_the_previous_one(tmp_path, debian_dir, capfd, one_thread):
    from moco_retrieval.train import train

    small = ["+experiment=smoke", "data.max_train_examples=128", "data.max_eval_queries=16", "data.max_eval_docs=32",
             "trainer.val_check_interval=3", "logger=none", "ckpt_path=last"]
    train(OmegaConf.to_object(compose_cfg("train", small + ["trainer.max_steps=4"])), tmp_path)
    last = tmp_path / "checkpoints" / "last.ckpt"
    # (the last step validates inside fit: that validation's last.ckpt, then the end of training's, both of step 4)
    assert read_checkpoint(last)["global_step"] == 4 and read_checkpoint(previous_of(last))["global_step"] == 4
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # as a bad copy or a damaged disk leaves it
    (last.parent / ".last.ckpt.0123abcd.tmp").write_bytes(b"x" * 4096)  # and a write a SIGKILL cut short
    capfd.readouterr()
    train(OmegaConf.to_object(compose_cfg("train", small)), tmp_path)  # the requeued job: 8 steps in all
    out, err = capfd.readouterr()
    assert f"ckpt_path={last}: cannot read it as a checkpoint" in err
    assert f"resuming from the previous checkpoint {previous_of(last)}" in err
    assert "removed 1 temporary file(s)" in err
    assert read_checkpoint(last)["global_step"] == 8
    assert read_checkpoint(previous_of(last))["global_step"] == 8  # not the damaged file, which was set aside
    assert (last.parent / "last.ckpt.unreadable").exists()
    assert not list(last.parent.glob(".*.tmp")) and not (tmp_path / LOCK_NAME).exists()
