"""B10/B18's report (benchmarks/data_scale.py): the on-paper rows scale the measured per-row costs."""
from __future__ import annotations

from benchmarks.data_scale import paper_report


def test_the_paper_rows_scale_the_measured_per_row_costs():
    res = {
        "conversion": {"1k": {"rows": 1000, "store_mb": 0.5}, "10M": {"rows": 10_000_000, "store_mb": 7000.0}},
        "prepare_workers": {"rows": 2_000_000, "runs": {"1": [{"cpu_s": 40.0}, {"cpu_s": 60.0}, {"cpu_s": 50.0}]},
                            "median": {"2": {"speedup_convert": 1.9}}},
        "stream_scale": {"prepare": {"1k store": {"mb": 1.0}, "1k stream": {"mb": 9.0},
                                     "30,000,000 store": {"mb": 10_000.0}, "30,000,000 stream": {"mb": 12_500.0}}},
        "sampler": {"now": {"1,000,000": {"anon_growth_mb": 9.0, "first_batch_s": 0.5},
                            "100,000,000": {"anon_growth_mb": 6.0, "first_batch_s": 0.08}}},
    }
    text = "\n".join(paper_report(res))
    # 700 bytes a pair (the largest conversion), 25 µs of CPU a pair (the median round), the largest sampler size
    assert "| 100,000,000 | 70 GB | 1.6 GB | 0.7 h | 3 min | 6 MB | 0.08 s |" in text
    assert "| 1,000,000,000 | 700 GB | 16.0 GB | 6.9 h | 26 min | 6 MB | 0.08 s |" in text
    assert "chunks take 1.25x the store's bytes at 30,000,000 pairs" in text and "(workers=2: 1.9x)" in text
