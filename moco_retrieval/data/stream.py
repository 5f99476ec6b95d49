"""Streaming (``data.stream=true``): the training rows as litdata chunks in ``data.stream_dir``, a local
folder or an object-store URL (``s3://``, ``gs://``, ``r2://``) that litdata reads and writes.

Preparing converts each source into its store first (convert.py: ids and groups assigned, caps
applied, rows checked), then ``litdata.optimize`` writes the kept rows into ``DIR/<source>/``
(``data`` for one source) with ``workers`` processes. Each item is one row: its index in the
source's kept rows and the pair as JSON, ids and groups included (litdata needs one item layout, and
the number of hard negatives varies). ``DIR/moco_stream.json`` (written last) records what the
chunks hold: each source's store key and cap (what this data config makes: :func:`expected`),
rows, and the counts that the run's checks need without reading the rows (rows without hard
negatives, rows without teacher scores, the first of each by its file and line).

Training (:func:`open_stream`) compares the manifest with this config: chunks of other data are
refused, naming the folder; missing ones (or an interrupted preparation's) are prepared first,
under a lock, as the store is converted (the lock is the node's: prepare ahead of a job of several
nodes). The key needs the input files (their content hashes, remembered as the store's are); where
they are missing (a node that only streams), finished chunks are trained on as they are, with a
line saying so. The chunk files listed in litdata's ``index.json`` are
checked for presence and size before the model loads (an ``s3://`` store's by one listing, also
right after writing: litdata only logs a failed upload). The batches: stream_batches.py.

Object stores. An ``s3://`` URL is reached as boto3 reaches it: the standard AWS variables
(``AWS_ENDPOINT_URL`` for MinIO, Ceph or moto, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_CA_BUNDLE``) or ``~/.aws/config``; litdata builds its boto3 client with
``session.client("s3")`` (litdata/streaming/client.py, ``S3Client._create_client``), and its obstore
path copies that client's endpoint and credentials (streaming/downloader.py,
``_build_obstore_s3_store``). obstore refuses a plain ``http://`` endpoint (litdata passes it no
``allow_http``): :func:`check_store` says so before anything is written or read.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from moco_retrieval.progress import log_line

from moco_retrieval.data.cache_lock import cache_lock
from moco_retrieval.data.convert import store_key
from moco_retrieval.data.formats import DataError, Negative, Pair
from moco_retrieval.data.multisource import has_sources, source_config, source_names
from moco_retrieval.data.sources import (check_train_paths, debian_folder, load_training_rows, pair_spec,
                                         store_root)

STREAM_VERSION = 1
MANIFEST = "moco_stream.json"
INDEX = "index.json"  # litdata's list of a dataset's chunks
CHUNK_BYTES = "64MB"  # litdata's advice for object stores; tests write smaller chunks
SPAN = 1024  # rows a preparation worker reads from the store at once
# an s3:// store's requests: litdata's own client retries 1000 times, which keeps a run whose store
# stopped silent for minutes; these fail it in seconds, with a message
S3_ATTEMPTS = 3
S3_CONNECT_S = 5


def litdata() -> Any:
    """The litdata module, or the one message that says how to install it."""
    try:
        import litdata as ld
    except ImportError as e:
        raise DataError(f"data.stream=true streams with litdata, which is not installed ({e}): "
                        "pip install --no-deps -r requirements-nodeps.txt in the repository (its declared "
                        "dependencies would replace torch; what it imports comes with moco-retrieval[stream])") from None
    return ld


def is_url(where: str) -> bool:
    return "://" in str(where)


def join(where: str, *parts: str) -> str:
    """``where``/``parts``, a URL's way or a path's."""
    if is_url(where):
        return "/".join([str(where).rstrip("/"), *parts])
    return str(Path(where).expanduser().joinpath(*parts))


def stream_names(cfg: Any) -> list[str]:
    """The sub-folder of each source ("data": one source)."""
    return source_names(cfg) if has_sources(cfg) else ["data"]


def _source_configs(cfg: Any) -> list[Any]:
    return [source_config(cfg, i) for i in range(len(cfg.sources))] if has_sources(cfg) else [cfg]


def _each(cfg: Any, fn: Any) -> list:
    """``fn(source's data config)`` for every source, an error prefixed with the source it is about."""
    return [_each_one(cfg, i, lambda: fn(c)) for i, c in enumerate(_source_configs(cfg))]


def _each_one(cfg: Any, i: int, fn: Any) -> Any:
    try:
        return fn()
    except DataError as exc:
        if not has_sources(cfg):
            raise
        raise DataError(f"data.sources[{i}] ({stream_names(cfg)[i]}): {exc}") from None


def _source_key(c: Any) -> dict:
    """What one source's chunks hold: its store (the input's content and how it is read) and cap."""
    check_train_paths(c)
    folder = debian_folder(c) if str(c.kind) == "debian" else None
    key = store_key(pair_spec(c, folder), store_root(c) / "fingerprints")
    cap = c.max_train_examples
    return {"store": key, "max_train_examples": cap, "seed": c.seed if cap else None}


def expected(cfg: Any) -> dict:
    """The key of the chunks this data config trains on, and each source's part of it."""
    parts = dict(zip(stream_names(cfg), _each(cfg, _source_key)))
    return {"version": STREAM_VERSION, "key": hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32],
            "sources": parts}


# ----------------------------------------------------------------------------------- the manifest


def storage_options(where: str) -> dict:
    """litdata's ``storage_options`` for ``where``: an ``s3://`` client's retries and connect timeout."""
    if not str(where).startswith("s3://"):
        return {}
    from botocore.config import Config

    return {"config": Config(retries={"max_attempts": S3_ATTEMPTS, "mode": "standard"}, connect_timeout=S3_CONNECT_S)}


def brief(e: BaseException) -> str:
    """An exception in one line (obstore's run to dozens of lines of debug structure)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _fs(where: str) -> Any:
    from litdata.streaming.fs_provider import _get_fs_provider

    return _get_fs_provider(where, storage_options(where))


def check_store(where: str) -> None:
    """DataError when litdata cannot use ``where``'s endpoint: a plain ``http://`` one while obstore is
    installed (litdata writes and reads chunks through obstore, which it gives no ``allow_http``)."""
    if not str(where).startswith("s3://"):
        return
    from litdata.constants import _OBSTORE_AVAILABLE

    endpoint = _fs(where).client.client.meta.endpoint_url or ""
    if endpoint.startswith("http://") and bool(_OBSTORE_AVAILABLE):
        raise DataError(f"data.stream_dir={where}: its endpoint {endpoint} (AWS_ENDPOINT_URL or ~/.aws/config) is "
                        "plain http, which litdata's obstore client refuses: serve it over https (a private CA: "
                        "AWS_CA_BUNDLE and SSL_CERT_FILE name its certificate), or pip uninstall obstore (litdata "
                        "then uses boto3 alone)")


def read_manifest(where: str) -> Optional[dict]:
    """``where``'s manifest (None: there is none); unreadable: DataError naming it."""
    path = join(where, MANIFEST)
    try:
        if is_url(where):
            litdata()
            check_store(where)
            try:
                text = _remote_text(path)
            except FileNotFoundError:
                return None
        else:
            if not Path(path).is_file():
                return None
            text = Path(path).read_text()
        manifest = json.loads(text)
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read the stream's manifest ({brief(e)})") from None
    except Exception as e:  # an object store's client errors (no credentials, no such bucket, no connection)
        raise DataError(f"{path}: cannot reach the stream's manifest ({brief(e)})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("sources"), dict):
        raise DataError(f"{path}: not a stream manifest of moco_retrieval (no 'sources')")
    return manifest


def _write_manifest(where: str, manifest: dict) -> None:
    text = json.dumps(manifest, indent=2)
    if is_url(where):
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, MANIFEST).write_text(text)
            _fs(where).upload_file(os.path.join(tmp, MANIFEST), join(where, MANIFEST))
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    tmp = Path(where) / f".{MANIFEST}.tmp"
    tmp.write_text(text)
    os.replace(tmp, Path(where) / MANIFEST)


def _clear(where: str, names: list[str]) -> None:
    """Remove the source folders of an interrupted preparation (ours: its manifest says so)."""
    for name in names:
        if is_url(where):
            if _fs(where).exists(join(where, name)):
                _fs(where).delete_file_or_directory(join(where, name))
        else:
            shutil.rmtree(join(where, name), ignore_errors=True)


def _stale(where: str, manifest: dict, want: dict) -> DataError:
    def show(m: dict) -> str:
        return ", ".join(f"{n}: store {str(p.get('store'))[:12]}" + (f" capped at {p['max_train_examples']}"
                                                                      if p.get("max_train_examples") else "")
                         for n, p in m["sources"].items())

    return DataError(f"data.stream_dir={where} holds the chunks of other training data ({show(manifest)}), "
                     f"not this config's ({show(want)}): give another data.stream_dir, or remove that one to "
                     "prepare it again")


# ---------------------------------------------------------------------------------------- writing


def pair_json(p: Pair) -> str:
    return json.dumps({"query": p.query, "positive": p.positive, "doc_id": p.doc_id, "group": p.group,
                       "query_id": p.query_id, "positive_score": p.positive_score,
                       "negatives": [[n.doc_id, n.text, n.score, n.group] for n in p.negatives]})


def json_pair(text: str) -> Pair:
    r = json.loads(text)
    return Pair(query=r["query"], positive=r["positive"], doc_id=r["doc_id"], group=r["group"], query_id=r["query_id"],
                positive_score=r["positive_score"],
                negatives=[Negative(doc_id=d, text=t, score=s, group=g) for d, t, s, g in r["negatives"]])


class RowItems:
    """``optimize``'s function: the items of rows ``[a, b)`` of a source's kept rows (picklable: a
    store travels to litdata's worker processes as its folder)."""

    def __init__(self, rows: Any):
        self.rows = rows

    def __call__(self, span: tuple[int, int]):
        a, b = span
        for i, pair in zip(range(a, b), self.rows.take(range(a, b))):
            yield {"index": i, "pair": pair_json(pair)}


def _counts(rows: Any) -> dict:
    """What the run's checks read from the manifest: rows without hard negatives, rows without
    teacher scores, and where the first of each is."""
    import numpy as np

    out: dict = {"rows": len(rows), "max_negatives": int(rows.negative_counts.max()) if len(rows) else 0}
    for name, missing in (("without_negatives", rows.negative_counts == 0),
                          ("unscored", ~np.asarray(rows.scored, dtype=bool))):
        at = np.flatnonzero(missing)
        out[name] = int(len(at))
        out[f"first_{name}"] = None if not len(at) else {"index": int(at[0]), "where": rows.where(int(at[0])),
                                                          "query": rows.take([int(at[0])])[0].query[:60]}
    return out


def prepare_stream(cfg: Any, workers: int = 1) -> dict:
    """Write the chunks of ``cfg``'s training rows into ``cfg.stream_dir`` (kept when already there);
    the manifest. Chunks of other data there are refused (never overwritten)."""
    where = str(cfg.stream_dir)
    want = expected(cfg)
    with _lock(cfg):
        found = read_manifest(where)
        if found is not None and found.get("key") == want["key"] and found.get("complete"):
            return found
        if found is not None and found.get("key") != want["key"]:
            raise _stale(where, found, want)
        if found is None and _holds_files(where):
            raise DataError(f"data.stream_dir={where} holds files but no {MANIFEST}: not chunks that "
                            "`prepare data.stream=true` wrote; give an empty or a new folder")
        ld = litdata()
        names = stream_names(cfg)
        _write_manifest(where, {**want, "complete": False})  # claims the folder: a stop from here on is ours to redo
        _clear(where, names)
        t0, sources = time.monotonic(), {}
        for i, (name, c) in enumerate(zip(names, _source_configs(cfg))):
            rows = _each_one(cfg, i, lambda: load_training_rows(c).rows)
            spans = [(a, min(a + SPAN, len(rows))) for a in range(0, len(rows), SPAN)]
            log_line(f"writing the chunks of {name}: {len(rows):,} rows into {join(where, name)} "
                     f"({workers} worker{'s' if workers != 1 else ''})", file=sys.stderr)
            try:
                ld.optimize(fn=RowItems(rows), inputs=spans, output_dir=join(where, name), num_workers=max(1, workers),
                            chunk_bytes=CHUNK_BYTES, mode=None, start_method="fork",
                            storage_options=storage_options(where))
            except Exception as e:  # a full disk, an object store gone
                raise DataError(f"cannot write the chunks of {name} into {join(where, name)} ({brief(e)})") from None
            check_chunks(join(where, name))
            sources[name] = {**want["sources"][name], **_counts(rows)}
        manifest = {**want, "sources": sources, "rows": sum(s["rows"] for s in sources.values()),
                    "workers": workers, "prepared_s": round(time.monotonic() - t0, 3), "complete": True}
        _write_manifest(where, manifest)
    log_line(f"prepared {manifest['rows']:,} rows as chunks in {where} in {manifest['prepared_s']:.1f}s", file=sys.stderr)
    return manifest


def _holds_files(where: str) -> bool:
    if is_url(where):
        return not _fs(where).is_empty(where) if _fs(where).exists(where) else False
    p = Path(where).expanduser()
    return p.is_dir() and any(p.iterdir())


def _lock(cfg: Any):
    """One preparation of a stream folder at a time, by the store's lock (cache_lock.py: it holds on a
    shared file system too, so every node sharing the cache waits for one preparation)."""
    root = store_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(str(cfg.stream_dir).encode()).hexdigest()[:16]
    # (ready never: a waiter takes the lock in turn and finds the finished chunks' manifest)
    return cache_lock(root / f"stream-{name}.lock", f"the chunks in {cfg.stream_dir}", lambda: False)


# ---------------------------------------------------------------------------------------- reading


def open_stream(cfg: Any) -> dict:
    """The manifest of ``cfg.stream_dir`` once it holds this config's chunks: prepared first when it
    holds none (or an interrupted preparation), refused when it holds other data; each source's
    chunk files checked against litdata's index (present, of their size)."""
    where = str(cfg.stream_dir)
    litdata()  # not installed: said now, before the model loads
    found = read_manifest(where)
    try:
        want = expected(cfg)
    except DataError as e:  # the input files are not here (a node that only streams): the chunks as prepared
        if found is None or not found.get("complete"):
            raise
        log_line(f"{e}; training on the chunks in data.stream_dir={where} as they were prepared "
                 f"({found['rows']:,} rows; sources {', '.join(found['sources'])}), unchecked against the input",
                 file=sys.stderr)
        want = found
    if found is not None and found.get("key") != want["key"]:
        raise _stale(where, found, want)
    if found is None or not found.get("complete"):
        log_line(f"data.stream_dir={where} holds no finished chunks of this data: preparing them", file=sys.stderr)
        found = prepare_stream(cfg, workers=max(1, int(cfg.num_workers)))
    for name in stream_names(cfg):
        check_chunks(join(where, name))
    return found


def check_chunks(where: str) -> None:
    """DataError naming the first chunk of ``where`` that its ``index.json`` lists and that is missing
    or of another size (a local folder, or an ``s3://`` store by one listing; gs:// and r2:// ones
    are found as they are read)."""
    index = join(where, INDEX)
    if is_url(where) and not where.startswith("s3://"):
        return
    try:
        sizes = _s3_sizes(where) if is_url(where) else None
        chunks = json.loads(_remote_text(index) if is_url(where) else Path(index).read_text())["chunks"]
    except FileNotFoundError:
        raise DataError(f"{index} is missing: the chunks of {where} cannot be read; prepare them again "
                        "(remove the folder, then `python -m moco_retrieval.data prepare data.stream=true ...`)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{index}: not a litdata index ({brief(e)})") from None
    except Exception as e:  # an object store out of reach
        raise DataError(f"{where}: cannot list the stream's chunks ({brief(e)})") from None
    for c in chunks:
        path = join(where, c["filename"])
        size = sizes.get(path) if sizes is not None else (Path(path).stat().st_size if Path(path).is_file() else None)
        if size is None:
            raise DataError(f"{path}: a chunk of the stream is missing; prepare the stream again "
                            "(remove the folder, then prepare)")
        if c.get("chunk_bytes") is not None and size != c["chunk_bytes"]:
            raise DataError(f"{path}: a chunk of the stream holds {size:,} bytes, its index says "
                            f"{c['chunk_bytes']:,} (truncated or changed); prepare the stream again")


def _s3_sizes(where: str) -> dict[str, int]:
    """Each object's size under the ``s3://`` folder ``where``, by URL."""
    bucket, _, prefix = where[len("s3://"):].partition("/")
    pages = _fs(where).client.client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                               Prefix=prefix.rstrip("/") + "/")
    return {f"s3://{bucket}/{o['Key']}": o["Size"] for page in pages for o in page.get("Contents", [])}


def _remote_text(url: str) -> str:
    """The text of the object at ``url``."""
    if not _fs(url).exists(url):
        raise FileNotFoundError(url)
    with tempfile.TemporaryDirectory() as tmp:
        _fs(url).download_file(url, os.path.join(tmp, "object"))
        return Path(tmp, "object").read_text()


__all__ = ["STREAM_VERSION", "MANIFEST", "CHUNK_BYTES", "litdata", "is_url", "join", "storage_options", "brief",
           "check_store", "stream_names", "expected", "read_manifest", "pair_json", "json_pair", "RowItems",
           "prepare_stream", "open_stream", "check_chunks"]
