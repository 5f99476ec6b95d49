"""The benchmarks' harness (benchmarks/harness/): one training step in the module's order, one peer
trainer whose weights score through our encoder, the run cache, the shared options, and retired
options refused with one message."""
from __future__ import annotations

import json
import time

import pytest
import torch

from benchmarks.harness import cli, runs, step_memory
from benchmarks.harness.steps import OurStep, PeerTrainer

from moco_retrieval.config import ModelConfig, OptimConfig
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.training.module import RetrievalModule


def moco_module(tiny_dir, momentum=0.9):
    torch.manual_seed(0)
    m = RetrievalModule(ModelConfig(backbone="tiny", path=tiny_dir), MoCoConfig(queue_size=32, temperature=0.1, momentum=momentum),
                        OptimConfig(lr=1e-3, warmup_steps=0, warmup_ratio=0.0, schedule="constant"))
    return m.train()


# ----------------------------------------------------------------------------------- our step


def test_our_step_runs_in_the_modules_order(tiny_dir, one_thread, monkeypatch, synthetic_data):
    """forward, backward, on_after_backward (enqueue), clip, optimizer, EMA: the order Lightning
    gives the module (core_step_time.py and speed.py used to enqueue after the optimizer and EMA)."""
    m = moco_module(tiny_dir)
    opt = torch.optim.AdamW([p for p in m.encoder.parameters() if p.requires_grad], lr=1e-3)
    calls: list[str] = []

    def spy(obj, name, label):
        orig = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, **k: (calls.append(label), orig(*a, **k))[1])

    spy(m, "shared_step", "forward")
    spy(m, "on_after_backward", "after_backward")
    spy(torch.nn.utils, "clip_grad_norm_", "clip")
    spy(opt, "step", "optimizer")
    spy(m.key_encoder, "update", "ema")
    batch = next(iter(synthetic_data(m.encoder.tokenize, batch_size=4).train_dataloader()))
    OurStep(m, opt, clip=1.0)(batch)
    assert calls == ["forward", "after_backward", "clip", "optimizer", "ema"]
    assert m.objective.docs.queue.fill == 4  # this step's keys are queued


def test_our_step_clips_before_the_optimizer_and_moves_the_key_encoder_by_the_modules_momentum(tiny_dir, one_thread, monkeypatch,
                                                                                                  synthetic_data):
    m = moco_module(tiny_dir, momentum=0.5)
    opt = torch.optim.SGD([p for p in m.encoder.parameters() if p.requires_grad], lr=0.0)  # lr 0: the encoder stays
    norms: list[float] = []
    orig_step = opt.step
    monkeypatch.setattr(opt, "step", lambda *a, **k: (norms.append(float(torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in m.encoder.parameters() if p.grad is not None])))), orig_step(*a, **k))[1])
    with torch.no_grad():  # the key encoder off the query encoder, so the EMA shows
        for p in m.key_encoder.parameters():
            p.add_(1.0)
    key_before = [p.clone() for p in m.key_encoder.parameters()]
    batch = next(iter(synthetic_data(m.encoder.tokenize, batch_size=4).train_dataloader()))
    OurStep(m, opt, clip=1e-3)(batch)
    assert norms and norms[0] <= 1e-3 * 1.001
    # m 0.5: halfway between the old key weights and the query weights
    q = dict(m.encoder.named_parameters())
    for (name, p), before in zip(m.key_encoder.named_parameters(), key_before):
        target = q.get(name.removeprefix("encoder."), q.get(name))
        if target is not None:
            assert torch.allclose(p, 0.5 * before + 0.5 * target, atol=1e-6)


# ----------------------------------------------------------------------------------- the peer


def test_peer_trainer_follows_the_schedule_and_scores_through_our_encoder(tiny_dir, one_thread):
    pytest.importorskip("sentence_transformers")
    torch.manual_seed(0)
    peer = PeerTrainer(tiny_dir, "mnrl", {}, lr=1e-3, weight_decay=0.01, lengths=(8, 16), steps=4, warmup=2)
    queries, docs = [f"query {i} about package {i}" for i in range(4)], [f"document {i} describes package {i}" for i in range(4)]
    feats = peer.features(queries, docs)
    assert feats[0]["input_ids"].shape[1] <= 8 and feats[1]["input_ids"].shape[1] <= 16
    lrs = []
    for _ in range(4):
        lrs.append(peer.opt.param_groups[0]["lr"])
        peer.step(peer.features(queries, docs))
    from moco_retrieval.training.module import lr_lambda

    # the main job's linear warmup over 2 steps, then linear decay
    assert lrs == pytest.approx([1e-3 * lr_lambda("linear", 2, 4)(s) for s in range(4)]) and len(set(lrs)) > 1
    assert peer.temperature == pytest.approx(0.05)
    enc = build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, head="none"))
    before = enc(enc.tokenize(docs, "doc"), "doc")
    peer.copy_into(enc)
    enc.eval()
    peer.model.eval()
    with torch.no_grad():
        ours = enc(enc.tokenize(docs, "doc"), "doc")
    theirs = torch.nn.functional.normalize(peer.model.encode(docs, convert_to_tensor=True), dim=-1)
    assert not torch.allclose(before, ours, atol=1e-4)  # the trained weights arrived
    assert torch.allclose(ours, theirs, atol=1e-5)


# ----------------------------------------------------------------------------------- run cache


def test_run_missing_skips_cached_runs_rereads_the_cache_and_cuts_past_the_deadline(tmp_path, monkeypatch):
    cache = tmp_path / "sub" / "x_runs.jsonl"
    runs.append_jsonl(cache, {"key": "a|seed=0", "v": 0})
    done: list[tuple[str, int]] = []

    def run(name, seed):
        done.append((name, seed))
        if name == "b":  # a parallel process finishes c seed 0 meanwhile
            runs.append_jsonl(cache, {"key": "c|seed=0", "v": -1})
        return {"key": f"{name}|seed={seed}", "v": len(done)}

    cut = runs.run_missing(cache, ["a", "b", "c"], [0], None, lambda n, s: f"{n}|seed={s}", run)
    assert cut == [] and done == [("b", 0)]
    assert [r["key"] for r in runs.read_jsonl(cache)] == ["a|seed=0", "c|seed=0", "b|seed=0"]  # c: the other process's
    now = time.strftime("%H:%M", time.gmtime())
    cut = runs.run_missing(cache, ["a", "d"], [0, 1], now, lambda n, s: f"{n}|seed={s}", run)
    assert cut == ["a seed 1", "d seed 0", "d seed 1"] and done == [("b", 0)]  # a seed 0: cached, not cut


def test_run_missing_reads_an_older_cache_by_its_own_key_field(tmp_path):
    cache = tmp_path / "peer.jsonl"
    cache.write_text(json.dumps({"name": "base", "run": {}}) + "\n")
    ran = []
    runs.run_missing(cache, ["base", "mnrl"], [0], None, lambda n, s: n,
                     lambda n, s: ran.append(n) or {"name": n, "run": {}}, key_field="name")
    assert ran == ["mnrl"]


def test_write_results_writes_the_report_and_the_data(tmp_path):
    import numpy as np

    md, js = runs.write_results("b", "# title\n\n", {"x": np.float32(0.5), "p": tmp_path}, tmp_path / "out")
    assert md.read_text() == "# title\n" and json.loads(js.read_text()) == {"x": 0.5, "p": str(tmp_path)}


# ----------------------------------------------------------------------------------- options


def test_shared_options_parse_the_same_everywhere_and_unknown_runs_exit(tmp_path, monkeypatch):
    ap = cli.parser("doc")
    cli.add_selection(ap, runs=["a", "b"], default="a,b")
    cli.add_report(ap)
    cli.add_deadline(ap)
    cli.add_common(ap, threads=1)
    args = ap.parse_args(["--only", "b", "--seeds", "0,2", "--out", str(tmp_path / "o"), "--deadline", "11:30",
                          "--debian-dir", str(tmp_path), "--cache", str(tmp_path / "c")])
    assert (cli.names(args.only, ["a", "b"]), cli.seeds(args.seeds), args.threads, args.report) == (["b"], [0, 2], 1, False)
    monkeypatch.delenv("MOCO_RETRIEVAL_DEBIAN_DIR", raising=False)
    monkeypatch.delenv("MOCO_RETRIEVAL_CACHE", raising=False)
    cli.apply(args)
    import os

    assert os.environ["MOCO_RETRIEVAL_DEBIAN_DIR"] == str(tmp_path) and os.environ["MOCO_RETRIEVAL_CACHE"] == str(tmp_path / "c")
    assert cli.out_dir(args).is_dir() and cli.out_dir(ap.parse_args([]), tmp_path / "d") == tmp_path / "d"
    with pytest.raises(SystemExit, match="--only: unknown x; expected some of a, b"):
        cli.names("a,x", ["a", "b"])


def test_step_clock_times_every_lightning_step_between_its_hooks(tiny_dir, tmp_path, one_thread, synthetic_data):
    import lightning as L

    from benchmarks.harness.steps import step_clock

    m = moco_module(tiny_dir)
    events: list[str] = []
    clock = step_clock(on_start=lambda: events.append("start"), on_end=lambda trainer, module: events.append(
        f"end {trainer.global_step} {module is m}"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                        callbacks=[clock], num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(m, datamodule=synthetic_data(m.encoder.tokenize, batch_size=4))
    assert events == ["start", "end 1 True", "start", "end 2 True", "start", "end 3 True"]
    assert len(clock.times) == 3 and all(t > 0 for t in clock.times)


def test_a_claimed_run_is_left_to_its_process_and_a_dead_process_claim_is_taken_over(tmp_path):
    import hashlib
    import os
    import socket
    import subprocess

    cache = tmp_path / "x_runs.jsonl"
    ran = []

    def run(name, seed):
        ran.append(name)
        # while "a" runs, a second process given the same runs leaves it alone
        if name == "a":
            assert runs.run_missing(cache, ["a"], [0], None, lambda n, s: n, lambda n, s: ran.append("twice")) == []
        return {"key": name}

    runs.run_missing(cache, ["a"], [0], None, lambda n, s: n, run)
    assert ran == ["a"] and not (tmp_path / "x_runs.jsonl.claims").exists()  # released, folder gone
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    folder = tmp_path / "x_runs.jsonl.claims"
    folder.mkdir()
    (folder / (hashlib.sha1(b"b").hexdigest()[:20] + ".json")).write_text(
        json.dumps({"key": "b", "pid": dead.pid, "host": socket.gethostname()}))
    (folder / (hashlib.sha1(b"c").hexdigest()[:20] + ".json")).write_text(
        json.dumps({"key": "c", "pid": os.getpid(), "host": socket.gethostname()}))  # alive: this process
    runs.run_missing(cache, ["b", "c"], [0], None, lambda n, s: n, lambda n, s: ran.append(n) or {"key": n})
    assert ran == ["a", "b"]  # b taken over from the dead process; c left to its live one
    assert [r["key"] for r in runs.read_jsonl(cache)] == ["a", "b"]


def test_a_steps_peak_is_its_own_and_resident_memory_counts_shared_storage_once():
    def allocate(mib):
        return lambda: torch.ones(mib * 2**18).sum()  # float32: 4 bytes, touched

    big = step_memory.peak_during(allocate(64))
    if big is None:
        pytest.skip("this kernel cannot reset the high-water mark")
    small = step_memory.peak_during(allocate(1))
    assert 60 <= big <= 80 and small < 16  # the 64 MiB step's mark is reset before the next step

    base, other = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)
    other.weight = base.weight  # a key encoder sharing frozen weights: counted once
    weights = (512 * 512 + 2 * 512) * 4 / 2**20
    assert step_memory.resident_mib([base, other]) == pytest.approx(weights)
    opt = torch.optim.AdamW(base.parameters())
    base(torch.randn(2, 512)).sum().backward()
    opt.step()
    assert step_memory.resident_mib([base], [opt]) == pytest.approx(4 * (512 * 512 + 512) * 4 / 2**20, rel=1e-3)


def test_run_selected_reads_a_retired_run_from_the_cache_and_refuses_to_run_it_before_anything_loads(tmp_path):
    from types import SimpleNamespace

    cache = tmp_path / "x_runs.jsonl"
    runs.append_jsonl(cache, {"key": "old|seed=0"})
    args = SimpleNamespace(report=False, only="old,new", seeds="0", deadline=None)
    loads = []

    def make_run():
        loads.append(True)
        return lambda name, seed: {"key": f"{name}|seed={seed}"}

    retired = {"old": "objective=x is retired (issue 43): below its twin"}
    assert runs.run_selected(cache, args, ["old", "new"], lambda n, s: f"{n}|seed={s}", make_run, retired) == []
    assert loads == [True] and [r["key"] for r in runs.read_jsonl(cache)] == ["old|seed=0", "new|seed=0"]  # old: read
    args.seeds = "1"
    with pytest.raises(SystemExit, match=r"^old: objective=x is retired .* cannot be run again"):
        runs.run_selected(cache, args, ["old", "new"], lambda n, s: f"{n}|seed={s}", make_run, retired)
    assert loads == [True]  # refused before make_run loaded anything
