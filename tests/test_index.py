"""FAISS indexes: inner product on the vectors as given, IVF/HNSW against exact search, save/load."""
import numpy as np
import pytest

from moco_retrieval.evaluation.index import (
    build_index,
    load_index,
    results_to_run,
    save_index,
    search,
)


def _unit(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_flat_ranks_by_raw_dot_product_not_cosine():
    # doc 0 points almost along the query but is short; doc 1 is long and less aligned:
    # cosine prefers doc 0, dot product prefers doc 1. A model trained without normalization
    # must be ranked by dot product, so the index must not normalize.
    docs = np.array([[1.0, 0.05], [3.0, 2.0]], np.float32)
    query = np.array([[1.0, 0.0]], np.float32)
    cos = (_unit(docs) @ _unit(query).T).ravel()
    dot = (docs @ query.T).ravel()
    assert cos.argmax() == 0 and dot.argmax() == 1
    for kind in ("flat", "hnsw"):
        scores, idx = search(build_index(docs, kind), query, 2)
        assert idx[0].tolist() == [1, 0], kind
        np.testing.assert_allclose(scores[0], [3.0, 1.0], rtol=1e-6)
    # normalized inputs (a normalizing model) give cosine ranking
    scores, idx = search(build_index(_unit(docs)), _unit(query), 2)
    assert idx[0].tolist() == [0, 1]
    np.testing.assert_allclose(scores[0], np.sort(cos)[::-1], rtol=1e-6)


def test_ivf_with_all_cells_probed_equals_exact_search():
    rng = np.random.default_rng(0)
    docs = _unit(rng.standard_normal((2000, 32)))
    queries = _unit(rng.standard_normal((50, 32)))
    exact_s, exact_i = search(build_index(docs, "flat"), queries, 10)
    ivf = build_index(docs, "ivf", nlist=16, nprobe=16)
    ivf_s, ivf_i = search(ivf, queries, 10)
    np.testing.assert_array_equal(ivf_i, exact_i)
    np.testing.assert_allclose(ivf_s, exact_s, rtol=1e-5, atol=1e-6)
    # probing one cell of 16 is approximate: it may miss neighbours, never invent better ones
    ivf1 = build_index(docs, "ivf", nlist=16, nprobe=1)
    s1, _ = search(ivf1, queries, 10)
    assert np.all(s1[:, 0] <= exact_s[:, 0] + 1e-6)


def test_ivf_needs_nlist_training_points():
    x = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="at least 16 training points"):
        build_index(x, "ivf", nlist=16)
    with pytest.raises(ValueError, match="unknown index kind"):
        build_index(x, "lsh")


def test_hnsw_recall_close_to_flat():
    rng = np.random.default_rng(1)
    docs = _unit(rng.standard_normal((3000, 32)))
    queries = _unit(rng.standard_normal((100, 32)))
    _, exact = search(build_index(docs, "flat"), queries, 10)
    _, approx = search(build_index(docs, "hnsw", hnsw_m=16, ef_search=64), queries, 10)
    recall = np.mean([len(set(a) & set(e)) / 10 for a, e in zip(approx.tolist(), exact.tolist())])
    assert recall >= 0.9


def test_k_is_clipped_and_run_conversion():
    docs = np.eye(3, dtype=np.float32)
    scores, idx = search(build_index(docs), np.array([[0.0, 1.0, 0.5]], np.float32), 10)
    assert idx.shape == (1, 3)
    run = results_to_run(scores, idx, ["q"], ["a", "b", "c"])
    assert run == {"q": {"b": 1.0, "c": 0.5, "a": 0.0}}
    # -1 positions are dropped
    run = results_to_run(np.array([[1.0, 0.0]]), np.array([[2, -1]]), ["q"], ["a", "b", "c"])
    assert run == {"q": {"c": 1.0}}
    with pytest.raises(ValueError, match="dimension"):
        search(build_index(docs), np.zeros((1, 4), np.float32), 1)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_save_and_load(tmp_path, kind):
    rng = np.random.default_rng(2)
    docs = _unit(rng.standard_normal((400, 16)))
    queries = _unit(rng.standard_normal((5, 16)))
    index = build_index(docs, kind, nlist=8, nprobe=8, hnsw_m=8, ef_search=32)
    before = search(index, queries, 5)
    save_index(index, tmp_path / "x.faiss")
    loaded = load_index(tmp_path / "x.faiss", nprobe=8, ef_search=32)
    assert loaded.ntotal == 400
    after = search(loaded, queries, 5)
    np.testing.assert_array_equal(before[1], after[1])
    np.testing.assert_allclose(before[0], after[0], rtol=1e-6)
