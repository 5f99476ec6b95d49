"""The conversion lock of a shared cache (data/cache_lock.py): it holds where flock does not (NFS),
one process converts while the others wait, and a holder that is gone is taken over."""
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moco_retrieval.config import DataConfig
from moco_retrieval.data import cache_lock, convert
from moco_retrieval.data.sources import prepare_store, store_root
from tests.data.test_store_integrity import log_lines, rows
from tests.helpers import write_jsonl

ROOT = Path(__file__).resolve().parents[2]

# Two of these at once: flock fails as on a filesystem without it; each conversion is counted in a
# file and lasts until the other process has asked for the store too.
RACE = """
import fcntl, glob, os, sys, time
def no_flock(*a, **k):
    raise OSError(38, "Function not implemented")
fcntl.flock = fcntl.lockf = no_flock
from moco_retrieval.config import DataConfig
from moco_retrieval.data import cache_lock, convert
from moco_retrieval.data.sources import prepare_store
cache_lock.POLL_S = 0.1
real = convert.write_store
def counted(spec, folder):
    with open(sys.argv[3], "a") as f:
        f.write(f"{os.getpid()}\\n")
    while len(glob.glob(sys.argv[3] + ".asking.*")) < 2:  # the other process asks too
        time.sleep(0.05)
    time.sleep(1)  # and finds the lock
    return real(spec, folder)
convert.write_store = counted
open(f"{sys.argv[3]}.asking.{os.getpid()}", "w").close()
print(prepare_store(DataConfig(kind="jsonl", train_path=sys.argv[1], cache_dir=sys.argv[2])), flush=True)
"""


@pytest.fixture
def cfg(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", rows(40))
    return DataConfig(kind="jsonl", train_path=str(tmp_path / "train.jsonl"), cache_dir=str(tmp_path / "cache"))


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = convert.write_store
    monkeypatch.setattr(convert, "write_store", lambda spec, folder: calls.append(1) or real(spec, folder))
    monkeypatch.setattr(cache_lock, "POLL_S", 0.05)
    return calls


def lock_of(cfg) -> Path:
    root = store_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    key = convert.store_key(convert_spec(cfg), root / "fingerprints")
    return root / f"{key}.lock"


def convert_spec(cfg):
    from moco_retrieval.data.sources import pair_spec

    return pair_spec(cfg)


def left_by(lock: Path, **holder) -> None:
    lock.mkdir()
    (lock / "owner.json").write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "started": "then", **holder}))


def test_two_processes_without_flock_convert_once_and_open_the_same_store(cfg, tmp_path):
    count = tmp_path / "conversions"
    procs = [subprocess.Popen([sys.executable, "-c", RACE, cfg.train_path, cfg.cache_dir, str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len(count.read_text().split()) == 1  # one conversion
    assert outs[0][0] == outs[1][0] and Path(outs[0][0].strip()).is_dir()
    waited = [err for _, err in outs if "waiting for pid" in err]
    assert len(waited) == 1 and f"on host {socket.gethostname()}" in waited[0], outs
    assert not list(store_root(cfg).glob("*.lock"))  # released


def test_a_lock_left_by_a_process_that_is_gone_is_taken_over(cfg, counted, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left_by(lock_of(cfg), pid=int(dead.stdout))
    t0 = time.monotonic()
    store = prepare_store(cfg)
    assert time.monotonic() - t0 < cache_lock.STALE_S and counted == [1] and store.is_dir()
    err = log_lines(capsys.readouterr().err)
    assert any(re.fullmatch(rf"taking over the lock of .* from pid {dead.stdout.strip()} on host "
                            rf"{re.escape(socket.gethostname())} \(since then\): its process is gone", line) for line in err), err


def test_a_holder_on_another_host_is_gone_when_its_heartbeat_stops(cfg, counted, capsys, monkeypatch):
    monkeypatch.setattr(cache_lock, "STALE_S", 0.6)
    left_by(lock_of(cfg), host="elsewhere", pid=os.getpid())
    t0 = time.monotonic()
    prepare_store(cfg)
    assert time.monotonic() - t0 >= 0.6 and counted == [1]
    err = log_lines(capsys.readouterr().err)
    assert err[0].startswith("waiting for pid ") and "on host elsewhere" in err[0]
    assert any(line.endswith("its heartbeat stopped 1s ago") for line in err), err


def test_a_live_holder_makes_the_others_wait_for_its_store(cfg, counted, monkeypatch):
    """A holder on another host whose heartbeat goes on is waited for past STALE_S; the waiter opens
    what it publishes and converts nothing."""
    monkeypatch.setattr(cache_lock, "STALE_S", 0.5)
    lock = lock_of(cfg)
    left_by(lock, host="elsewhere")
    stop = threading.Event()

    def beating():
        beat = 0
        while not stop.wait(0.1):
            beat += 1
            (lock / "owner.json").write_text(json.dumps({"host": "elsewhere", "pid": 1, "beat": beat}))

    threading.Thread(target=beating, daemon=True).start()
    got = []
    waiter = threading.Thread(target=lambda: got.append(prepare_store(cfg)))
    waiter.start()
    time.sleep(2.0)  # four times STALE_S
    assert waiter.is_alive() and not got and counted == []
    stop.set()
    elsewhere = DataConfig(kind="jsonl", train_path=cfg.train_path, cache_dir=str(Path(cfg.cache_dir).parent / "other"))
    done = prepare_store(elsewhere)  # "the other node" publishes its store into the shared cache
    os.rename(done, store_root(cfg) / done.name)
    waiter.join(timeout=30)
    assert got == [store_root(cfg) / done.name] and counted == [1]  # (1: the other node's conversion)
    assert lock.is_dir()  # still the other holder's: the waiter never took it
