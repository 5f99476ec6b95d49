"""Two processes for real: `torchrun --nproc_per_node=2 -m moco_retrieval.train ... trainer=ddp`
(gloo on CPU, the tiny model, a slice of the Debian set).

One job, launched twice, as a requeued cluster job would be:
1. a SIGTERM to rank 1 alone, mid-epoch: both ranks stop after the same step, rank 0 writes
   checkpoints/last.ckpt, the workers exit 143;
2. the same command with `ckpt_path=last`: it completes and ends cleanly, and then
   * the ranks' queues in the final checkpoint match (each rank's fingerprint is recorded in
     every checkpoint) and hold both ranks' keys (all-gathered, in rank order);
   * the validation metrics are those of evaluating the final checkpoint's encoder on the whole
     pool in one process (not a shard), logged once per validation;
   * rank 1 wrote nothing: each rank gets `run_dir=<base>/rank$LOCAL_RANK`, and rank 1's folder
     stays empty.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from moco_retrieval import preemption

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
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


def worker_pid(torchrun_pid: int, local_rank: int) -> int:
    for pid in _children(torchrun_pid):
        if _local_rank(pid) == local_rank:
            return pid
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under torchrun (pid {torchrun_pid})")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Runs the job (interrupted, then resumed); returns what the tests look at."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed")
    debian = REPO.parent / "shared" / "data" / "debian-bookworm"
    if not debian.exists():
        pytest.skip(f"the shared Debian snapshot is not at {debian} (needed by the smoke experiment)")
    tmp = tmp_path_factory.mktemp("torchrun")
    cache = os.environ.get("MOCO_RETRIEVAL_CACHE") or str(tmp_path_factory.mktemp("moco_cache"))
    env = dict(os.environ, MOCO_RETRIEVAL_DEBIAN_DIR=str(debian), MOCO_RETRIEVAL_CACHE=cache,
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    base = tmp / "run"
    cmd = [
        TORCHRUN, "--standalone", f"--nproc_per_node={RANKS}", "-m", "moco_retrieval.train",
        "+experiment=smoke", "trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={RANKS}",
        f"data.batch_size={BATCH}", f"data.max_train_examples={BATCH * RANKS * STEPS}",
        "data.max_eval_queries=32", "data.max_eval_docs=64", "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=3",
        # a run directory per rank: anything rank 1 writes would land in <base>/rank1
        f"run_dir={base}/rank${{oc.env:LOCAL_RANK}}", f"hydra.run.dir={tmp}/hydra",
        "ckpt_path=last",  # the requeue setting: nothing to resume the first time
    ]
    t0 = time.monotonic()
    first = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, signalled_at = [], None
    for line in first.stdout:  # SIGTERM to rank 1 only, once step 2 is done
        seen.append(line)
        m = PROGRESS.search(line)
        if m and int(m.group(1)) >= 2 and signalled_at is None:
            signalled_at = int(m.group(1))
            os.kill(worker_pid(first.pid, 1), signal.SIGTERM)
    first.wait(timeout=300)
    first_out = "".join(seen)
    ckpt = base / "rank0" / "checkpoints" / "last.ckpt"
    interrupted = torch.load(ckpt, map_location="cpu", weights_only=False) if ckpt.exists() else None

    second = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    return dict(base=base, first_rc=first.returncode, first_out=first_out, signalled_at=signalled_at,
                interrupted=interrupted, second=second, seconds=time.monotonic() - t0)


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(job):
    out = job["first_out"]
    assert job["signalled_at"] is not None, out[-3000:]
    assert job["first_rc"] != 0, "torchrun reported success for a preempted run"
    m = re.search(r"stopped by SIGTERM after step (\d+)", out)
    assert m, out[-3000:]
    stop = int(m.group(1))
    assert job["signalled_at"] <= stop < STEPS
    # both workers left with the preemption status (torchrun itself reports a failed worker)
    assert re.search(r"exitcode\s*:\s*143", out), out[-3000:]
    assert "ChildFailedError" in out and not re.search(r"exitcode\s*:\s*-", out)  # none was killed
    ckpt = job["interrupted"]
    assert ckpt is not None and ckpt["global_step"] == stop
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "batches_done": stop}]
    fp = ckpt["rank_fingerprints"]
    assert len(fp) == RANKS and fp[0] == fp[1]  # the ranks stopped at one step, with one queue


def test_resumed_job_completes_cleanly(job):
    r = job["second"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Restoring states from the checkpoint path at" in out
    assert "Traceback" not in out and "destroy_process_group" not in out
    assert torch.load(job["base"] / "rank0" / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=False)["global_step"] == STEPS


def test_final_queues_match_across_ranks(job):
    ckpt = torch.load(job["base"] / "rank0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    fp = ckpt["rank_fingerprints"]
    assert len(fp) == RANKS and fp[0] == fp[1] and set(fp[0]) == {"queue", "key_encoder"}
    # rank 0's entry is the queue in this file
    sd = {k.split("objective.queue.", 1)[1]: v for k, v in ckpt["state_dict"].items() if k.startswith("objective.queue.")}
    assert fp[0]["queue"] == preemption._fingerprint([v for _, v in sorted(sd.items())])
    # every step enqueued the global batch (both ranks' keys), not one rank's share
    assert int(sd["queue_fill"]) == STEPS * RANKS * BATCH
    steps = sd["queue_steps"][: STEPS * RANKS * BATCH].view(STEPS, RANKS * BATCH)
    assert (steps == torch.arange(STEPS)[:, None]).all()


def test_validation_metrics_are_those_of_the_whole_pool_in_one_process(job):
    from omegaconf import OmegaConf

    from moco_retrieval.config import DataConfig
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.lightning_module import RetrievalModule

    run = job["base"] / "rank0"
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
    # one row per validation in the log (steps 3 and 6 before the preemption was resumed, 8 at the end)
    with open(run / "csv" / "metrics.csv", newline="") as f:
        val_steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("val/recall@1")]
    assert len(val_steps) == len(set(val_steps)) and val_steps


def test_only_rank_0_writes(job):
    base = job["base"]
    assert not [p for p in (base / "rank1").rglob("*") if p.is_file()] if (base / "rank1").exists() else True
    files = {str(p.relative_to(base / "rank0")) for p in (base / "rank0").rglob("*") if p.is_file()}
    assert {"config.yaml", "metrics.json", "checkpoints/last.ckpt", "csv/metrics.csv"} <= files
    assert [f for f in files if f.startswith("checkpoints/best-")]
    assert not [f for f in files if f.endswith(".tmp") or "last-v" in f]
