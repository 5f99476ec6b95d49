"""Preemption and resume (moco_retrieval/preemption.py).

* The real CLI on the smoke experiment gets a SIGTERM mid-epoch: it finishes the step, writes
  checkpoints/last.ckpt, exits 143; `ckpt_path=last` into the same run directory then gives the
  per-step losses and the final weights, queue, optimizer and scheduler of an uninterrupted run
  of the same seed (run in this process, alongside).
* In process, on a synthetic data module: SIGUSR1 too, the stop at an optimizer step under
  gradient accumulation, SLURM's requeue, the handlers put back, the wiring in train.build.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from moco_retrieval.training import checkpoints as fingerprints
from moco_retrieval.training import cluster as launcher
from moco_retrieval.training import preemption as requeue
from moco_retrieval.training import preemption as stop_signals
from moco_retrieval.training.preemption import Preempted, PreemptionCheckpoint
from tests.helpers import SMALL_RUN, SignalAt, compose_cfg, fit, make_module, train_command, train_losses

STEPS = 8  # SMALL_RUN's
PROGRESS = re.compile(r"\bstep (\d+)/(\d+)\b")  # moco_retrieval/progress.py's log lines


def reference_run(run_dir: Path, env: dict, extra: tuple = ()) -> None:
    """The uninterrupted run, in this process (no second interpreter start-up on a busy machine)."""
    from moco_retrieval.train import train

    saved = {k: os.environ.get(k) for k in ("MOCO_RETRIEVAL_DEBIAN_DIR", "MOCO_RETRIEVAL_CACHE")}
    threads = torch.get_num_threads()
    try:
        os.environ.update({k: env[k] for k in saved})
        torch.set_num_threads(1)  # as in the subprocesses (OMP_NUM_THREADS=1): the same float sums
        train(compose_cfg("train", SMALL_RUN + [*extra, f"run_dir={run_dir}"], to_object=True), run_dir)
    finally:
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("objective,refresh,variant", [
    ("two_queue", 0, ""), ("two_queue", 2, ""),
    # (each half a minute: the slow suite; MoCo's queue alone is also resumed bit-exact by the fast
    # in-process tests of training/test_lightning_module.py)
    pytest.param("moco", 0, "", marks=pytest.mark.slow),
    pytest.param("two_queue", 0, "online", marks=pytest.mark.slow),
    pytest.param("moco", 0, "documents", marks=pytest.mark.slow)])
def test_sigterm_mid_epoch_then_resume_matches_uninterrupted_run(tmp_path, cli_env, objective, refresh, variant):
    """``variant``: online keys (objective.keys=online: no key encoder, the queues alone carry the
    keys), or documents drawn as crops (data=documents: the views of the resumed batches too)."""
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    extra = (f"objective={objective}",)
    if variant == "online":
        extra += ("objective.keys=online",)
    if variant == "documents":
        words = "amber birch cedar dune ember fjord grove heath islet jade kelp loch moor nook oak pine".split()
        docs = tmp_path / "docs.jsonl"
        docs.write_text("".join(json.dumps({"text": " ".join(words[(i * 7 + j) % 16] for j in range(30 + i % 20)) + f" n{i}"})
                                + "\n" for i in range(160)))
        extra += ("data=documents", f"data.path={docs}")
    if objective == "two_queue":  # an age bound that bites on both sides of the stop: its window is restored too
        extra += ("objective.queue_max_age=2",)
    if refresh:  # queued texts re-encoded each step: the stored tokens and the draws resume too
        extra += (f"objective.queue_refresh={refresh}",)
    run = subprocess.Popen(train_command(run_dir, *extra), cwd=tmp_path, env=cli_env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []

    def sigterm_after_step_2():  # i.e. in the middle of the epoch
        for line in run.stdout:
            seen.append(line)
            m = PROGRESS.search(line)
            if m and int(m.group(1)) >= 2:
                os.kill(run.pid, signal.SIGTERM)
                return

    watcher = threading.Thread(target=sigterm_after_step_2, daemon=True)
    watcher.start()
    reference_run(ref_dir, cli_env, extra)  # meanwhile
    watcher.join(timeout=300)
    out = "".join(seen) + run.communicate(timeout=300)[0]
    assert run.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM" in out

    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.exists(), out[-3000:]
    assert not (run_dir / "metrics.json").exists()  # no final validation: the run is unfinished
    assert not list((run_dir / "checkpoints").glob(".*tmp")), "a temporary checkpoint file was left"
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    stop = ckpt["global_step"]
    assert 2 <= stop < STEPS, f"SIGTERM came too late to test a resume mid-epoch (stopped at {stop})"
    # the position in the epoch: the data module's sampler state, through the resumable loader
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "batches_done": stop}]
    part1 = train_losses(run_dir / "csv" / "metrics.csv")
    assert sorted(part1) == list(range(1, stop + 1)), part1  # logged at the step each batch completes

    resumed = subprocess.run(train_command(run_dir, *extra, "ckpt_path=last"), cwd=tmp_path, env=cli_env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "Restoring states from the checkpoint path at" in resumed.stdout + resumed.stderr
    assert (run_dir / "metrics.json").exists()

    # the resumed attempt logs to csv/resume-1/ and leaves the first attempt's history as it was
    ref_losses, part2 = train_losses(ref_dir / "csv" / "metrics.csv"), train_losses(run_dir / "csv" / "resume-1" / "metrics.csv")
    assert train_losses(run_dir / "csv" / "metrics.csv") == part1
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    assert sorted(part2) == list(range(stop + 1, STEPS + 1))  # no batch trained twice, none skipped
    for step in range(1, STEPS + 1):
        got = part1.get(step, part2.get(step))
        assert got == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6), f"train/loss at step {step}"

    # no last-v1.ckpt: the resumed run keeps writing the name a requeue resumes from (and its
    # predecessor, the fallback when last.ckpt cannot be read)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("last*")) == ["last.ckpt", "last.prev.ckpt"]
    a = torch.load(last, map_location="cpu", weights_only=False)
    b = torch.load(ref_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert a["global_step"] == b["global_step"] == STEPS
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert any("queue_keys" in k for k in a["state_dict"])
    assert any(k.startswith("key_encoder.") for k in a["state_dict"]) == (variant != "online")
    if objective == "two_queue":  # both queues are carried
        assert "objective.queries.queue.queue_keys" in a["state_dict"]
    if refresh:  # and the texts of both, and when each key was last encoded
        assert {"objective.docs.refresh.queue_tokens", "objective.queries.refresh.queue_encoded_steps"} <= a["state_dict"].keys()
        enc, enq = a["state_dict"]["objective.docs.refresh.queue_encoded_steps"], a["state_dict"]["objective.docs.queue.queue_steps"]
        assert (enc > enq).any()  # some keys were re-encoded after their enqueue
    for k, v in b["state_dict"].items():  # encoder, key encoder, queue (keys, ids, groups, steps, pointer)
        assert torch.allclose(a["state_dict"][k].double(), v.double(), rtol=1e-5, atol=1e-6), k
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(sa[name], sb[name], rtol=1e-5, atol=1e-8), name
    assert a["lr_schedulers"] == b["lr_schedulers"]

    # the run's clock counts both attempts: the first one's seconds came through the checkpoint
    before = ckpt["callbacks"]["RunClock"]
    after = json.loads((run_dir / "metrics.json").read_text())
    assert before["attempts"] == 1 and before["train_s"] > 0
    assert after["attempts"] == 2 and after["time/train_s"] > before["train_s"]
    assert json.loads((ref_dir / "metrics.json").read_text())["attempts"] == 1


# ------------------------------------------------------------------------------ in process


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_stops_after_the_step_with_a_checkpoint(tiny_dir, tmp_path, signum):
    before = {s: signal.getsignal(s) for s in stop_signals.STOP_SIGNALS}
    path = tmp_path / "checkpoints" / "last.ckpt"
    sig = SignalAt(signum, batch_idx=2)
    module = make_module(tiny_dir)
    with pytest.raises(Preempted) as stop:
        fit(module, tmp_path, callbacks=[PreemptionCheckpoint(path), sig])
    assert stop.value.code == 128 + signum and stop.value.signum == signum and stop.value.step == 3
    assert sig.ends == [0, 1, 2]  # the step the signal arrived in was finished, no further one began
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["global_step"] == 3
    queue = module.objective.docs.queue
    assert ckpt["state_dict"]["objective.docs.queue.queue_fill"] == queue.fill == 12  # the stopped step's keys are in
    assert torch.equal(ckpt["state_dict"]["objective.docs.queue.queue_keys"], queue.queue_keys)
    assert ckpt["rank_fingerprints"] == [fingerprints.rank_fingerprints(module)]
    assert {s: signal.getsignal(s) for s in stop_signals.STOP_SIGNALS} == before  # handlers put back


def test_no_signal_runs_to_the_end_and_saves_the_final_state(tiny_dir, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    trainer = fit(make_module(tiny_dir), tmp_path, callbacks=[PreemptionCheckpoint(tmp_path / "last.ckpt")], batches=3)
    assert trainer.global_step == 3
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 3
    assert signal.getsignal(signal.SIGTERM) == before


def test_stops_at_an_optimizer_step_under_accumulation(tiny_dir, tmp_path):
    sig = SignalAt(signal.SIGTERM, batch_idx=2)  # the first micro-batch of optimizer step 2
    with pytest.raises(Preempted) as stop:
        fit(make_module(tiny_dir), tmp_path, callbacks=[PreemptionCheckpoint(tmp_path / "last.ckpt"), sig],
            batches=8, accumulate_grad_batches=2)
    assert sig.ends == [0, 1, 2, 3] and stop.value.step == 2


def test_requeue_on_the_requeue_signal_only(tiny_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(requeue.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        with pytest.raises(Preempted):
            fit(make_module(tiny_dir), tmp_path,
                callbacks=[PreemptionCheckpoint(tmp_path / "last.ckpt", requeue_signal=signal.SIGUSR1), SignalAt(signum, 1)])
    assert calls == [["scontrol", "requeue", "4242"]]
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert launcher.slurm_job_id() == "77_3"


def test_lightnings_own_sigterm_stop_exits_143_not_0():
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    assert SIGTERMException().code is None  # what Lightning raises: status 0
    with pytest.raises(SystemExit) as stop:
        with stop_signals.sigterm_exit_status():
            raise SIGTERMException()
    assert stop.value.code == 143
    with pytest.raises(Preempted):  # ours passes through unchanged
        with stop_signals.sigterm_exit_status():
            raise Preempted(signal.SIGUSR1, "x", 1)


def test_requeue_without_scontrol_is_reported_not_fatal(monkeypatch, caplog):
    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(requeue.subprocess, "call", missing)
    with caplog.at_level("WARNING"):
        assert requeue.slurm_requeue("12") is False
    assert "scontrol is not available" in caplog.text


def test_build_wires_preemption_and_slurm_requeue(tmp_path, monkeypatch):
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from moco_retrieval.train import build

    monkeypatch.setenv("MOCO_RETRIEVAL_CACHE", os.environ.get("MOCO_RETRIEVAL_CACHE") or str(tmp_path / "cache"))
    cfg = compose_cfg("train", ["model=tiny", "trainer=cpu", "logger=none"], to_object=True)
    for var in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(var)
    _, _, trainer = build(cfg, tmp_path)
    (cb,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    assert cb.ckpt_path == tmp_path / "checkpoints" / "last.ckpt" and cb.requeue_signal is None
    assert not isinstance(trainer._accelerator_connector.cluster_environment, SLURMEnvironment)

    slurm = dict(SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
                 SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODELIST="node1")
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    _, _, trainer = build(cfg, tmp_path)
    env = trainer._accelerator_connector.cluster_environment
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal == signal.SIGUSR1
    (cb,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    assert cb.requeue_signal == signal.SIGUSR1
