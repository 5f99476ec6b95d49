"""objective.matryoshka_dims (objectives/matryoshka.py): the loss summed over truncated, re-normalised
prefixes of every embedding, queued keys included, against loop references."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.helpers import compose_cfg, encoder_stub, momentum_step, ref_direction, unit

from moco_retrieval.config import ConfigError
from moco_retrieval.objectives.inbatch import InBatchConfig
from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.objectives.registry import build_objective
from moco_retrieval.objectives.two_queue import TwoQueueConfig

TAU, D = 0.07, 8
IDS = torch.tensor([10, 11, 12, 13, 10, 15])  # rows 0 and 4 share a positive document
GROUPS = torch.tensor([1, 2, 2, -1, 1, -1])
Q_IDS = torch.tensor([10, 99, 12, 98, 97, 96, 13, 95, 94, 93])  # the queue holds positives 10, 12, 13
Q_GROUPS = torch.tensor([-1, 2, -1, -1, 1, -1, -1, 5, -1, -1])


def ref_prefix_loss(q, k, batch_keys, extra, dim, normalize=True):
    """MoCo's loss on the first ``dim`` coordinates (re-normalised): the loop reference on the cut vectors."""
    def cut(x):
        x = x[..., :dim]
        return F.normalize(x, dim=-1) if normalize else x
    return ref_direction(cut(q), cut(k), cut(batch_keys), IDS, GROUPS,
                         [(cut(vecs), ids, groups) for vecs, ids, groups in extra], TAU)


@pytest.mark.parametrize("normalize", [True, False])
def test_moco_loss_and_gradient_are_the_weighted_sum_over_prefixes(normalize):
    """Every block is truncated, queued keys included (they stay full-size in the queue)."""
    cfg = MoCoConfig(queue_size=20, temperature=TAU, matryoshka_dims=[8, 4, 2], matryoshka_weights=[1.0, 0.5, 0.25])
    obj = build_objective(cfg, encoder_stub(D, normalize=normalize)).train()
    docs = obj.objective.docs  # (Matryoshka wraps the objective)
    docs.queue.enqueue(unit(10, D, seed=5), Q_IDS, Q_GROUPS, step=0)
    queue = docs.queue.keys().clone()
    q, k = unit(6, D, seed=1).requires_grad_(), unit(6, D, seed=2)
    hard, hard_ids, hard_groups = unit(4, D, seed=9), torch.tensor([200, 11, 202, 203]), torch.tensor([-1, -1, 1, -1])
    loss, stats = momentum_step(obj, q, k, dict(doc_id=IDS, group=GROUPS, neg=hard, neg_id=hard_ids, neg_group=hard_groups))
    (got,) = torch.autograd.grad(loss, [q])
    q2 = q.detach().clone().requires_grad_()
    extra = [(hard, hard_ids, hard_groups), (queue, Q_IDS, Q_GROUPS)]
    parts = {dim: ref_prefix_loss(q2, k, k, extra, dim, normalize) for dim in (8, 4, 2)}
    ref = parts[8] + 0.5 * parts[4] + 0.25 * parts[2]
    (want,) = torch.autograd.grad(ref, [q2])
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    for dim, part in parts.items():
        assert stats[f"loss_dim{dim}"].item() == pytest.approx(part.item(), abs=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    obj.after_backward()
    assert docs.queue.keys().shape[1] == D and docs.queue.fill == 16  # full-size keys, written once


def test_two_queue_prefixes_cover_both_queues_and_the_in_batch_term():
    """With the one full dimension it is the objective without Matryoshka; with a smaller prefix
    alone, the objective on truncated, re-normalised embeddings and queues."""
    def make(**kw):
        obj = build_objective(TwoQueueConfig(queue_size=20, temperature=TAU, **kw), encoder_stub(D)).train()
        core = getattr(obj, "objective", obj)  # (Matryoshka wraps the objective)
        core.docs.queue.enqueue(unit(10, D, seed=5), Q_IDS, Q_GROUPS, step=0)
        core.queries.queue.enqueue(unit(10, D, seed=6), Q_IDS.flip(0), Q_GROUPS.flip(0), step=0)
        return obj
    step = dict(q=unit(6, D, seed=1), k=unit(6, D, seed=2), doc_id=IDS, group=GROUPS, d=unit(6, D, seed=3),
                q_key=unit(6, D, seed=4))

    def run(obj, step):
        meta = {n: v for n, v in step.items() if n not in ("q", "k")}
        return momentum_step(obj, step["q"], step["k"], meta)

    plain = run(make(), step)[0]
    assert run(make(matryoshka_dims=[D]), step)[0].item() == pytest.approx(plain.item(), rel=1e-6)
    cut = run(make(matryoshka_dims=[4]), step)[0]
    truncated = make()  # the same queues, truncated and re-normalised by hand
    for memory in (truncated.docs, truncated.queries):
        memory.queue.queue_keys[:, 4:] = 0
        memory.queue.queue_keys.copy_(F.normalize(memory.queue.queue_keys, dim=1))
    short = {n: (F.pad(F.normalize(v[:, :4], dim=1), (0, D - 4)) if n in ("q", "k", "d", "q_key") else v)
             for n, v in step.items()}
    assert cut.item() == pytest.approx(run(truncated, short)[0].item(), rel=1e-6)
    assert abs(cut.item() - plain.item()) > 1e-3


def test_bad_prefixes_are_refused():
    with pytest.raises(ConfigError, match="the embeddings have 8 dimensions"):  # (the encoder's: known once built)
        build_objective(InBatchConfig(matryoshka_dims=[16, 8]), encoder_stub(D))
    with pytest.raises(ConfigError, match="one weight >= 0 per dimension"):  # the rest with the config
        InBatchConfig(matryoshka_dims=[8, 4], matryoshka_weights=[1.0])
    with pytest.raises(ConfigError, match="distinct dimensions >= 1"):
        InBatchConfig(matryoshka_dims=[8, 0])


# ------------------------------------------------------------------ evaluation at each prefix

WORDS = "image resize shell terminal backup archive network server editor font audio video mail web".split()


def evalset():
    import random

    from moco_retrieval.data.formats import EvalSet

    rng = random.Random(0)
    docs = {f"d{i}": " ".join(rng.sample(WORDS, 5)) for i in range(30)}
    queries = {f"q{i}": " ".join(docs[f"d{2 * i}"].split()[:2]) for i in range(10)}
    return EvalSet(corpus=docs, queries=queries, qrels={f"q{i}": {f"d{2 * i}": 1} for i in range(10)})


def test_metrics_by_dim_score_the_truncated_renormalised_embeddings():
    import numpy as np

    from moco_retrieval.config import EvalConfig
    from moco_retrieval.evaluation.encode import evaluate_embeddings
    from moco_retrieval.evaluation.encode import metrics_by_dim

    es, cfg = evalset(), EvalConfig(top_k=10)
    rng = np.random.default_rng(0)
    docs, queries = rng.normal(size=(30, 8)).astype(np.float32), rng.normal(size=(10, 8)).astype(np.float32)
    got = metrics_by_dim(list(es.corpus), docs, list(es.queries), queries, es.qrels, cfg, [8, 4, 2], normalize=True)
    assert set(got) == {"4", "2"}  # the full size is the ordinary evaluation
    for dim in (4, 2):
        cut = [x[:, :dim] / np.linalg.norm(x[:, :dim], axis=1, keepdims=True) for x in (docs, queries)]
        want = evaluate_embeddings(list(es.corpus), cut[0], list(es.queries), cut[1], es.qrels, cfg, normalize=True)
        assert got[str(dim)] == pytest.approx(want.metrics)
    assert got["4"] != got["2"]


def test_validation_evaluate_and_export_report_each_prefix(tiny_dir, tmp_path):
    """A Matryoshka model: validation logs val/dim<d>/*, evaluate writes metrics_by_dim, export
    records the dimensions (card included) and sentence-transformers' truncate_dim serves them."""
    import json

    import lightning as L
    import numpy as np

    from moco_retrieval.config import DataConfig, EvalConfig, ModelConfig, OptimConfig
    from moco_retrieval.data.datamodule import RetrievalDataModule
    from moco_retrieval.evaluation.encode import encode_texts, evaluate_encoder
    from moco_retrieval.export.__main__ import write_model_card
    from moco_retrieval.export.writer import export_encoder
    from moco_retrieval.training.module import RetrievalModule
    from moco_retrieval.model.loading import load_model_dir

    st_mod = pytest.importorskip("sentence_transformers")
    torch.manual_seed(0)
    m = RetrievalModule(ModelConfig(backbone="tiny", path=tiny_dir, head="linear", head_dim=8),
                        InBatchConfig(matryoshka_dims=[8, 4]), OptimConfig(), EvalConfig(top_k=10))
    es = evalset()
    dm = RetrievalDataModule.from_loaded(DataConfig(kind="jsonl", eval_batch_size=8), [], es, tokenize=m.encoder.tokenize)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    (logged,) = trainer.validate(m, datamodule=dm, verbose=False)
    res = evaluate_encoder(m.encoder, es, EvalConfig(top_k=10), batch_size=8, show_progress=False, dims=[8, 4])
    assert set(res.metrics_by_dim) == {"4"} and res.summary()["metrics_by_dim"]["4"] == res.metrics_by_dim["4"]
    for k in ("recall@1", "ndcg@10"):
        assert logged[f"val/dim4/{k}"] == pytest.approx(res.metrics_by_dim["4"][k], abs=1e-6)
        assert logged[f"val/{k}"] == pytest.approx(res.metrics[k], abs=1e-6)

    out = export_encoder(m.encoder, tmp_path / "m", source={"source": "checkpoint", "matryoshka_dims": [8, 4]})
    assert json.loads((out / "moco_retrieval.json").read_text())["matryoshka_dims"] == [8, 4]
    back, desc = load_model_dir(out)
    assert desc["matryoshka_dims"] == [8, 4]  # so evaluate model_dir= scores each prefix
    texts = list(es.queries.values())
    ref = encode_texts(m.encoder, texts, "query", show_progress=False)
    st = st_mod.SentenceTransformer(str(out), device="cpu", truncate_dim=4)
    np.testing.assert_allclose(st.encode_query(texts), ref[:, :4], atol=1e-5)
    desc = {"source": "checkpoint", "dim": 8, "matryoshka_dims": [8, 4], "global_step": 0, "path": "x.ckpt"}
    card = write_model_card(out, desc, None, "query", "m").read_text()
    assert "## Matryoshka dimensions" in card and "truncate_dim=4" in card


def test_model_card_lists_each_prefix_with_its_held_out_metrics():
    from moco_retrieval.export.card import model_card

    metrics = {"recall@1": 0.5, "ndcg@10": 0.6, "dim64/recall@1": 0.4, "dim64/ndcg@10": 0.45}
    card = model_card({"dim": 128}, {"pooling": "mean"}, "query",
                      {"objective": {"name": "inbatch", "matryoshka_dims": [128, 64]}}, metrics, "out")
    assert "| dimensions | recall@1 | ndcg@10 |" in card and "| 64 | 0.4000 | 0.4500 |" in card
    assert 'SentenceTransformer("out", truncate_dim=64)' in card


def test_resuming_a_run_from_before_matryoshka_with_it_on_is_refused(tmp_path):
    """A checkpoint written before the option existed trained without prefixes: turning them on
    mid-run would train another loss, so the resume names the override that keeps it as trained."""
    from moco_retrieval.errors import CheckpointError
    from moco_retrieval.training.resume_check import check_resumable

    old = {"hyper_parameters": {"objective": {"name": "inbatch", "temperature": 0.05}}}

    def resume(*overrides):
        cfg = compose_cfg("train", ["objective=inbatch", "objective.temperature=0.05", *overrides], to_object=True)
        check_resumable(old, "old.ckpt", cfg)

    resume()
    with pytest.raises(CheckpointError, match=r"objective.matryoshka_dims=\[\], but this run's config has "
                                              r"objective.matryoshka_dims=\[64,32\]"):
        resume("objective.matryoshka_dims=[64,32]")
