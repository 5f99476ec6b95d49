"""Two processes for real: `torchrun --nproc_per_node=2 -m moco_retrieval.train ... trainer=ddp`
(gloo on CPU, the tiny model, a slice of the Debian set: 8 steps of 2 x 16 pairs).

* A complete run ends cleanly, and then
  - the ranks' queues in the final checkpoint match (every checkpoint records each rank's
    fingerprint of its queue and key encoder) and hold both ranks' keys of every step;
  - the validation metrics are those of evaluating the final checkpoint's encoder on the whole
    pool in one process (not a shard), logged once per validation;
  - rank 1 wrote nothing: each rank gets `run_dir=<base>/rank$LOCAL_RANK`, and rank 1's folder
    has no file.
* A SIGTERM to rank 1 alone, mid-epoch: both ranks stop after the same step, rank 0 writes
  checkpoints/last.ckpt, the workers exit 143. (Slow: the same job resumed from it completes.)

Each launch takes ~20 s on an idle 2-core machine (most of it two interpreters starting).
"""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from moco_retrieval.files import tensors_sha256

# torchrun as this interpreter's module: its workers then run this interpreter, and so this checkout's
# code (a `torchrun` script elsewhere on PATH starts another Python, with whatever install it has)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
BATCH, RANKS, STEPS = 16, 2, 8  # 256 pairs = 8 steps of 2 x 16
PROGRESS = re.compile(r"\bstep (\d+)/(\d+)\b")  # rank 0's progress lines (moco_retrieval/progress.py)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _local_rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"LOCAL_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def launch(cmd: list[str], env: dict, cwd: Path, on_line=None, timeout: float = 300) -> tuple[int, str]:
    """Runs ``cmd`` in its own session; on a timeout kills the whole group (torchrun and workers)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(proc, line)
        proc.wait()
    finally:
        timed_out = not timer.is_alive()
        timer.cancel()
    out = "".join(lines)
    assert not timed_out, f"{' '.join(cmd[:4])} ... did not finish in {timeout} s:\n{out[-3000:]}"
    return proc.returncode, out


def worker_pid(torchrun_pid: int, local_rank: int) -> int:
    for pid in _children(torchrun_pid):
        if _local_rank(pid) == local_rank:
            return pid
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under torchrun (pid {torchrun_pid})")


def command(tmp: Path) -> list[str]:
    return [
        *TORCHRUN, "--standalone", f"--nproc_per_node={RANKS}", "-m", "moco_retrieval.train",
        "+experiment=smoke", "trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={RANKS}",
        f"data.batch_size={BATCH}", f"data.max_train_examples={BATCH * RANKS * STEPS}",
        "data.max_eval_queries=32", "data.max_eval_docs=64", "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=3",
        # a run directory per rank: anything rank 1 writes would land in <tmp>/run/rank1
        f"run_dir={tmp}/run/rank${{oc.env:LOCAL_RANK}}", f"hydra.run.dir={tmp}/hydra",
    ]


@pytest.fixture(scope="module")
def completed(cli_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    rc, out = launch(command(tmp), cli_env, tmp)
    return dict(base=tmp / "run", rc=rc, out=out)


@pytest.fixture(scope="module")
def interrupted(cli_env, tmp_path_factory):
    env, tmp = cli_env, tmp_path_factory.mktemp("torchrun")
    signalled_at = []

    def sigterm_to_rank_1(proc, line):  # once step 2 is done
        m = PROGRESS.search(line)
        if m and int(m.group(1)) >= 2 and not signalled_at:
            signalled_at.append(int(m.group(1)))
            os.kill(worker_pid(proc.pid, 1), signal.SIGTERM)

    rc, out = launch(command(tmp), env, tmp, sigterm_to_rank_1)
    return dict(env=env, tmp=tmp, base=tmp / "run", rc=rc, out=out, signalled_at=signalled_at[0] if signalled_at else None)


def test_complete_run_ends_cleanly(completed):
    assert completed["rc"] == 0, completed["out"][-3000:]
    out = completed["out"]
    assert "Traceback" not in out and "destroy_process_group" not in out
    assert "final validation:" in out
    ckpt = torch.load(completed["base"] / "rank0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == STEPS


def test_final_queues_match_across_ranks(completed):
    ckpt = torch.load(completed["base"] / "rank0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    fp = ckpt["rank_fingerprints"]
    assert len(fp) == RANKS and fp[0] == fp[1] and set(fp[0]) == {"objective", "key_encoder"}
    # rank 0's entry is the objective's state in this file: MoCo's document memory (no guide, no logQ)
    state = {k[len("objective."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("objective.docs.")}
    assert fp[0]["objective"] == tensors_sha256(sorted(state.items()))
    sd = {k.split("objective.docs.queue.", 1)[1]: v for k, v in ckpt["state_dict"].items() if k.startswith("objective.docs.queue.")}
    # every step enqueued the global batch (both ranks' keys), not one rank's share
    assert int(sd["queue_fill"]) == STEPS * RANKS * BATCH
    steps = sd["queue_steps"][: STEPS * RANKS * BATCH].view(STEPS, RANKS * BATCH)
    assert (steps == torch.arange(STEPS)[:, None]).all()
    assert len(set(sd["queue_ids"].tolist())) > BATCH * STEPS  # more distinct documents than one rank saw


def test_validation_metrics_are_those_of_the_whole_pool_in_one_process(completed):
    from omegaconf import OmegaConf

    from moco_retrieval.config import DataConfig
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.training.module import RetrievalModule

    run = completed["base"] / "rank0"
    logged = json.loads((run / "metrics.json").read_text())
    module = RetrievalModule.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu")
    data = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig),
                                               OmegaConf.load(run / "config.yaml").data))
    dm = RetrievalDataModule(data, tokenize=module.encoder.tokenize)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    (single,) = trainer.validate(module, datamodule=dm, verbose=False)
    assert len(dm.eval_set.queries) == 32
    for key in ["val/recall@1", "val/recall@10", "val/mrr@10", "val/ndcg@10", "val/map@100"]:
        assert logged[key] == pytest.approx(single[key], abs=1e-6), key
    # one row per validation in the log (steps 3 and 6 in training, 8 at the end), not one per rank
    with open(run / "csv" / "metrics.csv", newline="") as f:
        val_steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("val/recall@1")]
    assert len(val_steps) == len(set(val_steps)) == 3, val_steps


def test_only_rank_0_writes(completed):
    base = completed["base"]
    assert not [p for p in (base / "rank1").rglob("*") if p.is_file()]
    files = {str(p.relative_to(base / "rank0")) for p in (base / "rank0").rglob("*") if p.is_file()}
    assert {"config.yaml", "metrics.json", "checkpoints/last.ckpt", "csv/metrics.csv"} <= files
    assert [f for f in files if f.startswith("checkpoints/best-")]
    assert not [f for f in files if f.endswith(".tmp") or "last-v" in f]


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(interrupted):
    out = interrupted["out"]
    assert interrupted["signalled_at"] is not None, out[-3000:]
    assert interrupted["rc"] != 0, "torchrun reported success for a preempted run"
    m = re.search(r"stopped by SIGTERM after step (\d+)", out)
    assert m, out[-3000:]
    stop = int(m.group(1))
    assert interrupted["signalled_at"] <= stop < STEPS
    # Each worker exits 143 after the checkpoint; one still in its interpreter shutdown when
    # torchrun, seeing the other's failure, sends SIGTERM may show -15 instead.
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)}
    assert 143 in codes and codes <= {143, -15}, out[-3000:]
    ckpt = torch.load(interrupted["base"] / "rank0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == stop
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "batches_done": stop}]
    fp = ckpt["rank_fingerprints"]
    assert len(fp) == RANKS and fp[0] == fp[1]  # the ranks stopped at one step, with one queue
    assert not (interrupted["base"] / "rank0" / "metrics.json").exists()


@pytest.mark.slow
def test_preempted_ddp_job_resumes_and_completes(interrupted):
    ckpt = interrupted["base"] / "rank0" / "checkpoints" / "last.ckpt"
    stop = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]
    # The requeue. (An explicit path, not `ckpt_path=last`, which is looked up in each rank's
    # run_dir: here the ranks have different ones on purpose. test_resume.py runs `ckpt_path=last`.)
    rc, out = launch(command(interrupted["tmp"]) + [f"ckpt_path={ckpt}"], interrupted["env"], interrupted["tmp"])
    assert rc == 0, out[-3000:]
    assert "Restoring states from the checkpoint path at" in out and "Traceback" not in out
    final = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert final["global_step"] == STEPS
    fp = final["rank_fingerprints"]
    assert fp[0] == fp[1]
    queue_steps = final["state_dict"]["objective.docs.queue.queue_steps"].view(STEPS, RANKS * BATCH)
    assert (queue_steps == torch.arange(STEPS)[:, None]).all()  # no step twice, none missing
    # the resumed attempt logs to csv/resume-1/ (loggers.csv_version), at the step each batch completes
    with open(interrupted["base"] / "rank0" / "csv" / "resume-1" / "metrics.csv", newline="") as f:
        train_steps = sorted(int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss"))
    assert train_steps == list(range(stop + 1, STEPS + 1))


@pytest.mark.slow  # ~55 s on a busy 2-core machine (two interpreters starting, 5 s of waiting)
def test_stalled_rank_ends_the_others_after_the_process_group_timeout(cli_env, tmp_path_factory):
    """SIGSTOP rank 1 after step 2: rank 0 waits `trainer.process_group_timeout` (5 s here, not
    Lightning's 30 min) at its next collective and exits with a message naming what it waited for.
    `trainer=ddp` without trainer.devices: under torchrun the launcher's 2 processes are the devices."""
    env, tmp = cli_env, tmp_path_factory.mktemp("torchrun")
    cmd = [a for a in command(tmp) if not a.startswith("trainer.devices=")] + ["trainer.process_group_timeout=5"]
    stopped: list[int] = []

    def stop_rank_1_then_kill_it_once_rank_0_gives_up(proc, line):
        m = PROGRESS.search(line)
        if m and int(m.group(1)) >= 2 and not stopped:
            stopped.append(worker_pid(proc.pid, 1))
            os.kill(stopped[0], signal.SIGSTOP)
            stopped.append(time.monotonic())
        elif "waited 5 s" in line and stopped:
            stopped.append(time.monotonic())
            os.kill(stopped[0], signal.SIGKILL)  # (torchrun would SIGTERM it, then SIGKILL 30 s later)

    rc, out = launch(cmd, env, tmp, stop_rank_1_then_kill_it_once_rank_0_gives_up, timeout=240)
    assert len(stopped) == 3, out[-3000:]
    assert rc != 0
    m = re.search(r"rank 0 of 2: waited 5 s \(trainer.process_group_timeout\) for the other ranks in a collective "
                  r"at step (\d+)", out)
    assert m and int(m.group(1)) >= 2, out[-3000:]
    assert 4 <= stopped[2] - stopped[1] < 60  # it gave up after the timeout, not Lightning's 1800 s


@pytest.mark.slow  # ~30 s on a busy 2-core machine (two interpreters starting)
def test_a_rank_killed_by_sigkill_leaves_the_other_with_the_projects_message(cli_env, tmp_path_factory):
    """SIGKILL rank 1 after step 2 (the out-of-memory killer, a node lost): rank 0's next
    collective finds the connection closed; it says so in one line (not gloo's "Connection reset
    by peer" traceback) and exits non-zero."""
    env, tmp = cli_env, tmp_path_factory.mktemp("torchrun")
    killed: list[int] = []

    def kill_rank_1(proc, line):
        m = PROGRESS.search(line)
        if m and int(m.group(1)) >= 2 and not killed:
            killed.append(worker_pid(proc.pid, 1))
            os.kill(killed[0], signal.SIGKILL)

    rc, out = launch(command(tmp), env, tmp, kill_rank_1, timeout=240)
    assert killed and rc != 0, out[-3000:]
    m = re.search(r"\[moco_retrieval\] rank 0 of 2: lost another rank in a collective at step (\d+): its connection "
                  r"closed", out)
    assert m and int(m.group(1)) >= 2, out[-3000:]
    assert "DistBackendError" not in out and "lightning/pytorch/trainer" not in out, out[-3000:]
