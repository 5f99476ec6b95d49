"""B11's harness (benchmarks/small_batch.py): the batch-8 runs see B6's pairs in B6's order, the main
objective is scaled to the steps, and a dry run on the tiny model trains, caches, resumes and reports."""
from __future__ import annotations

import json

import pytest

from test_finetune_report import load_bench


@pytest.fixture(scope="module")
def b11():
    return load_bench("b11_small_batch", "small_batch.py")


def test_the_main_objective_at_batch_8_keeps_the_keys_and_the_ema_span_of_batch_32(b11):
    cfg = b11.b6.compose_cfg(b11.b6.BASE + b11.RUNS["main-8"][2] + ["data.batch_size=8"])
    obj = cfg.objective
    assert obj.name == "two_queue" and obj.inbatch_weight == 1.0
    assert obj.queue_max_age * 8 == 128 * 32 == obj.queue_size  # the same 4,096 keys
    assert 1 / (1 - obj.momentum) == pytest.approx(4 * 1 / (1 - 0.995))  # an EMA 4x as many steps long
    lora = b11.b6.compose_cfg(b11.b6.BASE + b11.RUNS["lora_main-8"][2])
    assert lora.model.lora.r == 16 and lora.optim.lr == 2e-4 and lora.objective.queue_max_age == 512


def test_small_batches_split_b6s_batches_in_order(b11, monkeypatch):
    b32 = [list(range(i, i + 32)) for i in range(0, 96, 32)]
    monkeypatch.setattr(b11.b6, "pair_batches", lambda bench, seed, pairs, batch: b32)
    for batch in (8, 4):
        got = b11.batches_of(None, 0, 96, batch)
        assert len(got) == 96 // batch and all(len(b) == batch for b in got)
        assert sum(got, []) == list(range(96))  # the same pairs, the same order
    with pytest.raises(SystemExit):
        b11.batches_of(None, 0, 96, 6)


def test_dry_run_trains_caches_resumes_and_reports(b11, debian_dir, tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("MOCO_RETRIEVAL_DEBIAN_DIR", str(debian_dir))
    argv = ["--dry-run", "--only", "inbatch-8,lora_main-8", "--pairs", "256", "--eval-every", "128", "--out", str(tmp_path)]
    assert b11.main(argv) == 0
    cache = tmp_path / "small_batch_dry_run_runs.jsonl"
    runs = [json.loads(line) for line in cache.read_text().splitlines()]
    assert [r["name"] for r in runs] == ["inbatch-8", "lora_main-8"]
    for r in runs:
        assert r["steps"] == 32 and r["batch_size"] == 8 and r["pairs"] == 256 and r["model"] == "tiny"
        assert r["peak_rss_mib"] > 0 and [p["step"] for p in r["curve"]] == [16, 32]
    assert runs[1]["objective"] == "two_queue" and runs[1]["curve"] != runs[0]["curve"]
    assert b11.main(argv) == 0  # the cache resumes: nothing is run again
    assert len(cache.read_text().splitlines()) == 2
    md = (tmp_path / "small_batch_dry_run.md").read_text()
    assert "| lora_main-8 |" in md and "main-8 is not run yet" in md and (tmp_path / "small_batch_dry_run.png").is_file()
