"""A teacher that scores (query, document) pairs for distillation (``mine teacher=PATH``).

``PATH`` is, in this order of detection:

* a checkpoint of ours (a file): its trained encoder; the score is the training score, the dot
  product of the embeddings (cosine for a normalising model), with the checkpoint's prompts;
* a folder written by ``moco_retrieval.export``: the same, rebuilt exactly;
* a sentence-transformers ``CrossEncoder`` folder (``model_type: CrossEncoder``, or an older one: a
  Hugging Face ``*ForSequenceClassification`` alone) with one label: ``predict`` on each (query,
  document), its raw logit, without the sigmoid ``predict`` applies by default: FlagEmbedding
  distils rerankers' logits, and a sigmoid squashes the margins MarginMSE learns;
* a sentence-transformers bi-encoder folder (``modules.json``): ``SentenceTransformer``, queries by
  ``encode_query`` and documents by ``encode_document`` (its own prompts), scored by its own
  similarity (``similarity_pairwise``: cosine unless the model says otherwise).

A bi-encoder embeds each query and each document once and scores any pair from those vectors; a
cross-encoder reads every pair (what the ``filter_scores=teacher`` candidates cost).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moco_retrieval.errors import ConfigError, ModelNotFoundError
from moco_retrieval.files import json_object


class Teacher:
    """Scores pairs ``(queries[r], documents[c])`` given as row and column indices."""

    kind: str  # "bi-encoder" | "cross-encoder"
    description: dict

    def prepare(self, queries: Sequence[str], documents: Sequence[str], batch_size: int, progress: bool) -> None:
        """Before scoring: the texts the indices refer to (a bi-encoder embeds them here)."""
        self.queries, self.documents = list(queries), list(documents)
        self.batch_size, self.progress = batch_size, progress

    def score(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class BiEncoderTeacher(Teacher):
    """A bi-encoder: ``embed(texts, "query"|"doc") -> [n, d]`` and ``pairwise(a, b) -> [n]``."""

    kind = "bi-encoder"

    def __init__(self, embed, pairwise, description: dict):
        self.embed, self.pairwise, self.description = embed, pairwise, description

    def prepare(self, queries, documents, batch_size, progress) -> None:
        super().prepare(queries, documents, batch_size, progress)
        self.q = np.asarray(self.embed(self.queries, "query", batch_size, progress), dtype=np.float32)
        self.d = np.asarray(self.embed(self.documents, "doc", batch_size, progress), dtype=np.float32)

    def score(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return np.asarray(self.pairwise(self.q[rows], self.d[cols]), dtype=np.float64)


class CrossEncoderTeacher(Teacher):
    """A cross-encoder: ``predict(list of (query, document)) -> [n]`` raw logits."""

    kind = "cross-encoder"

    def __init__(self, predict, description: dict):
        self.predict, self.description = predict, description

    def score(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        pairs = [(self.queries[int(r)], self.documents[int(c)]) for r, c in zip(rows, cols)]
        if not pairs:
            return np.zeros(0)
        return np.asarray(self.predict(pairs, self.batch_size, self.progress), dtype=np.float64).reshape(len(pairs))




def is_cross_encoder(folder: Path) -> bool:
    """sentence-transformers >= 5 records ``model_type: CrossEncoder`` (such a folder has a
    ``modules.json`` too); older CrossEncoder folders are a sequence-classification model alone."""
    model_type = json_object(folder / "config_sentence_transformers.json").get("model_type")
    if model_type:
        return model_type == "CrossEncoder"
    return not (folder / "modules.json").is_file() and any(
        str(a).endswith("ForSequenceClassification") for a in json_object(folder / "config.json").get("architectures") or [])


def _ours(encoder, description: dict) -> BiEncoderTeacher:
    import torch

    from moco_retrieval.evaluation.encode import encode_texts

    def embed(texts, kind, batch_size, progress):
        return encode_texts(encoder, texts, kind, batch_size, progress, description=f"teacher: encoding {len(texts):,} "
                                                                                  f"{'queries' if kind == 'query' else 'documents'}")

    def dot(a, b):
        return (torch.from_numpy(a).double() * torch.from_numpy(b).double()).sum(1).numpy()

    return BiEncoderTeacher(embed, dot, description)


def _sentence_transformer(folder: Path, device: str | None) -> BiEncoderTeacher:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device=device, local_files_only=True)

    def embed(texts, kind, batch_size, progress):
        encode = model.encode_query if kind == "query" else model.encode_document
        return encode(list(texts), batch_size=batch_size, show_progress_bar=progress, convert_to_numpy=True)

    def pairwise(a, b):
        return model.similarity_pairwise(a, b).double().numpy()

    similarity = getattr(model, "similarity_fn_name", None) or "cosine"
    return BiEncoderTeacher(embed, pairwise, {"source": "sentence-transformers", "path": str(folder.resolve()),
                                              "similarity": str(similarity)})


def _cross_encoder(folder: Path, device: str | None) -> CrossEncoderTeacher:
    import torch
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(folder), device=device, local_files_only=True)
    if model.num_labels != 1:
        raise ConfigError(f"teacher={folder}: a cross-encoder with {model.num_labels} labels; expected one relevance "
                          "score per pair (num_labels 1)")

    def predict(pairs, batch_size, progress):
        return model.predict(pairs, batch_size=batch_size, show_progress_bar=progress, activation_fn=torch.nn.Identity(),
                             convert_to_numpy=True)

    return CrossEncoderTeacher(predict, {"source": "cross-encoder", "path": str(folder.resolve()), "score": "logit"})


def load_teacher(path: str, model: Any = None, device: str | None = None) -> Teacher:
    """The teacher at ``path`` (see the module docstring); ``model``: the ModelConfig a plain Hugging
    Face folder of ours would be built with (as ``model_dir`` is)."""
    from moco_retrieval.model.loading import META_FILE, load_encoder

    p = Path(path).expanduser()
    if p.is_file():
        encoder, desc = load_encoder(checkpoint=str(p))
        return _ours(encoder, {**desc, "score": "dot"})
    if not p.is_dir():
        raise ModelNotFoundError(f"teacher={path}: no such file or directory (expected a checkpoint, a "
                                 "sentence-transformers folder or a CrossEncoder folder)")
    if (p / META_FILE).is_file():
        encoder, desc = load_encoder(model_dir=str(p), model=model)
        return _ours(encoder, {**desc, "score": "dot"})
    if is_cross_encoder(p):
        return _cross_encoder(p, device)
    if (p / "modules.json").is_file():
        return _sentence_transformer(p, device)
    raise ModelNotFoundError(f"teacher={path}: neither a checkpoint, a folder written by moco_retrieval.export, a "
                             "sentence-transformers folder (modules.json) nor a CrossEncoder folder")


__all__ = ["Teacher", "BiEncoderTeacher", "CrossEncoderTeacher", "is_cross_encoder", "load_teacher"]
