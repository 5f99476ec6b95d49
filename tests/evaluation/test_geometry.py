"""Geometry figures on constructed embeddings with known answers."""
import math

import numpy as np
import pytest

from moco_retrieval.evaluation.geometry import alignment, compute_geometry, uniformity


def _ids(prefix, n):
    return [f"{prefix}{i}" for i in range(n)]


def test_identical_vectors_anisotropy_one():
    v = np.tile(np.array([[0.6, 0.8, 0.0]], np.float32), (5, 1))
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(5)}
    g = compute_geometry(3 * v, v, _ids("q", 5), _ids("d", 5), qrels)
    s = g.stats
    assert s["anisotropy"] == pytest.approx(1.0, abs=1e-6)
    assert s["unrelated_cos_p05"] == pytest.approx(1.0, abs=1e-6)
    assert s["unrelated_cos_p95"] == pytest.approx(1.0, abs=1e-6)
    assert s["positive_cos_mean"] == pytest.approx(1.0, abs=1e-6)
    assert s["cos_gap"] == pytest.approx(0.0, abs=1e-6)
    assert s["alignment"] == pytest.approx(0.0, abs=1e-6)
    assert s["uniformity"] == pytest.approx(0.0, abs=1e-6)  # log E exp(0)
    assert len(g.positive_cosines) == 5
    assert len(g.unrelated_cosines) == 20  # 5 x 5 pairs minus the 5 judged ones


def test_orthonormal_vectors_anisotropy_zero():
    e = np.eye(6, dtype=np.float32)
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(6)}
    s = compute_geometry(e, e, _ids("q", 6), _ids("d", 6), qrels).stats
    assert s["anisotropy"] == pytest.approx(0.0, abs=1e-7)
    assert s["unrelated_cos_p05"] == pytest.approx(0.0, abs=1e-7)
    assert s["unrelated_cos_p95"] == pytest.approx(0.0, abs=1e-7)
    assert s["positive_cos_mean"] == pytest.approx(1.0)
    assert s["cos_gap"] == pytest.approx(1.0)
    assert s["alignment"] == pytest.approx(0.0, abs=1e-7)
    # distinct orthonormal vectors: ||x - y||^2 = 2 for every pair -> log exp(-4) = -4
    assert s["uniformity_query"] == pytest.approx(-4.0, abs=1e-6)
    assert s["uniformity_doc"] == pytest.approx(-4.0, abs=1e-6)
    assert s["uniformity"] == pytest.approx(-4.0, abs=1e-6)


def test_antipodal_pairs():
    x = np.array([[1.0, 0.0], [-1.0, 0.0]], np.float32)
    assert uniformity(x) == pytest.approx(-8.0)  # ||x - (-x)||^2 = 4 -> log exp(-8)
    # three points: one antipodal pair (d^2 = 4) and two identical (d^2 = 0):
    # pairs (0,1): 4, (0,2): 0, (1,2): 4 -> log((2 e^-8 + 1) / 3)
    y = np.array([[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]], np.float32)
    assert uniformity(y) == pytest.approx(math.log((2 * math.exp(-8) + 1) / 3))
    # positives pointing the opposite way: alignment = ||q - (-q)||^2 = 4, cosine -1
    q = np.array([[0.0, 2.0], [1.0, 0.0]], np.float32)
    assert alignment(q, -q) == pytest.approx(4.0)
    s = compute_geometry(q, -q, ["a", "b"], ["x", "y"], {"a": {"x": 1}, "b": {"y": 1}}).stats
    assert s["positive_cos_mean"] == pytest.approx(-1.0)
    assert s["alignment"] == pytest.approx(4.0)


def test_judged_docs_are_not_unrelated():
    # q0's judged non-relevant doc d1 is identical to it; it must not count as "unrelated"
    q = np.array([[1.0, 0.0]], np.float32)
    d = np.array([[0.0, 1.0], [1.0, 0.0], [0.0, -1.0]], np.float32)
    g = compute_geometry(q, d, ["q0"], ["d0", "d1", "d2"], {"q0": {"d0": 1, "d1": 0}})
    assert g.unrelated_cosines.tolist() == [0.0]  # only (q0, d2)
    assert g.positive_cosines.tolist() == [0.0]


def test_sampling_is_bounded_and_seeded():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((300, 16)).astype(np.float32)
    d = rng.standard_normal((400, 16)).astype(np.float32)
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(300)}
    a = compute_geometry(q, d, _ids("q", 300), _ids("d", 400), qrels, num_unrelated=5000,
                         max_uniformity_points=100)
    b = compute_geometry(q, d, _ids("q", 300), _ids("d", 400), qrels, num_unrelated=5000,
                         max_uniformity_points=100)
    assert len(a.unrelated_cosines) == 5000
    np.testing.assert_array_equal(a.unrelated_cosines, b.unrelated_cosines)
    assert a.stats == b.stats
    # random directions in 16-d: unrelated cosines centred on 0 (sd 1/4); uniformity
    # = -4 + log E exp(4 cos) ~ -4 + 16 / (2 * 16) = -3.5
    assert abs(a.stats["anisotropy"]) < 0.02
    assert a.stats["unrelated_cos_p05"] < -0.3 < 0.3 < a.stats["unrelated_cos_p95"]
    assert -3.7 < a.stats["uniformity"] < -3.3
