"""moco_retrieval.training.cluster (job id, SLURM detection) and moco_retrieval.training.loggers (W&B mode and grouping)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from moco_retrieval.training.cluster import job_id, on_slurm
from moco_retrieval.training.loggers import wandb_mode, wandb_settings
from moco_retrieval.config import LoggerConfig


def cfg(**kw):
    return OmegaConf.structured(LoggerConfig(**kw))


# --- job_id -----------------------------------------------------------------------------------


def test_job_id_none_outside_a_job():
    assert job_id({}) is None
    assert job_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default when no --rdzv-id


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"SLURM_JOB_ID": "4242"}, "4242"),
        ({"SLURM_JOB_ID": "4250", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "8"}, "4242_8"),
        ({"PYTORCHJOB_NAME": "moco-queue65k"}, "moco-queue65k"),
        ({"K8S_JOB_NAME": "moco-job"}, "moco-job"),
        ({"TORCHELASTIC_RUN_ID": "rdzv-7"}, "rdzv-7"),
        ({"SLURM_JOB_ID": "1", "TORCHELASTIC_RUN_ID": "x"}, "1"),
        ({"MOCO_RETRIEVAL_JOB_ID": "mine", "SLURM_JOB_ID": "1"}, "mine"),
        ({"SLURM_JOB_ID": "", "PYTORCHJOB_NAME": "p"}, "p"),
    ],
)
def test_job_id(env, expected):
    assert job_id(env) == expected


def test_job_id_reads_os_environ(monkeypatch):
    for var in ("MOCO_RETRIEVAL_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert job_id() == "77"


# --- on_slurm ---------------------------------------------------------------------------------


def test_on_slurm():
    assert on_slurm({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "16", "SLURM_JOB_NAME": "moco"})
    assert not on_slurm({})
    assert not on_slurm({"SLURM_JOB_ID": "1"})  # an allocation, but not started by srun
    assert not on_slurm({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "bash"})
    assert not on_slurm({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "interactive"})


# --- W&B --------------------------------------------------------------------------------------

KEY = {"WANDB_API_KEY": "x" * 40}


@pytest.mark.parametrize(
    "env, logger, expected",
    [
        ({}, cfg(), "offline"),  # the default: never waits for a network
        (KEY, cfg(), "offline"),  # a key alone does not turn it online
        ({"WANDB_MODE": "online"}, cfg(), "offline"),  # online without a key would hang or fail
        ({**KEY, "WANDB_MODE": "online"}, cfg(), "online"),
        ({**KEY, "WANDB_MODE": "ONLINE "}, cfg(), "online"),
        (KEY, cfg(mode="online"), "online"),
        ({}, cfg(mode="online"), "offline"),
        ({**KEY, "WANDB_MODE": "online"}, cfg(mode="offline"), "offline"),  # the config is explicit
        ({**KEY, "WANDB_MODE": "dryrun"}, cfg(), "offline"),
        ({"WANDB_MODE": "disabled"}, cfg(), "disabled"),
        ({**KEY, "WANDB_MODE": "online"}, cfg(wandb=False), "disabled"),
        ({}, cfg(mode="disabled"), "disabled"),
        ({**KEY, "WANDB_MODE": "online"}, None, "online"),
    ],
)
def test_wandb_mode(env, logger, expected):
    mode, reason = wandb_mode(logger, env)
    assert mode == expected
    assert reason


def test_wandb_mode_says_why_it_stayed_offline():
    assert "WANDB_API_KEY" in wandb_mode(cfg(), {"WANDB_MODE": "online"})[1]


def test_wandb_mode_rejects_unknown():
    with pytest.raises(ValueError, match="sometimes"):
        wandb_mode(cfg(mode="sometimes"), {})


def test_wandb_settings_group_is_the_job_id():
    s = wandb_settings(cfg(tags=["a"]), env={"SLURM_JOB_ID": "4242"})
    assert s == {
        "project": "moco-retrieval", "entity": None, "name": None, "group": "4242", "tags": ["a"],
        "mode": "offline", "offline": True,
    }


def test_wandb_settings_explicit_group_and_run_dir(tmp_path):
    s = wandb_settings(cfg(group="ablation", name="r1", entity="team"), run_dir=tmp_path,
                       env={**KEY, "WANDB_MODE": "online", "SLURM_JOB_ID": "1"})
    assert (s["group"], s["name"], s["entity"], s["mode"], s["offline"]) == ("ablation", "r1", "team", "online", False)
    assert s["save_dir"] == str(tmp_path)


def test_wandb_settings_plain_dict_and_no_job():
    s = wandb_settings({"project": "p", "wandb": True}, env={})
    assert s["group"] is None and s["project"] == "p" and s["mode"] == "offline"


def test_wandb_settings_feed_wandb_logger(tmp_path, monkeypatch):
    """The dict goes straight into Lightning's WandbLogger, and offline needs no network."""
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    for var in ("WANDB_API_KEY", "MOCO_RETRIEVAL_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    # WandbLogger(offline=True) writes WANDB_MODE into os.environ; monkeypatch restores it after
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(**wandb_settings(cfg(), run_dir=str(tmp_path)))
    try:
        logger.log_metrics({"loss": 1.0}, step=0)
        assert logger.experiment.group == "4242"
    finally:
        logger.experiment.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*")), list(tmp_path.rglob("*"))[:20]
