"""Streaming on two ranks for real (`torchrun --nproc_per_node=2 -m moco_retrieval.train ... trainer=ddp
data.stream=true`, gloo on CPU, the tiny model, 8 steps of 2 x 16 Debian pairs from chunks of a
few rows): a run stopped by SIGTERM mid-epoch and resumed from its checkpoint trains exactly the
(rank, pair)s of an uninterrupted run, step by step, none twice and none skipped (by hash over the
queue, which holds every step's keys of both ranks with their ids), and ends with its queue and EMA
key encoder bit-exact. Slow: three launches of two interpreters (~1.5 min on a busy 2-core machine)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("litdata", reason="data.stream needs litdata (pip install --no-deps -r requirements-nodeps.txt)")

from tests.helpers import compose_cfg  # noqa: E402

BATCH, RANKS, STEPS = 16, 2, 8
PROGRESS = re.compile(r"\bstep (\d+)/(\d+)\b")


def overrides(tmp: Path) -> list[str]:
    return ["+experiment=smoke", "trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={RANKS}",
            f"data.batch_size={BATCH}", f"data.max_train_examples={BATCH * RANKS * STEPS}", "data.max_eval_queries=16",
            "data.max_eval_docs=32", "trainer.log_every_n_steps=1", "logger=none", "data.stream=true",
            f"data.stream_dir={tmp / 'chunks'}"]


def command(tmp: Path, run: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
            "-m", "moco_retrieval.train", *overrides(tmp), f"run_dir={tmp / run}/rank${{oc.env:LOCAL_RANK}}",
            f"hydra.run.dir={tmp / 'hydra'}", *extra]


def launch(cmd: list[str], env: dict, cwd: Path, stop_after: int | None = None) -> tuple[int, str]:
    """Runs ``cmd`` in its own session; ``stop_after``: SIGTERM to torchrun (which passes it to both
    ranks) once rank 0 reports that step."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timer = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    lines, sent = [], False
    try:
        for line in proc.stdout:
            lines.append(line)
            m = PROGRESS.search(line)
            if stop_after is not None and m and int(m.group(1)) >= stop_after and not sent:
                sent = True
                os.kill(proc.pid, signal.SIGTERM)
        proc.wait()
    finally:
        timer.cancel()
    return proc.returncode, "".join(lines)


def expected_rows(cfg) -> list[list[int]]:
    """Each step's rows of each rank as the stream gives them (rank 0's, then rank 1's)."""
    from moco_retrieval.data.stream import stream_names
    from moco_retrieval.data.stream_batches import StreamBatches

    names, manifest = stream_names(cfg), json.loads((Path(cfg.stream_dir) / "moco_stream.json").read_text())
    ranks = [list(StreamBatches(cfg.stream_dir, names, [manifest["rows"]], BATCH, lambda items: [i for i, _ in items],
                                seed=cfg.seed, rank=r, world_size=RANKS)) for r in range(RANKS)]
    return [ranks[0][s] + ranks[1][s] for s in range(STEPS)]


@pytest.mark.slow
def test_two_ranks_stopped_mid_epoch_resume_exactly(cli_env, tmp_path, monkeypatch):
    from moco_retrieval.data import stream
    from moco_retrieval.data.sources import load_training_rows

    for k in ("MOCO_RETRIEVAL_DEBIAN_DIR", "MOCO_RETRIEVAL_CACHE"):
        monkeypatch.setenv(k, cli_env[k])
    monkeypatch.setattr(stream, "CHUNK_BYTES", 4096)  # chunks of a few rows: a rank's share spans many
    cfg = compose_cfg("train", overrides(tmp_path), to_object=True).data
    stream.prepare_stream(cfg, workers=2)
    assert len(list((tmp_path / "chunks" / "data").glob("chunk-*.bin"))) > 8

    rc, out = launch(command(tmp_path, "full"), cli_env, tmp_path)
    assert rc == 0, out[-3000:]
    rc, out = launch(command(tmp_path, "cut"), cli_env, tmp_path, stop_after=3)
    assert rc != 0 and "stopped by SIGTERM" in out, out[-3000:]
    last = tmp_path / "cut" / "rank0" / "checkpoints" / "last.ckpt"
    stop = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 3 <= stop < STEPS, out[-3000:]
    rc, out = launch(command(tmp_path, "cut", f"ckpt_path={last}"), cli_env, tmp_path)
    assert rc == 0 and "Restoring states from the checkpoint path" in out, out[-3000:]

    full, cut = (torch.load(tmp_path / r / "rank0" / "checkpoints" / "last.ckpt", map_location="cpu",
                            weights_only=False) for r in ("full", "cut"))
    assert full["global_step"] == cut["global_step"] == STEPS
    # every step's keys of both ranks are in the queue (256 keys, 8 steps of 2 x 16), with their ids
    ids = {r: c["state_dict"]["objective.docs.queue.queue_ids"].view(STEPS, RANKS, BATCH) for r, c in
           (("full", full), ("cut", cut))}
    steps = cut["state_dict"]["objective.docs.queue.queue_steps"].view(STEPS, RANKS * BATCH)
    assert (steps == torch.arange(STEPS)[:, None]).all()

    def hashes(run_ids) -> list[str]:
        return [hashlib.sha256(f"{rank}|{run_ids[s, rank].tolist()}".encode()).hexdigest()
                for s in range(STEPS) for rank in range(RANKS)]

    assert hashes(ids["cut"]) == hashes(ids["full"])  # the same (rank, rows) at every step: none twice, none skipped
    rows = load_training_rows(cfg).rows
    want = [[rows.doc_ids[i] for i in step] for step in expected_rows(cfg)]
    assert ids["full"].view(STEPS, -1).tolist() == want  # and they are the stream's rows, each rank its own share
    seen = [i for step in expected_rows(cfg) for i in step]
    assert len(seen) == len(set(seen)) == STEPS * RANKS * BATCH
    # the queue and the EMA key encoder, bit-exact
    for key, value in full["state_dict"].items():
        if key.startswith(("objective.", "key_encoder.")):
            assert torch.equal(cut["state_dict"][key], value), key
