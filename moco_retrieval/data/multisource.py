"""Several training sources in one run (``data.sources``): each read as a data config of its own
through :func:`.sources.load_training_rows` (its own converted store: same formats, same located
errors, prefixed with the source), joined in the order given as one row space
(:class:`.store.ConcatStores`) with ``source_offsets`` (source ``s`` is rows
``[offsets[s], offsets[s + 1])``) for :class:`.sampler.MultiSourceBatchSampler` and the collate. Only
the ids, groups and negative counts are in memory (numpy); texts stay in each store.

Each source has its own ``prompts`` (unset: ``data.prompts``) and ``weight`` (every source one, or
none: batches in proportion to the sources' sizes). Validation stays on the data config's own pool
(``data.eval_dir``, or the kind's), encoded with ``data.prompts``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
from omegaconf import OmegaConf


from moco_retrieval.data.formats import DataError
from moco_retrieval.data.prompts import Prompts, to_prompts
from moco_retrieval.data.sources import check_train_paths, load_training_rows, prepare_store
from moco_retrieval.data.store import ConcatStores, PairRows

# what a source sets for itself; everything else (seed, caps of the pool, cache_dir, ...) is the data config's
SOURCE_KEYS = ("kind", "train_path", "path", "split", "dir", "train_split", "columns", "views", "max_train_examples")


def has_sources(cfg: Any) -> bool:
    return bool(getattr(cfg, "sources", None))


def source_config(cfg: Any, i: int) -> Any:
    """The data config that source ``i`` is read with: ``cfg`` with the keys the source sets (an
    unset one, e.g. ``max_train_examples``, stays the data config's)."""
    src = cfg.sources[i]
    base = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    own = {k: getattr(src, k) for k in SOURCE_KEYS if getattr(src, k) is not None}
    return OmegaConf.merge(base, {**own, "sources": []})


def check_sources(cfg: Any) -> None:
    """The settings of ``data.sources`` that no reader checks: names, weights, no train_path."""
    if getattr(cfg, "train_path", None):
        raise DataError("data.train_path and data.sources are both set: give the training files in data.sources only")
    names = source_names(cfg)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DataError(f"data.sources: the name {dup[0]!r} is given to more than one source")
    weighted = [s.weight is not None for s in cfg.sources]
    if any(weighted) and not all(weighted):
        missing = [n for n, s in zip(names, cfg.sources) if s.weight is None]
        raise DataError(f"data.sources: give every source a weight or none (no weight: {', '.join(missing)})")
    if all(weighted) and sum(s.weight for s in cfg.sources) <= 0:
        raise DataError("data.sources: the weights are all 0")


def _each_source(cfg: Any, fn: Any) -> list:
    """``fn(source's data config)`` for every source, an error prefixed with the source it is about."""
    check_sources(cfg)
    out = []
    for i, name in enumerate(source_names(cfg)):
        try:
            out.append(fn(source_config(cfg, i)))
        except DataError as exc:
            raise DataError(f"data.sources[{i}] ({name}): {exc}") from None
    return out


def load_source_rows(cfg: Any) -> tuple[PairRows, np.ndarray]:
    """Every source's (capped) store rows as one row space, and the offsets ``[S + 1]``."""
    _each_source(cfg, check_train_paths)  # a missing file of the last source, before the first one converts
    joined = ConcatStores(_each_source(cfg, lambda c: load_training_rows(c).rows))
    return PairRows(joined), joined.offsets


def prepare_sources(cfg: Any, verify: bool = False) -> list[Optional[Path]]:
    """Each source's store, converted when absent or not whole (``prepare``; ``verify``: every byte
    checked); None for a ``beir`` source (read from qrels)."""
    _each_source(cfg, check_train_paths)
    return _each_source(cfg, lambda c: None if c.kind == "beir" else prepare_store(c, verify=verify))


def source_views(cfg: Any) -> list[Any]:
    """Each source's ``views`` (documents.py) when it is a source of documents, else None."""
    return [source_config(cfg, i).views if str(s.kind) == "documents" else None for i, s in enumerate(cfg.sources)]


def source_weights(cfg: Any) -> Optional[list[float]]:
    """The sources' weights, or None (by size)."""
    weights = [s.weight for s in cfg.sources]
    return None if any(w is None for w in weights) else [float(w) for w in weights]


def source_prompts(cfg: Any) -> list[Prompts]:
    """Each source's prompts: its own, else ``data.prompts``."""
    default = to_prompts(cfg.prompts)
    return [default if s.prompts is None else to_prompts(s.prompts) for s in cfg.sources]


def source_names(cfg: Any) -> list[str]:
    """Each source's name, its position when it has none."""
    return [str(i) if s.name is None else str(s.name) for i, s in enumerate(cfg.sources)]


def schedule_record(cfg: Any) -> Optional[dict]:
    """What fixes the order of the sources (with the seed): names, weights, mode; None for one source.
    Kept with the data module's position in checkpoints (:func:`check_same_schedule`)."""
    if not has_sources(cfg):
        return None
    return {"names": source_names(cfg), "weights": source_weights(cfg), "mode": str(cfg.source_mode)}


def check_same_schedule(trained: Optional[dict], now: Optional[dict]) -> None:
    """A resume under other sources, weights or mode would continue another schedule from the
    checkpoint's position (not the batches that were left): refused."""
    if trained == now:
        return
    def show(r: Optional[dict]) -> str:
        if r is None:
            return "one source (no data.sources)"
        w = "by size" if r["weights"] is None else ", ".join(f"{n}={x:g}" for n, x in zip(r["names"], r["weights"]))
        return f"data.sources {r['names']} ({w}), data.source_mode={r['mode']}"
    raise DataError(f"the checkpoint's position is in a run on {show(trained)}, but this run's config has {show(now)}; "
                    "resume with the sources it was trained on (or start a new run_dir)")


__all__ = ["SOURCE_KEYS", "check_same_schedule", "check_sources", "has_sources", "load_source_rows", "prepare_sources",
           "schedule_record",
           "source_config", "source_names", "source_prompts", "source_views", "source_weights"]
