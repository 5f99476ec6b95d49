"""``python -m moco_retrieval.search``: semantic search over a corpus with a trained or exported model.

    python -m moco_retrieval.search checkpoint=CKPT query="resize images from the command line"
    python -m moco_retrieval.search model_dir=EXPORTED k=5 < queries.txt      # one query a line
    python -m moco_retrieval.search model_dir=EXPORTED corpus=BEIR_DIR_OR_corpus.jsonl format=json
    python -m moco_retrieval.search model_dir=EXPORTED corpus=eval query="..."   # the held-out pool only
    python -m moco_retrieval.search model_dir=EXPORTED corpus=eval eval_set=scifact   # of several data.eval_dirs: one, by name

The first call encodes the corpus, builds the FAISS index (``eval.index``: flat, ivf or hnsw) and
saves it in ``index_dir`` (default ``$MOCO_RETRIEVAL_CACHE/search/<key>``, the key hashing the
model, the corpus and the index settings); later calls with the same model and corpus load it.
``rebuild=true`` forces a new one. Queries come from ``query=...`` / ``queries=[...]``, else from
standard input (one a line; an interactive prompt on a terminal).

Before encoding a corpus it says how many documents and about how long (timed on a sample).
Default corpus: the data group's documents. Debian (default): every package description, training
and held-out ones, the package name as id: a semantic ``apt search``. ``data=beir``: ``data.dir``'s
corpus.jsonl; ``data=jsonl``: the training positives and ``data.eval_dir``'s corpus.

Keys: SearchConfig in config.py (``conf/search.yaml``).

The saved index (``SearchIndex``): built once per model, corpus and index settings, saved
(``index.faiss``, ``doc_ids.json``, ``meta.json``) and loaded by later searches with the same key.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf

from moco_retrieval.command import command
from moco_retrieval.config import (
    EVAL_CORPUS,
    EvalConfig,
    ModelConfig,
    SearchConfig,
    cache_root,
    check_eval_set,
    check_queries,
    to_config,
)
from moco_retrieval.model.loading import load_encoder


def model_identity(cfg: Any) -> dict:
    """What the index was built with, by the command's keys: a checkpoint (path, size, time), an
    exported folder (path, newest file time) or the base model's config."""
    if cfg.checkpoint:
        p = Path(cfg.checkpoint).expanduser().resolve()
        st = p.stat()
        return {"checkpoint": str(p), "size": st.st_size, "mtime": st.st_mtime_ns, "encoder": cfg.encoder}
    if cfg.model_dir:
        p = Path(cfg.model_dir).expanduser().resolve()
        stamp = max((f.stat().st_mtime_ns for f in p.rglob("*") if f.is_file()), default=0)
        return {"model_dir": str(p), "mtime": stamp}
    return {"base": OmegaConf.to_container(OmegaConf.structured(to_config(ModelConfig, cfg.model)), enum_to_str=True)}


def _corpus_digest(doc_ids: list[str], texts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for d, t in zip(doc_ids, texts):
        h.update(d.encode())
        h.update(b"\0")
        h.update(t.encode())
        h.update(b"\1")
    return h.hexdigest()


class SearchIndex:
    """A saved FAISS index with its document ids (``index.faiss``, ``doc_ids.json``, ``meta.json``)."""

    def __init__(self, index: Any, doc_ids: list[str], meta: dict):
        self.index, self.doc_ids, self.meta = index, doc_ids, meta

    def save(self, folder: Path) -> None:
        from moco_retrieval.evaluation.index import save_index

        folder.mkdir(parents=True, exist_ok=True)
        save_index(self.index, folder / "index.faiss")
        (folder / "doc_ids.json").write_text(json.dumps(self.doc_ids), encoding="utf-8")
        (folder / "meta.json").write_text(json.dumps(self.meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, folder: Path, eval_cfg: Any) -> Optional["SearchIndex"]:
        from moco_retrieval.evaluation.index import load_index

        files = [folder / n for n in ("index.faiss", "doc_ids.json", "meta.json")]
        if not all(f.is_file() for f in files):
            return None
        index = load_index(files[0], nprobe=eval_cfg.nprobe, ef_search=eval_cfg.ef_search)
        return cls(index, json.loads(files[1].read_text(encoding="utf-8")), json.loads(files[2].read_text(encoding="utf-8")))

    def search(self, query_emb: np.ndarray, k: int) -> list[list[tuple[str, float]]]:
        from moco_retrieval.evaluation.index import search

        scores, idx = search(self.index, query_emb, k)
        return [[(self.doc_ids[j], float(s)) for s, j in zip(srow, irow) if j >= 0]
                for srow, irow in zip(scores.tolist(), idx.tolist())]


def build_or_load_index(
    encoder: Any,
    corpus: Any,
    eval_cfg: Any,
    index_dir: Path,
    model_identity: dict,
    *,
    batch_size: int = 256,
    rebuild: bool = False,
    progress: bool = True,
    what: str = "the corpus",
    hint: str = "",
) -> tuple[SearchIndex, bool]:
    """The index of ``corpus`` under ``encoder``: loaded from ``index_dir`` when it was built from
    the same model, corpus and index settings, else built and saved there. ``(index, built)``.
    ``corpus``: a corpus view (data/corpus_store.py) or ``{doc id: text}``; its texts are read a
    batch at a time."""
    from itertools import chain

    from moco_retrieval.data.corpus_store import as_corpus, iter_texts
    from moco_retrieval.evaluation.encode import encode_corpus
    from moco_retrieval.evaluation.forecast import announce_corpus
    from moco_retrieval.evaluation.index import build_index_from_config

    corpus = as_corpus(corpus)
    doc_ids = list(corpus.doc_ids)
    meta = {
        "model": model_identity,
        "corpus_sha256": _corpus_digest(doc_ids, chain.from_iterable(iter_texts(corpus))),
        "documents": len(doc_ids),
        "index": {k: getattr(eval_cfg, k) for k in ("index", "nlist", "pq_m", "hnsw_m")},
    }
    if not rebuild:
        found = SearchIndex.load(index_dir, eval_cfg)
        if found is not None and {k: found.meta.get(k) for k in meta} == meta:
            return found, False
    announce_corpus(encoder, corpus, what, batch_size, hint)
    t0 = time.perf_counter()
    emb = encode_corpus(encoder, corpus, batch_size, show_progress=progress)
    meta["encode_seconds"] = round(time.perf_counter() - t0, 3)
    meta["dim"] = int(emb.shape[1])
    meta["normalize"] = bool(getattr(encoder, "normalize", True))
    idx = SearchIndex(build_index_from_config(emb, eval_cfg), doc_ids, meta)
    idx.save(index_dir)
    return idx, True


def default_index_dir(model_identity: dict, corpus_key: str, eval_cfg: Any) -> Path:
    key = hashlib.sha256(
        json.dumps({"model": model_identity, "corpus": corpus_key, "index": eval_cfg.index}, sort_keys=True).encode()
    ).hexdigest()[:16]
    return cache_root() / "search" / key



FULL_CORPUS_HINT = "corpus=eval searches only the held-out pool (faster); the index is saved, later searches load it"


def load_corpus(corpus: Optional[str], data: Any, eval_set: Optional[str] = None) -> tuple[Any, str]:
    """``(corpus view, description)`` from ``corpus`` (a file or folder, or ``eval``: the data
    group's held-out pool; of several ``data.eval_dirs``, the one named ``eval_set``) or, when None,
    every document of the data group. A corpus.jsonl (given,
    or ``data=beir``'s) is a memory-mapped store converted once per content (data/corpus_store.py);
    the others are in memory behind the same interface (``len``, ``doc_ids``, ``texts(rows)``, ``text(id)``)."""
    from moco_retrieval.data.corpus_store import as_corpus, corpus_store
    from moco_retrieval.data.formats import DataError
    from moco_retrieval.data.sources import corpus_root, load_document_corpus

    if corpus == EVAL_CORPUS:  # the held-out pool of the data group: a fraction of its documents
        from moco_retrieval.data.sources import load_eval_pool_mapped, load_eval_pools

        pool = load_eval_pools(data, mapped=True)[eval_set] if eval_set else load_eval_pool_mapped(data)
        d = pool.description
        return as_corpus(pool.eval_set.corpus), f"the held-out pool of data={d['kind']} ({d['dir']}, {d['documents']:,} documents)"
    if corpus:
        p = Path(corpus).expanduser()
        if p.is_dir():
            p = p / "corpus.jsonl"
        if not p.is_file():
            raise DataError(f"corpus={corpus}: expected a corpus.jsonl file or a BEIR folder holding one")
        return corpus_store(p, corpus_root(data)), str(p)
    return load_document_corpus(data)


def _query_stream(cfg: Any) -> Iterable[str]:
    given = ([cfg.query] if cfg.query else []) + list(cfg.queries)
    if given:
        yield from given
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("query> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def _snippet(text: str, n: int) -> str:
    t = " ".join(text.split())
    return t if len(t) <= n else t[: n - 1] + "…"


def run_search(cfg: Any, out=None) -> list[dict]:
    """Answer the configured queries; prints them and returns ``[{query, results}]``."""
    from moco_retrieval.evaluation.encode import encode_texts
    from moco_retrieval.model.devices import pick_device

    out = out or sys.stdout
    SearchConfig.check(cfg)  # (read as is, a DictConfig: the dataclass's checks by hand) k, format, ...
    check_queries(cfg)
    check_eval_set(cfg)
    eval_cfg = to_config(EvalConfig, cfg.eval)
    corpus, corpus_desc = load_corpus(cfg.corpus, cfg.data, cfg.eval_set)
    enc, desc = load_encoder(checkpoint=cfg.checkpoint, model_dir=cfg.model_dir, model=cfg.model, encoder=cfg.encoder,
                             prompts=cfg.data.prompts)
    identity = model_identity(cfg)
    if not enc.prompts.empty:  # the documents are encoded with them: another index
        identity["prompts"] = enc.prompts.to_dict()
    index_dir = Path(cfg.index_dir).expanduser() if cfg.index_dir else default_index_dir(identity, corpus_desc, eval_cfg)
    enc.to(pick_device(cfg.device))
    batch_size = int(cfg.batch_size or cfg.data.eval_batch_size)
    index, built = build_or_load_index(enc, corpus, eval_cfg, index_dir, identity, batch_size=batch_size,
                                       rebuild=bool(cfg.rebuild), progress=bool(cfg.progress), what=corpus_desc,
                                       hint="" if cfg.corpus else FULL_CORPUS_HINT)
    print(f"{'built' if built else 'loaded'} index of {len(index.doc_ids):,} documents ({corpus_desc}) "
          f"in {index_dir}", file=sys.stderr)
    answers = []
    for q in _query_stream(cfg):
        emb = encode_texts(enc, [q], "query", show_progress=False)
        hits = index.search(emb, cfg.k)[0]
        answer = {"query": q, "results": [
            {"rank": r, "doc_id": d, "score": round(s, 4), "text": corpus.text(d)} for r, (d, s) in enumerate(hits, 1)
        ]}
        answers.append(answer)
        if cfg.format == "json":
            print(json.dumps(answer, ensure_ascii=False), file=out, flush=True)
        else:
            print(f"\n{q}", file=out)
            for h in answer["results"]:
                print(f"{h['rank']:>3}. {h['score']:+.3f}  {h['doc_id']}: {_snippet(h['text'], cfg.max_chars)}", file=out)
            out.flush()
    return answers


@command("search")
def main(cfg: DictConfig) -> None:
    run_search(cfg)


if __name__ == "__main__":
    main()


__all__ = ['SearchIndex', 'build_or_load_index', 'default_index_dir', 'model_identity']
