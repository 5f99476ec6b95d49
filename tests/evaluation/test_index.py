"""FAISS indexes: inner product on the vectors as given, IVF/HNSW against exact search, save/load."""
import numpy as np
import pytest

from moco_retrieval.evaluation.index import (
    build_index,
    rerank_exact,
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


# ------------------------------------------------------------------------------------ IVF-PQ


def _clustered(n, d=64, clusters=20, seed=0):
    rng = np.random.default_rng(seed)
    centers = _unit(rng.standard_normal((clusters, d)))
    return _unit(centers[rng.integers(clusters, size=n)] + 0.3 * rng.standard_normal((n, d)) / np.sqrt(d) * 3)


def _recall(found, exact):
    return np.mean([len(set(a) & set(e)) / exact.shape[1] for a, e in zip(found.tolist(), exact.tolist())])


def test_ivfpq_stores_pq_m_bytes_per_document_and_approximates_exact_search():
    import faiss

    docs, queries = _clustered(3000), _clustered(60, seed=1)
    _, exact = search(build_index(docs, "flat"), queries, 10)
    index = build_index(docs, "ivfpq", nlist=16, nprobe=16, pq_m=8)
    ivf = faiss.extract_index_ivf(index)
    assert index.ntotal == 3000 and ivf.code_size == 8  # 8 bytes per document instead of 64 * 4
    scores, found = search(index, queries, 10)
    assert (found >= 0).all()
    recall_all_cells = _recall(found, exact)
    assert 0.3 < recall_all_cells < 1.0  # quantized scores: approximate even with every cell probed
    ivf.nprobe = 1
    assert _recall(search(index, queries, 10)[1], exact) <= recall_all_cells
    # re-ranking a deeper candidate list with the stored vectors recovers the exact top-10
    _, deep = search(build_index(docs, "ivfpq", nlist=16, nprobe=16, pq_m=8), queries, 100)
    r_scores, r_found = rerank_exact(queries, deep, docs, 10)
    assert _recall(r_found, exact) >= 0.9 > recall_all_cells
    np.testing.assert_allclose(r_scores, np.take_along_axis(queries @ docs.T, r_found, 1), rtol=1e-5)


def test_ivfpq_checks_pq_m_and_training_points():
    docs = _clustered(3000)
    with pytest.raises(ValueError, match=r"eval.pq_m=48 must divide the embedding dimension 64"):
        build_index(docs, "ivfpq", nlist=16, pq_m=48)
    with pytest.raises(ValueError, match="needs at least 256 training points"):
        build_index(docs[:200], "ivfpq", nlist=16, pq_m=8)


@pytest.mark.parametrize("kind", ["flat", "ivfpq"])
def test_memory_mapped_embeddings_index_like_an_array(tmp_path, kind):
    docs, queries = _clustered(3000), _clustered(20, seed=1)
    mapped = np.lib.format.open_memmap(tmp_path / "docs.npy", mode="w+", dtype=np.float32, shape=docs.shape)
    mapped[:] = docs
    mapped.flush()
    reread = np.load(tmp_path / "docs.npy", mmap_mode="r")
    kw = {"nlist": 16, "nprobe": 4, "pq_m": 8}
    from_array, from_map = search(build_index(docs, kind, **kw), queries, 10), search(build_index(reread, kind, **kw), queries, 10)
    np.testing.assert_array_equal(from_array[1], from_map[1])
    np.testing.assert_allclose(from_array[0], from_map[0], rtol=1e-6)
    # rerank_exact reads only the candidate rows of the map
    np.testing.assert_allclose(rerank_exact(queries, from_map[1], reread, 5)[0], rerank_exact(queries, from_map[1], docs, 5)[0])


def test_eval_config_rejects_unknown_index_and_non_positive_sizes():
    from moco_retrieval.config import EvalConfig, to_config

    assert to_config(EvalConfig, {"index": "ivfpq", "pq_m": 8}).pq_m == 8
    with pytest.raises(ValueError, match=r"eval.index='ivf_pq': expected one of flat, ivf, ivfpq, hnsw"):
        to_config(EvalConfig, {"index": "ivf_pq"})
    with pytest.raises(ValueError, match=r"eval.nprobe=0: must be >= 1"):
        to_config(EvalConfig, {"nprobe": 0})
    with pytest.raises(ValueError, match="pq_bits"):
        to_config(EvalConfig, {"pq_bits": 4})  # not an option: codes are one byte per sub-vector


def test_evaluation_over_ivfpq_holds_exact_scores_of_its_candidates():
    from moco_retrieval.config import EvalConfig
    from moco_retrieval.evaluation.encode import evaluate_embeddings

    docs, queries = _clustered(3000), _clustered(30, seed=1)
    doc_ids, query_ids = [f"d{i}" for i in range(3000)], [f"q{i}" for i in range(30)]
    qrels = {q: {doc_ids[int(np.argmax(docs @ queries[i]))]: 1} for i, q in enumerate(query_ids)}
    res = evaluate_embeddings(doc_ids, docs, query_ids, queries, qrels,
                              EvalConfig(index="ivfpq", nlist=16, nprobe=16, pq_m=8, top_k=50))
    for i, q in enumerate(query_ids):
        hits = res.run[q]
        assert len(hits) == 50
        exact = {d: float(docs[int(d[1:])] @ queries[i]) for d in hits}
        assert hits == pytest.approx(exact, abs=1e-5)
        assert list(hits.values()) == sorted(hits.values(), reverse=True)
        nearest = next(iter(qrels[q]))
        assert (next(iter(hits)) == nearest) == (nearest in hits)  # among the candidates: ranked first
    assert res.metrics["recall@1"] > 0.5


def test_saved_search_index_is_rebuilt_when_its_build_settings_change(tiny_dir, tmp_path):
    """search's saved index is reused for the same settings and rebuilt when nlist or pq_m change."""
    from moco_retrieval.config import EvalConfig, ModelConfig
    from moco_retrieval.model.encoder import build_encoder
    from moco_retrieval.search import build_or_load_index

    enc = build_encoder(ModelConfig(backbone="tiny", path=tiny_dir))
    corpus = {f"d{i}": f"document {i} about topic {i % 17} and {i % 5}" for i in range(300)}

    def built(**kw):
        cfg = EvalConfig(**{"index": "ivfpq", "nlist": 2, "pq_m": 4, **kw})
        return build_or_load_index(enc, corpus, cfg, tmp_path / "index", {"model": "tiny"}, progress=False)[1]

    assert built() is True
    assert built() is False  # same settings: loaded
    assert built(nprobe=1) is False  # a search-time setting: still loaded
    assert built(pq_m=8) is True
    assert built(pq_m=8, nlist=4) is True
