"""objective.queue_reproject: in frozen-backbone mode the MoCo queue holds backbone features and
re-projects them with the *current* key head every step, so no queued key is stale."""
from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from moco_retrieval.config import ModelConfig, ObjectiveConfig, OptimConfig
from moco_retrieval.lightning_module import RetrievalModule
from moco_retrieval.model.tiny import build_tiny_bert
from synthetic import SyntheticData

TAU = 0.1


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_bert(tmp_path_factory.mktemp("tiny") / "bert"))


def make_module(tiny_dir, *, key_encoder="ema", frozen=True, objective="moco", queue_size=64, reproject=True,
                backbone_kind="bag_of_wordpieces", head_dim=16, key_grad=False):
    model = ModelConfig(
        backbone="tiny", path=tiny_dir, backbone_kind=backbone_kind, frozen_backbone=frozen, head="linear",
        head_dim=head_dim, momentum=0.5, key_encoder=key_encoder,
    )
    obj = ObjectiveConfig(name=objective, queue_size=queue_size, temperature=TAU, queue_reproject=reproject,
                          key_grad=key_grad)
    return RetrievalModule(model, obj, OptimConfig(lr=5e-2, warmup_steps=0, warmup_ratio=0.0, schedule="constant"))


def fit(module, tmp_path, steps, batch_size=4):
    t = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    t.fit(module, SyntheticData(lambda texts, kind: {}, batch_size=batch_size, batches=steps))
    return t


def batch_of(seed=123, n=4):
    dm = SyntheticData(lambda texts, kind: {}, batch_size=n, batches=1, seed=seed)
    dm.trainer = None
    return next(iter(dm.train_dataloader()))


def reference_loss(m: RetrievalModule, batch: dict, grad: bool = False) -> torch.Tensor:
    """InfoNCE with the stored queue features projected by the current key head, from scratch
    (``grad``: keep the graph through queries and keys, as objective.key_grad should)."""
    key_enc = m.key_encoder.key_encoder if m.key_encoder is not None else m.encoder
    tower = key_enc.tower_for("doc")
    head = tower.head

    def keys_of(feats):
        return F.normalize(head(feats.float()), dim=-1)

    with torch.set_grad_enabled(grad):
        q = m.encoder(batch["query"], "query")
        doc_feats = tower.feature_cache.gather(batch["doc"]["texts"], key_enc.max_len("doc"))
        k = keys_of(doc_feats)
        queue = m.objective.queue
        qk = keys_of(queue.keys())
        ids = batch["doc_id"]
        pos = (q * k).sum(1, keepdim=True)
        own = torch.eye(len(ids), dtype=torch.bool) | (ids[None, :] == ids[:, None])
        batch_logits = (q @ k.T).masked_fill(own, -float("inf"))
        queue_logits = (q @ qk.T).masked_fill(queue.ids()[None, :] == ids[:, None], -float("inf"))
        logits = torch.cat([pos, batch_logits, queue_logits], dim=1) / TAU
        return F.cross_entropy(logits, torch.zeros(len(ids), dtype=torch.long))


@pytest.mark.parametrize("key_encoder", ["ema", "query"])
def test_loss_equals_reference_with_current_key_head(tiny_dir, tmp_path, key_encoder):
    torch.manual_seed(0)
    m = make_module(tiny_dir, key_encoder=key_encoder)
    fit(m, tmp_path, steps=6)
    queue = m.objective.queue
    assert queue.fill == 24
    hidden = m.encoder.hidden_size
    assert hidden != m.encoder.dim and queue.queue_keys.shape == (64, hidden)  # features, not keys

    key_enc = m.key_encoder.key_encoder if m.key_encoder is not None else m.encoder
    # the queue holds exactly the frozen features of the documents it enqueued
    tower = key_enc.tower_for("doc")
    cache = tower.feature_cache
    max_len = key_enc.max_len("doc")
    cached = cache.gather(cache.texts(max_len), max_len)
    for row in range(queue.fill):
        assert any(torch.equal(queue.keys()[row], f) for f in cached)

    batch = batch_of()
    m.eval()
    m.objective.eval()
    loss, stats = m.shared_step(batch)
    torch.testing.assert_close(loss, reference_loss(m, batch), rtol=1e-5, atol=1e-5)
    assert stats["negatives_per_query"] == pytest.approx(3 + 24, abs=1.0)

    # move the key head: the queued negatives follow it at once (nothing stale)
    with torch.no_grad():
        for p in tower.head.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    loss2, _ = m.shared_step(batch)
    ref2 = reference_loss(m, batch)
    torch.testing.assert_close(loss2, ref2, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(loss2, loss)


def test_gradient_reaches_query_head_only_and_queue_enqueues_after_backward(tiny_dir):
    torch.manual_seed(0)
    m = make_module(tiny_dir)
    m.train()
    batch = batch_of(seed=5)
    loss, _ = m.shared_step(batch)
    assert m.objective.queue.fill == 0  # held back until commit
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.encoder.parameters() if p.requires_grad)
    assert all(p.grad is None for p in m.key_encoder.parameters())
    m.objective.commit()
    assert m.objective.queue.fill == 4
    key_enc = m.key_encoder.key_encoder
    feats = key_enc.tower_for("doc").feature_cache.gather(batch["doc"]["texts"], key_enc.max_len("doc"))
    torch.testing.assert_close(m.objective.queue.keys(), feats)


def test_state_dict_round_trip(tiny_dir, tmp_path):
    torch.manual_seed(0)
    m = make_module(tiny_dir)
    fit(m, tmp_path, steps=3)
    fresh = make_module(tiny_dir)
    fresh.load_state_dict(m.state_dict())
    assert fresh.objective.reproject and fresh.objective.queue.fill == 12
    assert torch.equal(fresh.objective.queue.queue_keys, m.objective.queue.queue_keys)


def test_needs_frozen_backbone_and_a_queue(tiny_dir):
    with pytest.raises(ValueError, match="frozen_backbone"):
        make_module(tiny_dir, frozen=False)
    with pytest.raises(ValueError, match="objective=moco"):
        make_module(tiny_dir, objective="inbatch")


def test_off_by_default_keeps_key_queue(tiny_dir):
    m = make_module(tiny_dir, reproject=False)
    assert not m.objective.reproject and m.objective.queue.queue_keys.shape[1] == m.encoder.dim


def test_key_grad_trains_the_document_side_through_queued_keys(tiny_dir, tmp_path):
    """objective.key_grad: the loss is in-batch InfoNCE over batch + queued documents with every key
    made by the trained head, and its gradient flows through the queued keys too."""
    torch.manual_seed(0)
    m = make_module(tiny_dir, key_encoder="query", key_grad=True)
    fit(m, tmp_path, steps=6)
    assert m.objective.key_grad and m.objective.queue.fill == 24
    batch = batch_of(seed=9)
    m.train()
    head = [p for p in m.encoder.parameters() if p.requires_grad]
    loss, _ = m.shared_step(batch)
    got = torch.autograd.grad(loss, head)
    m.objective._pending = None
    ref = reference_loss(m, batch, grad=True)
    want = torch.autograd.grad(ref, head)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    # without key gradient the same loss has a different gradient (query side only)
    m.objective.key_grad = False
    loss_q, _ = m.shared_step(batch)
    torch.testing.assert_close(loss_q, ref, rtol=1e-5, atol=1e-5)
    got_q = torch.autograd.grad(loss_q, head)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got_q, want))


def test_key_grad_needs_query_key_encoder_and_reprojected_queue(tiny_dir):
    with pytest.raises(ValueError, match="key_encoder=query"):
        make_module(tiny_dir, key_encoder="ema", key_grad=True)
    with pytest.raises(ValueError, match="queue_reproject=true"):
        make_module(tiny_dir, key_encoder="query", reproject=False, key_grad=True)
