"""mine teacher=PATH (mining/teacher.py, issue 47 part 2): the teacher's scores of every written
positive and negative, the filters judging by them (filter_scores=teacher), and each kind of teacher
folder: a checkpoint or export of ours, a sentence-transformers bi-encoder, a CrossEncoder."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moco_retrieval.config import ConfigError
from moco_retrieval.data.formats import Pair, read_pairs_jsonl, write_pairs_jsonl
from moco_retrieval.mining import MiningFilters, MiningOptions, build_corpus, mine_from_embeddings
from moco_retrieval.mining.teacher import BiEncoderTeacher, CrossEncoderTeacher, is_cross_encoder, load_teacher
from tests.helpers import compose_cfg


def make_pairs(n=12):
    return [Pair(query=f"query {i}", positive=f"document {i}", doc_id=100 + i) for i in range(n)]


def embeddings(corpus, seed=0):
    rng = np.random.default_rng(seed)
    d = rng.normal(size=(len(corpus), 8))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    q = np.stack([d[j] for j in corpus.row_doc]) + 0.1
    return q.astype(np.float32), d.astype(np.float32)


class TableTeacher(CrossEncoderTeacher):
    """A teacher whose score of (query i, document j) is 10 * i + j: every written score says which pair it is."""

    def __init__(self):
        super().__init__(lambda pairs, b, p: [10.0 * int(q.split()[1]) + int(d.split()[1]) for q, d in pairs],
                         {"source": "table", "path": "table"})


def mined(teacher, filter_by_teacher=False, **filters):
    pairs = make_pairs()
    corpus = build_corpus(pairs)
    q, d = embeddings(corpus)
    teacher.prepare([p.query for p in pairs], corpus.texts, 4, False)
    return mine_from_embeddings(pairs, corpus, q, d, MiningFilters(relative_margin=None, range_max=6, **filters),
                                MiningOptions(n_negatives=3, progress=False), teacher, filter_by_teacher)


def test_the_teachers_scores_replace_the_miners():
    res = mined(TableTeacher())
    for p in res.pairs:
        i = int(p.query.split()[1])
        assert p.positive_score == 11.0 * i  # (query i, document i)
        assert [n.score for n in p.negatives] == [10.0 * i + int(n.text.split()[1]) for n in p.negatives]
        assert p.scored
    assert res.stats["teacher"]["kind"] == "cross-encoder" and res.stats["teacher"]["filters_judge_by"] == "miner"


def test_the_filters_can_judge_by_the_teacher():
    """max_score=10*i+5 keeps, by the teacher's scores, the documents numbered up to 5 only (and the
    miner's rank order): a rule that the miner's cosines, all below 2, would never apply."""
    kept = mined(TableTeacher(), filter_by_teacher=True, margin=0.0)  # score(neg) <= score(pos) = 11 i: documents j <= i
    for p in kept.pairs:
        i = int(p.query.split()[1])
        assert all(int(n.text.split()[1]) <= i for n in p.negatives)
        assert [n.score for n in p.negatives] == [10.0 * i + int(n.text.split()[1]) for n in p.negatives]
    by_miner = mined(TableTeacher(), filter_by_teacher=False, margin=0.0)
    assert any(int(n.text.split()[1]) > int(p.query.split()[1]) for p in by_miner.pairs for n in p.negatives)
    assert kept.stats["candidates"]["removed"]["margin"] > 0


def test_a_bi_encoder_teacher_scores_from_its_embeddings():
    vectors = {"query": np.eye(12, 4, dtype=np.float32), "doc": np.eye(12, 4, k=0, dtype=np.float32) * 2}
    teacher = BiEncoderTeacher(lambda texts, kind, b, p: vectors[kind][[int(t.split()[1]) for t in texts]],
                               lambda a, b: (a * b).sum(1), {"path": "vectors"})
    for p in mined(teacher).pairs:
        i = int(p.query.split()[1])
        assert p.positive_score == (2.0 if i < 4 else 0.0)
        assert all(n.score == 0.0 for n in p.negatives)  # (only the same index meets on the diagonal)


@pytest.fixture(scope="module")
def st_folders(tiny_dir, tmp_path_factory):
    """The tiny BERT saved as a sentence-transformers bi-encoder and as a CrossEncoder (one label)."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    root = tmp_path_factory.mktemp("teachers")
    SentenceTransformer(tiny_dir, local_files_only=True).save(str(root / "bi"))
    CrossEncoder(tiny_dir, num_labels=1, local_files_only=True).save(str(root / "cross"))
    return root


def test_each_kind_of_folder_loads_as_its_teacher(st_folders, tmp_path):
    assert is_cross_encoder(st_folders / "cross") and not is_cross_encoder(st_folders / "bi")
    queries, docs = ["apt install", "resize images"], ["a package tool", "ImageMagick edits images"]
    for name, kind in (("bi", "bi-encoder"), ("cross", "cross-encoder")):
        teacher = load_teacher(str(st_folders / name))
        assert teacher.kind == kind
        teacher.prepare(queries, docs, 2, False)
        scores = teacher.score(np.array([0, 1, 1]), np.array([0, 1, 0]))
        assert scores.shape == (3,) and np.isfinite(scores).all()
    # the cross-encoder's raw logit, not predict's default sigmoid
    from sentence_transformers import CrossEncoder

    logits = CrossEncoder(str(st_folders / "cross"), local_files_only=True).predict([("resize images", "a package tool")],
                                                                                    activation_fn=None)
    cross = load_teacher(str(st_folders / "cross"))
    cross.prepare(queries, docs, 2, False)
    sigmoid = float(np.asarray(logits).reshape(-1)[0])
    raw = float(cross.score(np.array([1]), np.array([0]))[0])
    assert raw == pytest.approx(np.log(sigmoid / (1 - sigmoid)), abs=1e-4)
    with pytest.raises(Exception, match="neither a checkpoint"):
        (tmp_path / "empty").mkdir()
        load_teacher(str(tmp_path / "empty"))


def test_mine_with_a_sentence_transformers_teacher_writes_its_scores(st_folders, tiny_dir, tmp_path):
    from moco_retrieval.mine import run_mine, to_mine_config

    write_pairs_jsonl(tmp_path / "pairs.jsonl", make_pairs())
    cfg = to_mine_config(compose_cfg("mine", [
        "model=tiny", f"model.path={tiny_dir}", "data=jsonl", f"data.train_path={tmp_path / 'pairs.jsonl'}",
        f"output={tmp_path / 'mined.jsonl'}", "n_negatives=2", "range_max=4", "relative_margin=null", "progress=false",
        f"teacher={st_folders / 'cross'}"]))
    run_mine(cfg)
    rows = read_pairs_jsonl(tmp_path / "mined.jsonl")
    assert rows and all(p.scored for p in rows)
    teacher = load_teacher(str(st_folders / "cross"))
    teacher.prepare([rows[0].query], [rows[0].positive], 2, False)
    assert rows[0].positive_score == pytest.approx(float(teacher.score(np.array([0]), np.array([0]))[0]), abs=1e-5)
    stats = json.loads((tmp_path / "mined.stats.json").read_text())
    assert stats["teacher"]["kind"] == "cross-encoder" and stats["teacher"]["score"] == "logit"


@pytest.mark.parametrize("overrides, says", [
    (["filter_scores=teacher"], "filter_scores=teacher judges candidates by a teacher's scores: give teacher=PATH"),
    (["model_dir={tiny}", "teacher={tiny}"], "is the mining model (model_dir): its scores are written without it"),
    (["teacher={tiny}/absent"], "absent: no such file or directory (expected a checkpoint"),
])
def test_teacher_options_are_refused_before_any_model_loads(overrides, says, tiny_dir, tmp_path):
    from moco_retrieval.mine import mining_settings, to_mine_config

    from moco_retrieval.errors import UserError

    with pytest.raises(UserError) as e:  # ConfigError, ModelNotFoundError: exit status 2, one message
        mining_settings(to_mine_config(compose_cfg("mine", [f"output={tmp_path / 'o.jsonl'}",
                                                            *[o.format(tiny=tiny_dir) for o in overrides]])))
    assert says in str(e.value)


def test_a_checkpoint_of_ours_teaches_with_its_training_score(tiny_dir, tmp_path):
    """The checkpoint's trained encoder, the dot product of its embeddings (cosine: it normalises)."""
    import torch

    from moco_retrieval.evaluation.encode import encode_texts
    from moco_retrieval.model.loading import load_encoder
    from tests.helpers import train_checkpoint

    ckpt = train_checkpoint(tiny_dir, None, tmp_path)
    teacher = load_teacher(ckpt)
    assert teacher.kind == "bi-encoder" and teacher.description["source"] == "checkpoint"
    queries, docs = ["apt install", "resize images"], ["a package tool", "ImageMagick edits images"]
    teacher.prepare(queries, docs, 2, False)
    encoder, _ = load_encoder(checkpoint=ckpt)
    q, d = (torch.from_numpy(encode_texts(encoder, t, k, 2, False)) for t, k in ((queries, "query"), (docs, "doc")))
    assert teacher.score(np.array([0, 1]), np.array([1, 1])) == pytest.approx([float(q[0] @ d[1]), float(q[1] @ d[1])],
                                                                              abs=1e-5)
