"""Ctrl-C (SIGINT) during training stops as a preemption does: the step finishes, last.ckpt is
written, the command that resumes is printed, status 130; a second Ctrl-C aborts at once. Any
command interrupted outside training says so in one line, status 130."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from moco_retrieval.errors import reports_user_errors
from moco_retrieval.training.preemption import Preempted, PreemptionCheckpoint
from tests.helpers import SMALL_RUN, SignalAt, fit, make_module, train_command

PROGRESS = re.compile(r"\bstep (\d+)/(\d+)\b")


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_status_130(tiny_dir, tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    sig = SignalAt(signal.SIGINT, batch_idx=2)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Preempted) as stop:
        fit(make_module(tiny_dir), tmp_path, callbacks=[PreemptionCheckpoint(path), sig])
    assert stop.value.code == 130 and stop.value.step == 3
    assert sig.ends == [0, 1, 2]  # the step Ctrl-C came in was finished, no further one began
    assert torch.load(path, weights_only=False)["global_step"] == 3
    assert signal.getsignal(signal.SIGINT) == before  # Python's own handler back after fit


class TwiceAt(Callback):
    """Ctrl-C at batch ``batch_idx``, and again while that step still runs (its end hook)."""

    def __init__(self, batch_idx):
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx:
            os.kill(os.getpid(), signal.SIGINT)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.batch_idx:
            os.kill(os.getpid(), signal.SIGINT)


def test_a_second_ctrl_c_aborts_at_once_without_a_checkpoint(tiny_dir, tmp_path, capfd):
    path = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as stop:  # Lightning ends a KeyboardInterrupt with status 1
        fit(make_module(tiny_dir), tmp_path, callbacks=[PreemptionCheckpoint(path), TwiceAt(2)])
    assert stop.value.code not in (0, None)
    assert not path.exists()
    err = capfd.readouterr().err
    assert "Ctrl-C again aborts at once" in err and "got SIGINT again: aborting now" in err
    signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_command_interrupted_by_ctrl_c_says_so_in_one_line(capsys):
    @reports_user_errors("evaluate")
    def task():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stop:
        task()
    assert stop.value.code == 130
    assert capsys.readouterr().err == "evaluate: interrupted (Ctrl-C) before it finished\n"


def _interrupt_when(proc: subprocess.Popen, seen: list, ready) -> None:
    for line in proc.stdout:
        seen.append(line)
        if ready(line):
            os.kill(proc.pid, signal.SIGINT)
            break
    seen.extend(proc.stdout)


@pytest.mark.slow  # two short trainings from the command line (~40 s on a busy machine)
def test_ctrl_c_on_the_command_line_prints_the_command_that_resumes(tmp_path, cli_env):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(train_command(run_dir), cwd=tmp_path, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen: list[str] = []
    watcher = threading.Thread(target=_interrupt_when, args=(
        proc, seen, lambda line: bool(PROGRESS.search(line)) and int(PROGRESS.search(line).group(1)) >= 2), daemon=True)
    watcher.start()
    proc.wait(timeout=300)
    watcher.join(timeout=30)
    out = "".join(seen)
    assert proc.returncode == 130, out[-3000:]
    m = re.search(r"stopped by SIGINT after step (\d+)", out)
    assert m and "Traceback" not in out and "graceful shutdown" not in out, out[-3000:]
    stop = int(m.group(1))
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == stop
    resume = re.search(r"\[moco_retrieval\] to resume: (python -m moco_retrieval\.train .*)", out)
    assert resume, out[-3000:]
    args = shlex.split(resume.group(1))
    assert args[-1] == "ckpt_path=last" and f"run_dir={run_dir}" in args
    assert args[:3] == ["python", "-m", "moco_retrieval.train"]
    assert sorted(args[3:-1]) == sorted([*SMALL_RUN, f"run_dir={run_dir}", f"hydra.run.dir={tmp_path / 'run-hydra'}"])
    done = subprocess.run([sys.executable, *args[1:]], cwd=tmp_path, env=cli_env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 8
    assert (run_dir / "metrics.json").exists()


@pytest.mark.slow  # one evaluate start-up (~20 s on a busy machine)
def test_evaluate_interrupted_by_ctrl_c_is_one_line_and_status_130(tmp_path, cli_env):
    cmd = [sys.executable, "-m", "moco_retrieval.evaluate", "model=tiny", f"out_dir={tmp_path / 'out'}",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    watcher = threading.Thread(target=_interrupt_when, args=(proc, seen, lambda line: line.startswith("pool:")),
                               daemon=True)
    watcher.start()
    proc.wait(timeout=300)
    watcher.join(timeout=30)
    out = "".join(seen)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert out.rstrip().splitlines()[-1] == "evaluate: interrupted (Ctrl-C) before it finished", out[-3000:]
