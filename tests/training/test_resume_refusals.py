"""A resume trains on as the checkpoint trained, or is refused naming the trained values (data
order and contents, model, optimizer, seed, number of processes); config.yaml keeps what was
trained. Best checkpoints: none orphaned by a kill between a best-N write and last.ckpt, tracking
kept by a run directory that was moved or copied. Notices once."""
from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from moco_retrieval.files import atomic_torch_save, read_checkpoint
from moco_retrieval.errors import CheckpointError
from tests.helpers import SHARED_DEBIAN, SMALL_RESUMABLE, compose_cfg


def config(*overrides: str):
    """The small run's train config (8 steps, validations at steps 3 and 6), resuming from last.ckpt."""
    return compose_cfg("train", [*SMALL_RESUMABLE, *overrides], to_object=True)


def _train(run_dir: Path, *overrides: str) -> str:
    """train() in this process; what it printed on stderr."""
    from moco_retrieval.train import train

    err = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stderr(err):
            train(config(*overrides), run_dir)
    finally:
        torch.set_num_threads(threads)
    return err.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 8 steps (last.ckpt of step 8, last.prev.ckpt of step 6, one best file), and what it printed."""
    if not SHARED_DEBIAN.exists():
        pytest.skip(f"the shared Debian snapshot is not at {SHARED_DEBIAN}")
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    err = _train(run_dir)
    return run_dir, err


def test_a_fresh_start_says_no_checkpoint_once(trained):
    run_dir, err = trained
    assert err.count("ckpt_path=last: no checkpoint in") == 1, err
    assert f"{run_dir} holds no earlier attempt (if this run should resume, check run_dir)" in err


@pytest.mark.parametrize("override, trained_value", [
    ("data.batch_size=8", "data.batch_size=16"),
    ("data.max_train_examples=64", "data.max_train_examples=128"),
    ("data.seed=1", "data.seed=0"),
    ("data.shuffle=false", "data.shuffle=true"),
    ("model.pooling=cls", "model.pooling=mean"),
    ("model.doc_max_len=128", "model.doc_max_len=64"),
    ("optim.lr=0.01", "optim.lr=0.001"),
    ("seed=3", "seed=0"),
    ("trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches=1"),
])
def test_resume_that_changes_what_is_trained_is_refused_naming_the_trained_value(trained, override, trained_value):
    from moco_retrieval.train import prepare_run_dir

    run_dir, _ = trained
    with pytest.raises(CheckpointError) as err:
        prepare_run_dir(config(override), run_dir)
    msg = str(err.value)
    assert f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}: trained with {trained_value}" in msg, msg
    assert f"this run's config has {override}" in msg and "add the trained values as overrides" in msg


def test_resume_under_options_that_may_change_is_accepted(trained):
    from moco_retrieval.train import prepare_run_dir

    run_dir, _ = trained
    last = str(run_dir / "checkpoints" / "last.ckpt")
    assert prepare_run_dir(config("trainer.max_steps=9", "data.max_eval_queries=8", "data.num_workers=0",
                                  "trainer.val_check_interval=2"), run_dir) == last


def test_refused_resume_leaves_the_run_directory_as_it_was(trained):
    """config.yaml keeps the values the checkpoint trained with: a refused model.* change is not
    written into it (before, the change was ignored yet recorded as if applied)."""
    from moco_retrieval.train import train

    run_dir, _ = trained
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="trained with model.head=none"):
        train(config("model.head=linear"), run_dir)
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert OmegaConf.load(run_dir / "config.yaml").model.head == "none"


def test_resume_on_another_number_of_processes_is_refused():
    from moco_retrieval.training.resume_check import RecordTraining

    record = RecordTraining(config())
    ckpt: dict = {}
    record.on_save_checkpoint(SimpleNamespace(world_size=2), None, ckpt)
    assert ckpt["trained_with"]["world_size"] == 2 and ckpt["trained_with"]["data.batch_size"] == 16
    with pytest.raises(CheckpointError, match=r"trained by 2 process\(es\) \(devices x nodes\), this run has 1"):
        record.on_load_checkpoint(SimpleNamespace(world_size=1), None, ckpt)
    record.on_load_checkpoint(SimpleNamespace(world_size=2), None, ckpt)


def test_best_files_written_after_the_resumed_checkpoint_are_removed(tmp_path, capsys):
    """SIGKILL between a best-N write and the next last.ckpt: the resume redoes those steps, so
    their best files go (else they outlive keep_best_checkpoints, and best-N-v1.ckpt follows)."""
    from moco_retrieval.train import prepare_run_dir

    folder = tmp_path / "checkpoints"
    for name, step in [("best-3.ckpt", 3), ("last.ckpt", 4), ("best-6.ckpt", 6), ("best-6-v1.ckpt", 6)]:
        atomic_torch_save({"global_step": step}, folder / name)
    assert prepare_run_dir(config(), tmp_path) == str(folder / "last.ckpt")
    assert sorted(p.name for p in folder.iterdir()) == ["best-3.ckpt", "last.ckpt"]
    err = capsys.readouterr().err
    assert err.count("removed best-6-v1.ckpt, best-6.ckpt") == 1 and "of step 4 this run resumes from" in err


def test_a_moved_run_directory_keeps_its_best_tracking_through_lightning():
    from lightning.pytorch.callbacks import ModelCheckpoint

    from moco_retrieval.training.checkpoints import RebaseCheckpointPaths

    old = ModelCheckpoint(dirpath="/old/run/checkpoints", filename="best-{step}", monitor="val/recall@1", mode="max")
    old.best_model_score, old.best_model_path = torch.tensor(0.297), "/old/run/checkpoints/best-4.ckpt"
    old.best_k_models = {old.best_model_path: old.best_model_score}
    old.kth_best_model_path, old.kth_value = old.best_model_path, old.best_model_score
    ckpt = {"callbacks": {old.state_key: old.state_dict()}}
    RebaseCheckpointPaths("/new/place/checkpoints").on_load_checkpoint(None, None, ckpt)
    new = ModelCheckpoint(dirpath="/new/place/checkpoints", filename="best-{step}", monitor="val/recall@1", mode="max")
    new.load_state_dict(ckpt["callbacks"][new.state_key])
    assert float(new.best_model_score) == pytest.approx(0.297)
    assert new.best_model_path == "/new/place/checkpoints/best-4.ckpt"
    assert list(new.best_k_models) == ["/new/place/checkpoints/best-4.ckpt"]


def _best_state(ckpt: dict) -> dict:
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint{'monitor': 'val/recall@1'")]
    return state


def test_a_copied_run_resumes_with_its_best_tracking_and_no_orphan_best_file(trained, tmp_path):
    """The run copied elsewhere and resumed from its step-6 checkpoint (as after a kill between the
    step-8 writes), with a best-8.ckpt beside it: the resumed copy ends with keep_best_checkpoints
    (1) best file, the best score of all its validations, and its paths in the copy."""
    run_dir, _ = trained
    # the same run to step 6: its last.prev.ckpt is the step-6 validation's, mid-epoch (the 8-step
    # run's two last files are both of step 8: its end validates inside fit)
    six = tmp_path / "six"
    _train(six, "trainer.max_steps=6")
    copy = tmp_path / "copy"
    shutil.copytree(six, copy)
    folder = copy / "checkpoints"
    shutil.copy(run_dir / "checkpoints" / "last.ckpt", folder / "best-8.ckpt")
    (folder / "last.prev.ckpt").replace(folder / "last.ckpt")
    original = {p: p.read_bytes() for p in six.rglob("*") if p.is_file()}
    start = _best_state(read_checkpoint(folder / "last.ckpt"))
    assert Path(start["dirpath"]) == (six / "checkpoints").resolve()
    err = _train(copy)
    assert "removed best-8.ckpt" in err and "of step 6 this run resumes from" in err
    bests = sorted(p.name for p in folder.glob("best-*"))
    assert len(bests) == 1, bests
    final = read_checkpoint(folder / "last.ckpt")
    assert final["global_step"] == 8
    after = _best_state(final)
    assert Path(after["dirpath"]) == folder.resolve() and Path(after["best_model_path"]) == folder.resolve() / bests[0]
    assert float(after["best_model_score"]) >= float(start["best_model_score"])
    assert after["best_model_score"] == _best_state(read_checkpoint(run_dir / "checkpoints" / "last.ckpt"))["best_model_score"]
    # the original run is untouched (the copy's paths now point into the copy)
    assert {p: p.read_bytes() for p in six.rglob("*") if p.is_file()} == original
