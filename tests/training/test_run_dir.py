"""Issue 46: nothing a user made is overwritten, a resume trains on the data it trained on.

A fresh start never writes into a folder of the user's files, nor over a run (ckpt_path=last resumes
it, overwrite=true replaces it); evaluate's out_dir follows export's rule; the validation at the end
of training writes its best checkpoint; a resume refuses rows that changed under the same options
(a file rewritten in place, sources swapped, per-source options) and takes the data location from
the checkpoint where the command gives none. Real trainings of a tiny model on a few JSONL pairs.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moco_retrieval.errors import CheckpointError, OutputExistsError, USER_ERROR_STATUS
from tests.helpers import compose_cfg, tiny_overrides, write_eval, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


def pairs(path: Path, word: str, n: int = 48) -> Path:
    return write_jsonl(path, [{"query": f"{word} query {i}", "positive": f"{word} document {i}"} for i in range(n)])


def config(data: Path, tiny_dir: str, *overrides: str):
    """A tiny MoCo run on data/train.jsonl (48 pairs, batch 8: 6 steps an epoch), validated every 3 steps."""
    if not (data / "eval").exists():
        write_eval(data / "eval")
    if not (data / "train.jsonl").exists():
        pairs(data / "train.jsonl", "alpha")
    return compose_cfg("train", [*tiny_overrides(tiny_dir), "objective=moco", "objective.queue_size=32", "trainer=cpu",
                                 "logger=csv", "data=jsonl", f"data.train_path={data / 'train.jsonl'}",
                                 f"data.eval_dir={data / 'eval'}", "data.batch_size=8", "trainer.val_check_interval=3",
                                 "trainer.max_steps=4", "trainer.max_epochs=-1", *overrides], to_object=True)


def train(cfg, run_dir: Path) -> str:
    """train() in this process; what it printed on stderr."""
    from moco_retrieval.train import train as run

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        run(cfg, run_dir)
    return err.getvalue()


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


# ---- a fresh start: never into the user's files, never over a run --------------------------------------------

def test_a_fresh_start_in_a_folder_of_the_users_files_is_refused_overwrite_or_not(tmp_path, tiny_dir):
    run_dir = tmp_path / "mine"
    (run_dir / "plots").mkdir(parents=True)
    for name in ("config.yaml", "metrics.csv", "metrics.json", "plots/loss.png"):
        (run_dir / name).write_text(f"the user's {name}")
    before = contents(run_dir)
    with pytest.raises(OutputExistsError, match=r"run_dir=.*mine exists and is not empty: ckpt_path=last resumes the "
                                                r"run there, overwrite=true replaces an earlier training run"):
        train(config(tmp_path, tiny_dir), run_dir)
    with pytest.raises(OutputExistsError, match="holds files but no training run of this project, so overwrite=true "
                                                "does not touch it"):
        train(config(tmp_path, tiny_dir, "overwrite=true"), run_dir)
    assert contents(run_dir) == before


def test_a_fresh_start_over_a_run_is_refused_and_overwrite_replaces_the_whole_run(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    train(config(tmp_path, tiny_dir, "trainer.keep_best_checkpoints=5", "trainer.max_steps=5"), run_dir)
    # the validation of the last step (5, not a multiple of 3) is one of fit's: its best file is written
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} >= {"best-3.ckpt", "best-5.ckpt", "last.ckpt"}
    (run_dir / "notes.txt").write_text("the user's notes")
    before = contents(run_dir)
    with pytest.raises(OutputExistsError, match="ckpt_path=last resumes the run there, overwrite=true replaces"):
        train(config(tmp_path, tiny_dir), run_dir)  # a forgotten ckpt_path=last
    assert contents(run_dir) == before

    err = train(config(tmp_path, tiny_dir, "overwrite=true", "trainer.max_steps=2"), run_dir)
    assert "overwrite=true: removed the earlier run's checkpoints, csv, plots, metrics.csv, metrics.json, config.yaml" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best-2.ckpt", "last.ckpt", "last.prev.ckpt"]
    assert json.loads((run_dir / "metrics.json").read_text())["attempts"] == 1
    assert (run_dir / "notes.txt").read_text() == "the user's notes"  # overwrite replaces only what a run wrote


def test_a_checkpoint_of_another_run_starts_only_in_an_empty_folder(tmp_path, tiny_dir):
    train(config(tmp_path, tiny_dir, "trainer.max_steps=3"), tmp_path / "first")
    other = tmp_path / "second"
    train(config(tmp_path, tiny_dir, "trainer.max_steps=3"), other)
    elsewhere = str(tmp_path / "first" / "checkpoints" / "last.ckpt")
    with pytest.raises(OutputExistsError, match="second exists and is not empty"):
        train(config(tmp_path, tiny_dir, f"ckpt_path={elsewhere}", "trainer.max_steps=6"), other)
    own = str(other / "checkpoints" / "last.ckpt")  # this run's own checkpoint continues it
    train(config(tmp_path, tiny_dir, f"ckpt_path={own}", "trainer.max_steps=6"), other)
    assert torch.load(other / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6


# ---- a resume: the same rows, the location taken from the checkpoint ------------------------------------------

def test_a_resume_on_a_training_file_rewritten_in_place_is_refused(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    train(config(tmp_path, tiny_dir, "trainer.max_steps=3"), run_dir)
    stat = (tmp_path / "train.jsonl").stat()
    pairs(tmp_path / "train.jsonl", "omega")  # other rows, same path, same count
    with pytest.raises(CheckpointError, match=r"the training data is not the data this run trained on"):
        train(config(tmp_path, tiny_dir, "ckpt_path=last", "trainer.max_steps=6"), run_dir)
    pairs(tmp_path / "train.jsonl", "alpha")  # the rows it trained on again: resumed
    os.utime(tmp_path / "train.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    train(config(tmp_path, tiny_dir, "ckpt_path=last", "trainer.max_steps=6"), run_dir)


def test_a_resume_takes_the_data_location_from_the_checkpoint_when_not_given(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    train(config(tmp_path, tiny_dir, "trainer.max_steps=3"), run_dir)
    err = train(config(tmp_path, tiny_dir, "ckpt_path=last", "trainer.max_steps=6", "data.train_path=null"), run_dir)
    assert f"resuming with the checkpoint's data location: data.train_path={tmp_path / 'train.jsonl'}" in err
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6


def two_source_config(data: Path, tiny_dir: str, a: str, b: str, *overrides: str):
    for name, word in (("a.jsonl", "alpha"), ("b.jsonl", "beta")):
        if not (data / name).exists():
            pairs(data / name, word, 32)
    sources = (f"data.sources=[{{name: a, train_path: {data / a}}}, "
               f"{{name: b, train_path: {data / b}, prompts: {{query: 'q: ', doc: 'd: '}}}}]")
    return config(data, tiny_dir, sources, "data.train_path=null", *overrides)


@pytest.mark.parametrize("change, says", [
    (("b.jsonl", "a.jsonl"), r"trained with data.sources\[a\].train_path=.*a.jsonl, data.sources\[b\].train_path="),
    (("a.jsonl", "b.jsonl", "data.sources.0.max_train_examples=16"), r"trained with data.sources\[a\].max_train_examples=null"),
    (("a.jsonl", "b.jsonl", "data.sources.1.prompts.query='question: '"), r"trained with data.sources\[b\].prompts.query='q: '"),
], ids=["files swapped", "a source's cap", "a source's prompts"])
def test_a_resume_under_changed_sources_is_refused(tmp_path, tiny_dir, change, says):
    run_dir = tmp_path / "run"
    train(two_source_config(tmp_path, tiny_dir, "a.jsonl", "b.jsonl", "trainer.max_steps=3"), run_dir)
    with pytest.raises(CheckpointError, match=says):
        train(two_source_config(tmp_path, tiny_dir, *change, "ckpt_path=last", "trainer.max_steps=6"), run_dir)


# ---- evaluate: export's rule for out_dir ---------------------------------------------------------------------

@pytest.mark.slow  # four evaluate commands: about 40 s on a quiet machine
def test_evaluate_never_writes_over_a_users_report_and_replaces_its_own_with_overwrite(tmp_path, tiny_dir):
    write_eval(tmp_path / "beir")
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("the user's report")

    def evaluate(*extra: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("HYDRA_FULL_ERROR", None)
        return subprocess.run([sys.executable, "-m", "moco_retrieval.evaluate", *tiny_overrides(tiny_dir), "data=beir",
                               f"data.dir={tmp_path / 'beir'}", "plots=false", "progress=false", f"out_dir={out}", *extra],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)

    for extra, says in (((), "exists and is not empty: overwrite=true replaces an earlier evaluation there"),
                        (("overwrite=true",), "holds files but no evaluation of this project")):
        done = evaluate(*extra)
        assert done.returncode == USER_ERROR_STATUS and says in " ".join(done.stderr.split()), done.stderr[-2000:]
        assert [p.name for p in out.iterdir()] == ["report.md"] and (out / "report.md").read_text() == "the user's report"

    (out / "report.md").unlink()
    assert evaluate().returncode == 0 and (out / "eval.json").is_file()
    (out / "run.old.trec").write_text("an earlier evaluation's run file\n")
    assert evaluate().returncode == USER_ERROR_STATUS
    assert evaluate("overwrite=true").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "report.md", "run.trec"]


def test_a_resume_on_two_sources_whose_contents_were_swapped_is_refused(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    train(two_source_config(tmp_path, tiny_dir, "a.jsonl", "b.jsonl", "trainer.max_steps=3"), run_dir)
    a, b = (tmp_path / "a.jsonl").read_bytes(), (tmp_path / "b.jsonl").read_bytes()
    (tmp_path / "a.jsonl").write_bytes(b)
    (tmp_path / "b.jsonl").write_bytes(a)
    with pytest.raises(CheckpointError, match=r"data.sources\[a\], data.sources\[b\] is not the data this run trained on"):
        train(two_source_config(tmp_path, tiny_dir, "a.jsonl", "b.jsonl", "ckpt_path=last", "trainer.max_steps=6"), run_dir)


def test_a_start_says_how_many_hard_negatives_each_row_trains_with(tmp_path, tiny_dir):
    """Issue 46, point 15: a negatives column left out by an unset data.n_negatives is said, not silent."""
    write_jsonl(tmp_path / "train.jsonl", [{"query": f"query {i}", "positive": f"document {i}",
                                            "negatives": [f"other {i}", f"else {i}"][: 1 + i % 2]} for i in range(48)])
    err = train(config(tmp_path, tiny_dir, "trainer.max_steps=1"), tmp_path / "run")
    assert "48 of 48 training rows carry hard negatives (up to 2), not used: data.n_negatives=N trains" in err
    err = train(config(tmp_path, tiny_dir, "trainer.max_steps=1", "data.n_negatives=1"), tmp_path / "run2")
    assert "each row trains with 1 of its hard negatives (data.n_negatives)" in err and "not used" not in err
