"""The mined rows as training JSONL, and where their statistics go.

The output is the training JSONL of :mod:`moco_retrieval.data.formats` (read by
``read_pairs_jsonl``; train with ``data=jsonl data.train_path=OUT data.n_negatives=N``): each row
keeps its query, positive, ids and group, gains ``positive_score`` and ``negatives`` (``doc_id``,
``text``, ``score``, ``group`` when known, and ``rank``), replacing any negatives it had; ids and
groups are written as the data gave them (a string ``"d9"`` stays ``"d9"``). The statistics go to
``<output stem>.stats.json``.
"""
from __future__ import annotations

from pathlib import Path

from moco_retrieval.data.formats import pair_to_json, write_jsonl
from moco_retrieval.mining.miner import MiningResult


def write_mined(path: str | Path, result: MiningResult) -> int:
    """The training JSONL (see the module docstring); returns the number of rows."""
    def records():
        for pair, ranks in zip(result.pairs, result.ranks):
            obj = pair_to_json(pair)
            for neg, r in zip(obj.get("negatives", []), ranks):
                neg["rank"] = r
            yield obj

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_jsonl(path, records())


def stats_path_for(output: str | Path) -> Path:
    p = Path(output)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + ".stats.json")


__all__ = ["stats_path_for", "write_mined"]
