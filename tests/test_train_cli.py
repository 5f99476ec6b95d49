"""The main job's entry point: the smoke experiment end to end, strict configs, packaged configs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests.helpers import REPO, compose_cfg


def test_smoke_experiment_end_to_end(tmp_path, debian_dir, capsys):
    import csv as csv_module
    import re

    from moco_retrieval.train import train

    # W&B offline (conftest sets WANDB_MODE=offline): it must neither hang nor need a network
    cfg = OmegaConf.to_object(compose_cfg("train", ["+experiment=smoke", "data.max_train_examples=160", "logger=wandb"]))
    metrics = train(cfg, tmp_path)
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert list((tmp_path / "checkpoints").glob("best-*.ckpt"))
    saved = json.loads((tmp_path / "metrics.json").read_text())
    for key in ["val/recall@1", "val/recall@10", "val/mrr@10", "val/ndcg@10", "val/map@100"]:
        assert 0.0 <= saved[key] <= 1.0, key
    assert saved == pytest.approx(metrics)
    assert saved["val/recall@100"] >= saved["val/recall@10"] >= saved["val/recall@1"]
    written = OmegaConf.load(tmp_path / "config.yaml")
    assert written.objective.queue_size == 256 and written.model.backbone == "tiny"
    csv = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0]
    assert "train/loss" in csv and "val/recall@1" in csv and "train/masked_per_query" in csv
    assert "time/train_s" in csv and 0 < saved["time/train_s"] and 0 < saved["time/val_s"] and saved["attempts"] == 1
    assert sorted(p.name for p in (tmp_path / "plots").glob("cosines-step*.png")) == ["cosines-step10.png"]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    # a time-stamped metrics line after each validation (not only at the end), with the best so far
    out = capsys.readouterr().out
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
    lines = re.findall(stamp + r"validation at step (\d+): recall@1 (0\.\d{4})  ndcg@10 0\.\d{4}  "
                       r"unrelated cos [+-]\d\.\d{3}  best recall@1 (0\.\d{4}) \(step (\d+)\)  "
                       r"after \d+\.\d min of training", out)
    assert [int(step) for step, *_ in lines] == [10]  # 160 pairs / 16 = 10 steps, validation every 10
    assert float(lines[0][1]) == pytest.approx(saved["val/recall@1"], abs=1e-4)
    assert re.search(stamp + r"epoch 0 step 5/10 \(50%\) .* eta [\d.]+ min \(validations included\)", out)
    # the whole resolved config is the logged hyperparameters (data.*, trainer.*, not only the module's)
    hparams = OmegaConf.load(tmp_path / "csv" / "hparams.yaml")
    assert hparams.data.batch_size == 16 and hparams.trainer.val_check_interval == 10
    assert hparams.logger.tags == ["smoke"] and hparams.objective.queue_size == 256
    # one step numbering: the CSV's, the checkpoint's name and the console's
    rows = list(csv_module.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    assert {int(r["step"]) for r in rows if r["val/recall@1"]} == {10}
    assert {int(r["step"]) for r in rows if r["train/loss"]} == {5, 10}
    assert {int(r["step"]) for r in rows if r["lr-AdamW"]} == {5, 10}
    assert [p.name for p in (tmp_path / "checkpoints").glob("best-*.ckpt")] == ["best-10.ckpt"]


def test_experiment_presets_compose():
    q = compose_cfg("train", ["+experiment=queue65k"])
    assert (q.objective.name, q.objective.queue_size, q.data.batch_size, q.objective.momentum) == ("two_queue", 65536, 64, 0.995)
    assert q.objective.queue_max_age == 128  # B6: the queue's span inside m 0.995's 200-step time constant
    assert q.optim.lr == pytest.approx(2e-5) and q.objective.temperature == pytest.approx(0.05)
    # the main job with another objective: only the objective changes (B6's comparisons, the README's)
    for name in ("moco", "inbatch"):
        other = compose_cfg("train", ["+experiment=queue65k", f"objective={name}"])
        assert other.objective.name == name and other.objective.temperature == pytest.approx(0.05)
        assert (other.data.batch_size, other.optim.lr, other.trainer.max_epochs) == (64, q.optim.lr, 1)
        if name == "moco":  # the main job before B6, exactly
            assert (other.objective.queue_size, other.objective.momentum) == (65536, 0.999)
    b = compose_cfg("train", ["+experiment=inbatch256"])
    assert (b.objective.name, b.data.batch_size) == ("inbatch", 256)
    a = compose_cfg("train", ["+experiment=adapt", "data.path=docs.jsonl"])  # B15 (b)'s defaults
    assert (a.objective.name, a.data.kind, a.data.batch_size, a.trainer.max_steps) == ("inbatch", "documents", 32, 150)
    assert a.optim.lr == pytest.approx(2e-5) and a.model.backbone == "minilm"


@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")))
def test_every_preset_builds_its_module(preset, tmp_path, monkeypatch):
    """A preset whose options contradict each other (e.g. a feature memory on a fine-tuned backbone) fails here,
    not an hour into a user's job."""
    from moco_retrieval.training.module import RetrievalModule

    monkeypatch.setenv("MOCO_RETRIEVAL_CACHE", str(tmp_path))
    cfg = OmegaConf.to_object(compose_cfg("train", [f"+experiment={preset}"]))
    module = RetrievalModule.from_config(cfg)
    assert module.objective_cfg.name == cfg.objective.name
    if preset == "frozen_queue":  # the B1 winner: re-projected feature queue, keys with gradient
        assert cfg.objective.name == "feature_memory" and module.key_encoder is None


@pytest.mark.parametrize("override", ["objective.queue_sise=10", "model.pooling_mode=cls", "data=xlsx"])
def test_typo_in_override_is_an_error(override):
    with pytest.raises(Exception) as err:
        compose_cfg("train", [override])
    assert override.split("=")[0].split(".")[-1] in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["objective=inbatch", "objective.queue_size=10"],  # in-batch has no queue
    ["objective=inbatch", "objective.momentum=0.99"],  # nor an EMA key encoder
    ["+experiment=frozen_queue", "objective.momentum=0.9"],  # the feature memory has no EMA either
    ["objective=moco", "objective.symmetric=true"],
])
def test_option_the_objective_does_not_use_is_an_error(overrides):
    with pytest.raises(Exception) as err:
        compose_cfg("train", overrides)
    assert overrides[-1].split("=")[0].split(".")[-1] in str(err.value)


def test_wrong_type_is_an_error():
    with pytest.raises(Exception, match="queue_size"):
        compose_cfg("train", ["objective.queue_size=lots"])


def _cli(args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "moco_retrieval.train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=240, env={**os.environ, **(env or {})})


def test_cli_rejects_typo_and_missing_values(tmp_path):
    out = _cli(["objective.temprature=0.1"], tmp_path)
    assert out.returncode != 0 and "temprature" in out.stderr
    out = _cli(["data=jsonl", "logger=none"], tmp_path)
    assert out.returncode != 0
    assert "data.train_path" in out.stderr + out.stdout
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("*.ckpt"))


def test_configs_found_from_a_plain_install(tmp_path):
    """`pip install .` (not editable) ships conf/ as package data; Hydra finds it from any cwd. The
    install builds from a copy of what the build reads, so its build/ folder is not left in the
    repository (where stale copies of removed files would reach the next such install)."""
    source = tmp_path / "source"
    for name in ("moco_retrieval", "conf"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True, timeout=240)
    assert (target / "moco_retrieval" / "conf" / "experiment" / "queue65k.yaml").exists()
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {"PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import moco_retrieval; print(moco_retrieval.__file__)"],
                           cwd=work, capture_output=True, text=True, env={**os.environ, **env}, check=True)
    assert where.stdout.strip().startswith(str(target))
    out = _cli(["--cfg", "job", "+experiment=queue65k"], work, env)
    assert out.returncode == 0, out.stderr
    assert "queue_size: 65536" in out.stdout


def test_configs_found_from_the_editable_install(tmp_path):
    out = _cli(["--cfg", "job", "+experiment=smoke"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "queue_size: 256" in out.stdout


def test_user_experiment_from_config_dir(tmp_path):
    conf = tmp_path / "my_conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - override /objective: inbatch\n"
                                    "data:\n  batch_size: 48\n")
    out = _cli(["--config-dir", str(tmp_path / "my_conf"), "--cfg", "job", "+experiment=mine"], tmp_path)
    assert out.returncode == 0, out.stderr
    job = OmegaConf.create(out.stdout)
    assert job.objective.name == "inbatch" and job.data.batch_size == 48


def test_resumed_attempt_keeps_earlier_csv_history(tmp_path):
    from moco_retrieval.training.loggers import csv_version

    assert csv_version(tmp_path) == ""
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "metrics.csv").write_text("step\n1\n")
    assert csv_version(tmp_path) == "resume-1"
    (tmp_path / "csv" / "resume-1").mkdir()
    assert csv_version(tmp_path) == "resume-2"


def test_checkpoint_files_are_readable_like_other_files(tmp_path):
    import stat

    from moco_retrieval.files import atomic_torch_save

    old = os.umask(0o022)
    try:
        atomic_torch_save({"a": 1}, tmp_path / "x.ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.ckpt").stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["x.ckpt"]  # no temporary left behind


def test_eta_counts_the_validations_still_to_come():
    from types import SimpleNamespace

    from moco_retrieval.training.report import LogLineProgress, validations_left

    assert validations_left(0, 570, 100) == 6  # 100..500 and the final one at 570
    assert validations_left(500, 570, 100) == 1
    assert validations_left(0, 500, 100) == 5  # the last step is a validation point: no extra one
    assert validations_left(570, 570, 100) == 0
    assert validations_left(3, 10, None) == 1  # once per epoch, at the end
    # the pool's texts (several evaluation sets: all of theirs) estimate a validation's time
    dm = SimpleNamespace(eval_sets={"a": SimpleNamespace(corpus=range(2000), queries=range(2000)),
                                    "b": SimpleNamespace(corpus=range(1283), queries=range(1283))},
                         cfg=SimpleNamespace(batch_size=64))
    trainer = SimpleNamespace(val_check_interval=100, check_val_every_n_epoch=None, accumulate_grad_batches=1,
                              num_training_batches=570, datamodule=dm)
    p = LogLineProgress()
    rate = 1 / 6.3  # steps per second
    # before any validation ran: estimated from the pool (about 3 minutes each on the main job)
    est = p.validation_seconds(trainer, 6.3)
    assert 120 < est < 240
    assert p.eta_seconds(trainer, 0, 570, rate) == pytest.approx(570 * 6.3 + 6 * est)
    p._val_seconds = [100.0, 140.0]  # once timed, the mean of the measured ones
    assert p.eta_seconds(trainer, 200, 570, rate) == pytest.approx(370 * 6.3 + 4 * 120.0)


def test_the_first_step_is_said_at_once_and_the_rate_leaves_its_warm_up_out(monkeypatch, capsys):
    """Issue 46, point 16: the main job on a CPU printed nothing for minutes (the first line came after
    log_every_n_steps steps) and its rate counted the first step's warm-up."""
    from types import SimpleNamespace

    from moco_retrieval.training import report

    now = [0.0]
    monkeypatch.setattr(report.time, "monotonic", lambda: now[0])
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, estimated_stepping_batches=570, current_epoch=0,
                              val_check_interval=100, check_val_every_n_epoch=None, accumulate_grad_batches=1,
                              num_training_batches=570, datamodule=None, progress_bar_metrics={})
    p = report.LogLineProgress(every=10)
    p.on_train_start(trainer, None)
    now[0], trainer.global_step = 30.0, 1  # a first step of 30 s: model warm-up, allocations
    p.on_train_batch_end(trainer, None, None, None, 0)
    assert "step 1/570: the first step of this attempt took 30.0 s" in capsys.readouterr().out
    for step in range(2, 11):  # then 5 s a step
        now[0], trainer.global_step = 30.0 + 5 * (step - 1), step
        p.on_train_batch_end(trainer, None, None, None, step - 1)
    assert p.training_rate(trainer) == pytest.approx(1 / 5)  # not 10 steps / 75 s
    assert "step 10/570 (2%) 0.20 steps/s" in capsys.readouterr().out
    p.on_train_epoch_start(trainer, None)  # a new epoch: its first step is left out of the rate, not said again
    now[0], trainer.global_step = 200.0, 11
    p.on_train_batch_end(trainer, None, None, None, 0)
    assert "first step" not in capsys.readouterr().out


def test_a_resumed_run_continues_its_wandb_run(tmp_path, debian_dir, capsys):
    """ckpt_path=last (a requeued job) logs into the same W&B run (offline here), not a new one."""
    from moco_retrieval.training.loggers import RUN_ID_FILE
    from moco_retrieval.train import train

    small = ["+experiment=smoke", "logger=wandb", "data.max_train_examples=64", "data.max_eval_queries=16",
             "data.max_eval_docs=32", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1",
             "ckpt_path=last"]
    run = tmp_path / "run"
    train(OmegaConf.to_object(compose_cfg("train", small + ["trainer.max_steps=2"])), run)
    run_id = (run / "wandb" / RUN_ID_FILE).read_text().strip()
    train(OmegaConf.to_object(compose_cfg("train", small + ["trainer.max_steps=4"])), run)
    assert (run / "wandb" / RUN_ID_FILE).read_text().strip() == run_id
    attempts = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    # offline-run-DATE_TIME-ID; W&B adds "-1" when both attempts start within the same second
    assert len(attempts) == 2 and all(f"-{run_id}" in name for name in attempts)
    assert f"continuing {run_id}" in capsys.readouterr().out


def test_wandb_run_id_is_kept_only_when_resuming(tmp_path):
    from moco_retrieval.training.loggers import wandb_run_id

    first = wandb_run_id(tmp_path / "run", resume=False)
    assert wandb_run_id(tmp_path / "run", resume=True) == first  # the requeued attempt
    assert wandb_run_id(tmp_path / "other", resume=True) != first  # nothing stored there: a new run
    fresh = wandb_run_id(tmp_path / "run", resume=False)  # a fresh start over the old run directory
    assert fresh != first and wandb_run_id(tmp_path / "run", resume=True) == fresh


def test_a_run_with_run_dir_leaves_no_hydra_folder_beside_it(tmp_path, cli_env):
    out = subprocess.run([sys.executable, "-m", "moco_retrieval.train", "+experiment=smoke", "data.max_train_examples=32",
                          "data.max_eval_queries=8", "data.max_eval_docs=16", "trainer.max_steps=1", "logger=none",
                          f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, env=cli_env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.json").is_file()
    assert not (tmp_path / "outputs").exists()  # Hydra's outputs/DATE/TIME/.hydra, empty but for its record


def test_help_comes_at_once_names_no_internal_file_and_lists_the_keys_a_user_sets_first(tmp_path):
    """``--help`` prints before Lightning is imported, without the docstring's references to the
    project's files, with trainer.max_steps and the data keys among its main options. Its CPU time
    is the bound (the wall time on a shared 2-core machine varies threefold with the load): 3.0-3.3 s
    (torch's import most of it), 9.2-9.4 s before (15-20 s of wall time here, 12-21 s for a new user)."""
    import re
    import resource

    env = dict(os.environ, PYTHONPATH=str(REPO))  # this checkout's package, from any folder
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "moco_retrieval.train", "--help"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "moco_retrieval.command" in imported and not {"lightning", "transformers"} & imported
    assert cpu < 6, f"--help took {cpu:.1f} s of CPU"
    text = out.stdout
    assert not re.search(r"\w+\.py\b", text), text  # run_lock.py, records.py, config.py ...
    for key in ("trainer.max_steps=-1", "trainer.max_epochs=1", "data.train_path=null", "data.eval_dir=null",
                "data.path=null", "data.batch_size=64", "data.max_train_examples=null", "seed=0", "ckpt_path=null"):
        assert f"\n  {key}\n" in text, key
    assert "ranges checked)" in text and "every attempt's logged metrics in step order)" in text
