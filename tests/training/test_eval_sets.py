"""Issue 47, part 6: several evaluation sets (``data.eval_dirs``).

Each set is named by its folder; with several, validation logs ``val/<set>/...`` and their unweighted
mean ``val/mean/...`` (one set keeps ``val/...``), the best checkpoint follows ``trainer.best_set``,
``evaluate`` reports per set and the mean, and the model card lists both. Bad settings stop before
the model loads, naming the key. Real trainings of a tiny model on a few JSONL pairs.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import re
from pathlib import Path

import pytest
import torch

from moco_retrieval.errors import ConfigError
from moco_retrieval.data.formats import DataError
from tests.helpers import compose_cfg, tiny_overrides, write_eval, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


def folders(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Training pairs and two BEIR sets of different sizes, "small" and "large"."""
    train = write_jsonl(tmp_path / "train.jsonl",
                        [{"query": f"eval query {i}", "positive": f"eval document {i}"} for i in range(48)])
    small, large = tmp_path / "sets" / "small", tmp_path / "sets" / "large"
    if not small.exists():
        write_eval(small, n_docs=12, n_queries=6)
        write_eval(large, n_docs=30, n_queries=15)
    return train, small, large


def config(tmp_path: Path, tiny_dir: str, *overrides: str, sets=None):
    """A tiny MoCo run of 6 steps of 8 pairs, validated at steps 3 and 6 on ``sets`` (both by default)."""
    train, small, large = folders(tmp_path)
    sets = [small, large] if sets is None else sets
    return compose_cfg("train", [*tiny_overrides(tiny_dir), "objective=moco", "objective.queue_size=32", "trainer=cpu",
                                 "logger=csv", "data=jsonl", f"data.train_path={train}",
                                 "data.eval_dirs=[" + ",".join(f"'{s}'" for s in sets) + "]",
                                 "data.batch_size=8", "trainer.val_check_interval=3", "trainer.max_steps=6",
                                 "trainer.max_epochs=-1", "trainer.enable_progress_bar=true", *overrides],
                       to_object=True)


def train(cfg, run_dir: Path) -> str:
    """train() in this process; what it printed."""
    from moco_retrieval.train import train as run

    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        run(cfg, run_dir)
    return out.getvalue()


def validation_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if any(k.startswith("val/") and k.endswith("recall@1") and v
                                                    for k, v in r.items())]


# ---- settings: one clear error, before any data or model ---------------------------------------------------------

def test_bad_eval_set_settings_are_located_errors(tmp_path, tiny_dir):
    _, small, large = folders(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(f"data.eval_dir={small} and data.eval_dirs=")):
        config(tmp_path, tiny_dir, f"data.eval_dir={small}")
    twin = tmp_path / "other" / "small"
    with pytest.raises(ConfigError, match=re.escape(f"data.eval_dirs[1]={twin}: a set is named by its folder, and "
                                                    f"data.eval_dirs[0]={small} is named 'small' too")):
        config(tmp_path, tiny_dir, sets=[small, twin])
    with pytest.raises(ConfigError, match=re.escape("data.eval_dirs[0]=") + ".*'mean' names the mean"):
        config(tmp_path, tiny_dir, sets=[tmp_path / "mean", small])
    with pytest.raises(ConfigError, match=re.escape("trainer.best_set='big': expected mean or a set of "
                                                    "data.eval_dirs (small, large)")):
        config(tmp_path, tiny_dir, "trainer.best_set=big")
    with pytest.raises(ConfigError, match=re.escape("trainer.best_set='small': expected mean (no data.eval_dirs")):
        config(tmp_path, tiny_dir, f"data.eval_dir={small}", "trainer.best_set=small", sets=[])


def test_a_missing_eval_folder_stops_the_run_before_the_model_loads(tmp_path, tiny_dir, monkeypatch):
    _, small, _ = folders(tmp_path)
    cfg = config(tmp_path, tiny_dir, sets=[small, tmp_path / "gone"])
    from moco_retrieval.training import module

    monkeypatch.setattr(module.RetrievalModule, "from_config", lambda cfg: pytest.fail("the model was built"))
    with pytest.raises(DataError, match=re.escape(f"data.eval_dirs[1]={tmp_path / 'gone'}: no such directory, "
                                                  "expected a BEIR-layout folder")):
        train(cfg, tmp_path / "run")


# ---- the data: each set capped alike, each its own validation loader --------------------------------------------

def test_each_set_is_named_by_its_folder_capped_alike_and_served_by_its_own_loader(tmp_path):
    from moco_retrieval.config import DataConfig
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.mine import eval_option

    train, small, large = folders(tmp_path)
    cfg = DataConfig(kind="jsonl", train_path=str(train), eval_dirs=[f"{large}/", str(small)], max_eval_queries=4,
                     batch_size=4, eval_batch_size=5)
    dm = RetrievalDataModule(cfg)
    assert list(dm.eval_sets) == ["large", "small"]
    assert [(len(ev.queries), len(ev.corpus)) for ev in dm.eval_sets.values()] == [(4, 30), (4, 12)]
    with pytest.raises(ValueError, match="2 evaluation sets"):
        dm.eval_set
    loaders = dm.val_dataloader()
    assert [sorted({b["kind"] for b in loader}) for loader in loaders] == [["doc", "query"]] * 2
    assert [sum(len(b["ids"]) for b in loader) for loader in loaders] == [34, 16]
    # neither eval_dir nor eval_dirs with pairs: the message offers both
    with pytest.raises(DataError, match=re.escape("data.eval_dir is required with data=jsonl (a BEIR-layout folder "
                                                  "for validation; or several: data.eval_dirs=[DIR,...])")):
        RetrievalDataModule(DataConfig(kind="jsonl", train_path=str(train))).eval_sets
    # mine's closing command validates on the same sets
    assert eval_option(cfg) == f"data.eval_dirs=[{large}/,{small}]"


# ---- training: per-set metrics, their mean, the best checkpoint by the chosen set -------------------------------

def test_two_sets_log_each_set_and_their_mean_and_the_best_checkpoint_follows_best_set(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    # 8 steps at a high rate, validated every 2: the small set scores best first, the mean later
    printed = train(config(tmp_path, tiny_dir, "trainer.best_set=small", "optim.lr=1e-2", "optim.warmup_ratio=0",
                           "trainer.val_check_interval=2", "trainer.max_steps=8"), run_dir)
    rows = validation_rows(run_dir)
    assert [int(float(r["step"])) for r in rows] == [2, 4, 6, 8]
    for r in rows:
        assert not r.get("val/recall@1")  # several sets: no unnamed metric
        assert (float(r["val/small/pool_queries"]), float(r["val/large/pool_queries"])) == (6, 15)
        for metric in ("recall@1", "ndcg@10", "mrr@10"):
            per_set = [float(r[f"val/{s}/{metric}"]) for s in ("small", "large")]
            assert float(r[f"val/mean/{metric}"]) == pytest.approx(sum(per_set) / 2)
    for s in ("small", "large", "mean"):
        assert re.search(rf"validation at step 8{' on ' + s if s != 'mean' else ', mean of 2 sets'}: recall@1", printed)
    assert "best small/recall@1" in printed
    final = json.loads((run_dir / "metrics.json").read_text())
    assert {"val/small/recall@1", "val/large/recall@1", "val/mean/recall@1"} <= set(final)
    # the best checkpoint is the first validation of the highest val/small/recall@1, not of the mean's
    def best(key: str) -> tuple[float, int]:
        score, step = max((float(r[key]), -int(float(r["step"]))) for r in rows)
        return score, -step

    best_score, best_step = best("val/small/recall@1")
    assert best_step != best("val/mean/recall@1")[1]  # (else this run could not tell them apart)
    assert [p.name for p in (run_dir / "checkpoints").glob("best-*.ckpt")] == [f"best-{best_step}.ckpt"]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = next(v for k, v in ckpt["callbacks"].items() if "'monitor': 'val/small/recall@1'" in k)
    assert float(state["best_model_score"]) == best_score
    assert (run_dir / "plots" / "cosines-small-step8.png").is_file() and (run_dir / "plots" / "cosines-large-step8.png").is_file()

    # the model card of the exported best checkpoint lists each set and the mean
    from moco_retrieval.export.__main__ import run_export

    out = tmp_path / "model"
    run_export(compose_cfg("export", [*tiny_overrides(tiny_dir), f"checkpoint={run_dir / 'checkpoints' / f'best-{best_step}.ckpt'}",
                                      f"out_dir={out}"]))
    card = (out / "README.md").read_text()
    assert f"- Data: JSONL pairs `{tmp_path / 'train.jsonl'}`; validated on 2 sets: `small`, `large`;" in card
    best_row = next(r for r in rows if int(float(r["step"])) == best_step)
    for s in ("small", "large", "mean"):
        line = next(l for l in card.splitlines() if l.startswith(f"| {s} |"))
        assert f"| {float(best_row[f'val/{s}/recall@1']):.4f} |" in line
    assert "| small | 6 / 12 |" in card and "| large | 15 / 30 |" in card


def test_one_set_in_eval_dirs_keeps_the_metric_names_of_one_pool(tmp_path, tiny_dir):
    _, small, _ = folders(tmp_path)
    run_dir = tmp_path / "run"
    train(config(tmp_path, tiny_dir, "trainer.max_steps=3", sets=[small]), run_dir)
    row = validation_rows(run_dir)[-1]
    assert float(row["val/pool_queries"]) == 6 and row["val/recall@1"]
    assert not any(k.startswith(("val/small/", "val/mean/")) for k in row)
    assert [p.name for p in (run_dir / "checkpoints").glob("best-*.ckpt")] == ["best-3.ckpt"]


# ---- evaluate: each set's report, and their mean ---------------------------------------------------------------

def test_evaluate_on_two_sets_writes_each_sets_report_and_their_mean(tmp_path, tiny_dir, capsys):
    from moco_retrieval.evaluate import run_evaluate

    _, small, large = folders(tmp_path)
    cfg = compose_cfg("evaluate", tiny_overrides(tiny_dir) + [
        f"data.eval_dirs=['{small}','{large}']", f"data.cache_dir={tmp_path / 'cache'}", "progress=false",
        "device=cpu", "plots=false", "eval.top_k=10", "compare=[base]", "name=tiny"])
    out = tmp_path / "report"
    run_evaluate(cfg, out)
    top = json.loads((out / "eval.json").read_text())
    assert list(top["sets"]) == ["small", "large"]
    for s, queries in (("small", 6), ("large", 15)):
        own = json.loads((out / s / "eval.json").read_text())
        assert own["dataset"]["queries"] == queries and own["dataset"]["dir"] == str(tmp_path / "sets" / s)
        assert (out / s / "run.tiny.trec").is_file() and (out / s / "run.base.trec").is_file()
        assert top["sets"][s]["metrics"]["tiny"] == own["models"]["tiny"]["metrics"]
    for model in ("tiny", "base"):
        for m, v in top["mean"][model].items():
            assert v == pytest.approx((top["sets"]["small"]["metrics"][model][m] + top["sets"]["large"]["metrics"][model][m]) / 2)
    report = (out / "report.md").read_text()
    assert "| **mean** |" in report and "| small | 6 | 12 |" in report and "| large | 15 | 30 |" in report
    printed = capsys.readouterr().out
    assert "tiny on small: recall@1" in printed and "tiny on large: recall@1" in printed
    assert f"tiny, mean of 2 sets: recall@1 {top['mean']['tiny']['recall@1']:.4f}" in printed
    # overwrite=true replaces the whole earlier evaluation, set folders included
    from moco_retrieval.evaluation.report import earlier_report

    assert {"small", "large", "eval.json", "report.md"} <= set(earlier_report(out))


# ---- W&B: a histogram pair and a table of sample queries per set -------------------------------------------------

def test_wandb_gets_each_sets_histograms_and_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from types import SimpleNamespace

    import numpy as np
    from lightning.pytorch.loggers import WandbLogger

    from moco_retrieval.config import EvalConfig
    from moco_retrieval.data.formats import read_beir
    from moco_retrieval.evaluation.encode import evaluate_embeddings
    from moco_retrieval.training import report

    class Recorder(WandbLogger):  # what ValidationReport hands W&B, without a W&B run
        def __init__(self):
            self.logged = []

        @property
        def experiment(self):
            return SimpleNamespace(log=self.logged.append)

    _, small, large = folders(tmp_path)
    sets = {"small": read_beir(small), "large": read_beir(large)}
    rng = np.random.default_rng(0)
    results = {name: evaluate_embeddings(list(ev.corpus), rng.normal(size=(len(ev.corpus), 8)).astype(np.float32),
                                         list(ev.queries), rng.normal(size=(len(ev.queries), 8)).astype(np.float32),
                                         ev.qrels, EvalConfig(top_k=5)) for name, ev in sets.items()}
    metrics = {f"val/{s}/{m}": float(np.mean([r.metrics[m] for r in results.values()])) if s == "mean"
               else float(results[s].metrics[m]) for s in ("small", "large", "mean") for m in ("recall@1", "ndcg@10")}
    lines = []
    monkeypatch.setattr(report, "log_line", lines.append)
    recorder = Recorder()
    trainer = SimpleNamespace(is_global_zero=True, sanity_checking=False, global_step=4, loggers=[recorder],
                              datamodule=SimpleNamespace(eval_sets=sets), callback_metrics={}, checkpoint_callback=None)
    callback = report.ValidationReport(tmp_path / "plots", sample_queries=3, monitor="val/large/recall@1")
    callback.on_validation_end(trainer, SimpleNamespace(last_val_results=results, last_val_metrics=metrics))
    keys = [set(payload) for payload in recorder.logged]
    assert keys == [{f"val/{s}/cos_positive", f"val/{s}/cos_unrelated", f"val/{s}/top5", "trainer/global_step"}
                    for s in ("small", "large")]
    assert [len({row[0] for row in p[f"val/{s}/top5"].data}) for p, s in zip(recorder.logged, sets)] == [3, 3]
    assert lines[0].startswith("validation at step 4 on small: ") and lines[1].startswith("validation at step 4 on large: ")
    assert lines[2].startswith(f"validation at step 4, mean of 2 sets: recall@1 {metrics['val/mean/recall@1']:.4f}")
    assert f"best large/recall@1 {metrics['val/large/recall@1']:.4f} (step 4)" in lines[2]
