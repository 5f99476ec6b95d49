"""Data: ids, formats (JSONL pairs, BEIR), the Debian builder, loading by kind (``sources``), the
collate, the batch sampler and the Lightning data module.

The data module (which imports Lightning) is not imported here; use
``from moco_retrieval.data.datamodule import RetrievalDataModule``.
"""
from moco_retrieval.data.formats import (
    DataError,
    EvalSet,
    Negative,
    Pair,
    beir_train_pairs,
    read_beir,
    read_beir_splits,
    read_pairs_jsonl,
    write_beir,
    write_pairs_jsonl,
)
from moco_retrieval.data.ids import NO_GROUP, doc_id_for_text, group_id, normalize_text, stable_id

__all__ = [
    "DataError",
    "EvalSet",
    "Negative",
    "Pair",
    "beir_train_pairs",
    "read_beir",
    "read_beir_splits",
    "read_pairs_jsonl",
    "write_beir",
    "write_pairs_jsonl",
    "NO_GROUP",
    "doc_id_for_text",
    "group_id",
    "normalize_text",
    "stable_id",
]
