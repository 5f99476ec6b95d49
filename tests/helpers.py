"""What many tests share, in one module (the shared fixtures are in conftest.py). Test files import
from here, never from one another.

* Paths: ``REPO``, ``SHARED_DEBIAN``.
* Configs: ``compose_cfg`` (a command's config as Hydra composes it), ``tiny_overrides``.
* A tiny model trains: ``make_module``, ``quiet_trainer``, ``fit``, ``fit_to_last_ckpt``,
  ``train_checkpoint``, ``SignalAt``, ``last_and_previous``, ``train_losses``; the small smoke run
  on the command line (``SMALL_RUN``, ``train_command``) and in process (``SMALL_RESUMABLE``).
* Synthetic batches: ``SyntheticData`` (the batch contract of docs/design.md without the data
  pipeline), ``WORDS``.
* Data files: ``write_jsonl``, ``write_eval``, ``make_cfg``, ``two_sources``, ``fake_tokenize``,
  ``epoch_indices``; CSV and Parquet pairs (``PAIR_ROWS``, ``write_csv``, ``write_parquet``).
* Objectives: an encoder's stand-in (``encoder_stub``), fixed embeddings (``unit``, ``Given``,
  ``labels``, ``momentum_step``), the loop reference of InfoNCE (``excluded``, ``ref_direction``),
  steps in one process or on ranks (``momentum_steps``, ``train_steps``).
* Gloo: ``on_ranks``, a function run on N CPU processes joined by a gloo process group.
* Permissions: ``deny``, a folder or file not writable (or readable) by this process, root included.

Importing this module does not import Lightning (a gloo rank imports it with its test module):
``SyntheticData`` and ``SignalAt``, Lightning subclasses, are made on first use (``__getattr__``).
"""
from __future__ import annotations

import csv
import json
import os
import random
import socket
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SHARED_DEBIAN = REPO.parent / "shared" / "data" / "debian-bookworm"


# ----------------------------------------------------------------------------------------- configs


def compose_cfg(command: str, overrides=(), *, to_object: bool = False):
    """``command``'s config (train, evaluate, export, search, mine) composed by Hydra from the
    package's conf/ with ``overrides``, as the command composes it: a DictConfig, or with
    ``to_object`` the dataclasses the command's task receives."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from moco_retrieval.command import register_configs

    register_configs()  # the command schemas and the objectives' group, as a command module does on import
    with initialize_config_module("moco_retrieval.conf", version_base="1.3"):
        cfg = compose(command, overrides=list(overrides))
    return OmegaConf.to_object(cfg) if to_object else cfg


def tiny_overrides(tiny_dir) -> list[str]:
    """The overrides that give a command the tiny model at ``tiny_dir``."""
    return ["model=tiny", f"model.path={tiny_dir}"]


# ------------------------------------------------------------------------------ a tiny model trains


def make_module(model, objective=None, *, lr: float = 1e-3, seed: int | None = None, **options):
    """A training module at a constant learning rate ``lr`` (no warm-up). ``model``: a ModelConfig,
    or the tiny model's folder; ``objective``: an objective's config, MoCo with a 32-key queue
    (temperature 0.1, momentum 0.9) when None; ``seed``: torch's seed before the build (heads and
    adapters initialise from it, as train.py seeds first); ``options``: RetrievalModule's own."""
    from moco_retrieval.config import ModelConfig, OptimConfig
    from moco_retrieval.objectives.moco import MoCoConfig
    from moco_retrieval.training.module import RetrievalModule

    if seed is not None:
        torch.manual_seed(seed)
    if not isinstance(model, ModelConfig):
        model = ModelConfig(backbone="tiny", path=str(model))
    if objective is None:
        objective = MoCoConfig(queue_size=32, temperature=0.1, momentum=0.9)
    return RetrievalModule(model, objective, OptimConfig(lr=lr, warmup_steps=0, warmup_ratio=0.0, schedule="constant"),
                           **options)


def quiet_trainer(folder, **kw):
    """A Lightning trainer on one CPU without logger, progress bar, model summary, checkpointing,
    sanity check or validation, its files under ``folder``; ``kw``: other or more Trainer arguments."""
    import lightning as L

    args = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(folder))
    return L.Trainer(**{**args, **kw})


def fit(module, folder, *, epochs: int = 1, batches: int = 6, batch_size: int = 4, tokenize=None, ckpt_path=None,
        **trainer_kw):
    """``module`` trained for ``epochs`` epochs of ``batches`` synthetic batches of ``batch_size``
    pairs (SyntheticData, tokenised by the module's encoder unless ``tokenize``) by
    ``quiet_trainer(folder, **trainer_kw)`` (max_steps, callbacks, ...), from ``ckpt_path`` if given;
    the trainer."""
    trainer = quiet_trainer(folder, max_epochs=epochs, **trainer_kw)
    data = sys.modules[__name__].SyntheticData(tokenize or module.encoder.tokenize, batch_size=batch_size, batches=batches)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def fit_to_last_ckpt(module, folder, epochs: int, ckpt_path=None) -> dict:
    """``module`` trained for ``epochs`` epochs of 3 synthetic batches (from ``ckpt_path`` if given),
    a PreemptionCheckpoint writing ``folder/last.ckpt`` at the end as a finished run does; that
    checkpoint, loaded."""
    from moco_retrieval.training.preemption import PreemptionCheckpoint

    fit(module, folder, epochs=epochs, batches=3, callbacks=[PreemptionCheckpoint(Path(folder) / "last.ckpt")],
        ckpt_path=ckpt_path)
    return torch.load(Path(folder) / "last.ckpt", map_location="cpu", weights_only=False)


def train_checkpoint(model, objective, folder: Path, steps: int = 2, **module_options) -> str:
    """``steps`` optimizer steps (lr 1e-2, everything seeded 0) on synthetic batches of 4, saved as
    ``folder/checkpoints/last.ckpt``: a real Lightning checkpoint for the commands that read one."""
    import lightning as L

    L.seed_everything(0)
    m = make_module(model, objective, lr=1e-2, **module_options)
    t = fit(m, folder, batches=steps, max_steps=steps)
    path = folder / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    t.save_checkpoint(str(path))
    return str(path)


def last_and_previous(run_dir: Path) -> Path:
    """``run_dir/checkpoints/last.ckpt`` of step 4 and its predecessor last.prev.ckpt of step 2, as
    atomic saves write them (with a checksum of their 250,000 weights); the path of last.ckpt."""
    from moco_retrieval.files import atomic_torch_save

    last = run_dir / "checkpoints" / "last.ckpt"
    for step in (2, 4):
        atomic_torch_save({"global_step": step, "state_dict": {"w": torch.full((250_000,), float(step))}}, last,
                          keep_previous=True)
    return last


def train_losses(metrics_csv: Path) -> dict[int, float]:
    """The training loss logged at each step in a run's csv/metrics.csv."""
    with open(metrics_csv, newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


# 8 steps of 16 pairs, a validation every 3 steps on a small pool: a run takes ~20 s here
SMALL_RUN = [
    "+experiment=smoke",
    "data.max_train_examples=128",
    "data.max_eval_queries=32",
    "data.max_eval_docs=64",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=3",
]

# 8 steps of 16 pairs, validations at steps 3 and 6 (each writes last.ckpt) and at the end, no
# logger, resuming from the run directory's last.ckpt when there is one
SMALL_RESUMABLE = ["+experiment=smoke", "data.max_train_examples=128", "data.max_eval_queries=16",
                   "data.max_eval_docs=32", "trainer.val_check_interval=3", "logger=none", "ckpt_path=last"]


def train_command(run_dir: Path, *extra: str) -> list[str]:
    """The train command of the small run (SMALL_RUN) into ``run_dir``, Hydra's folder beside it."""
    return [sys.executable, "-m", "moco_retrieval.train", *SMALL_RUN, f"run_dir={run_dir}",
            f"hydra.run.dir={run_dir.parent / (run_dir.name + '-hydra')}", *extra]


# -------------------------------------------------------------------------------- synthetic batches

WORDS = "apple banana cherry delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


class SyntheticBatches(torch.utils.data.IterableDataset):
    def __init__(self, tokenize, batch_size, batches, seed, rank, id_offset, epoch_fn=lambda: 0):
        self.tokenize, self.batch_size, self.batches = tokenize, batch_size, batches
        self.seed, self.rank, self.id_offset, self.epoch_fn = seed, rank, id_offset, epoch_fn

    def __len__(self):
        return self.batches

    def __iter__(self):
        epoch = self.epoch_fn()
        for b in range(self.batches):
            rng = random.Random(f"{self.seed}-{epoch}-{b}-{self.rank}")
            docs = [" ".join(rng.choices(WORDS, k=8)) for _ in range(self.batch_size)]
            queries = [" ".join(d.split()[:3]) for d in docs]
            ids = torch.tensor([self.id_offset + rng.randrange(10_000) for _ in docs])
            yield {
                "query": {"texts": queries, **self.tokenize(queries, "query")},
                "doc": {"texts": docs, **self.tokenize(docs, "doc")},
                "doc_id": ids,
                "group": torch.full((len(docs),), -1),
                "index": torch.arange(len(docs)),
            }


# --------------------------------------------------------------------------------------- data files


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_eval(d: Path, n_docs=12, n_queries=6, split="test") -> Path:
    """A BEIR folder: ``n_docs`` documents in 4 groups, query i relevant to document i (and query 0
    to the last document too)."""
    (d / "qrels").mkdir(parents=True)
    write_jsonl(d / "corpus.jsonl", [{"_id": f"d{i}", "title": "", "text": f"eval document {i}", "group": f"g{i % 4}"} for i in range(n_docs)])
    write_jsonl(d / "queries.jsonl", [{"_id": f"q{i}", "text": f"eval query {i}"} for i in range(n_queries)])
    rows = [f"q{i}\td{i}\t1" for i in range(n_queries)] + [f"q0\td{n_docs - 1}\t1"]
    (d / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
    return d


def make_cfg(tmp_path: Path, n=40, repeat_ids=False, negatives=None, **kw):
    """A DataConfig of ``n`` JSONL pairs ("query i", "document i") in ``tmp_path`` and write_eval's
    pool; ``repeat_ids``: 7 documents and 5 groups shared across rows; ``negatives(i)``: row i's."""
    from moco_retrieval.config import DataConfig

    rows = []
    for i in range(n):
        r = {"query": f"query {i}", "positive": f"document {i}", "query_id": f"q{i}"}
        if repeat_ids:
            r["doc_id"] = f"doc{i % 7}"  # 7 distinct documents (one text per id)
            r["positive"] = f"document {i % 7}"
            r["group"] = f"grp{i % 5}" if i % 2 else None  # 5 groups and rows without a group
        if negatives is not None:
            r["negatives"] = negatives(i)
        rows.append(r)
    write_jsonl(tmp_path / "train.jsonl", rows)
    if not (tmp_path / "eval").exists():
        write_eval(tmp_path / "eval")
    args = dict(kind="jsonl", train_path=str(tmp_path / "train.jsonl"), eval_dir=str(tmp_path / "eval"), batch_size=4, eval_batch_size=5)
    args.update(kw)
    return DataConfig(**args)


def two_sources(tmp_path: Path, n_a=48, n_b=24, **kw):
    """A DataConfig of two JSONL sources, "a" (``n_a`` pairs, the run's prompts) and "b" (``n_b``
    pairs, its own prompts), validated on write_eval's pool."""
    from moco_retrieval.config import DataConfig, PromptsConfig, SourceConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    a = write_jsonl(tmp_path / "a.jsonl", [{"query": f"alpha query {i}", "positive": f"alpha doc {i}"} for i in range(n_a)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"query": f"beta query {i}", "positive": f"beta doc {i}"} for i in range(n_b)])
    if not (tmp_path / "eval").exists():
        write_eval(tmp_path / "eval")
    sources = [SourceConfig(name="a", train_path=str(a)),
               SourceConfig(name="b", train_path=str(b), prompts=PromptsConfig(query="question: ", doc="answer: "))]
    args = dict(kind="jsonl", eval_dir=str(tmp_path / "eval"), batch_size=4, eval_batch_size=5, sources=sources,
                prompts=PromptsConfig(query="query: ", doc="passage: "))
    args.update(kw)
    return DataConfig(**args)


def fake_tokenize(texts, kind):
    """Words -> ids, truncated to 3 (query) / 5 (doc) tokens, padded to the longest."""
    max_len = {"query": 3, "doc": 5}[kind]
    toks = [[len(w) + 1 for w in t.split()][:max_len] for t in texts]
    L = max(len(t) for t in toks)
    ids = torch.tensor([t + [0] * (L - len(t)) for t in toks])
    return {"input_ids": ids, "attention_mask": (ids > 0).long()}


def fit_recording_batches(datamodule, root: Path, max_steps: int = -1, ckpt_path=None) -> list:
    """A 2-epoch Lightning fit of a one-parameter module on ``datamodule``, a checkpoint every step
    (``root/ck/last.ckpt``): ``(epoch, the batch's row indices)`` of every step trained, for the
    resume tests (stop with ``max_steps``, resume from ``ckpt_path``: the two lists add up)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append((self.current_epoch, batch["index"].tolist()))
            return (self.w - 1.0).pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Recorder()
    trainer = L.Trainer(
        default_root_dir=root, max_epochs=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=root / "ck", save_last=True, every_n_train_steps=1, save_top_k=0)],
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return module.seen


def epoch_indices(sampler, epoch):
    sampler.set_epoch(epoch)
    return [list(b) for b in sampler]


# Two pairs with every column, the second with its optional ones empty
PAIR_ROWS = [
    {"query": "resize images", "positive": "ImageMagick edits images.", "query_id": "q1", "doc_id": "imagemagick",
     "group": "imagemagick-src", "negatives": ["GIMP paints.", {"text": "Inkscape draws.", "doc_id": "inkscape"}],
     "positive_score": 0.9},
    {"query": "play chess", "positive": "GNOME chess.", "query_id": "q2", "doc_id": None, "group": None,
     "negatives": None, "positive_score": None},
]


def write_csv(path: Path, rows, rename=None, header=None):
    """``rows`` (as PAIR_ROWS) as a CSV file, columns renamed by ``rename`` (or named by ``header``)."""
    rename = rename or {}
    fields = header or [rename.get(k, k) for k in rows[0]]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in rows:
            w.writerow(["" if v is None else json.dumps(v) if isinstance(v, list) else v for v in r.values()])
    return path


def write_parquet(path: Path, rows, rename=None):
    """``rows`` (as PAIR_ROWS) as a Parquet file, columns renamed by ``rename``; negatives as texts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rename = rename or {}
    cols = {rename.get(k, k): [r[k] for r in rows] for k in rows[0] if k != "negatives"}
    table = pa.table(cols)
    negs = [[n if isinstance(n, str) else n["text"] for n in (r["negatives"] or [])] or None for r in rows]
    table = table.append_column(rename.get("negatives", "negatives"), pa.array(negs, pa.list_(pa.string())))
    pq.write_table(table, path)
    return path


# --------------------------------------------------------------------------- objectives' embeddings

# Given's keywords -> (side, encoder) as objectives ask embed() for them
SIDES = {
    "query": ("query", "trained"), "doc": ("doc", "trained"), "neg": ("neg", "trained"),
    "query_key": ("query", "momentum"), "doc_key": ("doc", "momentum"), "neg_key": ("neg", "momentum"),
    "guide_query": ("query", "guide"), "guide_doc": ("doc", "guide"), "guide_neg": ("neg", "guide"),
}


def encoder_stub(dim: int, hidden_size: int | None = None, *, frozen=False, shared_tower=True, normalize=True):
    """What build_objective reads of an encoder: its output and hidden sizes, whether its backbone is
    frozen, its towers shared, its output normalised, and the token rows per side (6)."""
    from types import SimpleNamespace

    return SimpleNamespace(dim=dim, hidden_size=hidden_size or dim, frozen=frozen, shared_tower=shared_tower,
                           normalize=normalize, max_len=lambda kind: 6)


def unit(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g), dim=-1)


class Given:
    """An ``embed`` (objectives/base.py) serving fixed embeddings: ``Given(step, query=q, doc_key=k, ...)``;
    ``tokens``: what stored texts embed to (a function of the side and kind); ``features`` /
    ``project``: the frozen features of "doc" and the head's projection (a function)."""

    def __init__(self, step: int = 0, *, tokens=None, features=None, project=None, **embeddings):
        self.step = step
        self.table = {SIDES[name]: t for name, t in embeddings.items() if t is not None}
        self._tokens, self._features, self._project = tokens, features, project
        self.asked: list[tuple[str, str, bool]] = []

    def __call__(self, side, encoder="trained", grad=True):
        self.asked.append((side, encoder, grad))
        t = self.table.get((side, encoder))
        return t if t is None or grad else t.detach()

    def tokens(self, side, kind, encoder="momentum"):
        self.asked.append(("stored " + kind, encoder, False))
        return self._tokens(side, kind)

    def features(self, side):
        return self._features

    def project(self, features):
        return self._project(features)


def labels(ids, groups, **more) -> dict:
    """A batch's labels as the collate gives them: the positives' ids and groups (and more entries)."""
    return {"doc_id": ids, "group": groups, **more}


def momentum_step(obj, q, k, meta: dict, step: int = 0):
    """A momentum objective (moco, two_queue) on one step's embeddings: queries ``q``, EMA document
    keys ``k``, and from ``meta`` the trained documents "d", the EMA query keys "q_key", the EMA hard
    negatives "neg", a fixed guide's "g_q" / "g_k" / "g_neg", and the batch's labels."""
    m = dict(meta)
    given = Given(step, query=q, doc_key=k, doc=m.pop("d", None), query_key=m.pop("q_key", None),
                  neg_key=m.pop("neg", None), guide_query=m.pop("g_q", None), guide_doc=m.pop("g_k", None),
                  guide_neg=m.pop("g_neg", None))
    return obj(labels(m.pop("doc_id"), m.pop("group"), **m), given)


def excluded(i, ids, groups, j_id, j_group):
    """Whether candidate (``j_id``, ``j_group``) is masked for row ``i``: its positive's id, or its group."""
    return bool(j_id == ids[i] or (groups[i] >= 0 and j_group == groups[i]))


def ref_direction(a, pos, batch_keys, ids, groups, extra, tau, mask=True):
    """The loop reference of one InfoNCE direction: the mean over rows i of -log softmax of
    a_i . pos_i / tau among the positive, the other batch keys and ``extra`` blocks [(vectors, ids,
    groups)], candidates sharing row i's id or group masked (``mask``)."""
    out = []
    for i in range(a.shape[0]):
        logits = [a[i] @ pos[i] / tau]
        logits += [a[i] @ batch_keys[j] / tau for j in range(len(batch_keys))
                   if j != i and not (mask and excluded(i, ids, groups, ids[j], groups[j]))]
        for vecs, v_ids, v_groups in extra:
            logits += [a[i] @ vecs[j] / tau for j in range(len(vecs))
                       if not (mask and excluded(i, ids, groups, v_ids[j], v_groups[j]))]
        out.append(torch.logsumexp(torch.stack(logits), 0) - logits[0])
    return torch.stack(out).mean()


def momentum_steps(n: int, rows: int, dim: int, groups, **more) -> list[dict]:
    """``n`` steps of ``rows`` rows for train_steps: unit queries "q", EMA document keys "k", trained
    documents "d" and EMA query keys "q_key" (seeds 10, 20, 30, 40 plus the step), ids new at each
    step (100 apart), the same ``groups``; ``more``: further entries, each a function of the step."""
    return [dict(q=unit(rows, dim, seed=10 + s), k=unit(rows, dim, seed=20 + s), d=unit(rows, dim, seed=30 + s),
                 q_key=unit(rows, dim, seed=40 + s), ids=torch.arange(rows) + 100 * s, groups=groups,
                 **{name: make(s) for name, make in more.items()})
            for s in range(n)]


def train_steps(obj, steps, batch, rank, world, extra=None) -> dict:
    """``steps`` through ``obj`` on this rank's ``batch`` rows (every row in one process): each
    step's loss and gradients and the final state. ``extra(step, rows)``: more ``meta`` entries (momentum_step)."""
    per = batch if world > 1 else len(steps[0]["q"])
    sl = slice(rank * per, (rank + 1) * per)
    obj.train()
    out = {"loss": [], "gq": [], "gd": []}
    for s, st in enumerate(steps):
        q, d = st["q"][sl].clone().requires_grad_(), st["d"][sl].clone().requires_grad_()
        more = extra(st, per) if extra else {}
        meta = {"doc_id": st["ids"][sl], "group": st["groups"][sl], "d": d, "q_key": st["q_key"][sl], **more}
        loss, _ = momentum_step(obj, q, st["k"][sl], meta, s)
        loss.backward()
        obj.after_backward()
        out["loss"].append(loss.item())
        out["gq"].append(q.grad)
        out["gd"].append(d.grad)
    out["state"] = {k: v.clone() for k, v in obj.state_dict().items()}
    return out


# -------------------------------------------------------------------------------------------- gloo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, folder):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(fn(*args, rank, world), os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Success only (an exception above propagates to mp.spawn as usual). Skipping interpreter
    # finalization: gloo's worker threads can still hold tensors with Python references then, and
    # destroying them aborts the process ("terminate called without an active exception",
    # pytorch/pytorch#179291), failing a test whose result is already saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def on_ranks(fn, args: tuple, world: int, folder, weights_only: bool = True) -> list:
    """``fn(*args, rank, world)`` on ``world`` CPU processes joined by a gloo process group (``fn``
    importable in a new process: a module-level function of a test module or of this one); the
    results, in rank order (``weights_only=False`` for results holding numpy arrays)."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, free_port(), fn, args, str(folder)), nprocs=world, join=True)
    return [torch.load(os.path.join(str(folder), f"rank{r}.pt"), weights_only=weights_only) for r in range(world)]


# ------------------------------------------------------------------ Lightning's classes, on first use


def _lightning_classes() -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    class SyntheticData(L.LightningDataModule):
        """A small deterministic data module in the batch contract of docs/design.md, for tests of the
        training core that should not depend on the real data pipeline. Batch b of epoch e depends
        only on (seed, e, b, rank), so runs are reproducible and resumable at epoch boundaries.
        ``id_offset_per_rank`` makes each rank's document ids recognisable (rank r: r * offset + ...)."""

        def __init__(self, tokenize, batch_size=4, batches=5, seed=0, id_offset_per_rank=100_000):
            super().__init__()
            self.tokenize, self.batch_size, self.batches = tokenize, batch_size, batches
            self.seed, self.id_offset_per_rank = seed, id_offset_per_rank
            self.dataset = None

        def train_dataloader(self):
            trainer = self.trainer
            rank = trainer.global_rank if trainer else 0
            self.dataset = SyntheticBatches(self.tokenize, self.batch_size, self.batches, self.seed, rank,
                                            rank * self.id_offset_per_rank,
                                            epoch_fn=lambda: trainer.current_epoch if trainer else 0)
            return torch.utils.data.DataLoader(self.dataset, batch_size=None)

    class SignalAt(Callback):
        """Sends ``signum`` to this process when batch ``batch_idx`` starts; ``ends``: the batches that ended."""

        def __init__(self, signum, batch_idx):
            self.signum, self.batch_idx, self.ends = signum, batch_idx, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == self.batch_idx:
                os.kill(os.getpid(), self.signum)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(batch_idx)

    classes = {"SyntheticData": SyntheticData, "SignalAt": SignalAt}
    for name, cls in classes.items():
        cls.__qualname__ = name  # pickled by name (ddp_spawn sends the data module to its processes)
    return classes


def __getattr__(name: str):
    """``SyntheticData`` and ``SignalAt`` subclass Lightning's classes and are made on first use, so
    that a process importing this module for its other helpers (a gloo rank) does not import
    Lightning (seconds on a busy machine)."""
    if name in ("SyntheticData", "SignalAt"):
        globals().update(_lightning_classes())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------- permissions


def deny(monkeypatch, under: Path, reads: bool = False) -> None:
    """``under`` not writable (``reads``: not readable either), as another user's files or a
    read-only cache are: a real chmod, and when root (who ignores modes, as here and in CI) the OS
    calls that would fail (open, os.open, os.mkdir) raise PermissionError for paths under it."""
    import builtins
    import errno
    import io

    under = under.resolve()
    if os.geteuid() != 0:
        os.chmod(under, 0o000 if reads and under.is_file() else 0o555)
        return

    def denied(path) -> bool:
        try:
            return Path(os.path.abspath(os.fspath(path))).is_relative_to(under)
        except TypeError:  # a file descriptor
            return False

    def refuse(path):
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))

    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def fake_open(file, mode="r", *args, **kwargs):
        if (reads or any(c in mode for c in "wax+")) and denied(file):
            raise refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if (reads or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)) and denied(path):
            raise refuse(path)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    def fake_mkdir(path, mode=0o777, *, dir_fd=None):
        if denied(path) and not os.path.isdir(path):
            raise refuse(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    for module, name, fake in ((builtins, "open", fake_open), (io, "open", fake_open), (os, "open", fake_os_open),
                               (os, "mkdir", fake_mkdir)):
        monkeypatch.setattr(module, name, fake)
