"""``python -m moco_retrieval.mine``: hard negatives for the training pairs (logic in mining.py).

    python -m moco_retrieval.mine output=mined.jsonl                          # Debian set, base MiniLM
    python -m moco_retrieval.mine checkpoint=RUN/checkpoints/last.ckpt output=mined.jsonl
    python -m moco_retrieval.mine model_dir=EXPORTED data=jsonl data.train_path=pairs.jsonl output=mined.jsonl \\
        n_negatives=8 range_min=0 range_max=50 relative_margin=0.05 margin=null max_score=null sampling=top

Keys: MineConfig in config.py (``conf/mine.yaml``). Writes ``output`` (training JSONL with
``negatives`` and ``positive_score``) and ``<output stem>.stats.json`` (what each filter removed).
Then train with ``data=jsonl data.train_path=OUTPUT data.eval_dir=DIR data.n_negatives=N``. An existing
``output`` is refused unless ``overwrite=true``; an input (the training pairs, ...) is refused always.
"""
from __future__ import annotations

import logging
import warnings

from omegaconf import DictConfig, OmegaConf

from moco_retrieval.command import command
from moco_retrieval.config import register_configs
from moco_retrieval.errors import ConfigError

register_configs()
logging.getLogger("faiss.loader").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")


def to_mine_config(cfg: DictConfig):
    """The composed DictConfig as a MineConfig; a missing required value is an error naming it."""
    if OmegaConf.is_missing(cfg.data, "eval_dir"):  # data=jsonl asks for it; mining reads only train_path
        cfg.data.eval_dir = None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("missing required config values: " + ", ".join(missing) + " (e.g. output=FILE)")
    return OmegaConf.to_object(cfg)


@command("mine")
def main(cfg: DictConfig) -> None:
    from moco_retrieval.mining import run_mine

    run_mine(to_mine_config(cfg))


if __name__ == "__main__":
    main()
