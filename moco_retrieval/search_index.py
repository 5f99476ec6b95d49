"""A search command's saved FAISS index: built once per model, corpus and index settings, saved
(``index.faiss``, ``doc_ids.json``, ``meta.json``) and loaded by later searches with the same key."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
from omegaconf import OmegaConf

from moco_retrieval.config import ModelConfig, cache_root, to_config


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
    return {"base": OmegaConf.to_container(OmegaConf.structured(to_config(ModelConfig, cfg.model)))}


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


__all__ = ["SearchIndex", "build_or_load_index", "default_index_dir", "model_identity"]
