"""Query and document prompts: a fixed prefix per side (E5's ``"query: "`` / ``"passage: "``, BGE's
instruction before queries), put before each text where a batch side is built, so every path that
embeds texts (training and validation batches: the collate; evaluate, search and mine:
``evaluation.encode.encode_texts``) sees the same text the model was trained on.

Where they come from: ``data.prompts.query`` / ``data.prompts.doc`` in training (stored in the
checkpoint's hyper-parameters as ``prompts``); the checkpoint or exported model's own prompts in the
other commands (``TextEncoder.prompts``, set by the loaders); in an exported model they are the
sentence-transformers ``prompts`` ``{"query", "document"}``, so ``encode_query`` / ``encode_document``
prepend them the same way. A per-source override (several sources) is one :class:`Prompts` per
source, chosen by the row's source.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from moco_retrieval.errors import ConfigError

KINDS = ("query", "doc")
ST_NAMES = {"query": "query", "doc": "document"}  # sentence-transformers' prompt names per side
ST_DOC_NAMES = ("document", "passage", "corpus")  # what encode_document looks for, in its order


@dataclass(frozen=True)
class Prompts:
    """The prefix of each side (empty: none)."""

    query: str = ""
    doc: str = ""

    def __post_init__(self) -> None:
        for kind in KINDS:
            if not isinstance(getattr(self, kind), str):
                raise ConfigError(f"data.prompts.{kind}: expected a string, got {getattr(self, kind)!r}")

    def for_kind(self, kind: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"kind must be 'query' or 'doc', got {kind!r}")
        return self.query if kind == "query" else self.doc

    def apply(self, texts: Sequence[str], kind: str) -> list[str]:
        """``texts`` as the model sees them on side ``kind``: the side's prefix + each text."""
        prefix = self.for_kind(kind)
        return [prefix + t for t in texts] if prefix else list(texts)

    @property
    def empty(self) -> bool:
        return not (self.query or self.doc)

    def to_dict(self) -> dict[str, str]:
        return {"query": self.query, "doc": self.doc}

    def describe(self) -> str:
        """As the overrides that set them: ``data.prompts.query='query: ' data.prompts.doc=''``."""
        return " ".join(f"data.prompts.{k}={getattr(self, k)!r}" for k in KINDS)

    # -- sentence-transformers (config_sentence_transformers.json)
    def sentence_transformers(self) -> tuple[dict[str, str], Optional[str]]:
        """``(prompts, default_prompt_name)`` of an exported model: ``encode_query`` uses "query",
        ``encode_document`` "document"; plain ``encode`` (document length) defaults to "document"."""
        prompts = {ST_NAMES[k]: getattr(self, k) for k in KINDS}
        return prompts, ("document" if self.doc else None)

    @classmethod
    def from_sentence_transformers(cls, prompts: Mapping[str, str]) -> "Prompts":
        """The query / document prompts of a sentence-transformers ``prompts`` dict."""
        doc = next((prompts[n] for n in ST_DOC_NAMES if n in prompts), "")
        return cls(query=str(prompts.get("query", "")), doc=str(doc))


NO_PROMPTS = Prompts()


def by_row(per_source: Sequence[Prompts], sources: Sequence[int]) -> list[Prompts]:
    """Each row's prompts from its source index."""
    return [per_source[int(s)] for s in sources]


def apply_by_row(prompts: Sequence[Prompts], texts: Sequence[str], kind: str) -> list[str]:
    """``texts[i]`` with ``prompts[i]``'s prefix for side ``kind`` (rows of several sources)."""
    if len(prompts) != len(texts):
        raise ValueError(f"{len(prompts)} prompts for {len(texts)} texts")
    return [p.for_kind(kind) + t for p, t in zip(prompts, texts)]


def to_prompts(value: Any) -> Prompts:
    """A :class:`Prompts` from a PromptsConfig, a DictConfig or dict of one, or None (none)."""
    if value is None:
        return NO_PROMPTS
    if isinstance(value, Prompts):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ConfigError(f"data.prompts: unknown key(s) {unknown} (expected query, doc)")
        return Prompts(**{k: value[k] for k in KINDS if k in value and value[k] is not None})
    return Prompts(query=getattr(value, "query", "") or "", doc=getattr(value, "doc", "") or "")


def model_prompts(stored: Optional[Prompts], given: Any, model: str) -> Prompts:
    """The prompts to encode with: a model's ``stored`` ones (None: it has none on record, e.g. a
    base model), else ``given`` (``data.prompts``). Given prompts that differ from stored ones are
    refused: they would silently change the embeddings of a model trained with others."""
    given_p = to_prompts(given)
    if stored is None:
        return given_p
    if not given_p.empty and given_p != stored:
        raise ConfigError(
            f"{model} was trained with {stored.describe()}, but this command has {given_p.describe()}; "
            "leave data.prompts unset to use the model's own"
        )
    return stored


__all__ = ["KINDS", "NO_PROMPTS", "Prompts", "apply_by_row", "by_row", "model_prompts", "to_prompts"]
