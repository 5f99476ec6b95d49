"""The README's commands as written: its first run (the smoke preset, with its data setting, on a
small set built from planted apt index files), then its evaluate / export / search / mine commands
with no data.debian_dir or $MOCO_RETRIEVAL_DEBIAN_DIR (the cached set is found); and every command
of the README and the user guide composes as a valid strict config."""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, compose_cfg

WORDS = ("image audio video text editor library python tool command line package manager compress archive "
         "backup font color terminal shell mail web browser chess game network server file system").split()


def readme_commands(section: str = "## Evaluate, export, search, mine") -> list[str]:
    """The ``python -m`` lines of the first bash block after ``section``, comments cut."""
    text = (REPO / "README.md").read_text()
    block = text[text.index(section):]
    block = block[block.index("```bash") + len("```bash"): block.index("```", block.index("```bash") + 7)]
    return [line.split("   #")[0].strip() for line in block.splitlines() if line.startswith("python -m")]


def documented_commands() -> list[tuple[str, str]]:
    """(file, line) for every ``python -m moco_retrieval.<command>`` line in a bash block of the
    README and the user guide."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            found += [(path.name, line.split("   #")[0].strip()) for line in block.splitlines()
                      if line.startswith("python -m moco_retrieval.")]
    return found


def test_every_documented_command_composes_as_a_strict_config():
    """Each train / evaluate / export / search / mine line of the docs names keys and values the
    schema accepts (a renamed key or a preset that no longer exists fails here, in seconds)."""
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from moco_retrieval.config import COMMAND_SCHEMAS, check_known_keys

    commands = documented_commands()
    names = {c.split()[2].removeprefix("moco_retrieval.") for _, c in commands}
    assert {"train", "evaluate", "export", "search", "mine"} <= names
    checked = 0
    for where, command in commands:
        name, *overrides = shlex.split(command)[2:]
        name = name.removeprefix("moco_retrieval.")
        if name not in COMMAND_SCHEMAS or any(o.startswith("--") for o in overrides):
            continue
        GlobalHydra.instance().clear()
        try:
            cfg = compose_cfg(name, overrides)
            check_known_keys(cfg)
            OmegaConf.to_object(cfg)
        except Exception as e:  # (the message names the file and the line)
            raise AssertionError(f"{where}: {command}\n{type(e).__name__}: {e}") from e
        checked += 1
    GlobalHydra.instance().clear()
    assert checked >= 20


def plant_apt_lists(d: Path, n: int = 240) -> Path:
    """Packages + Translation-en for ``n`` packages of random words (one source per 3 packages)."""
    rng = random.Random(0)
    d.mkdir(parents=True)
    tr, pk = [], []
    for i in range(n):
        short = " ".join(rng.sample(WORDS, 3)) + f" {i}"
        desc = f"{short}\n " + " ".join(rng.sample(WORDS, 12)) + f" number {i}."
        md5 = hashlib.md5((desc + "\n").encode()).hexdigest()
        tr.append(f"Package: p{i}\nDescription-md5: {md5}\nDescription-en: {desc}\n")
        pk.append(f"Package: p{i}\nSource: s{i // 3}\nVersion: 1.0\nArchitecture: amd64\n"
                  f"Description: {short}\nDescription-md5: {md5}\n")
    (d / "Translation-en").write_text("\n".join(tr))
    (d / "Packages").write_text("\n".join(pk))
    return d


def run(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_readme_commands_run_as_written_on_the_built_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MOCO_RETRIEVAL_DEBIAN_DIR"}
    env.update(MOCO_RETRIEVAL_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", WANDB_MODE="offline",
               PYTHONPATH=str(REPO))
    work = tmp_path / "work"
    work.mkdir()
    run_dir = work / "outputs" / "run"
    # the README's first run builds the set from the apt lists it names (here, and only here)
    apt = plant_apt_lists(tmp_path / "apt")
    (first,) = readme_commands("## A first run in 20 seconds")
    assert "data.debian_dir=../shared/data/debian-bookworm" in first and "run_dir=runs/first" in first
    first = first.replace("data.debian_dir=../shared/data/debian-bookworm", f"data.debian_dir={apt}")
    started = run(shlex.split(first.replace("run_dir=runs/first", f"run_dir={run_dir}"))[1:], work, env)
    assert f"to resume this run: python -m moco_retrieval.train +experiment=smoke data.debian_dir={apt} " \
           f"run_dir={run_dir} ckpt_path=last" in started.stderr
    for name in ("checkpoints/last.ckpt", "metrics.csv", "metrics.json", "config.yaml"):
        assert (run_dir / name).is_file(), name  # the folder the README draws
    assert list((run_dir / "plots").glob("cosines-step*.png"))
    commands = readme_commands()
    assert [c.split()[2] for c in commands] == ["moco_retrieval.evaluate", "moco_retrieval.export",
                                                "moco_retrieval.search", "moco_retrieval.search", "moco_retrieval.mine"]
    outs = {}
    for i, command in enumerate(commands):
        args = shlex.split(command.replace("RUN/", f"{run_dir}/"))[1:]
        outs[i] = run(args, work, env)
    # evaluate: the report in its own folder, not among the training runs
    reports = list((work / "evaluations").glob("*/*/eval.json"))
    assert len(reports) == 1 and sorted(json.loads(reports[0].read_text())["models"]) == ["base", "run-last"]
    assert not list((work / "outputs").rglob("eval.json")) and not list((work / "outputs").rglob("report.md"))
    assert re.search(r"encoding [\d,]+ documents \+ [\d,]+ queries \(the pool, model run-last\) on cpu: about \d+ s",
                     outs[0].stderr)
    # export: files with the umask's permissions, and a model card with what training knows
    umask = os.umask(0o022)
    os.umask(umask)
    for f in (work / "my_model").rglob("*"):
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f
    card = (work / "my_model" / "README.md").read_text()
    assert "base_model: tiny-bert-h32-l2" in card and "Unknown" not in card
    assert "`objective=moco`" in card and "queue_size=256" in card and "Debian package descriptions" in card
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert f"{metrics['val/recall@1']:.4f}" in card and 'SentenceTransformer("my_model")' in card
    # search: corpus=eval is the held-out pool; without it, every description, said up front
    manifest = json.loads(next((tmp_path / "cache").glob("debian-*/manifest.json")).read_text())["counts"]
    assert f"of {manifest['eval_documents']:,} documents (the held-out pool" in outs[2].stderr
    assert f"encoding {manifest['pairs']:,} documents (Debian package descriptions" in outs[3].stderr
    assert "corpus=eval searches only the held-out pool" in outs[3].stderr or "about" in outs[3].stderr
    assert "resize images from the command line" in outs[3].stdout and " 1. " in outs[3].stdout
    # mine: the output, and the eval folder to train with named
    eval_dir = next(p for p in (tmp_path / "cache").glob("debian-*") if p.is_dir()) / "eval"
    assert (work / "mined.jsonl").is_file()
    assert f"data.eval_dir={eval_dir} " in outs[4].stdout
    # log files get plain lines, never tqdm's carriage-return redraws
    for proc in outs.values():
        assert "\r" not in proc.stderr


def test_ci_runs_exactly_the_readmes_install_and_test_commands():
    """.ci/run says it runs the README's install and test commands: hold the two to each other."""
    ci = (REPO / ".ci" / "run").read_text()
    text = (REPO / "README.md").read_text()
    for section in ("## Install", "## Test"):
        block = text[text.index(section):]
        block = block[block.index("```bash") + 7: block.index("```", block.index("```bash") + 7)]
        commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
        assert commands, section
        for command in commands:
            assert re.search(rf"^{re.escape(command)}$", ci, re.M), f"README {section}: {command!r} is not what .ci/run runs"
