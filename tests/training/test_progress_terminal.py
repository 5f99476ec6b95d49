"""The terminal bar (progress.ResumableBar) after a resume, and log lines beside tqdm's bars."""
from __future__ import annotations

import io
import re
import signal

import pytest
from lightning.pytorch.callbacks import Callback

from moco_retrieval.training.preemption import Preempted, PreemptionCheckpoint
from moco_retrieval.progress import log_line
from moco_retrieval.training.report import ResumableBar
from tests.helpers import SignalAt, fit, make_module


class BarProbe(Callback):
    """What the bar shows when training starts and after the first batch."""

    def __init__(self, bar):
        self.bar, self.seen = bar, []

    def _look(self):
        b = self.bar.train_progress_bar
        self.seen.append((b.n, b.total, b.initial))

    def on_train_start(self, trainer, pl_module):
        self._look()

    def on_train_batch_end(self, *args):
        if len(self.seen) == 1:
            self._look()
            self.postfix = self.bar.train_progress_bar.postfix


def test_the_bar_after_a_resume_mid_epoch_has_its_total_and_counts_only_new_batches(tiny_dir, tmp_path):
    with pytest.raises(Preempted):
        fit(make_module(tiny_dir), tmp_path, callbacks=[PreemptionCheckpoint(tmp_path / "last.ckpt"), SignalAt(signal.SIGTERM, 2)])
    bar = ResumableBar()
    probe = BarProbe(bar)
    fit(make_module(tiny_dir), tmp_path, callbacks=[bar, probe], enable_progress_bar=True,
        ckpt_path=str(tmp_path / "last.ckpt"))
    (n0, total0, initial0), (n1, total1, _) = probe.seen
    assert total0 == total1 == 6  # not "3/?"
    assert n0 == initial0 == 3 and n1 == 4  # the rate counts from the resumed batch: (n - initial) / elapsed
    assert re.search(r"eta=[\d.]+min incl\. validations", probe.postfix or ""), probe.postfix  # the run's, validations in


def test_a_log_line_is_not_glued_to_the_bar(capsys):
    from tqdm import tqdm

    out = io.StringIO()
    bar = tqdm(total=10, file=out, ascii=True)
    bar.update(3)
    log_line("validation at step 3: recall@1 0.5", file=out)
    bar.close()
    text = out.getvalue()
    line = re.search(r"(.)\d{4}-\d\d-\d\d \d\d:\d\d:\d\d validation at step 3", text, re.S)
    assert line and line.group(1) in "\r\n", repr(text)
