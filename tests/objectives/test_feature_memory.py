"""objective=feature_memory: in frozen-backbone mode the queue holds backbone features, projected
by the trained head every step with gradient, so no queued key is stale and both sides train."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moco_retrieval.config import ModelConfig
from moco_retrieval.objectives.feature_memory import FeatureMemoryConfig
from moco_retrieval.training.module import RetrievalModule
from tests.helpers import SyntheticData, fit, make_module

TAU = 0.1


def memory_module(tiny_dir, *, frozen=True, queue_size=64, head_dim=16):
    """The feature memory on bag-of-wordpieces features with a linear head (lr 5e-2)."""
    model = ModelConfig(backbone="tiny", path=tiny_dir, backbone_kind="bag_of_wordpieces", frozen_backbone=frozen,
                        head="linear", head_dim=head_dim)
    return make_module(model, FeatureMemoryConfig(queue_size=queue_size, temperature=TAU), lr=5e-2)


def batch_of(seed=123, n=4):
    dm = SyntheticData(lambda texts, kind: {}, batch_size=n, batches=1, seed=seed)
    dm.trainer = None
    return next(iter(dm.train_dataloader()))


def reference_loss(m: RetrievalModule, batch: dict) -> torch.Tensor:
    """InfoNCE with the stored features projected by the current head, written from scratch."""
    enc = m.encoder
    head = enc.tower_for("doc").head

    def keys_of(feats):
        return F.normalize(head(feats.float()), dim=-1)

    q = enc(batch["query"], "query")
    k = keys_of(enc.features(batch["doc"], "doc"))
    queue = m.objective.memory.queue
    qk = keys_of(queue.keys())
    ids = batch["doc_id"]
    pos = (q * k).sum(1, keepdim=True)
    own = torch.eye(len(ids), dtype=torch.bool) | (ids[None, :] == ids[:, None])
    batch_logits = (q @ k.T).masked_fill(own, -float("inf"))
    queue_logits = (q @ qk.T).masked_fill(queue.ids()[None, :] == ids[:, None], -float("inf"))
    logits = torch.cat([pos, batch_logits, queue_logits], dim=1) / TAU
    return F.cross_entropy(logits, torch.zeros(len(ids), dtype=torch.long))


def test_queue_holds_features_and_loss_and_gradient_equal_reference(tiny_dir, tmp_path):
    torch.manual_seed(0)
    m = memory_module(tiny_dir)
    fit(m, tmp_path, batches=6, max_steps=6, tokenize=lambda texts, kind: {})  # frozen features: texts only
    queue = m.objective.memory.queue
    assert queue.fill == 24 and m.key_encoder is None
    assert queue.queue_keys.shape == (64, m.encoder.hidden_size) != (64, m.encoder.dim)  # features, not keys
    batch = batch_of(seed=9)
    m.train()
    head = [p for p in m.encoder.parameters() if p.requires_grad]
    loss, stats = m.shared_step(batch)
    got = torch.autograd.grad(loss, head)
    ref = reference_loss(m, batch)
    want = torch.autograd.grad(ref, head)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want):  # gradient through the queued keys too: the document side trains
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert stats["negatives_per_query"] == pytest.approx(3 + 24, abs=1.0)
    # move the head: the queued negatives follow it at once (nothing stale)
    m.eval()
    with torch.no_grad():
        for p in head:
            p.add_(torch.randn_like(p) * 0.5)
        loss2, _ = m.shared_step(batch)
        torch.testing.assert_close(loss2, reference_loss(m, batch), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(loss2, loss.detach())


def test_enqueues_the_batch_features_after_backward(tiny_dir):
    torch.manual_seed(0)
    m = memory_module(tiny_dir)
    m.train()
    batch = batch_of(seed=5)
    loss, _ = m.shared_step(batch)
    assert m.objective.memory.queue.fill == 0  # held back until after backward
    loss.backward()
    m.on_after_backward()
    assert m.objective.memory.queue.fill == 4
    torch.testing.assert_close(m.objective.memory.queue.keys(), m.encoder.features(batch["doc"], "doc"))
    assert torch.equal(m.objective.memory.queue.ids(), batch["doc_id"])


def test_state_dict_round_trip(tiny_dir, tmp_path):
    torch.manual_seed(0)
    m = memory_module(tiny_dir)
    fit(m, tmp_path, batches=3, max_steps=3, tokenize=lambda texts, kind: {})
    fresh = memory_module(tiny_dir)
    fresh.load_state_dict(m.state_dict())
    assert fresh.objective.memory.queue.fill == 12 and fresh.objective.stats(3)["queue_fill"] == 12
    assert torch.equal(fresh.objective.memory.queue.queue_keys, m.objective.memory.queue.queue_keys)


def test_needs_a_frozen_backbone(tiny_dir):
    with pytest.raises(ValueError, match="frozen_backbone"):
        memory_module(tiny_dir, frozen=False)
