"""objective.distill end to end (issue 47): a tiny run learns teacher scores and logs both terms; a run
whose rows lack scores stops with one message before the model loads."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moco_retrieval.errors import USER_ERROR_STATUS
from tests.helpers import compose_cfg, tiny_overrides, write_eval, write_jsonl


def scored_data(folder: Path, n: int = 24, unscored_row: int | None = None) -> list[str]:
    rows = []
    for i in range(n):
        negatives = [{"text": f"other text {i} {j}"} for j in range(2)]
        row = {"query": f"query {i}", "positive": f"document {i}", "negatives": negatives}
        if i != unscored_row:
            row.update(positive_score=5.0, negative_scores=[1.0 + j for j in range(2)])
        rows.append(row)
    write_jsonl(folder / "train.jsonl", rows)
    write_eval(folder / "eval")
    return [f"data.train_path={folder / 'train.jsonl'}", f"data.eval_dir={folder / 'eval'}", "data.n_negatives=2",
            "data.batch_size=4", "data.eval_batch_size=8"]


def run_overrides(tiny_dir, tmp_path, *extra):
    return [*tiny_overrides(tiny_dir), "data=jsonl", "trainer=cpu", "logger=csv", "trainer.max_steps=3",
            "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "optim.warmup_steps=1", f"run_dir={tmp_path / 'run'}", *extra]


@pytest.mark.parametrize("objective", [["objective=inbatch", "objective.distill=kl"],
                                       ["objective=moco", "objective.queue_size=8", "objective.distill=margin_mse",
                                        "objective.contrastive_weight=0"]])
def test_a_tiny_run_distils_and_logs_both_terms(objective, tiny_dir, tmp_path, monkeypatch):
    from moco_retrieval.train import train

    monkeypatch.setenv("MOCO_RETRIEVAL_CACHE", str(tmp_path / "cache"))
    cfg = compose_cfg("train", run_overrides(tiny_dir, tmp_path, *scored_data(tmp_path), *objective), to_object=True)
    train(cfg, tmp_path / "run")
    logged = list(csv.DictReader(open(next((tmp_path / "run").rglob("metrics.csv")))))
    distill = [float(r["train/loss_distill"]) for r in logged if r.get("train/loss_distill")]
    assert len(distill) == 3 and all(d >= 0 for d in distill)


def test_a_run_whose_rows_lack_scores_stops_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch):
    from moco_retrieval import train as train_command
    from moco_retrieval.training.module import RetrievalModule

    monkeypatch.setenv("MOCO_RETRIEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(RetrievalModule, "from_config", classmethod(lambda cls, cfg: pytest.fail("the model loaded")))
    monkeypatch.setattr("hydra.core.hydra_config.HydraConfig.get", lambda: OmegaConf.create(
        {"runtime": {"output_dir": str(tmp_path / "hydra")}, "overrides": {"task": [], "hydra": []}}))
    cfg = compose_cfg("train", run_overrides(tiny_dir, tmp_path, *scored_data(tmp_path, unscored_row=5),
                                             "objective=inbatch", "objective.distill=kl"))
    with pytest.raises(SystemExit) as stop:
        train_command.main.__wrapped__(cfg)
    assert stop.value.code == USER_ERROR_STATUS
    err = " ".join(capsys.readouterr().err.split())
    assert (f"{tmp_path / 'train.jsonl'}:6: training example 5 (query 'query 5') has no teacher scores (1 of 24 rows "
            "lack them), but objective.distill trains on them") in err
    assert "Traceback" not in err
