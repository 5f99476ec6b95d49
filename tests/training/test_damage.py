"""Damage a run must notice: a checkpoint whose bytes changed (checksum), a loss or weights gone
inf / NaN, a full disk (what the message says is kept), a read-only run directory, a DDP rank
killed under the others."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from moco_retrieval import distributed
from moco_retrieval import files as checkpoint_file
from moco_retrieval.files import atomic_torch_save, previous_of, read_checkpoint
from moco_retrieval.training.checkpoints import resolve_ckpt_path
from moco_retrieval.errors import USER_ERROR_STATUS, CheckpointError
from tests.helpers import SHARED_DEBIAN, SMALL_RESUMABLE, compose_cfg, fit, last_and_previous, make_module


# ---- flipped bytes -----------------------------------------------------------------------------

def _flip(path: Path, n: int = 64) -> None:
    """``n`` bytes in the middle of the file inverted, as a bad disk or copy leaves them."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def test_a_checkpoint_with_flipped_bytes_falls_back_to_the_previous_one(tmp_path, capsys):
    last = last_and_previous(tmp_path)
    _flip(last)
    assert resolve_ckpt_path("last", tmp_path) == str(previous_of(last))
    err = " ".join(capsys.readouterr().err.split())
    assert f"ckpt_path={last}: damaged: its tensors do not match the checksum written with them" in err
    assert f"resuming from the previous checkpoint {previous_of(last)} instead" in err


def test_a_checkpoint_with_flipped_bytes_is_refused_by_every_command(tmp_path):
    last = last_and_previous(tmp_path)
    _flip(last)
    with pytest.raises(CheckpointError, match="checkpoint=.*last.ckpt: damaged"):
        read_checkpoint(last)  # what evaluate, export, search and mine load through
    with pytest.raises(CheckpointError, match="ckpt_path=.*last.ckpt: damaged"):
        resolve_ckpt_path(str(last), tmp_path)
    assert read_checkpoint(previous_of(last))["global_step"] == 2  # an intact one reads


def test_a_changed_byte_outside_the_tensors_is_caught_by_the_zips_crc(tmp_path):
    """The tensor checksum does not cover the pickled rest: a learning rate of 1e-3 turned into 65.5
    by one changed float (issue 46, point 8) must not resume at that rate."""
    import struct

    path = tmp_path / "last.ckpt"
    atomic_torch_save({"global_step": 2, "lr_schedulers": [{"base_lrs": [1e-3]}], "w": torch.ones(4)}, path)
    data = path.read_bytes()
    old, new = struct.pack(">d", 1e-3), struct.pack(">d", 65.5)  # a pickled float: 'G' and 8 big-endian bytes
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))
    with pytest.raises(CheckpointError, match=r"last.ckpt: damaged: .*data.pkl does not match the CRC the zip holds"):
        read_checkpoint(path)
    with pytest.raises(CheckpointError, match="ckpt_path=.*last.ckpt: damaged"):
        resolve_ckpt_path(str(path), tmp_path)


# ---- non-finite loss or weights ------------------------------------------------------------------

class Poison(Callback):
    """Fills the weights with NaN after optimizer step ``step`` (the next step's loss is NaN) and
    saves ``path`` after step ``save_at`` (a good checkpoint when before it)."""

    def __init__(self, step: int, path: Path, save_at: int):
        self.step, self.path, self.save_at = step, path, save_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                for p in pl_module.encoder.parameters():
                    p.fill_(float("nan"))
        if trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.path)


def test_weights_that_overflow_the_forward_pass_are_never_kept_nor_exported(tiny_dir, tmp_path):
    """Issue 46, point 9: one step at lr 1e29 leaves finite weights (about 1e29) whose embeddings are
    NaN; the step-1 validation stops the run before its checkpoints, and export refuses such a model."""
    from moco_retrieval.export.__main__ import check_finite
    from moco_retrieval.model.loading import load_encoder
    from moco_retrieval.train import train
    from moco_retrieval.training.finite_guard import NonFiniteError
    from tests.helpers import tiny_overrides, write_eval, write_jsonl

    write_jsonl(tmp_path / "train.jsonl", [{"query": f"query {i}", "positive": f"document {i}"} for i in range(32)])
    write_eval(tmp_path / "eval")
    run = ["data=jsonl", f"data.train_path={tmp_path / 'train.jsonl'}", f"data.eval_dir={tmp_path / 'eval'}",
           *tiny_overrides(tiny_dir), "objective=inbatch", "trainer=cpu", "logger=none", "data.batch_size=8",
           "optim.warmup_steps=0", "trainer.max_steps=3", "trainer.val_check_interval=1"]
    with pytest.raises(NonFiniteError, match=r"the validation embeddings were not finite .*val/anisotropy=nan.* after step 1"):
        train(compose_cfg("train", [*run, "optim.lr=1e29"], to_object=True), tmp_path / "run")
    assert not list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))

    train(compose_cfg("train", [*run, "optim.lr=1e-3", "trainer.max_steps=1"], to_object=True), tmp_path / "good")
    last = tmp_path / "good" / "checkpoints" / "last.ckpt"
    enc, _ = load_encoder(checkpoint=str(last), model=compose_cfg("export", ["out_dir=x", *tiny_overrides(tiny_dir)]).model)
    check_finite(enc, str(last))  # a sound model passes
    with torch.no_grad():
        for p in enc.parameters():
            p.mul_(1e29)
    with pytest.raises(CheckpointError, match="embeddings of a probe text are not finite"):
        check_finite(enc, str(last))


def test_a_loss_gone_nan_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(tiny_dir, tmp_path):
    from moco_retrieval.training.checkpoints import AtomicCheckpointIO
    from moco_retrieval.training.finite_guard import FiniteGuard, NonFiniteError

    folder = tmp_path / "checkpoints"
    poison = Poison(step=2, path=folder / "last.ckpt", save_at=1)
    with pytest.raises(NonFiniteError) as err:
        fit(make_module(tiny_dir), tmp_path, callbacks=[FiniteGuard(every=2, checkpoints=folder), poison], batches=8,
            plugins=[AtomicCheckpointIO()])
    msg = str(err.value)
    assert "the training loss was not finite (inf or NaN) at step 3" in msg
    assert "training stopped at step 4" in msg  # seen at the next look, step 4
    assert f"{folder / 'last.ckpt'} (step 1) is the last good checkpoint, kept" in msg
    assert read_checkpoint(folder / "last.ckpt")["global_step"] == 1


def test_non_finite_weights_are_never_written_into_a_checkpoint(tiny_dir, tmp_path):
    """Looked at every 100 steps only, the loss flag is not due; the checkpoint write looks itself."""
    from moco_retrieval.training.finite_guard import FiniteGuard, NonFiniteError

    folder = tmp_path / "checkpoints"
    poison = Poison(step=2, path=folder / "last.ckpt", save_at=2)  # saves right after poisoning
    with pytest.raises(NonFiniteError, match="the weights were not finite .inf or NaN. after step 2"):
        fit(make_module(tiny_dir), tmp_path, callbacks=[FiniteGuard(every=100, checkpoints=folder), poison], batches=8)
    assert not (folder / "last.ckpt").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device sync can only be caught on a GPU")
def test_the_guard_does_not_sync_the_device_between_its_looks(tmp_path):
    """The loss flag stays on the GPU; only the looks (every ``every`` steps) copy it to the host."""
    from types import SimpleNamespace

    from moco_retrieval.training.finite_guard import FiniteGuard, NonFiniteError

    guard = FiniteGuard(every=10, checkpoints=tmp_path)
    weight = torch.nn.Parameter(torch.ones(3, device="cuda"))
    module = SimpleNamespace(device=weight.device, parameters=lambda: [weight])
    trainer = SimpleNamespace(accumulate_grad_batches=1, is_last_batch=False, global_step=0)
    losses = [torch.tensor(float("nan") if step == 4 else 1.0, device="cuda") for step in range(11)]  # (made before)
    guard.on_train_batch_end(trainer, module, {"loss": losses[0]}, None, 0)  # step 0 is a look: its flag is made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 10):
            trainer.global_step = step
            guard.on_train_batch_end(trainer, module, {"loss": losses[step]}, None, step - 1)  # no sync: no error
        trainer.global_step = 10
        with pytest.raises(RuntimeError, match="synchroniz"):  # the look at step 10 syncs, once
            guard.on_train_batch_end(trainer, module, {"loss": losses[10]}, None, 9)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(NonFiniteError, match="at step 4"):
        guard.on_train_batch_end(trainer, module, {"loss": losses[10]}, None, 9)


@pytest.mark.skipif(not SHARED_DEBIAN.exists(), reason="needs the shared Debian snapshot")
def test_a_learning_rate_that_blows_up_ends_the_run_with_one_message_and_status_2(tmp_path, capsys, monkeypatch, one_thread):
    from moco_retrieval.train import main

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    cfg = OmegaConf.structured(compose_cfg("train", [*SMALL_RESUMABLE, "optim.lr=1e30", "optim.warmup_steps=0",
                                                     "trainer.log_every_n_steps=2", f"run_dir={tmp_path / 'run'}"],
                                           to_object=True))
    with pytest.raises(SystemExit) as stop:
        main.__wrapped__(cfg)
    assert stop.value.code == USER_ERROR_STATUS
    err = " ".join(capsys.readouterr().err.split())
    assert "train: error: the training loss was not finite (inf or NaN) at step" in err, err[-2000:]
    assert "optim.lr" in err and "Traceback" not in err
    assert not list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))  # nothing NaN was saved
    assert not (tmp_path / "run" / "metrics.json").exists()


# ---- a full disk ---------------------------------------------------------------------------------

def test_disk_full_message_names_the_checkpoints_that_are_kept(tmp_path, monkeypatch):
    last = last_and_previous(tmp_path)
    real_open = os.open
    monkeypatch.setattr(checkpoint_file.os, "open", lambda path, flags, mode=0o777: real_open("/dev/full", os.O_WRONLY))
    with pytest.raises(CheckpointError) as err:
        atomic_torch_save({"w": torch.zeros(100_000)}, last.parent / "best-6.ckpt")
    monkeypatch.undo()
    msg = str(err.value)
    assert "no earlier checkpoint" not in msg
    assert f"best-6.ckpt was not written (checkpoints in {last.parent}: last.ckpt, last.prev.ckpt)" in msg
    with pytest.raises(CheckpointError) as err:
        monkeypatch.setattr(checkpoint_file.os, "open",
                            lambda path, flags, mode=0o777: real_open("/dev/full", os.O_WRONLY))
        atomic_torch_save({"w": torch.zeros(100_000)}, tmp_path / "empty" / "best-1.ckpt")
    monkeypatch.undo()
    assert f"no checkpoint was in {tmp_path / 'empty'} before" in str(err.value)


# ---- a read-only run directory ---------------------------------------------------------------------

@pytest.fixture
def read_only(tmp_path):
    """Makes a folder read-only for this process: a read-only mount as root (root writes through
    permission bits), the permission bits otherwise. Yields the function."""
    mounted: list[Path] = []

    def make(folder: Path) -> Path:
        if os.geteuid() != 0:
            for p in [folder, *folder.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o555)
            return folder
        keep = tmp_path / "keep"
        shutil.copytree(folder, keep)
        shutil.rmtree(folder)
        folder.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], capture_output=True).returncode:
            pytest.skip("running as root without the right to mount a read-only folder")
        mounted.append(folder)
        shutil.copytree(keep, folder, dirs_exist_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=False)
    for p in tmp_path.rglob("*"):
        if p.is_dir() and not os.access(p, os.W_OK):
            p.chmod(0o755)


@pytest.mark.parametrize("resume", [False, True])
def test_a_read_only_run_dir_is_one_message_and_status_2(tmp_path, read_only, capsys, monkeypatch, resume):
    from moco_retrieval.train import main

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    run_dir = tmp_path / "run"
    if resume:
        last_and_previous(run_dir)
    run_dir.mkdir(exist_ok=True)
    read_only(run_dir)
    target = run_dir if resume else run_dir / "new"
    with pytest.raises(SystemExit) as stop:
        main.__wrapped__(OmegaConf.structured(compose_cfg("train", [*SMALL_RESUMABLE, f"run_dir={target}"],
                                                          to_object=True)))
    assert stop.value.code == USER_ERROR_STATUS
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"train: error: run_dir={target}: cannot write there (") and "Traceback" not in err
    assert "give a writable run_dir" in err


# ---- a rank killed under the others ------------------------------------------------------------------

@pytest.mark.parametrize("raw", ["[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:40123: "
                                 "Connection reset by peer",
                                 "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                                 "[127.0.0.1]:29500"])
def test_a_lost_peer_is_the_projects_message_not_glooss_error(monkeypatch, raw):
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    with pytest.raises(SystemExit) as stop:
        with distributed.exit_when_peers_stall(600, lambda: 5):
            raise torch.distributed.DistBackendError(raw)
    msg = str(stop.value.code)
    assert msg.startswith("[moco_retrieval] rank 0 of 2: lost another rank in a collective at step 5: its connection "
                          "closed (the process was killed")
    assert "Resume with ckpt_path=last once every rank runs" in msg
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is not dressed up
        with distributed.exit_when_peers_stall(600, lambda: 5):
            raise RuntimeError("a bug")
