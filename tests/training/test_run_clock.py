"""The run's clock (run_clock.py): training and validation seconds kept apart, carried through a
checkpoint so that a resumed run counts the time before its preemption."""
from types import SimpleNamespace

import pytest
from lightning.pytorch.trainer.states import TrainerFn

from moco_retrieval.training import records as run_clock
from moco_retrieval.training.records import RunClock


@pytest.fixture()
def clock_at(monkeypatch):
    now = {"t": 1000.0}
    monkeypatch.setattr(run_clock.time, "monotonic", lambda: now["t"])

    def advance(seconds: float) -> None:
        now["t"] += seconds

    return advance


def trainer(fn=TrainerFn.FITTING, stop=False):
    return SimpleNamespace(sanity_checking=False, should_stop=stop, state=SimpleNamespace(fn=fn))


def test_validation_time_is_kept_out_of_training_time(clock_at):
    c, t = RunClock(), trainer()
    c.on_train_start(t, None)
    clock_at(30)
    c.on_validation_start(t, None)
    clock_at(7)
    c.on_validation_end(t, None)
    clock_at(5)
    c.on_train_end(t, None)
    clock_at(100)  # after fit: neither
    final = trainer(TrainerFn.VALIDATING)
    c.on_validation_start(final, None)
    clock_at(4)
    c.on_validation_end(final, None)
    clock_at(50)
    assert c.seconds() == {"time/train_s": 35.0, "time/val_s": 11.0}
    assert c.attempts == 1


def test_a_checkpoint_taken_mid_span_carries_it_and_a_resume_adds_to_it(clock_at):
    first, t = RunClock(), trainer()
    first.on_train_start(t, None)
    clock_at(40)
    state = first.state_dict()  # what PreemptionCheckpoint saves mid-training
    assert state == {"train_s": 40.0, "val_s": 0.0, "attempts": 1}
    clock_at(25)  # work after the checkpoint, lost to the preemption: not counted

    second = RunClock()
    second.load_state_dict(state)
    second.on_train_start(t, None)
    clock_at(10)
    second.on_train_end(t, None)
    assert second.seconds()["time/train_s"] == 50.0
    assert second.attempts == 2
    assert second.summary() == "training 0.8 min, validation 0.0 min, over 2 attempts"


def test_a_validation_that_ends_the_run_does_not_restart_the_training_span(clock_at):
    c = RunClock()
    c.on_train_start(trainer(), None)
    clock_at(10)
    c.on_validation_start(trainer(), None)
    clock_at(2)
    c.on_validation_end(trainer(stop=True), None)
    clock_at(60)
    assert c.seconds() == {"time/train_s": 10.0, "time/val_s": 2.0}


def test_sanity_check_validation_is_not_counted(clock_at):
    c, t = RunClock(), trainer()
    c.on_train_start(t, None)
    sanity = SimpleNamespace(sanity_checking=True, should_stop=False, state=SimpleNamespace(fn=TrainerFn.FITTING))
    c.on_validation_start(sanity, None)
    clock_at(3)
    c.on_validation_end(sanity, None)
    assert c.seconds() == {"time/train_s": 3.0, "time/val_s": 0.0}
