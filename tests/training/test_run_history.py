"""A run's history across attempts: the command that resumes it, printed at its start;
``ckpt_path=last`` without ``run_dir`` (the newest run of the same experiment); one merged
``RUN/metrics.csv`` over every attempt (training/records.py)."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moco_retrieval.training.records import RECORD, merged_metrics, write_merged_metrics

TINY = ["+experiment=smoke", "data.max_train_examples=32", "data.max_eval_queries=16", "data.max_eval_docs=32",
        "trainer.log_every_n_steps=1", "trainer.val_check_interval=null"]


def train_cli(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "moco_retrieval.train", *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def rows_of(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_the_main_job_without_run_dir_prints_its_resume_command_and_ckpt_path_last_finds_it(tmp_path, debian_dir):
    first = train_cli(tmp_path, *TINY)  # one epoch: 2 steps
    assert first.returncode == 0, first.stderr[-3000:]
    runs = [p.parent.parent for p in tmp_path.glob("outputs/*/*/checkpoints/last.ckpt")]
    assert len(runs) == 1
    run = runs[0].resolve()
    said = re.search(r"to resume this run: (python -m moco_retrieval\.train .*)", first.stderr)
    assert said and f"run_dir={run}" in said.group(1) and said.group(1).endswith("ckpt_path=last")

    # as the README says: without run_dir, ckpt_path=last resumes the newest run of the experiment, named
    again = train_cli(tmp_path, *TINY, "trainer.max_epochs=2", "ckpt_path=last")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming the newest run of experiment smoke: {run}" in again.stderr
    rows = rows_of(run / "metrics.csv")  # one file over both attempts, in step order
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps) and {r["attempt"] for r in rows} == {"1", "2"}
    assert max(int(r["step"]) for r in rows if r["attempt"] == "1") <= 2 < max(steps)
    assert json.loads((run / "metrics.json").read_text())["attempts"] == 2
    validated = [r for r in rows if r.get("val/recall@1")]  # each validation says what pool it measured
    assert validated and all((float(r["val/pool_queries"]), float(r["val/pool_docs"])) == (16, 32) for r in validated)

    # another experiment has no run to resume: refused, naming what to give, leaving no folder behind
    folders = sorted(tmp_path.glob("outputs/*/*"))
    other = train_cli(tmp_path, "+experiment=frozen_inbatch", "ckpt_path=last")
    assert other.returncode == 2
    assert "no run of experiment frozen_inbatch" in other.stderr and "run_dir=DIR" in other.stderr
    assert sorted(tmp_path.glob("outputs/*/*")) == folders
    assert not list(tmp_path.glob("outputs/**/*.log"))  # no empty train.log: the output is the console's


def test_a_start_refused_for_bad_input_leaves_no_hydra_folder(tmp_path):
    bad = train_cli(tmp_path, "+experiment=smoke", "objective.queue_dtype=int8")
    assert bad.returncode == 2 and "objective.queue_dtype" in bad.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*"))


def _attempt(folder: Path, resumed_from: int | None, steps: range) -> None:
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "step", "train/loss"])
        w.writerows([0, s, 1.0 / (s + 1)] for s in steps)
    if resumed_from is not None:
        (folder / RECORD).write_text(json.dumps({"resumed_from_step": resumed_from}))


def test_merged_metrics_drop_the_steps_a_later_attempt_redid(tmp_path):
    _attempt(tmp_path / "csv", 0, range(0, 10))  # stopped at 9; the last checkpoint was of step 6
    _attempt(tmp_path / "csv" / "resume-1", 6, range(7, 12))  # stopped at 11, checkpoint of 11
    _attempt(tmp_path / "csv" / "resume-2", 11, range(12, 15))
    columns, rows = merged_metrics(tmp_path)
    assert columns[0] == "attempt"
    assert [(r["attempt"], int(r["step"])) for r in rows] == \
        [(1, s) for s in range(0, 7)] + [(2, s) for s in range(7, 12)] + [(3, s) for s in range(12, 15)]
    out = write_merged_metrics(tmp_path)
    assert out == tmp_path / "metrics.csv" and len(rows_of(out)) == 15


def test_the_model_card_says_what_pool_its_numbers_were_measured_on(tmp_path):
    from moco_retrieval.export.card import model_card, validation_at

    run = tmp_path / "run"
    (run / "csv").mkdir(parents=True)
    (run / "csv" / "metrics.csv").write_text("step,val/recall@1\n5,0.9\n")  # the attempt thrown away
    (run / "metrics.csv").write_text("attempt,step,val/recall@1,val/pool_queries,val/pool_docs\n"
                                     "1,5,0.25,64,256\n2,5,0.266,64,256\n")
    metrics = validation_at(run, 5, "best-5.ckpt")
    assert metrics == {"recall@1": 0.266, "pool_queries": 64.0, "pool_docs": 256.0}
    capped = {"data": {"kind": "debian", "max_eval_queries": 64, "max_eval_docs": 256, "batch_size": 16}}
    card = model_card({"dim": 8, "global_step": 5}, {"pooling": "mean"}, "query", capped, metrics, "out")
    assert "64 queries against 256 documents, capped by `data.max_eval_queries=64`, `data.max_eval_docs=256`" in card
    assert "not the full held-out set" in card and "model_dir=out data.max_eval_queries=null" in card
    full = model_card({"dim": 8, "global_step": 5}, {"pooling": "mean"}, "query", {"data": {"kind": "debian"}},
                      metrics, "out")
    assert "on the full held-out pool: 64 queries against 256 documents" in full


@pytest.mark.parametrize("name", ["train", "evaluate"])
def test_help_says_what_the_command_does_without_the_schemas(tmp_path, name):
    out = subprocess.run([sys.executable, "-m", f"moco_retrieval.{name}", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "_schema" not in text and "powered by Hydra" not in text
    assert f"python -m moco_retrieval.{name}" in text and "data: beir, csv, debian, documents, hf, jsonl, parquet" in text
    if name == "train":
        assert "objective: feature_memory, inbatch, moco, two_queue" in text
        assert "+experiment=NAME" in text and "smoke" in text and "ckpt_path=null" in text
        assert "checkpoints/last.ckpt" in text  # what it does and writes, from the module's docstring
    else:
        assert "checkpoint=null" in text and "model_dir=EXPORTED_DIR" in text
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "evaluations").exists()


def test_the_model_card_lists_only_the_warmup_setting_that_was_used():
    from moco_retrieval.export.card import model_card

    def optimizer_line(optim):
        card = model_card({"dim": 8}, {"pooling": "mean"}, "query", {"optim": optim}, None, "out")
        return next(line for line in card.splitlines() if line.startswith("- Optimizer"))

    steps = optimizer_line({"lr": 1e-3, "warmup_steps": 2, "warmup_ratio": 0.1})
    assert "`warmup_steps=2`" in steps and "warmup_ratio" not in steps
    ratio = optimizer_line({"lr": 1e-3, "warmup_steps": 0, "warmup_ratio": 0.1})
    assert "`warmup_ratio=0.1`" in ratio and "warmup_steps" not in ratio


def test_a_resumed_run_numbers_its_attempts_and_logs_the_consoles_steps(tmp_path, monkeypatch, capsys, debian_dir,
                                                                        one_thread):
    """A run stopped (SIGTERM) before its first logged row, resumed to the end of an epoch (4 steps),
    resumed again from that epoch-end checkpoint: metrics.csv numbers the attempts as metrics.json
    counts them, and logs the steps the console printed (every 5, and the last)."""
    import signal

    from moco_retrieval import train as train_module
    from moco_retrieval.training.preemption import Preempted
    from tests.helpers import SignalAt, compose_cfg

    run = tmp_path / "run"
    base = ["+experiment=smoke", "data.max_train_examples=64", "data.max_eval_queries=16", "data.max_eval_docs=32",
            "trainer.val_check_interval=null", "trainer.max_epochs=-1", "trainer.log_every_n_steps=5",
            f"run_dir={run}", "ckpt_path=last"]
    build = train_module.build

    def build_stopped_at_step_3(*args, **kw):
        module, dm, trainer = build(*args, **kw)
        trainer.callbacks.append(SignalAt(signal.SIGTERM, 2))  # batch 2 starts: the stop after step 3
        return module, dm, trainer

    monkeypatch.setattr(train_module, "build", build_stopped_at_step_3)
    with pytest.raises(Preempted):
        train_module.train(compose_cfg("train", [*base, "trainer.max_steps=8"], to_object=True), run)
    monkeypatch.setattr(train_module, "build", build)
    train_module.train(compose_cfg("train", [*base, "trainer.max_steps=4"], to_object=True), run)
    capsys.readouterr()
    train_module.train(compose_cfg("train", [*base, "trainer.max_steps=12"], to_object=True), run)
    console = [int(s) for s in re.findall(r"step (\d+)/12 \(", capsys.readouterr().out)]

    assert json.loads((run / "metrics.json").read_text())["attempts"] == 3
    rows = rows_of(run / "metrics.csv")
    trained = [(r["attempt"], int(r["step"])) for r in rows if r.get("train/loss")]
    assert console == [5, 10]
    assert trained == [("2", 4), ("3", 5), ("3", 10), ("3", 12)]  # step 4: the last of attempt 2, logged at its stop
    assert {r["attempt"] for r in rows} == {"2", "3"}  # attempt 1 logged nothing before its stop
