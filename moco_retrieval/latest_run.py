"""``ckpt_path=last`` without ``run_dir``: the newest run of the same experiment in Hydra's outputs folder.

A run started without ``run_dir`` gets a new Hydra folder at each start (``outputs/DATE/TIME``),
so "resume" has to mean "the run I started last". A run is a folder two
levels under the outputs folder holding ``checkpoints/last.ckpt`` (or its ``last.prev.ckpt``);
its experiment is the ``experiment`` choice Hydra recorded in its ``.hydra/hydra.yaml``. The newest
is the one whose checkpoint was written last.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from moco_retrieval.checkpoint_file import LAST, previous_of
from moco_retrieval.checkpointing import last_checkpoint
from moco_retrieval.errors import ConfigError

NO_EXPERIMENT = "(none)"


def experiment_of(run_dir: Path) -> Optional[str]:
    """The ``+experiment=NAME`` a Hydra run folder was started with (None: none, or not a Hydra folder)."""
    record = Path(run_dir) / ".hydra" / "hydra.yaml"
    if not record.is_file():
        return None
    try:
        choices = OmegaConf.select(OmegaConf.load(record), "hydra.runtime.choices", default=None) or {}
    except Exception:  # noqa: BLE001 - a damaged record: not a run we can match
        return None
    return choices.get("experiment")


def _checkpoint_time(run_dir: Path) -> Optional[float]:
    last = last_checkpoint(run_dir)
    times = [p.stat().st_mtime for p in (last, previous_of(last)) if p.is_file()]
    return max(times) if times else None


def latest_run(outputs: Path, experiment: Optional[str], exclude: Optional[Path] = None) -> Path:
    """The run folder under ``outputs`` (``outputs/*/*``) of ``experiment`` whose checkpoint was
    written last; a ConfigError saying where it looked when there is none."""
    outputs = Path(outputs)
    found = []
    for folder in outputs.glob("*/*") if outputs.is_dir() else []:
        if exclude is not None and folder.resolve() == Path(exclude).resolve():
            continue
        when = _checkpoint_time(folder)
        if when is not None and experiment_of(folder) == experiment:
            found.append((when, str(folder), folder))
    if not found:
        raise ConfigError(
            f"ckpt_path=last without run_dir: no run of experiment {experiment or NO_EXPERIMENT} under "
            f"{outputs.resolve()}/*/* holds checkpoints/{LAST}; give run_dir=DIR (the run directory to resume, "
            "printed at its start) or leave ckpt_path unset to start a new run")
    return max(found)[2]


__all__ = ["experiment_of", "latest_run"]
