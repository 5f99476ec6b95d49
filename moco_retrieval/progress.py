"""Progress of long loops (encoding, converting, searching): a tqdm bar on a terminal, time-stamped lines in a log file.

Lines with the time left when the output goes to a log file (Docker, SLURM, Kubernetes), where a
redrawn bar shows as one endless line. Training's own progress lines are training/report.py's."""
from __future__ import annotations

import sys
import time
from typing import Any


def stamp() -> str:
    """The local time of a log line, to the second."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


def log_line(message: str, file: Any = None) -> None:
    """``message`` as one time-stamped line (stdout unless ``file``); on a terminal, on a line of its
    own above tqdm's bars (tqdm.write clears them first, then draws them again below it)."""
    from tqdm import tqdm

    out = file or sys.stdout
    tqdm.write(f"{stamp()} {message}", file=out)
    out.flush()


class LogLineBar:
    """tqdm's ``update``/``close`` as plain time-stamped lines on stderr: one at most every
    ``interval`` seconds, and one at the end."""

    def __init__(self, total: int, desc: str, unit: str = "", interval: float = 30.0):
        self.total, self.desc, self.unit, self.interval = int(total), desc, unit, interval
        self.n, self._t0 = 0, time.monotonic()
        self._last = self._t0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval and self.n < self.total:
            self._last = now
            rate = self.n / max(now - self._t0, 1e-9)
            left = (self.total - self.n) / rate if rate > 0 else float("nan")
            log_line(f"{self.desc}: {self.n:,}/{self.total:,}{self.unit} ({100 * self.n / max(self.total, 1):.0f}%) "
                     f"{rate:.1f}/s, {left / 60:.1f} min left", file=sys.stderr)

    def close(self) -> None:
        if self.total:
            log_line(f"{self.desc}: {self.n:,}/{self.total:,}{self.unit} done in {time.monotonic() - self._t0:.1f}s",
                     file=sys.stderr)


def progress_bar(total: int, desc: str, unit: str = "") -> Any:
    """A tqdm bar on a terminal; :class:`LogLineBar` lines when stderr is a log file."""
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=False)
    return LogLineBar(total, desc, unit)
