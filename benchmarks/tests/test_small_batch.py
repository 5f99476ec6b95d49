"""B11's harness (benchmarks/small_batch.py): the batch-8 runs see B6's pairs in B6's order, the main
objective is scaled to the steps, and a dry run on the tiny model trains, caches, resumes and reports."""
from __future__ import annotations

import json

import pytest

from benchmarks import small_batch
from benchmarks.harness import equal_data, side_by_side
from benchmarks.harness.training import compose_cfg


@pytest.fixture(scope="module")
def b11():
    return small_batch


def test_the_main_objective_at_batch_8_keeps_the_keys_and_the_ema_span_of_batch_32(b11):
    cfg = compose_cfg(equal_data.BASE + b11.RUNS["main-8"][2] + ["data.batch_size=8"])
    obj = cfg.objective
    assert obj.name == "two_queue" and obj.inbatch_weight == 1.0
    assert obj.queue_max_age * 8 == 128 * 32 == obj.queue_size  # the same 4,096 keys
    assert 1 / (1 - obj.momentum) == pytest.approx(4 * 1 / (1 - 0.995))  # an EMA 4x as many steps long
    lora = compose_cfg(equal_data.BASE + b11.RUNS["lora_main-8"][2])
    assert lora.model.lora.r == 16 and lora.optim.lr == 2e-4 and lora.objective.queue_max_age == 512


def test_small_batches_split_b6s_batches_in_order(b11, monkeypatch):
    b32 = [list(range(i, i + 32)) for i in range(0, 96, 32)]
    monkeypatch.setattr(equal_data, "pair_batches", lambda bench, seed, pairs, batch: b32)
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


def _record(name: str, seed: int, batch: int, recall: float, train_s: float) -> dict:
    final = {"recall@1": recall, "mrr@10": recall, "ndcg@10": recall, "unrelated_cos_mean": 0.0}
    return {"key": f"{name}|seed={seed}|model=minilm|pairs=18240|pool=1000x2400", "name": name, "seed": seed,
            "batch_size": batch, "final": final, "curve": [], "train_s": train_s, "s_per_step": 1.0, "peak_rss_mib": 100.0}


def test_cost_times_side_by_side_and_the_goal_takes_its_ratio_not_the_own_clocks(b11, tmp_path, monkeypatch):
    cache = tmp_path / "small_batch_runs.jsonl"
    runs = [_record("inbatch-8", s, 8, 0.80 + s / 1000, 1000.0) for s in range(3)]
    runs += [_record("main-8", s, 8, 0.84, 9000.0) for s in range(3)]  # own clocks: slowed by a busy machine
    runs += [_record("gradcache-256", s, 256, 0.845, 3000.0) for s in range(3)]
    cache.write_text("".join(json.dumps(r) + "\n" for r in runs))
    timed = {}

    def measure(bench, names, rounds, warmup, runs, batches):
        timed.update(names=names, rounds=rounds, batch_fn=batches)
        # per pair, round by round: main-8 0.1 and 0.2 s, gradcache-256 0.5 and 0.5 s -> ratios 0.2 and 0.4
        step = {"inbatch-8": [0.4, 0.4], "main-8": [0.8, 1.6], "gradcache-256": [128.0, 128.0]}
        return {n: step[n] for n in names}

    monkeypatch.setattr(side_by_side, "measure", measure)
    monkeypatch.setattr(b11, "Bench", lambda: None)
    monkeypatch.setattr(b11, "references", lambda args: [])
    assert b11.main(["--cost", "--rounds", "2", "--only", "main-8,gradcache-256", "--out", str(tmp_path)]) == 0
    assert timed["names"] == ["inbatch-8", "main-8", "gradcache-256"]  # the reference first, always
    assert timed["rounds"] == 2 and timed["batch_fn"] is b11.batches_of  # batch-8 steps split B6's batches
    cost = json.loads((tmp_path / "small_batch_cost.json").read_text())
    assert {r["name"]: r["per_pair_vs_inbatch-8"] for r in cost["rows"]} == pytest.approx(
        {"inbatch-8": 1.0, "main-8": 3.0, "gradcache-256": 10.0})
    assert len(cache.read_text().splitlines()) == 9  # --cost trains nothing
    md = (tmp_path / "small_batch.md").read_text()
    assert "side by side: 0.30x gradcache-256's" in md  # the median of the rounds' ratios, not 9000 / 3000
    assert "own clocks" not in md.split("## Cost")[0].split("vs gradcache-256")[1]
    assert "| main-8 | 8 | 1.20 | 150.0 | 3.00 | 2 |" in md


def test_cost_and_memory_have_no_dry_run(b11):
    for mode in ("--cost", "--memory"):
        with pytest.raises(SystemExit, match="no --dry-run"):
            b11.main(["--dry-run", mode])


def test_memory_measures_steps_alone_and_the_table_and_plot_take_it_over_the_process_peak(b11, tmp_path, monkeypatch):
    cache = tmp_path / "small_batch_runs.jsonl"
    runs = [_record("inbatch-8", 0, 8, 0.80, 1000.0), _record("main_gc-8", 0, 8, 0.84, 1000.0),
            _record("main-8", 0, 8, 0.84, 1000.0), _record("gradcache-256", 0, 256, 0.83, 1000.0)]
    runs[1]["peak_rss_mib"] = 1900.0  # the process's peak: evaluation included, the same for every run
    cache.write_text("".join(json.dumps(r) + "\n" for r in runs))
    asked = {}

    def memory(bench, names, runs, batches):
        asked.update(names=names, batches=batches)
        return [{"name": "inbatch-8", "batch": 8, "resident_mib": 350.0, "step_peak_mib": 400.0, "step_peaks_mib": [400.0]},
                {"name": "main_gc-8", "batch": 8, "resident_mib": 460.0, "step_peak_mib": 90.0, "step_peaks_mib": [90.0]},
                {"name": "main-8", "batch": 8, "resident_mib": 460.0, "step_peak_mib": 400.0, "step_peaks_mib": [400.0]},
                {"name": "gradcache-256", "batch": 256, "resident_mib": 350.0, "step_peak_mib": 450.0, "step_peaks_mib": [450.0]}]

    monkeypatch.setattr(side_by_side, "memory", memory)
    monkeypatch.setattr(b11, "Bench", lambda: None)
    monkeypatch.setattr(b11, "references", lambda args: [])
    figures, real_figure = [], b11.figure
    monkeypatch.setattr(b11, "figure", lambda *a: figures.append(real_figure(*a)) or figures[-1])
    only = "inbatch-8,main_gc-8,main-8,gradcache-256"
    assert b11.main(["--memory", "--only", only, "--out", str(tmp_path)]) == 0
    assert asked["names"] == only.split(",") and asked["batches"] is b11.batches_of
    assert len(cache.read_text().splitlines()) == 4  # --memory trains nothing
    md = (tmp_path / "small_batch.md").read_text()
    assert "| 550 (460 + 90) | 1,900 |" in md and "| 750 (350 + 400) | 100 |" in md
    assert "training memory 860 vs 800 MiB (1.07x)" in md.split("vs gradcache-256")[1]
    memory_axis = figures[0].axes[0]
    points = {c.get_label(): tuple(c.get_offsets()[0]) for c in memory_axis.collections}
    assert points == {"inbatch-8": (750.0, 0.80), "main_gc-8": (550.0, 0.84), "main-8": (860.0, 0.84),
                      "gradcache-256": (800.0, 0.83)}  # the plot's x: training memory, not the process peaks
    assert memory_axis.get_xlabel() == "training memory, MiB"
