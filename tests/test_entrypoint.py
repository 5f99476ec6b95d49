"""docker/entrypoint.sh: the exact command line it builds for each cluster environment.

The test puts stand-in `python`, `torchrun` (and, where needed, `nvidia-smi`, `wandb`) on a
PATH of its own; each stand-in prints its name and argv as JSON, so the assertion is on the
exact argument vector the entrypoint exec's, quoting included.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ENTRYPOINT = Path(__file__).resolve().parents[1] / "docker" / "entrypoint.sh"
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")

# Overrides that a naive `$*` or unquoted expansion would break.
TRICKY = [
    "+experiment=queue65k",
    "data.train_path=/data/my pairs.jsonl",
    "logger.name='it''s a \"run\"'",
    "logger.tags=[a,b]",
    "trainer.max_steps=100",
    "hydra.job.env_set.X=$HOME*",
]

STUB = """#!{python}
import json, os, sys
print(json.dumps({{"prog": os.path.basename(sys.argv[0]), "argv": sys.argv[1:]}}))
"""

NVIDIA_SMI = """#!/bin/sh
i=0
while [ "$i" -lt {n} ]; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; i=$((i+1)); done
"""


@pytest.fixture
def bindir(tmp_path: Path) -> Path:
    b = tmp_path / "bin"
    b.mkdir()
    for name in ("python", "torchrun", "wandb"):
        _write_exec(b / name, STUB.format(python=sys.executable))
    grep = shutil.which("grep")
    assert grep, "grep is needed by the entrypoint"
    os.symlink(grep, b / "grep")
    return b


def _write_exec(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def run(bindir: Path, args: list[str], env: dict[str, str] | None = None, check: bool = True):
    full_env = {"PATH": str(bindir), "HOME": str(bindir.parent)}
    full_env.update(env or {})
    proc = subprocess.run(
        [BASH, str(ENTRYPOINT), *args], env=full_env, capture_output=True, text=True, timeout=60
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def launched(bindir: Path, args: list[str], env: dict[str, str] | None = None) -> list[str]:
    proc = run(bindir, args, env)
    out = json.loads(proc.stdout)
    return [out["prog"], *out["argv"]]


# --- single process ---------------------------------------------------------------------------


def test_single_process_passes_overrides_intact(bindir):
    assert launched(bindir, TRICKY) == ["python", "-m", "moco_retrieval.train", *TRICKY]


def test_single_process_no_arguments(bindir):
    assert launched(bindir, []) == ["python", "-m", "moco_retrieval.train"]


def test_entry_module_override(bindir):
    argv = launched(bindir, ["ckpt=/ckpt/last.ckpt"], {"ENTRY": "moco_retrieval.evaluate"})
    assert argv == ["python", "-m", "moco_retrieval.evaluate", "ckpt=/ckpt/last.ckpt"]


def test_printed_command_line_is_the_launched_one(bindir):
    proc = run(bindir, TRICKY)
    line = [ln for ln in proc.stderr.splitlines() if "launcher=single" in ln]
    assert len(line) == 1, proc.stderr
    printed = line[0].split(": ", 1)[1]
    assert shlex.split(printed) == ["python", "-m", "moco_retrieval.train", *TRICKY]


def test_dry_run_prints_without_running(bindir):
    proc = run(bindir, ["+experiment=queue65k"], {"DRY_RUN": "1"})
    assert proc.stdout == ""
    assert "python -m moco_retrieval.train +experiment=queue65k" in proc.stderr


def test_accelerator_from_environment(bindir):
    _write_exec(bindir / "nvidia-smi", NVIDIA_SMI.format(n=1))  # a GPU alone changes nothing
    assert launched(bindir, ["+experiment=queue65k"]) == ["python", "-m", "moco_retrieval.train", "+experiment=queue65k"]
    assert launched(bindir, ["a=1"], {"ACCELERATOR": "gpu"})[3:] == ["trainer.accelerator=gpu", "a=1"]
    # the user's own override wins over ACCELERATOR
    assert launched(bindir, ["trainer.accelerator=cpu"], {"ACCELERATOR": "gpu"})[3:] == ["trainer.accelerator=cpu"]


def test_command_instead_of_overrides(bindir):
    argv = launched(bindir, ["wandb", "sync", "outputs/run 1/wandb/offline-run-x"])
    assert argv == ["wandb", "sync", "outputs/run 1/wandb/offline-run-x"]


# --- SLURM ------------------------------------------------------------------------------------

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "moco",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "11",
    "SLURM_LOCALID": "3",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
}


def test_slurm_runs_python_with_devices_and_nodes(bindir):
    assert launched(bindir, TRICKY, SLURM) == [
        "python", "-m", "moco_retrieval.train",
        "trainer.devices=8", "trainer.num_nodes=2", "hydra.run.dir=outputs/4242",
        *TRICKY,
    ]


def test_slurm_without_ntasks_per_node(bindir):
    env = {k: v for k, v in SLURM.items() if k not in ("SLURM_NTASKS_PER_NODE", "SLURM_NNODES")}
    argv = launched(bindir, [], env)
    assert argv[3:5] == ["trainer.devices=8", "trainer.num_nodes=2"]


def test_slurm_user_overrides_win(bindir):
    args = ["trainer.devices=8", "+trainer.num_nodes=2", "hydra.run.dir=/scratch/run"]
    assert launched(bindir, args, {**SLURM, "OUTPUT_ROOT": "/out"}) == [
        "python", "-m", "moco_retrieval.train", *args,
    ]


def test_slurm_array_job_run_dir(bindir):
    env = {**SLURM, "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "7", "OUTPUT_ROOT": "/out"}
    assert launched(bindir, [], env)[-1] == "hydra.run.dir=/out/4200_7"


def test_slurm_interactive_shell_is_single_process(bindir):
    env = {**SLURM, "SLURM_JOB_NAME": "interactive", "RUN_DIR_FROM_JOB": "0"}
    assert launched(bindir, ["a=1"], env) == ["python", "-m", "moco_retrieval.train", "a=1"]


def test_slurm_wins_over_torchrun_variables(bindir):
    env = {**SLURM, "MASTER_ADDR": "node1", "MASTER_PORT": "12910", "WORLD_SIZE": "16"}
    assert launched(bindir, [], env)[0] == "python"


# --- torchrun rendezvous ----------------------------------------------------------------------


def test_torchrun_plain(bindir):
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "16", "NODE_RANK": "1",
           "NPROC_PER_NODE": "8"}
    assert launched(bindir, TRICKY, env) == [
        "torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8",
        "--master_addr=10.0.0.1", "--master_port=29500",
        "-m", "moco_retrieval.train", "trainer.devices=8", "trainer.num_nodes=2", *TRICKY,
    ]


def test_torchrun_explicit_nnodes_and_extra_args(bindir):
    env = {"MASTER_ADDR": "h0", "MASTER_PORT": "1", "WORLD_SIZE": "4", "NODE_RANK": "0", "NNODES": "4",
           "NPROC_PER_NODE": "1", "TORCHRUN_ARGS": "--max_restarts=3 --log_dir=/tmp/tr",
           "MOCO_RETRIEVAL_JOB_ID": "exp7"}
    assert launched(bindir, ["x=1"], env) == [
        "torchrun", "--nnodes=4", "--node_rank=0", "--nproc_per_node=1", "--master_addr=h0", "--master_port=1",
        "--max_restarts=3", "--log_dir=/tmp/tr",
        "-m", "moco_retrieval.train", "trainer.devices=1", "trainer.num_nodes=4", "hydra.run.dir=outputs/exp7", "x=1",
    ]


def test_pytorchjob_legacy_world_size_counts_pods(bindir):
    # Kubeflow PyTorchJob: WORLD_SIZE = number of pods, RANK = the pod's index (= node rank)
    env = {"MASTER_ADDR": "moco-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
           "PET_NPROC_PER_NODE": "8", "PYTORCHJOB_NAME": "moco-queue65k"}
    assert launched(bindir, TRICKY, env) == [
        "torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8",
        "--master_addr=moco-master-0", "--master_port=23456",
        "-m", "moco_retrieval.train", "trainer.devices=8", "trainer.num_nodes=2",
        "hydra.run.dir=outputs/moco-queue65k", *TRICKY,
    ]


def test_pytorchjob_operator_with_nproc_per_node(bindir):
    # training-operator >= 1.7 with nprocPerNode: "8": WORLD_SIZE = pods x 8, PET_NNODES = pods
    env = {"MASTER_ADDR": "moco-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "16", "RANK": "1",
           "PET_NPROC_PER_NODE": "8", "PET_NNODES": "2", "PET_NODE_RANK": "1"}
    assert launched(bindir, [], env)[:4] == ["torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8"]


def test_pytorchjob_nproc_auto_counts_gpus(bindir):
    _write_exec(bindir / "nvidia-smi", NVIDIA_SMI.format(n=4))
    env = {"MASTER_ADDR": "m", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "0",
           "PET_NPROC_PER_NODE": "auto", "PET_NNODES": "2"}
    assert launched(bindir, ["a=b"], env) == [
        "torchrun", "--nnodes=2", "--node_rank=0", "--nproc_per_node=4", "--master_addr=m", "--master_port=23456",
        "-m", "moco_retrieval.train", "trainer.devices=4", "trainer.num_nodes=2", "a=b",
    ]


def test_one_node_several_processes(bindir):
    # docker run --gpus all -e NPROC_PER_NODE=gpu ...: torchrun on this machine alone
    _write_exec(bindir / "nvidia-smi", NVIDIA_SMI.format(n=8))
    assert launched(bindir, TRICKY, {"NPROC_PER_NODE": "gpu"}) == [
        "torchrun", "--nnodes=1", "--node_rank=0", "--nproc_per_node=8", "--master_addr=127.0.0.1",
        "--master_port=29500", "-m", "moco_retrieval.train", "trainer.devices=8", "trainer.num_nodes=1", *TRICKY,
    ]
    (bindir / "nvidia-smi").unlink()  # no GPU: "gpu" falls back to one process
    argv = launched(bindir, [], {"NPROC_PER_NODE": "gpu", "MASTER_PORT": "29600"})
    assert argv[3:6] == ["--nproc_per_node=1", "--master_addr=127.0.0.1", "--master_port=29600"]


def test_inside_a_torchrun_worker_runs_python(bindir):
    env = {"MASTER_ADDR": "m", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    assert launched(bindir, ["a=b"], env) == ["python", "-m", "moco_retrieval.train", "a=b"]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "10", "NODE_RANK": "0", "NPROC_PER_NODE": "8"}, "not a multiple"),
        ({"WORLD_SIZE": "2", "RANK": "0", "PET_NNODES": "1:3"}, "elastic"),
        ({"WORLD_SIZE": "2", "RANK": "2", "NPROC_PER_NODE": "1"}, "not below"),
        ({"WORLD_SIZE": "2", "RANK": "0", "NPROC_PER_NODE": "many"}, "nproc_per_node"),
    ],
)
def test_torchrun_bad_environment_fails_clearly(bindir, env, message):
    proc = run(bindir, [], {"MASTER_ADDR": "m", "MASTER_PORT": "1", **env}, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""


def test_forced_launcher(bindir):
    env = {"LAUNCHER": "torchrun", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "WORLD_SIZE": "2",
           "NODE_RANK": "0", "NPROC_PER_NODE": "2"}
    assert launched(bindir, [], env)[:4] == ["torchrun", "--nnodes=1", "--node_rank=0", "--nproc_per_node=2"]
    proc = run(bindir, [], {"LAUNCHER": "mpi"}, check=False)
    assert proc.returncode == 2 and "LAUNCHER" in proc.stderr
