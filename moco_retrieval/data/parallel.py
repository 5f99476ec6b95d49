"""A conversion split over worker processes (``data.prepare_workers``; ``prepare ... workers=N``).

The input is cut into parts in file order (a spec's ``split``): one JSONL file into byte ranges
that start at a line (formats.line_spans: each part knows its first line's number), a Parquet file
by row groups, a folder of Parquet shards by shards, a ``save_to_disk`` folder by row ranges. Each part is converted by a process of its own
(``python -m moco_retrieval.data.parallel PART_FOLDER``: this module, the readers, pyarrow; no
torch) into a folder of its own; the parent then joins them in order: the numpy columns, and the
parts' Arrow streams byte for byte, each part's record batches as written (no batch is decoded
again: the join costs a file copy). Ids are hashes of texts or of the given ids (ids.py), so no part
depends on another: the store holds the rows and columns a single process converts; only the record
batches at the parts' bounds are shorter.

Errors: the first in file order wins, as in one process: the first failed part's own located
message, unless an earlier line gives a ``doc_id`` a second text (checked over the parts together:
formats.doc_id_conflict). The parts after a failed one are stopped; on any error or Ctrl-C every
worker is stopped, and the parts go with the conversion's temporary folder. One progress bar (rows,
time left) covers every worker. A CSV file converts in one process: a quoted field may hold a line
break, so a byte offset does not tell where a record starts.
"""
from __future__ import annotations

import os
import pickle
import selectors
import shutil
import subprocess
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from moco_retrieval.data.formats import DataError, Span, doc_id_conflict, iter_pairs_jsonl_located, line_spans
from moco_retrieval.data.ids import doc_id_for_text
from moco_retrieval.data.writer import Row, write_rows

TABLE = "pairs.arrow"  # a part's table (the store's is store.TABLE, given to write_parts)
GIVEN = ("given_doc", "given_text", "given_line")  # a part's rows with a given doc_id: ids, text ids, lines


@dataclass
class Part:
    """One worker's share: ``rows(*args)`` yields its rows (a module-level function: pickled by name),
    about ``count`` of them (progress)."""

    rows: Callable[..., Iterator[Row]]
    args: tuple
    count: int


@dataclass
class Split:
    """The parts of an input, in file order, and the check run over them together (JSONL's doc_ids)."""

    parts: list[Part]
    check: Optional[Callable[[np.ndarray, np.ndarray, np.ndarray], Optional[DataError]]] = None


# ------------------------------------------------------------------------------------- splits


def jsonl_rows(path: Path, span: Span) -> Iterator[Row]:
    return ((0, line, p) for line, p in iter_pairs_jsonl_located(path, span))


def jsonl_split(path: Path, n: int) -> Split:
    spans = line_spans(path, n)
    last = spans[-1]  # its lines are not counted: as many a byte as in the others (progress only)
    per_byte = (last.line - 1) / max(last.start, 1)
    counts = [b.line - a.line for a, b in zip(spans, spans[1:])] + [round((last.stop - last.start) * per_byte)]
    return Split([Part(jsonl_rows, (path, s), c) for s, c in zip(spans, counts)],
                 lambda d, t, line: doc_id_conflict(path, d, t, line, spans))


def parquet_rows(path: Path, columns: Any, groups: range) -> Iterator[Row]:
    from moco_retrieval.data.tabular import iter_pairs_parquet_located

    return ((0, row, p) for row, p in iter_pairs_parquet_located(path, columns, groups))


def parquet_split(path: Path, columns: Any, n: int) -> Split:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    return Split([Part(parquet_rows, (path, columns, g), sum(rows[i] for i in g)) for g in _blocks(rows, n)])


def shard_rows(shards: list[str], first: int, columns: Any) -> Iterator[Row]:
    from moco_retrieval.data.hf_folder import iter_table_pairs, parquet_tables

    for i, table in enumerate(parquet_tables([Path(s) for s in shards]), first):
        yield from ((i, row, p) for row, p in iter_table_pairs(table, columns))


def shards_split(tables: list[Any], columns: Any, n: int) -> Split:
    """``tables``: hf_folder's, one per Parquet shard."""
    rows = [t.rows for t in tables]
    return Split([Part(shard_rows, ([tables[i].where for i in g], g.start, columns), sum(rows[i] for i in g))
                  for g in _blocks(rows, n)])


def dataset_rows(folder: str, split: str, columns: Any, rows: range) -> Iterator[Row]:
    from moco_retrieval.data.hf_folder import hf_tables, iter_table_pairs

    return ((0, row, p) for row, p in iter_table_pairs(hf_tables(Path(folder), split)[0], columns, rows))


def dataset_split(folder: Path, split: str, columns: Any, rows: int, n: int) -> Split:
    """A save_to_disk folder of ``rows`` rows in ``n`` row ranges."""
    step = -(-rows // n)
    return Split([Part(dataset_rows, (str(folder), split, columns, range(a, min(a + step, rows))), min(step, rows - a))
                  for a in range(0, rows, step)])


def _blocks(sizes: list[int], n: int) -> list[range]:
    """At most ``n`` runs of consecutive items of about equal total size."""
    total, out, start, acc = max(sum(sizes), 1), [], 0, 0
    for i, s in enumerate(sizes):
        acc += s
        if acc * n >= total * (len(out) + 1) and i + 1 < len(sizes):
            out.append(range(start, i + 1))
            start = i + 1
    return out + [range(start, len(sizes))] if start < len(sizes) else out


def split_input(spec: Any, workers: int) -> Optional[Split]:
    """The parts ``spec`` is converted in by ``workers`` processes; None: one process (one worker, an
    input that is not cut, or one too small for two parts)."""
    if workers <= 1:
        return None
    if spec.split is None:
        from moco_retrieval.progress import log_line

        log_line(f"converting {spec.name} in one process: only JSONL and Parquet files, folders of Parquet "
                 "shards and save_to_disk folders are cut into parts for workers", file=sys.stderr)
        return None
    split = spec.split(workers)
    return split if len(split.parts) > 1 else None


# ------------------------------------------------------------------------------------- parent


def write_parts(split: Split, table: Path, bar: Any) -> dict[str, np.ndarray]:
    """Convert ``split``'s parts side by side into folders beside ``table`` (removed at the end); write
    the joined table into ``table``; the joined numpy columns. ``bar``: rows done."""
    folder = table.parent
    procs: list[subprocess.Popen] = []
    dirs = [folder / f".part{k}" for k in range(len(split.parts))]
    try:
        for d, part in zip(dirs, split.parts):
            d.mkdir()
            (d / "task.pkl").write_bytes(pickle.dumps({"rows": part.rows, "args": part.args,
                                                       "given": split.check is not None}))
            with open(d / "stderr", "wb") as err:
                procs.append(subprocess.Popen([sys.executable, "-m", __name__, str(d)], stdin=subprocess.DEVNULL,
                                              stdout=subprocess.PIPE, stderr=err, env=_worker_env()))
        _follow(procs, dirs, bar)
        failed = next((k for k, d in enumerate(dirs) if not (d / "done").is_file()), None)
        upto = dirs if failed is None else dirs[: failed + 1]
        if failed is not None and not (dirs[failed] / "failed.pkl").is_file():
            raise _failure(dirs[failed], procs[failed], failed)  # (a worker that crashed left no rows to check)
        if split.check is not None:
            given = [np.concatenate([np.load(d / f"{g}.npy") for d in upto]) for g in GIVEN]
            if (conflict := split.check(*given)) is not None:
                raise conflict
        if failed is not None:
            raise _failure(dirs[failed], procs[failed], failed)
        return _join(dirs, table)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def _worker_env() -> dict:
    """The parent's environment, with this package importable from where the parent imported it."""
    here = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=here + (os.pathsep + path if path else ""))


def _follow(procs: list[subprocess.Popen], dirs: list[Path], bar: Any) -> None:
    """Until every worker has ended: their rows into ``bar``; once a part fails, the later parts are
    stopped (the first failure in file order is what is reported)."""
    sel = selectors.DefaultSelector()
    done = [0] * len(procs)
    for k, p in enumerate(procs):
        sel.register(p.stdout, selectors.EVENT_READ, k)
    open_ = len(procs)
    while open_:
        for key, _ in sel.select():
            k = key.data
            line = key.fileobj.readline()
            if line:
                n = int(line)
                bar.update(n - done[k])
                done[k] = n
                continue
            sel.unregister(key.fileobj)
            open_ -= 1
            if procs[k].wait() != 0 or (dirs[k] / "failed.pkl").is_file():
                for later in procs[k + 1:]:
                    if later.poll() is None:
                        later.terminate()
    sel.close()


def _failure(d: Path, proc: subprocess.Popen, k: int) -> BaseException:
    """The error of a failed part: its reader's DataError or OSError as raised, else what its process wrote."""
    if (d / "failed.pkl").is_file():
        return pickle.loads((d / "failed.pkl").read_bytes())
    tail = (d / "stderr").read_text(errors="replace")[-2000:].strip()
    return RuntimeError(f"the conversion's worker {k + 1} ended with status {proc.returncode}" + (f":\n{tail}" if tail else ""))


def _join(dirs: list[Path], table: Path) -> dict[str, np.ndarray]:
    """The parts' columns joined, and their Arrow streams into ``table``: the first part's schema, every
    part's record batches as bytes, one end-of-stream marker."""
    import pyarrow as pa

    names = [p.stem for p in sorted(dirs[0].glob("*.npy")) if p.stem not in GIVEN]
    arrays = {name: np.concatenate([np.load(d / f"{name}.npy") for d in dirs]) for name in names}
    with open(table, "wb") as out:
        for k, d in enumerate(dirs):
            with pa.OSFile(str(d / TABLE)) as src:
                pa.ipc.read_message(src)  # the schema: written once, from the first part
                start = 0 if k == 0 else src.tell()
            with open(d / TABLE, "rb") as src:
                size = os.fstat(src.fileno()).st_size
                src.seek(size - len(END))
                if src.read() != END:
                    raise RuntimeError(f"the conversion's part {k + 1} did not end its Arrow stream")
                src.seek(start)
                _copy(src, out, size - len(END) - start)
        out.write(END)
    return arrays


END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # Arrow IPC's end of stream (a continuation marker, length 0)


def _copy(src: Any, out: Any, n: int, block: int = 1 << 24) -> None:
    while n > 0:
        data = src.read(min(block, n))
        if not data:
            raise RuntimeError("a conversion part ended early")
        out.write(data)
        n -= len(data)


# ------------------------------------------------------------------------------------- worker


def _work(d: Path) -> None:
    """Convert one part into ``d``: its table and columns, its rows' given doc_ids; ``done``, else
    ``failed.pkl`` (the reader's error). Prints the rows written so far after each record batch."""
    task = pickle.loads((d / "task.pkl").read_bytes())
    given = {g: array("q") for g in GIVEN}

    def rows() -> Iterator[Row]:
        for row in task["rows"](*task["args"]):
            p = row[2]
            if task["given"] and p.given_doc_id is not None:
                for g, v in zip(GIVEN, (p.doc_id, doc_id_for_text(p.positive), row[1])):
                    given[g].append(v)
            yield row

    written = 0

    def done(chunk: list) -> None:
        nonlocal written
        written += len(chunk)
        print(written, flush=True)

    try:
        arrays = write_rows(rows(), d / TABLE, done)
    except (DataError, OSError) as e:
        arrays = None
        (d / "failed.pkl").write_bytes(pickle.dumps(e))
    for g, v in given.items():
        np.save(d / f"{g}.npy", np.frombuffer(v, dtype=np.int64) if len(v) else np.zeros(0, dtype=np.int64))
    if arrays is not None:
        for name, v in arrays.items():
            np.save(d / f"{name}.npy", v)
        (d / "done").touch()


if __name__ == "__main__":
    try:
        _work(Path(sys.argv[1]))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent reports it
        sys.exit(130)


__all__ = ["Part", "Split", "jsonl_split", "parquet_split", "shards_split", "dataset_split", "split_input", "write_parts"]
