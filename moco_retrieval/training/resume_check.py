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
trainer options below (each of ``data.sources`` by name), the number of processes and the key of
each source's converted store (data/convert.py: a hash of the input's content and conversion
options), which :func:`check_same_data` compares once the data is read: a file rewritten in place,
sources swapped or pointed at other files are refused, not trained on. Where the data is, when this
run does not say (``data.debian_dir``, ``data.train_path``, ``data.path``, ``data.dir`` left unset),
is taken from the checkpoint (:func:`adopt_data_location`), so the resume command needs no data settings. A checkpoint from before a record existed is
checked on what it has. Options left out may change between attempts: logging, validation and the
pool, cache folders, ``model.path`` (where the same backbone sits), memory knobs
(``model.grad_cache_chunk``, ``data.num_workers``), ``trainer.max_steps`` (to extend a run).
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from moco_retrieval.data.multisource import source_names
from moco_retrieval.data.prompts import to_prompts
from moco_retrieval.errors import CheckpointError

TRAINED_WITH = "trained_with"  # the checkpoint key RecordTraining writes
DATA_OPTIONS = ("kind", "train_path", "path", "split", "dir", "train_split", "debian_dir", "columns", "views", "batch_size",
                "seed", "shuffle", "unique_in_batch", "max_train_examples", "n_negatives")
TRAINER_OPTIONS = ("accumulate_grad_batches", "gradient_clip_val")
LOCATIONS = ("train_path", "path", "dir", "debian_dir")  # where the data is: taken from the checkpoint when unset
DATA_KEYS = "data_keys"  # each source's store key, in the checkpoint's record
MODEL_FREE = ("path", "feature_cache_dir", "grad_cache_chunk")  # where things are, or memory; not what is trained
# objective options added since checkpoints were first written: the value a checkpoint without
# the option was trained with (the behaviour before the option existed)
OPTIONS_BEFORE_THEY_EXISTED = {"inbatch_weight": 0.0, "queue_max_age": None, "queue_refresh": 0, "matryoshka_dims": [],
                               "matryoshka_weights": [], "queue_per_source": False, "distill": "none",
                               "distill_weight": 1.0, "distill_temperature": 1.0, "contrastive_weight": 1.0}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(OmegaConf.structured(node), enum_to_str=True) if not isinstance(node, dict) else node


def _flat(prefix: str, d: dict) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        out.update(_flat(f"{prefix}.{k}", v) if isinstance(v, dict) else {f"{prefix}.{k}": v})
    return out


def recorded_options(cfg: Any) -> dict[str, Any]:
    """This run's data and trainer options that a checkpoint records (flat keys: ``data.seed``,
    ``data.sources[NAME].max_train_examples``)."""
    data, trainer = _plain(cfg.data), _plain(cfg.trainer)
    sources = {}
    for name, source in zip(source_names(cfg.data), data["sources"]):
        sources.update(_flat(f"data.sources[{name}]", {k: v for k, v in source.items() if k != "name"}))
    return {**_flat("data", {k: data[k] for k in DATA_OPTIONS}), **sources,
            **_flat("trainer", {k: trainer[k] for k in TRAINER_OPTIONS})}


class RecordTraining(Callback):
    """Writes :func:`recorded_options` and the number of processes into every checkpoint, and
    refuses (at restore, where the number is known) a resume on another number of processes: the
    global batch and each rank's share of the data position depend on it."""

    def __init__(self, cfg: Any):
        self.options = recorded_options(cfg)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        keys = getattr(getattr(trainer, "datamodule", None), "data_keys", None)
        checkpoint[TRAINED_WITH] = {**self.options, "world_size": int(trainer.world_size),
                                    **({DATA_KEYS: keys()} if keys else {})}

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


def adopt_data_location(ckpt: dict, cfg: Any) -> list[str]:
    """Set each of :data:`LOCATIONS` this run leaves unset (``cfg.data``, changed in place) to the
    checkpoint's; returns them as overrides (said on stderr by the caller)."""
    trained = ckpt.get(TRAINED_WITH) or {}
    adopted = []
    for key in LOCATIONS:
        value = trained.get(f"data.{key}")
        if value is not None and getattr(cfg.data, key) is None:
            setattr(cfg.data, key, value)
            adopted.append(f"data.{key}={override(value)}")
    return adopted


def check_same_data(ckpt: dict, ckpt_path: str, keys: dict[str, Optional[str]]) -> None:
    """:class:`CheckpointError` when a source's store key (``keys``, the data module's) is not the
    one the checkpoint trained on (a checkpoint without the record is not checked)."""
    trained = (ckpt.get(TRAINED_WITH) or {}).get(DATA_KEYS)
    if trained is None:
        return
    changed = [n for n in dict.fromkeys([*trained, *keys]) if trained.get(n) != keys.get(n)]
    if changed:
        what = ", ".join("the training data" if n == "data" else f"data.sources[{n}]" for n in changed)
        raise CheckpointError(
            f"ckpt_path={ckpt_path}: {what} is not the data this run trained on (its content, or the file it names, "
            f"changed since the checkpoint: store {', '.join(str(trained.get(n))[:12] for n in changed)} then, "
            f"{', '.join(str(keys.get(n))[:12] for n in changed)} now); a resume must train on the same rows: give "
            "the files it trained on (or start a new run_dir)")


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


__all__ = ["RecordTraining", "TRAINED_WITH", "adopt_data_location", "check_resumable", "check_same_data", "override",
           "recorded_options"]
