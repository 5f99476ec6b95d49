"""B6's report helpers (benchmarks/finetune.py, harness/equal_data.py): the in-group miss share, the
time-to-reach reading, the side-by-side cost, and the runs of retired options: kept, marked, refused."""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import hydra
import pytest

from benchmarks import finetune, finetune_cost
from benchmarks.harness import equal_data, side_by_side
from benchmarks.harness.equal_data import MAIN_RUN
from benchmarks.harness.report import paired
from benchmarks.harness.training import FROZEN_BASE, Retired, compose_cfg, retired_reason


def test_miss_in_group_counts_wrong_top_documents_of_the_positive_group():
    pool = SimpleNamespace(
        queries={"a": "", "b": "", "c": "", "d": ""},
        qrels={"a": {"d1": 1}, "b": {"d2": 1}, "c": {"d4": 1}, "d": {"d5": 1}},
        doc_groups={"d1": 7, "d2": 7, "d3": 8, "d4": 8, "d5": 9},
    )
    run = {
        "a": {"d1": 0.9, "d2": 0.5},  # right
        "b": {"d1": 0.9, "d2": 0.8},  # wrong, same group (7): counted
        "c": {"d5": 0.9, "d4": 0.1},  # wrong, another group: not counted
        "d": {},  # nothing retrieved
    }
    assert equal_data.miss_in_group(run, pool) == pytest.approx(1 / 4)
    assert equal_data.miss_in_group(run, SimpleNamespace(**{**vars(pool), "doc_groups": None})) == 0.0


def test_time_to_reach_takes_the_first_evaluation_at_the_target():
    def rec(final, curve, train_s):
        return {"final": {"recall@1": final}, "train_s": train_s,
                "curve": [{"recall@1": r, "train_s": t} for r, t in curve]}

    by = {"inbatch-256": [rec(0.80, [(0.80, 1000.0)], 1000.0)],
          MAIN_RUN: [rec(0.85, [(0.79, 100.0), (0.81, 200.0), (0.85, 300.0)], 300.0),
                              rec(0.85, [(0.80, 400.0)], 400.0)],
          "inbatch-32": [rec(0.70, [(0.70, 300.0)], 300.0)]}
    (line,) = finetune.time_to_reach(by)
    assert f"{MAIN_RUN} 2/2 seed(s), median 300 s (ratio 0.30)" in line
    assert "inbatch-32 1/1 seed(s)" not in line and "inbatch-32 0/1 seed(s)" in line
    assert "mnrl-32" not in line  # not run: not listed


def test_cost_lines_scale_pairs_by_the_side_by_side_cost():
    def rec(pairs, curve, seed=0):
        final = {"recall@1": curve[-1][1], "ndcg@10": 0.9, "unrelated_cos_mean": 0.02}
        return {"seed": seed, "pairs": pairs, "final": final, "curve": [{"pairs": p, "recall@1": r} for p, r in curve]}

    by = {"inbatch-256": [rec(1000, [(1000, 0.80)])],
          MAIN_RUN: [rec(1000, [(250, 0.79), (500, 0.81), (1000, 0.85)]), rec(1000, [(250, 0.80), (1000, 0.82)], 1)],
          "inbatch-32": [rec(1000, [(500, 0.70), (1000, 0.75)])]}
    cost = {"threads": 1, "rows": [{"name": "inbatch-256", "s_per_1k_pairs": 100.0},
                                   {"name": MAIN_RUN, "s_per_1k_pairs": 120.0},
                                   {"name": "inbatch-32", "s_per_1k_pairs": 50.0}]}
    (line,) = finetune.cost_lines(by, cost)
    # equal data: 1,000 pairs x 0.12 s against 1,000 x 0.1 s; reach: median of 500 and 250 pairs
    assert f"{MAIN_RUN} 1.20x at equal data, reaches 0.800 after 375 pairs: 0.45x" in line
    assert "inbatch-32 0.50x at equal data, reaches it in 0/1 seeds" in line
    verdict = finetune.verdict(by, cost)  # the side-by-side cost replaces the own clocks' seconds
    assert not any("own-clock" in v or "on the curve" in v for v in verdict) and line in verdict


def test_cost_summary_takes_per_pair_ratios_round_by_round():
    # a noisy round (the third) slows both alike: its per-pair ratio stays 1.0
    times = {"inbatch-32": [1.0, 1.0, 9.0], "inbatch-256": [8.0, 16.0, 72.0]}
    rows = {r["name"]: r for r in side_by_side.summarise(times, "inbatch-32")}
    assert rows["inbatch-256"]["s_per_1k_pairs"] == pytest.approx(1000 * 16.0 / 256)
    assert rows["inbatch-256"]["per_pair_vs_inbatch-32"] == pytest.approx(1.0)  # ratios 1, 2, 1


def test_equal_steps_pairs_the_seeds_and_uses_the_larger_std():
    def rec(seed, r1, ndcg=0.9):
        return {"seed": seed, "final": {"recall@1": r1, "ndcg@10": ndcg}}

    subject = "candidate"
    by = {subject: [rec(2, 0.850), rec(0, 0.846), rec(1, 0.848)],
          "inbatch-32": [rec(0, 0.840), rec(1, 0.841), rec(2, 0.839)],
          "mnrl-32": [rec(0, 0.830), rec(1, 0.846)]}  # seed 2 not run
    assert paired(by[subject], by["inbatch-32"], "recall@1") == pytest.approx([0.006, 0.007, 0.011])
    assert paired(by[subject], by["mnrl-32"], "recall@1") == pytest.approx([0.016, 0.002])
    r1_inbatch, ndcg_inbatch, r1_mnrl, _ = finetune.equal_steps(by, subject)
    # +.008 against 2 x the larger std (the subject's .002 -> .004): beaten
    assert "0.848 vs 0.840 (+0.008, 2 std 0.0040); beats by more than 2 std: yes" in r1_inbatch
    assert "seed by seed +0.006 / +0.007 / +0.011" in r1_inbatch
    assert "beats by more than 2 std: no" in ndcg_inbatch  # equal nDCG
    assert "2 seed(s): no claim yet" in r1_mnrl and "seed by seed +0.016 / +0.002" in r1_mnrl


# ----------------------------------------------------------------------------------- retired runs

RESULTS = Path(__file__).resolve().parents[1] / "results"
RETIRED = ("two_queue_cosine-32", "two_queue_m0.995_ib_k4k_dq0.5-32", "icol-32")


@pytest.fixture
def committed_b6(tmp_path, monkeypatch):
    """A copy of B6's committed caches, in a folder where nothing may compose a config or load data."""
    for name in ("finetune_runs.jsonl", "finetune_4800pairs_runs.jsonl", "finetune_cost.json"):
        shutil.copy(RESULTS / name, tmp_path / name)

    def refuse(*a, **k):
        raise AssertionError("composed a config or loaded data")

    monkeypatch.setattr(hydra, "compose", refuse)
    monkeypatch.setattr(equal_data, "Bench", refuse)
    monkeypatch.setattr(finetune, "plots", lambda *a: None)  # seconds of Matplotlib, not what is tested
    return tmp_path


def test_the_report_of_the_committed_cache_composes_nothing_and_marks_only_the_retired_runs(committed_b6):
    assert set(equal_data.RETIRED_RUNS) == set(RETIRED)
    assert finetune.main(["--report", "--out", str(committed_b6)]) == 0
    new = (committed_b6 / "finetune.md").read_text().splitlines()
    old = (RESULTS / "finetune.md").read_text().splitlines()
    assert len(new) == len(old)
    changed = [(a, b) for a, b in zip(old, new) if a != b]
    assert sorted(b.split(" | ")[0] for _, b in changed) == sorted(f"| {n}" for n in RETIRED)  # every number the same
    for before, after in changed:
        what = before.split(" | ")[1]
        assert after == before.replace(f" | {what} | ", f" | {what}; {after.split('; ', 1)[1].split(' | ')[0]} | ")
        assert "is retired (issue 43): B6 measured it below its simpler twin" in after


def test_a_retired_run_is_read_from_the_cache_and_refused_when_not_there(committed_b6):
    assert finetune.main(["--only", "icol-32,inbatch-32", "--seeds", "0", "--out", str(committed_b6)]) == 0  # cached
    with pytest.raises(SystemExit, match=r"icol-32: objective=icol is retired .*cannot be run again"):
        finetune.main(["--only", "icol-32", "--seeds", "1", "--out", str(committed_b6)])
    with pytest.raises(SystemExit, match="two_queue_cosine-32: objective.momentum_schedule=cosine is retired"):
        finetune_cost.main(["--runs", "inbatch-32,two_queue_cosine-32", "--out", str(committed_b6)])


def test_composing_a_retired_option_exits_with_one_message():
    for option in ("objective=icol", "objective.momentum_schedule=cosine", "+objective.doc_to_query_weight=0.5"):
        with pytest.raises(Retired, match=f"{re.escape(option)} is retired") as e:
            compose_cfg(["+experiment=queue65k", option])
        assert isinstance(e.value, SystemExit) and "twin" in str(e.value)
    assert retired_reason(["objective.momentum=0.99", "objective=inbatch", "objective.inbatch_weight=1"]) is None
    assert retired_reason({"directions": ("query_to_doc",)}) is None  # a peer's loss options


@pytest.mark.slow
def test_every_run_of_the_b6_style_tables_composes_but_the_retired_ones():
    """A cached run keeps its meaning only while its overrides still compose (B6, B11, B12, B13, B7)."""
    from benchmarks import false_negatives, matryoshka, per_source, small_batch

    tables = [equal_data.RUNS, small_batch.RUNS, matryoshka.RUNS]
    overrides = [list(spec) + [f"data.batch_size={batch}"] for t in tables for kind, batch, spec, _ in t.values()
                 if kind == "ours" and not retired_reason(spec)]
    overrides += [ov for ov, _ in per_source.RUNS.values()]
    overrides += [equal_data.TWO_QUEUE + ov for ov in false_negatives.FT_RUNS.values()]
    for ov in overrides:
        compose_cfg(equal_data.BASE + ov)
    for _, ov in false_negatives.RUNS.values():
        compose_cfg(FROZEN_BASE + false_negatives.BASE + ov)
    assert len(overrides) >= 30
