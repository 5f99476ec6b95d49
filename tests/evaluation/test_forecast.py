"""The encoding forecast (evaluation/forecast.py) against the time it forecasts."""
from __future__ import annotations

import time

import pytest


def test_the_forecast_leaves_out_the_first_calls_one_off_cost(monkeypatch):
    """A first call that costs 50 ms once (allocations, thread pools) and 0.5 ms a text after it:
    encoding 6,400 texts takes ~3.2 s; scaling the first call up with the sample forecast ~8 s."""
    from moco_retrieval.evaluation import encode, forecast

    calls = []

    def encode_texts(encoder, texts, kind, batch_size, show_progress=True):
        time.sleep((0.05 if not calls else 0.0) + 0.0005 * len(texts))
        calls.append(len(texts))

    monkeypatch.setattr(encode, "encode_texts", encode_texts)
    texts = [f"text {i} " * (i % 7 + 1) for i in range(6400)]
    seconds = forecast.estimate_seconds(object(), texts, "doc", 128)
    assert seconds == pytest.approx(0.0005 * len(texts), rel=0.5)
    assert calls[-1] == forecast.SAMPLE  # the timed call is the sample
