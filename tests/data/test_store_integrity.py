"""A converted store is trusted only as far as it is found whole (issue 46, points 5-7): a rewritten
input with its mtime restored is converted again; damaged stores (real flipped, truncated, deleted
files) are converted again with one line, or refused with one message; the cache's own failures (not
writable, a full disk, another user's fingerprint) are one message each; a killed conversion's
temporary folder is removed on the next start.

Tests run as root here and in CI, and root ignores permissions: a read-only cache and another user's
0600 file are real chmods when not root, and the failing OS calls (open, os.open, os.mkdir) raise
PermissionError for those paths when root (tests.helpers.deny)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moco_retrieval.config import DataConfig
from moco_retrieval.data import convert
from moco_retrieval.data.__main__ import main
from moco_retrieval.data.corpus_store import corpus_store
from moco_retrieval.data.formats import read_pairs_jsonl
from moco_retrieval.data.sources import prepare_store, store_root
from moco_retrieval.data.store import PairStore
from moco_retrieval.errors import USER_ERROR_STATUS
from tests.helpers import deny, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def rows(n: int, word: str = "query") -> list[dict]:
    return [{"query": f"{word} {i:03d}", "positive": f"document {i:03d}", "doc_id": f"d{i}", "group": f"g{i % 3}"}
            for i in range(n)]


@pytest.fixture
def cfg(tmp_path) -> DataConfig:
    write_jsonl(tmp_path / "train.jsonl", rows(40))
    return DataConfig(kind="jsonl", train_path=str(tmp_path / "train.jsonl"), cache_dir=str(tmp_path / "cache"))


def prepare(cfg: DataConfig, *flags: str) -> list[str]:
    return ["prepare", *flags, "data=jsonl", f"data.train_path={cfg.train_path}", f"data.cache_dir={cfg.cache_dir}"]


def stopped(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code, " ".join(capsys.readouterr().err.split())


def log_lines(err: str) -> list[str]:
    """The lines of a call's stderr, without their time stamps."""
    return [re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", "", line) for line in err.strip().splitlines()]


# ------------------------------------------------------------------------------- point 5: the key


def rewrite_keeping_mtime(path: Path, old: str, new: str) -> None:
    """``old`` -> ``new`` (the same length) in place, the mtime set back as touch -r / cp -p / rsync -t do."""
    st = path.stat()
    text = path.read_text()
    assert len(old) == len(new) and old in text
    path.write_text(text.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert path.stat().st_ino == st.st_ino


def test_a_same_size_rewrite_with_the_mtime_restored_is_converted_again(cfg, tmp_path):
    first = prepare_store(cfg)
    rewrite_keeping_mtime(Path(cfg.train_path), "query 0", "QUERY 0")
    second = prepare_store(cfg)
    assert second != first
    assert PairStore(second).column("query") == [f"QUERY {i:03d}" for i in range(40)]


def test_a_rewritten_eval_corpus_with_the_mtime_restored_gives_the_new_texts(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, [{"_id": f"d{i}", "title": "", "text": f"old text {i}"} for i in range(30)])
    assert corpus_store(path, tmp_path / "corpora").text("d7") == "old text 7"
    rewrite_keeping_mtime(path, "old", "new")
    assert corpus_store(path, tmp_path / "corpora").text("d7") == "new text 7"


# ------------------------------------------------------------------- point 6 and 7: damaged stores


def flip_doc_ids(store: Path) -> None:
    """Other ids, the same size: the bytes of the array's data (after the .npy header) changed."""
    path = store / "doc_id.npy"
    data = bytearray(path.read_bytes())
    for at in range(len(data) - 8 * 10, len(data)):
        data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def fewer_rows(store: Path) -> None:
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["rows"] = 25
    (store / "manifest.json").write_text(json.dumps(manifest))


def fewer_contents(store: Path) -> None:
    """doc_id.npy dropped from the manifest's contents (then nothing would check it)."""
    manifest = json.loads((store / "manifest.json").read_text())
    del manifest["contents"]["doc_id.npy"]
    (store / "manifest.json").write_text(json.dumps(manifest))


def truncate(name: str, keep: float):
    def damage(store: Path) -> None:
        data = (store / name).read_bytes()
        (store / name).write_bytes(data[: int(len(data) * keep)])
    return damage


def garble(store: Path) -> None:
    size = (store / "pairs.arrow").stat().st_size
    (store / "pairs.arrow").write_bytes(np.random.default_rng(0).bytes(size))


DAMAGE = {
    "wrong doc ids": (flip_doc_ids, "doc_id.npy differs from its sha256 in the manifest (changed on disk)"),
    "a manifest claiming fewer rows": (fewer_rows, "pairs.arrow holds 40 rows, the manifest says 25"),
    "pairs.arrow truncated": (truncate("pairs.arrow", 0.5), "pairs.arrow holds {size:,} bytes, the manifest says"),
    "pairs.arrow garbled": (garble, "pairs.arrow is not a readable Arrow stream"),
    "pairs.arrow empty": (truncate("pairs.arrow", 0), "pairs.arrow holds 0 bytes, the manifest says"),
    "pairs.arrow deleted": (lambda s: (s / "pairs.arrow").unlink(), "pairs.arrow is missing"),
    "doc_id.npy truncated": (truncate("doc_id.npy", 0.7), "doc_id.npy holds {size:,} bytes, the manifest says"),
    "doc_id.npy deleted": (lambda s: (s / "doc_id.npy").unlink(), "doc_id.npy is missing"),
    "a file the manifest leaves out": (lambda s: fewer_contents(s), "doc_id.npy is not in the manifest"),
    "manifest.json invalid": (lambda s: (s / "manifest.json").write_text('{"rows": 4'),
                              "manifest.json is not readable JSON (JSONDecodeError)"),
    "manifest.json deleted": (lambda s: (s / "manifest.json").unlink(), "manifest.json is missing"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_store_is_converted_again_with_one_line(cfg, capsys, case):
    """Each damage a real change to a file of the store; prepare (as training: the same ensure_store)
    says which file is wrong in one line, converts again and reports the whole store."""
    store = prepare_store(cfg)
    damage, reason = DAMAGE[case]
    damage(store)
    size = (store / "pairs.arrow").stat().st_size if (store / "pairs.arrow").exists() else 0
    size = (store / "doc_id.npy").stat().st_size if "doc_id.npy holds" in reason else size
    capsys.readouterr()
    assert main(prepare(cfg)) == 0
    out, err = capsys.readouterr()
    assert err, "nothing said about the damage"
    first = log_lines(err)[0]
    assert first.startswith(f"{store}: the store of {cfg.train_path} cannot be trusted: {reason.format(size=size)}")
    assert first.endswith("; converting it again")
    assert f"store {store}: 40 rows of {cfg.train_path}" in out
    rebuilt = PairStore(prepare_store(cfg))
    want = read_pairs_jsonl(Path(cfg.train_path))
    assert rebuilt.column("query") == [p.query for p in want]
    assert rebuilt.array("doc_id").tolist() == [p.doc_id for p in want]
    assert [p.name for p in store_root(cfg).iterdir() if p.name.startswith(".")] == []  # nothing left aside


def test_prepare_verify_finds_flipped_bytes_in_the_texts(cfg, capsys):
    """Changed texts keep every size: an open does not read the texts (cheap), --verify does and converts
    again; a whole store passes --verify as it is."""
    store = prepare_store(cfg)
    table = store / "pairs.arrow"
    data = table.read_bytes()
    flipped = data.replace(b"query 01", b"qu\xe5ry 01")  # 10 texts, a bit flipped in each
    assert len(flipped) == len(data) and flipped != data
    table.write_bytes(flipped)
    assert prepare_store(cfg) == store and "cannot be trusted" not in capsys.readouterr().err
    assert main(prepare(cfg, "--verify")) == 0
    out, err = capsys.readouterr()
    assert log_lines(err)[0] == (f"{store}: the store of {cfg.train_path} cannot be trusted: pairs.arrow differs "
                                 "from its sha256 in the manifest (changed on disk); converting it again")
    assert f"store {store}: 40 rows of {cfg.train_path}" in out and "verified: every file matches the sha256 in its manifest" in out
    assert PairStore(store).column("query") == [f"query {i:03d}" for i in range(40)]
    assert main(prepare(cfg, "--verify")) == 0
    out, err = capsys.readouterr()
    assert err == "" and "verified: every file matches the sha256 in its manifest" in out


def test_an_open_reads_the_numbers_not_the_texts(cfg, monkeypatch):
    """The check on every open stays cheap: it hashes the numeric arrays, never the text table."""
    from moco_retrieval.data import store as store_module

    prepare_store(cfg)
    hashed: list[str] = []
    real = store_module.sha256_file
    monkeypatch.setattr(store_module, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    prepare_store(cfg)
    assert sorted(hashed) == sorted(f"{k}.npy" for k in ("doc_id", "group", "n_neg", "scored", "file", "line", "offsets"))
    hashed.clear()
    prepare_store(cfg, verify=True)
    assert "pairs.arrow" in hashed


def test_a_damaged_corpus_store_is_converted_again(tmp_path, capsys):
    """The corpora of evaluate and search are stores of the same kind, opened through the same check."""
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, [{"_id": f"d{i}", "title": "", "text": f"text {i}"} for i in range(30)])
    store = corpus_store(path, tmp_path / "corpora")
    truncate("corpus.arrow", 0.5)(store.folder)
    capsys.readouterr()
    again = corpus_store(path, tmp_path / "corpora")
    assert log_lines(capsys.readouterr().err)[0].startswith(
        f"{store.folder}: the store of {path} cannot be trusted: corpus.arrow holds ")
    assert again.folder == store.folder and again.text("d29") == "text 29"


# ------------------------------------------------------------------------ point 7: the cache itself


def test_a_read_only_cache_refuses_a_conversion_in_one_message(cfg, capsys, monkeypatch):
    root = store_root(cfg)
    root.mkdir(parents=True)
    deny(monkeypatch, root)
    try:
        status, err = stopped(prepare(cfg), capsys)
    finally:
        os.chmod(root, 0o755)
    assert status == USER_ERROR_STATUS
    assert re.fullmatch(rf"data prepare: error: cannot convert {re.escape(cfg.train_path)} into {re.escape(str(root))}: "
                        rf"the cache is not writable \(Permission denied: {re.escape(str(root))}/\w+\.lock\); give the "
                        r"cache another folder \(data.cache_dir=DIR or \$MOCO_RETRIEVAL_CACHE=DIR\), or ask its owner "
                        r"to make it writable", err), err


def test_a_damaged_store_in_a_read_only_cache_is_refused_in_one_message(cfg, capsys, monkeypatch):
    store = prepare_store(cfg)
    (store / "doc_id.npy").unlink()
    root = store_root(cfg)
    capsys.readouterr()
    deny(monkeypatch, root)
    try:
        status, err = stopped(prepare(cfg), capsys)
    finally:
        os.chmod(root, 0o755)
    assert status == USER_ERROR_STATUS
    assert err.startswith(f"data prepare: error: cannot convert {cfg.train_path} into {root} again (the one there cannot "
                          "be trusted: doc_id.npy is missing): the cache is not writable (Permission denied: ")
    assert err.count("error:") == 1 and "Traceback" not in err


def test_a_read_only_cache_still_serves_the_stores_it_holds(cfg, monkeypatch):
    store = prepare_store(cfg)
    root = store_root(cfg)
    for memo in (root / "fingerprints").iterdir():
        memo.unlink()  # the fingerprint cannot be remembered now: the content is hashed again
    deny(monkeypatch, root)
    try:
        assert prepare_store(cfg) == store
    finally:
        os.chmod(root, 0o755)


def test_fingerprints_are_as_readable_as_any_file(cfg):
    """A shared cache: the fingerprints one user writes, the others read (not mkstemp's 0600)."""
    from moco_retrieval.files import ordinary_mode

    prepare_store(cfg)
    memos = list((store_root(cfg) / "fingerprints").iterdir())
    assert memos and {m.stat().st_mode & 0o777 for m in memos} == {ordinary_mode(is_dir=False)}


def test_another_users_unreadable_fingerprint_is_done_without(cfg, monkeypatch):
    """A fingerprint another user wrote 0600 (before the fix above): the content is hashed again."""
    store = prepare_store(cfg)
    for memo in (store_root(cfg) / "fingerprints").iterdir():
        os.chmod(memo, 0o600)
        deny(monkeypatch, memo, reads=True)
    try:
        assert prepare_store(cfg) == store
    finally:
        monkeypatch.undo()


def test_a_full_disk_during_conversion_is_one_message_and_leaves_nothing(cfg, capsys, monkeypatch):
    """The table's writes go to /dev/full (ENOSPC from the kernel), as docs/tools/faults.py's DISK_FULL."""
    import pyarrow as pa

    real = pa.OSFile
    monkeypatch.setattr(pa, "OSFile", lambda path, mode="r": real("/dev/full", mode) if "w" in mode else real(path, mode))
    status, err = stopped(prepare(cfg), capsys)
    root = store_root(cfg)
    assert status == USER_ERROR_STATUS
    assert re.fullmatch(rf"data prepare: error: cannot convert {re.escape(cfg.train_path)} into {re.escape(str(root))}: "
                        r"no space left on the device \([\d.]+ [KMG]?B free\); what was partly written was removed\. Free some "
                        r"space, or give the cache another folder \(data.cache_dir=DIR or \$MOCO_RETRIEVAL_CACHE=DIR\)",
                        err), err
    assert [p.name for p in root.iterdir() if p.is_dir()] == ["fingerprints"]


STALLED_CONVERSION = """
import sys, time
from moco_retrieval.config import DataConfig
from moco_retrieval.data import convert
from moco_retrieval.data.sources import prepare_store

from moco_retrieval.data import writer
writer.CHUNK = 5
real = convert.write_store

def stalled(spec, folder):
    rows = spec.rows
    def slow():
        for i, row in enumerate(rows()):
            if i == 20:
                print("converting", flush=True)
                time.sleep(600)
            yield row
    spec.rows = slow
    return real(spec, folder)

convert.write_store = stalled
prepare_store(DataConfig(kind="jsonl", train_path=sys.argv[1], cache_dir=sys.argv[2]))
"""


def test_a_sigkilled_conversion_leaves_a_folder_the_next_start_removes(cfg, capsys):
    proc = subprocess.Popen([sys.executable, "-c", STALLED_CONVERSION, cfg.train_path, cfg.cache_dir],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "converting"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    root = store_root(cfg)
    left = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(".")]
    assert len(left) == 1 and (left[0] / "pairs.arrow").stat().st_size > 0  # what the kill left
    store = prepare_store(cfg)
    err = log_lines(capsys.readouterr().err)[0]
    assert re.fullmatch(rf"removed {re.escape(str(left[0]))}, the temporary folder of an interrupted conversion "
                    r"\([\d.]+ MB\)", err), err
    assert not left[0].exists() and len(PairStore(store)) == 40
