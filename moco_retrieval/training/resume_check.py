"""A resume trains on exactly as the checkpoint trained, or is refused before any model loads.

A checkpoint resumes the model, the optimizer and the position in the data (the batches of the
epoch already done). Options that change what is trained or the order the data comes in cannot
be honoured from the middle of a run: another ``data.batch_size`` or ``data.max_train_examples``
misreads the saved position, another ``data.seed`` draws another order, ``model.*`` would build
another model around the saved weights (or be ignored), ``optim.*`` another optimizer; another
objective or its options another loss, other ``data.prompts`` other texts (each objective holds its own state: queues, EMA keys).
:func:`check_resumable` compares this run's config with what the checkpoint was trained with and
names, in one message, the overrides that resume it as trained.

What the checkpoint was trained with: the module's hyperparameters (``model``, ``objective``,
``optim``, ``seed``) and, written by :class:`RecordTraining` into every checkpoint, the data and
trainer options below and the number of processes. A checkpoint from before a record existed is
checked on what it has. Options left out may change between attempts: logging, validation and the
pool, cache folders, ``model.path`` (where the same backbone sits), memory knobs
(``model.grad_cache_chunk``, ``data.num_workers``), ``trainer.max_steps`` (to extend a run).
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from moco_retrieval.data.prompts import to_prompts
from moco_retrieval.errors import CheckpointError

TRAINED_WITH = "trained_with"  # the checkpoint key RecordTraining writes
DATA_OPTIONS = ("kind", "train_path", "path", "split", "dir", "train_split", "debian_dir", "columns", "views", "batch_size",
                "seed", "shuffle", "unique_in_batch", "max_train_examples", "n_negatives")
TRAINER_OPTIONS = ("accumulate_grad_batches", "gradient_clip_val")
MODEL_FREE = ("path", "feature_cache_dir", "grad_cache_chunk")  # where things are, or memory; not what is trained
# objective options added since checkpoints were first written: the value a checkpoint without
# the option was trained with (the behaviour before the option existed)
OPTIONS_BEFORE_THEY_EXISTED = {"inbatch_weight": 0.0, "queue_max_age": None, "queue_refresh": 0, "matryoshka_dims": [],
                               "matryoshka_weights": [], "queue_per_source": False}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(OmegaConf.structured(node), enum_to_str=True) if not isinstance(node, dict) else node


def _flat(prefix: str, d: dict) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        out.update(_flat(f"{prefix}.{k}", v) if isinstance(v, dict) else {f"{prefix}.{k}": v})
    return out


def recorded_options(cfg: Any) -> dict[str, Any]:
    """This run's data and trainer options that a checkpoint records (flat keys: ``data.seed``)."""
    data, trainer = _plain(cfg.data), _plain(cfg.trainer)
    return {**_flat("data", {k: data[k] for k in DATA_OPTIONS}),
            **_flat("trainer", {k: trainer[k] for k in TRAINER_OPTIONS})}


class RecordTraining(Callback):
    """Writes :func:`recorded_options` and the number of processes into every checkpoint, and
    refuses (at restore, where the number is known) a resume on another number of processes: the
    global batch and each rank's share of the data position depend on it."""

    def __init__(self, cfg: Any):
        self.options = recorded_options(cfg)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        checkpoint[TRAINED_WITH] = {**self.options, "world_size": int(trainer.world_size)}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        trained = (checkpoint.get(TRAINED_WITH) or {}).get("world_size")
        if trained is not None and int(trained) != int(trainer.world_size):
            raise CheckpointError(
                f"the checkpoint was trained by {trained} process(es) (devices x nodes), this run has "
                f"{trainer.world_size}: the global batch and the saved data position depend on it; resume it "
                f"with {trained} (or start a new run_dir)")


def override(value: Any) -> str:
    """A value as a Hydra command-line override spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override(v) for v in value) + "]"
    text = str(value)
    if not text:
        return "''"
    return f"'{text}'" if any(c in text for c in " ,=[]{}()'\"") else text


def _objective_changes(trained: dict, objective: dict) -> list[tuple[str, Any, Any]]:
    before = {k: trained.get(k, OPTIONS_BEFORE_THEY_EXISTED.get(k)) for k in objective
              if k in trained or k in OPTIONS_BEFORE_THEY_EXISTED}
    return [(f"objective.{k}", v, objective[k]) for k, v in before.items() if v != objective[k]]


def _changes(trained: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """(key, trained, now) where both know the key and the values differ."""
    return [(k, trained[k], now[k]) for k in now if k in trained and trained[k] != now[k]]


def check_resumable(ckpt: dict, ckpt_path: str, cfg: Any) -> None:
    """:class:`CheckpointError` naming every option this run's config (a ``TrainConfig``) changes
    from the checkpoint's training, with the trained values as overrides; see the module docstring."""
    hp = ckpt.get("hyper_parameters") or {}
    objective = _plain(cfg.objective)
    trained_objective = hp.get("objective") if isinstance(hp.get("objective"), dict) else {}
    name = trained_objective.get("name")
    if name and name != objective["name"]:
        raise CheckpointError(f"ckpt_path={ckpt_path}: trained with objective={name}, but this run's config has "
                              f"objective={objective['name']}; add objective={name} to resume it (or start a new run_dir)")
    changed = _objective_changes(trained_objective, objective) if name else []
    model = {k: v for k, v in _plain(cfg.model).items() if k not in MODEL_FREE}
    for section, now in (("model", model), ("optim", _plain(cfg.optim))):
        if isinstance(hp.get(section), dict):
            changed += _changes(_flat(section, hp[section]), _flat(section, now))
    # the texts the model sees: a checkpoint from before prompts existed trained without any
    trained_prompts = to_prompts(hp.get("prompts")).to_dict()
    changed += _changes(_flat("data.prompts", trained_prompts), _flat("data.prompts", to_prompts(cfg.data.prompts).to_dict()))
    if "seed" in hp:
        changed += _changes({"seed": hp["seed"]}, {"seed": cfg.seed})
    changed += _changes(ckpt.get(TRAINED_WITH) or {}, recorded_options(cfg))
    if changed:
        raise CheckpointError(
            f"ckpt_path={ckpt_path}: trained with " + ", ".join(f"{k}={override(t)}" for k, t, _ in changed)
            + ", but this run's config has " + ", ".join(f"{k}={override(n)}" for k, _, n in changed)
            + "; a resumed run cannot change what it trains or the order of its data: add the trained values "
            "as overrides to resume it as trained (or start a new run_dir)")


__all__ = ["RecordTraining", "TRAINED_WITH", "check_resumable", "override", "recorded_options"]
