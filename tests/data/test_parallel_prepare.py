"""A conversion over worker processes (data/parallel.py, ``prepare ... workers=N``): the store one
process writes (its rows, and every other file byte for byte), and the error one process gives,
whatever the cut."""
import json
import re
from pathlib import Path

import pytest

from moco_retrieval.config import DataConfig
from moco_retrieval.data import writer
from moco_retrieval.data.__main__ import main
from moco_retrieval.data.formats import DataError, line_spans, text_lines
from moco_retrieval.data.parallel import jsonl_split
from moco_retrieval.data.sources import prepare_store
from moco_retrieval.data.store import TABLE, PairStore
from moco_retrieval.errors import USER_ERROR_STATUS
from tests.data.test_store import rich_rows
from tests.helpers import write_parquet


def lines(rows):
    return [json.dumps(r) for r in rows]


def awkward_file(path: Path) -> Path:
    """Rich rows with CRLF line ends, blank lines, a very long line and no newline after the last."""
    rows = rich_rows(90)
    rows[40]["positive"] = "long " * 4000  # wider than a third of the file: cuts fall inside it
    text = "\ufeff" + "\r\n".join(lines(rows[:30])) + "\r\n\n  \n" + "\n".join(lines(rows[30:])) + "\n\n" + lines(rich_rows(91)[90:])[0]
    path.write_text(text, encoding="utf-8", newline="")
    return path


def store_files(folder: Path) -> dict:
    """Every file's bytes but the table's (its rows: record batches end at the parts' bounds too); the
    manifest without its timings."""
    import pyarrow as pa

    out = {p.name: p.read_bytes() for p in folder.iterdir() if p.name not in ("manifest.json", TABLE)}
    m = json.loads((folder / "manifest.json").read_text())
    rows = pa.ipc.open_stream(pa.memory_map(str(folder / TABLE))).read_all().to_pylist()
    m["contents"].pop(TABLE)  # (its bytes' sha256)
    return {**out, TABLE: rows, "manifest": {k: v for k, v in m.items() if k not in ("converted_s", "rows_per_s")}}


def converted(path: Path, tmp_path: Path, workers: int, kind: str = "jsonl", **kw) -> dict:
    key = "path" if kind == "hf" else "train_path"
    cfg = DataConfig(kind=kind, cache_dir=str(tmp_path / f"cache{workers}"), prepare_workers=workers, **{key: str(path)}, **kw)
    return store_files(prepare_store(cfg))


def conversion_error(path: Path, tmp_path: Path, workers: int) -> str:
    with pytest.raises(DataError) as e:
        prepare_store(DataConfig(kind="jsonl", train_path=str(path), cache_dir=str(tmp_path / f"bad{workers}"),
                                 prepare_workers=workers))
    assert [p.name for p in (tmp_path / f"bad{workers}" / "pairs").iterdir() if p.is_dir()] == ["fingerprints"]
    return str(e.value)


def test_spans_start_at_lines_and_number_them_as_the_file_does(tmp_path):
    path = awkward_file(tmp_path / "t.jsonl")
    whole = list(text_lines(path))
    for n in (2, 3, 7, 50):
        spans = line_spans(path, n)
        data = path.read_bytes()
        assert spans[0].start == 0 and spans[-1].stop == len(data) and 1 < len(spans) <= n
        assert all(data[s.start - 1:s.start] == b"\n" for s in spans[1:])  # every part starts a line
        assert all(s.line == data[:s.start].count(b"\n") + 1 for s in spans)
        assert [x for s in spans for x in text_lines(path, s)] == whole
    assert len(line_spans(path, 3)) == 2  # the long line holds the second cut: one part less


def test_jsonl_in_two_and_three_processes_is_the_store_of_one(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "CHUNK", 7)  # one process's record batches end elsewhere than the parts'
    path = awkward_file(tmp_path / "t.jsonl")
    one = converted(path, tmp_path, 1)
    assert one["manifest"]["rows"] == 91
    assert converted(path, tmp_path, 2) == one
    assert converted(path, tmp_path, 3) == one


def test_the_joined_table_reads_every_row_across_the_parts_bounds(tmp_path):
    path = awkward_file(tmp_path / "t.jsonl")
    stores = [PairStore(prepare_store(DataConfig(kind="jsonl", train_path=str(path), cache_dir=str(tmp_path / f"c{w}"),
                                                 prepare_workers=w))) for w in (1, 2)]
    for s in stores:
        s.open()
    assert len(stores[1].table.to_batches()) == 2  # one record batch per part: joined, not re-cut
    rows = list(range(91))
    assert stores[1].take(rows[::-1]) == stores[0].take(rows[::-1])
    assert [stores[1].where(r) for r in rows] == [stores[0].where(r) for r in rows]


def test_parquet_row_groups_and_parquet_shards_in_two_processes(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    monkeypatch.setattr(writer, "CHUNK", 5)
    rows = [{"query": f"q {i}", "positive": f"p {i % 17}", "doc_id": f"d{i % 17}", "negatives": [f"n {i}"] * (i % 3)}
            for i in range(60)]
    write_parquet(tmp_path / "one.parquet", rows)
    table = pq.read_table(tmp_path / "one.parquet")
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=13)  # 5 row groups
    assert converted(tmp_path / "t.parquet", tmp_path, 2, "parquet") == converted(tmp_path / "t.parquet", tmp_path, 1, "parquet")
    (tmp_path / "shards").mkdir()
    for k, start in enumerate(range(0, 60, 20)):
        pq.write_table(table.slice(start, 20), tmp_path / "shards" / f"part-{k}.parquet")
    one = converted(tmp_path / "shards", tmp_path / "hf", 1, "hf")
    assert len(one["manifest"]["files"]) == 3 and converted(tmp_path / "shards", tmp_path / "hf", 2, "hf") == one


def test_a_save_to_disk_folder_in_row_ranges_is_the_store_and_the_error_of_one_process(tmp_path):
    import datasets

    rows = {"anchor": [f"q {i}" for i in range(50)], "positive": [f"p {i % 13}" for i in range(50)]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "ds"))
    one = converted(tmp_path / "ds", tmp_path / "a", 1, "hf")
    assert one["manifest"]["rows"] == 50
    assert converted(tmp_path / "ds", tmp_path / "a", 3, "hf") == one
    rows["positive"][40] = " "  # row 41: in the second of two ranges
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "bad"))
    errors = []
    for workers in (1, 2):
        with pytest.raises(DataError) as e:
            prepare_store(DataConfig(kind="hf", path=str(tmp_path / "bad"), cache_dir=str(tmp_path / f"c{workers}"),
                                     prepare_workers=workers))
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"{tmp_path / 'bad'} (split 'train'): row 41, column 'positive'")


def test_a_bad_line_in_the_second_half_is_the_error_of_one_process(tmp_path):
    rows = lines(rich_rows(80))
    rows[61] = '{"query": "q", "positive": '  # line 62
    rows[70] = '{"query": "q"}'  # a later error, in the same part: the first one wins
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    one = conversion_error(path, tmp_path, 1)
    assert one.startswith(f"{path}:62: malformed JSON")
    assert conversion_error(path, tmp_path, 2) == one


def test_a_doc_id_given_two_texts_across_parts_is_the_error_of_one_process(tmp_path):
    """The id's first line is in the first part; the second part repeats it with that text, then
    with another: one process names the first line, not the second part's first."""
    rows = [{"query": f"q {i}", "positive": f"p {i}"} for i in range(60)]
    rows[1] = {"query": "a", "positive": "text one", "doc_id": "d"}
    rows[45] = {"query": "b", "positive": "text one", "doc_id": "d"}
    rows[50] = {"query": "c", "positive": "text two", "doc_id": "d"}  # line 51
    rows[55] = {"query": 7, "positive": "x"}  # a later error of the same part
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines(rows)) + "\n")
    assert 2 < jsonl_split(path, 2).parts[1].args[1].line <= 46
    one = conversion_error(path, tmp_path, 1)
    assert one == (f"{path}:51: doc_id 'd' is also on line 2 with a different 'positive' text; expected one text per "
                   "doc_id (give the two documents different ids, or leave doc_id out to derive it from the text)")
    assert conversion_error(path, tmp_path, 2) == one


def test_the_doc_id_check_over_parts_finds_what_the_stream_finds(tmp_path):
    """In process (no workers): the parts' given ids checked together, for ids repeated here and there."""
    from moco_retrieval.data.formats import iter_pairs_jsonl_located
    from moco_retrieval.data.ids import doc_id_for_text

    for seed in range(6):
        import random

        rng = random.Random(seed)
        rows = [{"query": f"q{i}", "positive": f"text {rng.randrange(3)}", "doc_id": f"d{rng.randrange(8)}"}
                if rng.random() < 0.5 else {"query": f"q{i}", "positive": f"p{i}"} for i in range(40)]
        path = tmp_path / f"t{seed}.jsonl"
        path.write_text("\n".join(lines(rows)) + "\n")
        try:
            list(iter_pairs_jsonl_located(path))
            want = None
        except DataError as e:
            want = str(e)
        split = jsonl_split(path, 3)
        given = [(p.doc_id, doc_id_for_text(p.positive), line) for part in split.parts
                 for _, line, p in part.rows(*part.args) if p.given_doc_id is not None]
        got = split.check(*zip(*given)) if given else None
        assert (None if got is None else str(got)) == want, seed


def test_workers_is_a_checked_option_of_prepare(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines(rich_rows(5))) + "\n")
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit) as stop:
            main(["prepare", "data=jsonl", f"data.train_path={path}", f"data.cache_dir={tmp_path}", f"workers={bad}"])
        err = " ".join(capsys.readouterr().err.split())
        assert stop.value.code == USER_ERROR_STATUS and err.count("error:") == 1, err
        assert re.search(rf"data\.prepare_workers={bad}\b.*1", err), err
    assert not (tmp_path / "pairs").exists()


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_ctrl_c_stops_every_worker_and_leaves_no_temporary_folder(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "t.jsonl"
    path.write_text(("\n".join(lines(rich_rows(1000))) + "\n") * 150)  # long enough to be stopped midway
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "moco_retrieval.data", "prepare", "data=jsonl", f"data.train_path={path}",
                             f"data.cache_dir={cache}", "workers=2"], cwd=Path(__file__).resolve().parents[2],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(cache.glob("pairs/.*/.part1/pairs.arrow")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = children(proc.pid)
    assert len(workers) == 2 and proc.poll() is None
    proc.send_signal(signal.SIGINT)  # to the parent alone: it stops its workers
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert [p.name for p in (cache / "pairs").iterdir()] == ["fingerprints"]
    assert not [w for w in workers if Path(f"/proc/{w}").exists()]


def test_a_file_of_blank_lines_is_the_empty_file_of_one_process(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n" * 40 + "   \n" * 40)
    one = conversion_error(path, tmp_path, 1)
    assert one == f"{path}: empty file (expected at least one line of training pairs)"
    assert conversion_error(path, tmp_path, 2) == one


def test_a_csv_file_converts_in_one_process_and_says_so(tmp_path, capsys):
    from tests.helpers import PAIR_ROWS, write_csv

    write_csv(tmp_path / "t.csv", PAIR_ROWS)
    one = converted(tmp_path / "t.csv", tmp_path, 1, "csv")
    assert "in one process" not in capsys.readouterr().err
    assert converted(tmp_path / "t.csv", tmp_path, 2, "csv") == one
    assert "converting " + str(tmp_path / "t.csv") + " in one process: only JSONL and Parquet files" in capsys.readouterr().err


def test_a_worker_imports_no_torch():
    """What a worker process imports (parallel.py and the readers of every kind it is given) leaves
    torch out: a worker starts in a fraction of the seconds torch takes."""
    import subprocess
    import sys

    probe = ("import sys, moco_retrieval.data.parallel, moco_retrieval.data.tabular, moco_retrieval.data.hf_folder; "
             "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out


def test_a_bad_row_in_a_later_row_group_is_the_error_of_one_process(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    positives = [f"p {i}" for i in range(40)]
    positives[33] = " "  # row 34, in the third row group of 13
    pq.write_table(pa.table({"query": [f"q {i}" for i in range(40)], "positive": positives}), tmp_path / "t.parquet",
                   row_group_size=13)
    errors = []
    for workers in (1, 2):
        with pytest.raises(DataError) as e:
            prepare_store(DataConfig(kind="parquet", train_path=str(tmp_path / "t.parquet"),
                                     cache_dir=str(tmp_path / f"c{workers}"), prepare_workers=workers))
        errors.append(str(e.value))
    assert errors[0] == errors[1] == (f"{tmp_path / 't.parquet'}: row 34, column 'positive': field 'positive' is empty "
                                      "(expected a non-empty string)")
