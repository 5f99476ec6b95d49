"""Several sources on the memory-mapped store (issue 32, part 6): `data.sources` read as one
ConcatStores row space of each source's converted store (a JSONL file and a `datasets` folder here),
trained through train() with a tiny model: every batch from one source, the weights' proportions
kept, and a mid-epoch stop + `ckpt_path=last` that ends bit-exact with an uninterrupted run;
`python -m moco_retrieval.data prepare` converts every source ahead of the run."""
from __future__ import annotations

import csv
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from moco_retrieval.data import convert
from moco_retrieval.training.preemption import Preempted
from tests.helpers import REPO, compose_cfg, write_eval, write_jsonl

BATCH = 8
N_WEB, N_DOCS = 40, 24  # 5 + 3 batches a pass; weights 3:1 -> 6 + 2 of the epoch's 8 batches


def write_sources(d: Path) -> tuple[Path, Path]:
    """A JSONL file and a save_to_disk folder with sentence-transformers columns (anchor, positive)."""
    datasets = pytest.importorskip("datasets")
    d.mkdir(parents=True, exist_ok=True)
    web = write_jsonl(d / "web.jsonl", [{"query": f"web question {i}", "positive": f"web page {i} text"}
                                        for i in range(N_WEB)])
    datasets.Dataset.from_dict({"anchor": [f"doc summary {i}" for i in range(N_DOCS)],
                                "positive": [f"doc body {i} words" for i in range(N_DOCS)]}).save_to_disk(str(d / "ds"))
    if not (d / "eval").exists():
        write_eval(d / "eval")
    return web, d / "ds"


def sources_override(web: Path, ds: Path) -> str:
    return (f"data.sources=[{{name: web, train_path: '{web}', weight: 3}}, "
            f"{{name: docs, kind: hf, path: '{ds}', weight: 1, prompts: {{query: 'summary: '}}}}]")


def run_cfg(d: Path, *extra: str):
    web, ds = write_sources(d)
    return OmegaConf.to_object(compose_cfg("train", [
        "+experiment=smoke", "data=jsonl", sources_override(web, ds), f"data.eval_dir={d / 'eval'}",
        f"data.batch_size={BATCH}", "data.max_train_examples=null", "data.max_eval_queries=null",
        "data.max_eval_docs=null", "trainer.val_check_interval=null", "trainer.log_every_n_steps=1",
        "objective.queue_size=32", f"data.cache_dir={d / 'cache'}", *extra]))


class Recorder(Callback):
    """Each trained batch's rows, sources and query texts; a SIGTERM to this process when batch
    ``stop_at`` starts (the run finishes that step, writes last.ckpt and stops: preemption.py)."""

    def __init__(self, stop_at=None):
        self.stop_at, self.batches = stop_at, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((batch["index"].tolist(), batch["source"].tolist(), list(batch["query"]["texts"])))
        if batch_idx == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def recorded(monkeypatch):
    """train() with a Recorder on its trainer; the data modules it built."""
    import moco_retrieval.train as train_mod

    seen = {"dms": [], "recorder": None}
    build = train_mod.build

    def build_and_record(cfg, run_dir, dm=None, resuming=False):
        module, dm, trainer = build(cfg, run_dir, dm, resuming)
        trainer.callbacks.append(seen["recorder"])
        seen["dms"].append(dm)
        return module, dm, trainer

    monkeypatch.setattr(train_mod, "build", build_and_record)
    return seen


def _train(seen, cfg, run_dir, stop_at=None):
    from moco_retrieval.train import train

    seen["recorder"] = Recorder(stop_at)
    return train(cfg, run_dir), seen["recorder"].batches


def test_weighted_sources_train_from_their_stores(tmp_path, recorded, monkeypatch, one_thread, capsys):
    from moco_retrieval.data import sources
    from moco_retrieval.data.store import ConcatStores, PairStore

    # no source is read into Python objects: the only reader of pairs as objects must not run
    monkeypatch.setattr(sources, "load_training_pairs", lambda *a, **k: pytest.fail("pairs read as objects"))
    metrics, batches = _train(recorded, run_cfg(tmp_path), tmp_path / "run")
    assert 0.0 <= metrics["val/recall@1"] <= 1.0

    dm = recorded["dms"][0]
    joined = dm.train_rows.source
    assert isinstance(joined, ConcatStores) and dm.source_offsets.tolist() == [0, N_WEB, N_WEB + N_DOCS]
    assert [type(part.source) for part in joined.sources] == [PairStore, PairStore]
    assert len(list((tmp_path / "cache" / "pairs").glob("*/manifest.json"))) == 2  # one store per source

    assert len(batches) == 8  # one epoch: 5 + 3 batches, split 3:1
    per_batch = []
    for rows, srcs, queries in batches:
        (src,) = set(srcs)  # every batch from one source ...
        lo, hi = dm.source_offsets[src], dm.source_offsets[src + 1]
        assert all(lo <= r < hi for r in rows)  # ... its rows from that source's range
        want = "web question" if src == 0 else "summary: doc summary"  # the docs source's own prompt
        assert all(q.startswith(want) for q in queries), queries
        per_batch.append(src)
    assert Counter(per_batch) == {0: 6, 1: 2}  # 3:1
    assert len({tuple(rows) for rows, _, _ in batches if rows[0] < N_WEB}) == 6  # web repeats in a new pass, not a batch

    logged = list(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()))
    totals = {k: float(v) for r in logged for k, v in r.items() if k.startswith("train/pairs_source_") and v}
    assert totals == {"train/pairs_source_0": 6.0 * BATCH, "train/pairs_source_1": 2.0 * BATCH}
    assert [float(r["train/source"]) for r in logged if r.get("train/source")] == [float(s) for s in per_batch]

    # the docs source's own prompt is said at start and on the model card, not lost silently (issue 46, point 12)
    assert ("sources with prompts of their own: docs ({'query': 'summary: ', 'doc': ''}); validation and the exported "
            "model apply data.prompts (none)") in capsys.readouterr().err
    from moco_retrieval.export.__main__ import run_export

    out = run_export(compose_cfg("export", [f"checkpoint={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}",
                                            f"out_dir={tmp_path / 'model'}", "model=tiny"]))
    card = (out / "README.md").read_text()
    assert "- Source prompts (not in the model's `prompts`, which are `data.prompts`" in card
    assert "docs: query 'summary: ', document ''" in card


def test_stop_mid_epoch_across_sources_and_resume_is_bit_exact(tmp_path, recorded, one_thread):
    cfg = run_cfg(tmp_path / "data")
    _, reference = _train(recorded, cfg, tmp_path / "reference")
    order = [s[0] for _, s, _ in reference]
    # a stop with both sources trained before it and both still to come after it
    steps = next(n for n in range(1, len(order)) if len(set(order[:n])) == len(set(order[n:])) == 2)

    run_dir = tmp_path / "run"
    with pytest.raises(Preempted) as stop:
        _train(recorded, cfg, run_dir, stop_at=steps - 1)
    assert stop.value.step == steps
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == steps
    # the position (the schedule says which source comes next) and the sources it belongs to
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches_done"] == steps
    assert recorded["dms"][-1].state_dict()["sources"] == {"names": ["web", "docs"], "weights": [3.0, 1.0],
                                                           "mode": "weighted"}
    first = recorded["recorder"].batches
    _, second = _train(recorded, OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), {"ckpt_path": "last"})),
                       run_dir)
    assert first + second == reference  # no batch trained twice or skipped; the same sources, rows and prompts

    a = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    b = torch.load(tmp_path / "reference" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert a["global_step"] == b["global_step"] == 8
    assert a["state_dict"].keys() == b["state_dict"].keys() and any("queue_keys" in k for k in a["state_dict"])
    for k, v in b["state_dict"].items():  # encoder, key encoder, queue: bit for bit
        assert torch.equal(a["state_dict"][k], v), k
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_prepare_converts_every_source_ahead(tmp_path, capsys, monkeypatch):
    from moco_retrieval.config import DataConfig, SourceConfig
    from moco_retrieval.data.__main__ import main
    from moco_retrieval.data.datamodule import RetrievalDataModule

    web, ds = write_sources(tmp_path)
    args = ["prepare", "data=jsonl", sources_override(web, ds), f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"source web: store " in out and f"{N_WEB} rows of {web}" in out
    assert f"source docs: store " in out and f"{N_DOCS} rows of {ds}" in out
    monkeypatch.setattr(convert, "write_store", lambda *a: pytest.fail("converted again"))
    cfg = DataConfig(kind="jsonl", eval_dir=str(tmp_path / "eval"), batch_size=BATCH, cache_dir=str(tmp_path / "cache"),
                     sources=[SourceConfig(name="web", train_path=str(web)),
                              SourceConfig(name="docs", kind="hf", path=str(ds))])
    dm = RetrievalDataModule(cfg, rank=0, world_size=1)
    dm.setup("fit")  # opens both stores prepared above
    assert dm.source_offsets.tolist() == [0, N_WEB, N_WEB + N_DOCS]
    assert dm.train_rows.take([N_WEB])[0].query == "doc summary 0"
    monkeypatch.undo()
    web.write_text('{"query": "q"}\n')
    with pytest.raises(SystemExit, match="2"):
        main(args)
    assert f"data.sources[0] (web): {web}:1: missing field 'positive'" in " ".join(capsys.readouterr().err.split())


def test_a_missing_source_is_named_before_any_source_converts(tmp_path, monkeypatch):
    from moco_retrieval.config import DataConfig, SourceConfig
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.data.formats import DataError

    web, _ = write_sources(tmp_path)
    monkeypatch.setattr(convert, "write_store", lambda *a: pytest.fail("converted before the paths were checked"))
    cfg = DataConfig(kind="jsonl", eval_dir=str(tmp_path / "eval"), batch_size=BATCH, cache_dir=str(tmp_path / "cache"),
                     sources=[SourceConfig(name="web", train_path=str(web)),
                              SourceConfig(name="docs", kind="hf", path=str(tmp_path / "nope"))])
    with pytest.raises(DataError, match=r"data.sources\[1\] \(docs\): .*nope"):
        RetrievalDataModule(cfg, rank=0, world_size=1).setup("fit")


def test_the_readmes_two_source_command_composes():
    """The README's example (the Debian set and the docstrings, 3:1) is a valid strict config."""
    import shlex

    text = (REPO / "README.md").read_text()
    block = text[text.index("**Several sources.**"):]
    block = block[block.index("```bash"):block.index("```", block.index("```bash") + 7)]
    (line,) = [ln for ln in block.splitlines() if ln.startswith("python -m moco_retrieval.train")]
    cfg = compose_cfg("train", shlex.split(line)[3:])
    assert [(s.name, s.kind, s.weight) for s in cfg.data.sources] == [("debian", "debian", 3), ("pydoc", "jsonl", 1)]
    assert cfg.data.sources[1].train_path == "pydoc/train.jsonl" and cfg.data.sources[1].prompts.query == "docstring: "


def test_workers_read_the_same_batches_from_the_stores(tmp_path):
    """DataLoader workers (forked after the stores are mapped) give the batches the main process reads."""
    from moco_retrieval.config import DataConfig, SourceConfig
    from moco_retrieval.data.datamodule import RetrievalDataModule

    web, ds = write_sources(tmp_path)

    def batches(workers):
        cfg = DataConfig(kind="jsonl", eval_dir=str(tmp_path / "eval"), batch_size=BATCH, num_workers=workers,
                         cache_dir=str(tmp_path / "cache"), sources=[SourceConfig(name="web", train_path=str(web)),
                                                                     SourceConfig(name="docs", kind="hf", path=str(ds))])
        dm = RetrievalDataModule(cfg, rank=0, world_size=1)
        return [(b["index"].tolist(), b["source"].tolist(), b["query"]["texts"]) for b in dm.train_dataloader()]

    main = batches(0)
    assert len(main) == 8 and {s[0] for _, s, _ in main} == {0, 1}
    assert batches(2) == main


def test_each_sources_sampler_reads_its_stores_mapped_ids(tmp_path):
    """No joined copy of the sources' ids and groups per rank: each source's sampler works on its own
    store's memory-mapped arrays (pages shared by the ranks of a node)."""
    import numpy as np

    from moco_retrieval.config import DataConfig, SourceConfig
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.data.store import Segments

    web, ds = write_sources(tmp_path)
    cfg = DataConfig(kind="jsonl", eval_dir=str(tmp_path / "eval"), batch_size=BATCH, cache_dir=str(tmp_path / "cache"),
                     sources=[SourceConfig(name="web", train_path=str(web)), SourceConfig(name="docs", kind="hf", path=str(ds))])
    dm = RetrievalDataModule(cfg, rank=0, world_size=1)
    sampler = dm.batch_sampler
    joined = dm.train_rows.source
    for s, part in enumerate(joined.sources):
        for name, got in (("doc_id", sampler.sources[s].doc_ids), ("group", sampler.sources[s].groups)):
            mapped = part.source.array(name)
            assert isinstance(mapped, np.memmap) and np.shares_memory(got, mapped), (s, name)
    assert dm.train_rows.doc_ids.tolist() == [p.doc_id for p in dm.train_pairs]  # the joined column, when asked
    seg = Segments([np.arange(3), np.arange(10, 14)])
    assert seg[0:3].tolist() == [0, 1, 2] and seg[4:6].tolist() == [11, 12] and seg[2:5].tolist() == [2, 10, 11]
    assert len(seg) == 7 and seg[7:7].tolist() == [] and seg[::2].tolist() == [0, 2, 11, 13]
