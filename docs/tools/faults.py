"""The fault table: every failure case of docs/faults.md run for real, each command as a subprocess
(tiny models, the smoke experiment, planted files in a temporary folder), and the table written
from what came out, so it stays true.

    python docs/tools/faults.py                 # all cases, writes docs/faults.md (~15 min on 2 busy cores)
    python docs/tools/faults.py --only lock,ckpt_empty --out /tmp/faults.md

Not a test (tests/test_faults.py and tests/test_torchrun.py assert the same behaviour) and not a
measurement; a record, generated as docs/configuration.md is (beside config_reference.py).
Columns: the case, the exit status, what the user sees (the command's own lines on stderr, paths
shortened to RUN/DATA), and what is kept in the run directory afterwards.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from moco_retrieval.training.checkpoints import last_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SHARED_DEBIAN = ROOT.parent / "shared" / "data" / "debian-bookworm"  # the apt lists, when next to the repository
PY = sys.executable
SMOKE = ["+experiment=smoke", "data.max_train_examples=128", "data.max_eval_queries=16", "data.max_eval_docs=32",
         "trainer.val_check_interval=3", "trainer.log_every_n_steps=1"]
PROGRESS = re.compile(r"\bstep (\d+)/(\d+)\b")
# torch.save into /dev/full from the second checkpoint on: a disk that fills up during the run
DISK_FULL = (
    "import os, sys, runpy; real = os.open; n = [0]\n"
    "def full(path, flags, mode=0o777):\n"
    "    if str(path).endswith('.tmp') and '.last.ckpt.' in str(path):\n"
    "        n[0] += 1\n"
    "        if n[0] > 1: return real('/dev/full', os.O_WRONLY)\n"
    "    return real(path, flags, mode)\n"
    "os.open = full; sys.argv = ['moco_retrieval.train'] + sys.argv[1:]\n"
    "runpy.run_module('moco_retrieval.train', run_name='__main__')\n"
)


@dataclass
class Case:
    key: str
    title: str
    argv: Callable[["Work"], list[str]]
    setup: Callable[["Work"], None] = lambda w: None
    on_line: Optional[Callable[["Work", subprocess.Popen, str], None]] = None
    notes: str = ""


@dataclass
class Work:
    tmp: Path
    run: Path = field(init=False)
    data: Path = field(init=False)
    state: dict = field(default_factory=dict)

    def __post_init__(self):
        self.run, self.data = self.tmp / "run", self.tmp / "data"
        self.data.mkdir(parents=True, exist_ok=True)


def train(*extra: str) -> Callable[[Work], list[str]]:
    return lambda w: [PY, "-m", "moco_retrieval.train", *SMOKE, f"run_dir={w.run}", f"hydra.run.dir={w.tmp / 'hydra'}",
                      *[e.format(run=w.run, data=w.data) for e in extra]]


def command(name: str, *extra: str) -> Callable[[Work], list[str]]:
    return lambda w: [PY, "-m", f"moco_retrieval.{name}", f"hydra.run.dir={w.tmp / 'hydra'}",
                      *[e.format(run=w.run, data=w.data) for e in extra]]


# ---- planted files ----------------------------------------------------------------------------------

def _beir(w: Work, corpus_ids=("d1", "d2")) -> None:
    from moco_retrieval.data.formats import write_jsonl

    d = w.data / "beir"
    (d / "qrels").mkdir(parents=True, exist_ok=True)
    write_jsonl(d / "corpus.jsonl", [{"_id": i, "text": f"document {i}"} for i in corpus_ids])
    write_jsonl(d / "queries.jsonl", [{"_id": "q1", "text": "a query"}])
    (d / "qrels" / "test.tsv").write_text(f"query-id\tcorpus-id\tscore\nq1\t{corpus_ids[-1]}\t1\n")


def _pairs(w: Work, text: str | bytes) -> None:
    _beir(w)
    p = w.data / "train.jsonl"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())


JSONL = ["data=jsonl", "data.train_path={data}/train.jsonl", "data.eval_dir={data}/beir"]
GOOD_ROW = '{"query": "how to install", "positive": "apt tool"}\n'


def _hold_lock(w: Work) -> None:
    w.state["holder"] = subprocess.Popen(
        [PY, "-c", "import sys, time; from moco_retrieval.training.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
                   "print('held', flush=True); time.sleep(900)", str(w.run)], stdout=subprocess.PIPE, text=True)
    w.state["holder"].stdout.readline()


def _trained(w: Work) -> None:
    """A finished smoke run in RUN (8 steps: last.ckpt at 8, last.prev.ckpt from the validation at 6)."""
    subprocess.run(train("ckpt_path=last")(w), cwd=w.tmp, capture_output=True, check=True, env=ENV)


def _truncate_last(w: Work) -> None:
    _trained(w)
    last = last_checkpoint(w.run)
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])


def _bad_ckpt(kind: str) -> Callable[[Work], None]:
    def setup(w: Work) -> None:
        p = w.data / "model.ckpt"
        if kind == "empty":
            p.write_bytes(b"")
        elif kind == "random":
            p.write_bytes(os.urandom(65536))
        else:
            p.mkdir()
    return setup


def _sigkill_after_step_4(w: Work, proc: subprocess.Popen, line: str) -> None:
    m = PROGRESS.search(line)
    if m and int(m.group(1)) >= 4 and not w.state.get("killed"):
        w.state["killed"] = True
        proc.kill()


def _killed_then_requeued(w: Work) -> None:
    """A run SIGKILLed after step 4 (lock file and the step-3 checkpoint stay) and 10 temporaries
    as killed checkpoint writes leave them."""
    proc = subprocess.Popen(train("ckpt_path=last")(w), cwd=w.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ENV)
    for line in proc.stdout:
        _sigkill_after_step_4(w, proc, line)
    proc.wait()
    for i in range(10):
        (w.run / "checkpoints" / f".last.ckpt.{i:032x}.tmp").write_bytes(b"\0" * 100_000)


def _stall_rank_1(w: Work, proc: subprocess.Popen, line: str) -> None:
    m = PROGRESS.search(line)
    if m and int(m.group(1)) >= 2 and "stopped" not in w.state:
        w.state["stopped"] = _worker(proc.pid, 1)
        os.kill(w.state["stopped"], signal.SIGSTOP)
    elif "waited" in line and w.state.get("stopped"):
        os.kill(w.state["stopped"], signal.SIGKILL)


def _worker(parent: int, local_rank: int) -> int:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env:
            return int(stat.parent.name)
    raise RuntimeError("no such worker")


TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "moco_retrieval.train"]

CASES = [
    Case("json_truncated", "training pairs: a truncated JSON line", train(*JSONL), lambda w: _pairs(w, GOOD_ROW + '{"query": "q", "posi')),
    Case("utf8", "training pairs: bad UTF-8", train(*JSONL), lambda w: _pairs(w, GOOD_ROW.encode() + b'{"query": "caf\xe9", "positive": "x"}\n')),
    Case("wrong_type", "training pairs: a field of the wrong type", train(*JSONL), lambda w: _pairs(w, GOOD_ROW + '{"query": 42, "positive": "x"}\n')),
    Case("empty_file", "training pairs: an empty file", train(*JSONL), lambda w: _pairs(w, "")),
    Case("doc_id_twice", "training pairs: one doc_id, two texts", train(*JSONL),
         lambda w: _pairs(w, '{"query": "a", "positive": "apt tool", "doc_id": "d7"}\n{"query": "b", "positive": "dpkg", "doc_id": "d7"}\n')),
    Case("train_path_dir", "data.train_path is a directory", train("data=jsonl", "data.train_path={data}", "data.eval_dir={data}/beir"), _beir),
    Case("no_data", "data=jsonl without data.train_path", train("data=jsonl")),
    Case("qrels_missing_id", "BEIR qrels name a document not in the corpus", train(*JSONL),
         lambda w: (_pairs(w, GOOD_ROW), (w.data / "beir" / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tnope\t1\n"))),
    Case("id_whitespace", "evaluate: a BEIR _id with a space", command("evaluate", "model=tiny", "data=beir", "data.dir={data}/beir"),
         lambda w: _beir(w, ("d1", "doc one"))),
    Case("momentum", "objective.momentum=1.5", train("objective.momentum=1.5")),
    Case("lr", "optim.lr=0", train("optim.lr=0")),
    Case("typo", "a typo in a key (Hydra's own check)", train("objective.temprature=0.1")),
    Case("lock", "a second training in a run directory in use", train("seed=1"), _hold_lock),
    Case("ckpt_empty", "ckpt_path: a zero-byte file", train("ckpt_path={data}/model.ckpt"), _bad_ckpt("empty")),
    Case("ckpt_random", "ckpt_path: random bytes", train("ckpt_path={data}/model.ckpt"), _bad_ckpt("random")),
    Case("ckpt_dir", "ckpt_path: a directory", train("ckpt_path={data}/model.ckpt"), _bad_ckpt("dir")),
    Case("ckpt_last_fresh", "ckpt_path=last, no checkpoint (a mistyped run_dir)", train("ckpt_path=last")),
    Case("ckpt_last_truncated", "ckpt_path=last, last.ckpt truncated", train("ckpt_path=last"), _truncate_last),
    Case("ckpt_options", "ckpt_path=last, resumed under other objective options (objective.temperature=0.1)",
         train("ckpt_path=last", "objective.temperature=0.1"), _trained),
    Case("sigkill_requeue", "SIGKILL after step 4 (lock and 10 write temporaries left), then the requeue",
         train("ckpt_path=last"), _killed_then_requeued),
    Case("disk_full", "the disk fills up: the second write of last.ckpt fails",
         lambda w: [PY, "-c", DISK_FULL, *train()(w)[3:]],
         notes="simulated: the checkpoint writes go to /dev/full, so the free space shown is the real disk's"),
    Case("evaluate_ckpt", "evaluate: a zero-byte checkpoint", command("evaluate", "model=tiny", "data=beir", "data.dir={data}/beir",
                                                                       "checkpoint={data}/model.ckpt"),
         lambda w: (_beir(w), _bad_ckpt("empty")(w))),
    Case("export_ckpt", "export: random bytes as checkpoint", command("export", "checkpoint={data}/model.ckpt", "out_dir={data}/out"),
         _bad_ckpt("random")),
    Case("search_model_dir", "search: a model_dir that is not there", command("search", "model_dir={data}/nowhere", "query=x",
                                                                              "corpus={data}/beir"), _beir),
    Case("mine_output", "mine: no output given", command("mine", "data=jsonl", "data.train_path={data}/train.jsonl"),
         lambda w: _pairs(w, GOOD_ROW)),
    Case("stalled_rank", "DDP: rank 1 of 2 stopped (SIGSTOP) after step 2, trainer.process_group_timeout=10",
         lambda w: [*TORCHRUN, *SMOKE, "trainer=ddp", "trainer.accelerator=cpu", "trainer.process_group_timeout=10",
                    f"run_dir={w.run}", f"hydra.run.dir={w.tmp / 'hydra'}"],
         on_line=_stall_rank_1, notes="trainer=ddp without trainer.devices: torchrun's 2 processes are the devices"),
]

# ---- issue 33, inputs and outputs: values, keys and composition refused when the config is read; what
# mine, export and search refuse to write or answer (tests/test_faults_inputs.py asserts the same)

TINY = ["model=tiny", "model.path={data}/tiny"]
MINE_PAIRS = "".join(  # rows 0-8 of one group (3 other documents: ranks 0-2), the rest of their own
    json.dumps({"query": f"query {i} about topic {i % 4}", "positive": f"document {i} on topic {i % 4}",
                "doc_id": f"d{i}", "group": "g" if i < 9 else f"s{i}"}) + "\n" for i in range(12))
MINE = [*TINY, "data=jsonl", "data.train_path={data}/train.jsonl", "progress=false"]


def _user_folder(w: Work) -> None:
    (w.data / "out").mkdir()
    (w.data / "out" / "notes.txt").write_text("the user's")


def _existing_output(w: Work) -> None:
    _pairs(w, MINE_PAIRS)
    (w.data / "mined.jsonl").write_text("an earlier output\n")


INPUT_CASES = [
    Case("lr_inf", "optim.lr=inf", train("optim.lr=inf")),
    Case("temperature_inf", "objective.temperature=inf", train("objective.temperature=inf")),
    Case("precision", "trainer.precision=17-bogus", train("trainer.precision=17-bogus")),
    Case("devices", "trainer.devices=abc", train("trainer.devices=abc")),
    Case("queue_dtype", "objective.queue_dtype=int8", train("objective.queue_dtype=int8")),
    Case("schedule", "optim.schedule=bogus", train("optim.schedule=bogus")),
    Case("pooling", "model.pooling=max", train("model.pooling=max")),
    Case("queue_size", "objective.queue_size=1000000000000 (estimated before it is allocated)",
         train("objective.queue_size=1000000000000")),
    Case("plus_typo", "a typo added with a + (Hydra's hint): +trainer.max_step=10", train("+trainer.max_step=10")),
    Case("evaluate_plus", "evaluate +chekpoint=... (would evaluate the untrained model)",
         command("evaluate", *TINY, "data=beir", "data.dir={data}/beir", "+chekpoint={data}/model.ckpt"), _beir),
    Case("group_option", "an unknown group option: objective=bogus", train("objective=bogus")),
    Case("bad_syntax", "bad override syntax: export out_dir=[1,", command("export", "out_dir=[1,")),
    Case("missing_key", "deleting a key that is not there: search ~model.nothing", command("search", "~model.nothing")),
    Case("mine_over_input", "mine: output= the training pairs, with overwrite=true",
         command("mine", *MINE, "output={data}/train.jsonl", "overwrite=true"), lambda w: _pairs(w, MINE_PAIRS)),
    Case("mine_exists", "mine: output= an existing file", command("mine", *MINE, "output={data}/mined.jsonl"),
         _existing_output),
    Case("mine_dir", "mine: output= a directory", command("mine", *MINE, "output={data}"), lambda w: _pairs(w, MINE_PAIRS)),
    Case("mine_dropped", "mine: 9 of 12 rows get no negative (ranks 5-10 of a group that leaves 3)",
         command("mine", *MINE, "output={data}/mined.jsonl", "n_negatives=2", "range_min=5", "range_max=10",
                 "relative_margin=null"), lambda w: _pairs(w, MINE_PAIRS)),
    Case("export_exists", "export onto a non-empty folder", command("export", *TINY, "out_dir={data}/out"),
         _user_folder),
    Case("export_not_export", "export overwrite=true onto a folder that is not an export",
         command("export", *TINY, "out_dir={data}/out", "overwrite=true"), _user_folder),
    Case("best_set", "trainer.best_set=nope (no such evaluation set)", train("trainer.best_set=nope")),
    Case("eval_both", "data.eval_dir and data.eval_dirs both given",
         train("data.eval_dir={data}/beir", "data.eval_dirs=[{data}/beir]"), _beir),
    Case("stream_dir_alone", "data.stream_dir without data.stream=true", train("data.stream_dir={data}/chunks")),
    Case("stream_no_dir", "data.stream=true without data.stream_dir", train("data.stream=true")),
    Case("search_k0", "search k=0", command("search", *TINY, "k=0", "query=apt", "corpus={data}/beir"), _beir),
    Case("search_blank", "search: a blank query", command("search", *TINY, "query=' '", "corpus={data}/beir"), _beir),
]
ALL_CASES = CASES + INPUT_CASES

# the children's environment: offline, one thread (the caller's TRANSFORMERS_OFFLINE and TOKENIZERS_PARALLELISM win)
ENV = {"TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       **dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1")}
OURS = re.compile(r"^(\w+: error:|  |\[moco_retrieval\]|Error |Could not|Key '|final validation|Restoring states)")


def _seen(stderr: str, w: Work) -> str:
    """The command's own lines (its error, its notes), paths shortened; not Lightning's chatter."""
    lines, keep = [], False
    for line in stderr.splitlines():
        line = re.sub(r"^\[rank\d\]:", "", line)
        if OURS.match(line) and not line.startswith("  File"):
            if line.startswith("  ") and not keep:
                continue
            keep = not line.startswith(("final validation", "Restoring states"))
            lines.append(line.strip())
        else:
            keep = False
    text = " ".join(lines)
    text = re.sub(r"\(torch\.distributed: .*?\)$", "(torch.distributed: ...)", text)
    for path, name in ((w.run, "RUN"), (w.data, "DATA"), (w.tmp, "TMP")):
        text = text.replace(str(path), name)
    return re.sub(r"(since|, since) \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \w+", r"\1 ...", text).replace("|", "\\|")


def _kept(w: Work) -> str:
    if not w.run.exists():
        return "nothing written"
    import torch

    out = []
    for p in sorted(w.run.rglob("*")):
        rel = p.relative_to(w.run)
        if p.is_file() and (rel.parts[0] in ("checkpoints",) or rel.name in (".lock", "metrics.json")):
            desc = str(rel)
            if p.suffix == ".ckpt":
                try:
                    desc += f" (step {torch.load(p, map_location='cpu', weights_only=True)['global_step']})"
                except Exception:  # noqa: BLE001 - a damaged one is listed as such
                    desc += " (unreadable)"
            out.append(desc)
    return ", ".join(out) or "nothing (an empty run directory)"


def run_case(case: Case, root: Path) -> dict:
    w = Work(root / case.key)
    case.setup(w)
    t0 = time.monotonic()
    proc = subprocess.Popen(case.argv(w), cwd=w.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ENV)
    timer = threading.Timer(600, proc.kill)
    timer.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if case.on_line:
            case.on_line(w, proc, line)
    proc.wait()
    timer.cancel()
    holder = w.state.get("holder")
    if holder:
        holder.kill()
    return {"key": case.key, "case": case.title, "status": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
            "sees": _seen("".join(lines), w), "kept": _kept(w), "notes": case.notes}


def write_table(rows: list[dict], out: Path) -> None:
    lines = [
        "# Fault table",
        "",
        "What a user sees when something goes wrong, and what is kept. Written by `python docs/tools/faults.py`,",
        "which runs every case below as a subprocess (tiny models, the smoke experiment, planted files); rerun",
        "it after changing any of this. Paths: RUN is the run directory, DATA the folder of planted files.",
        "Status 2: a known error (data, config, checkpoint, model, run directory, disk), one message and no",
        "traceback (`HYDRA_FULL_ERROR=1` shows it), Hydra's own composition errors included; 1: a stalled rank;",
        "0: the run went on. Preemption (SIGTERM / SIGUSR1: exit 143 / 138 with checkpoints/last.ckpt, a",
        "bit-exact resume) is in tests/test_resume.py and tests/test_torchrun.py.",
        "",
        "| case | status | what the user sees | what is kept in RUN |",
        "|---|---|---|---|",
    ]
    inputs = {c.key for c in INPUT_CASES}
    lines += _rows(r for r in rows if r["key"] not in inputs)
    lines += ["", "## Inputs and outputs (issue 33: values, keys, mine, export, search)", "",
              "Checked when the config is read or before a model loads (tests/test_faults_inputs.py); mine, export and",
              "search write into DATA (what is kept there is in the message: nothing of the user's is overwritten).", "",
              "| case | status | what the user sees | what is kept in RUN |", "|---|---|---|---|"]
    lines += _rows(r for r in rows if r["key"] in inputs)
    out.write_text("\n".join(lines) + "\n" + hand_written_blocks(out))


def hand_written_blocks(out: Path) -> str:
    """The blocks written by hand below the table (from ``<!-- begin: ...`` to ``<!-- end: ... -->``),
    kept when the table is written again."""
    if not out.exists():
        return ""
    return "".join(re.findall(r"\n<!-- begin:.*?<!-- end:[^\n]*-->\n", out.read_text(), flags=re.S))


def _rows(rows) -> list[str]:
    return [f"| {r['case']}{' (' + r['notes'] + ')' if r['notes'] else ''} | {r['status']} | {r['sees']} | {r['kept']} |"
            for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated case keys: " + ",".join(c.key for c in ALL_CASES))
    ap.add_argument("--out", default=str(ROOT / "docs" / "faults.md"))
    args = ap.parse_args()
    if not os.environ.get("MOCO_RETRIEVAL_DEBIAN_DIR") and SHARED_DEBIAN.is_dir():
        os.environ["MOCO_RETRIEVAL_DEBIAN_DIR"] = str(SHARED_DEBIAN)
    ENV.update({k: os.environ[k] for k in ("MOCO_RETRIEVAL_DEBIAN_DIR", "MOCO_RETRIEVAL_CACHE") if k in os.environ})
    cases = [c for c in ALL_CASES if not args.only or c.key in args.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        for case in cases:
            row = run_case(case, Path(tmp))
            print(f"{row['key']}: status {row['status']} in {row['seconds']} s: {row['sees'][:160]}", flush=True)
            rows.append(row)
    record = Path(args.out).with_suffix(".json")
    if args.only and record.exists():  # a partial rerun replaces its rows, keeps the others
        new = {r["key"]: r for r in rows}
        old = {r["key"]: r for r in json.loads(record.read_text())}
        rows = [new.get(c.key) or old[c.key] for c in ALL_CASES if c.key in new or c.key in old]
    write_table(rows, Path(args.out))
    record.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
