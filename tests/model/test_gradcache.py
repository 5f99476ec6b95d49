"""GradCache: the parameter gradients of a chunked, cached step equal those of one graph over the
batch (dropout on: the random state of each chunk is replayed), and a Lightning fit with grad cache,
clipping and accumulation ends where the same fit without it ends."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from moco_retrieval.config import ModelConfig
from moco_retrieval.objectives.inbatch import InBatchConfig
from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.model.gradcache import GradCache, split_side
from tests.helpers import WORDS, fit, make_module

B, N_NEG, CHUNK = 8, 2, 3  # 3 does not divide 8 or 16: a short last chunk


pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def chunked_module(tiny_dir, objective="inbatch", chunk=CHUNK, symmetric=False):
    """In-batch (or MoCo) on the tiny model with grad cache in chunks of ``chunk`` (None: off), seeded 0."""
    obj = (InBatchConfig(temperature=0.1, symmetric=symmetric) if objective == "inbatch"
           else MoCoConfig(temperature=0.1, queue_size=16, momentum=0.9))
    return make_module(ModelConfig(backbone="tiny", path=tiny_dir, grad_cache_chunk=chunk), obj, seed=0)


def make_batch(tokenize, seed=0):
    rng = random.Random(seed)
    docs = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(B)]
    queries = [" ".join(d.split()[:2]) for d in docs]
    negs = [" ".join(rng.choices(WORDS, k=rng.randint(2, 10))) for _ in range(B * N_NEG)]
    return {
        "query": {"texts": queries, **tokenize(queries, "query")},
        "doc": {"texts": docs, **tokenize(docs, "doc")},
        "doc_id": torch.arange(B) + 100,
        "group": torch.full((B,), -1),
        "index": torch.arange(B),
        "neg": {"texts": negs, **tokenize(negs, "doc")},
        "neg_id": torch.arange(B * N_NEG) + 1000,
        "neg_group": torch.full((B * N_NEG,), -1),
    }


class OneGraph:
    """The reference: the same chunks, in the same order (so the same dropout masks from the same
    seed), all kept in one autograd graph."""

    def __init__(self, chunk):
        self.chunk = chunk

    def embed(self, fn, side, device=None, grad=True):
        return torch.cat([fn(part) for part in split_side(side, self.chunk)])


def grads_of(module, batch, seed=1):
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss, _ = module.shared_step(batch)
    loss.backward()  # (no commit: the queue stays as it was for the reference)
    return float(loss.detach()), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_same(a, b, atol=1e-5):
    assert a.keys() == b.keys() and len(a) > 5
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def fill_queue(module):
    q = module.objective.docs.queue
    q.enqueue(torch.nn.functional.normalize(torch.randn(12, module.encoder.dim), dim=1), torch.arange(12) + 5000,
              torch.full((12,), -1), step=0)


@pytest.mark.parametrize("objective,symmetric", [("inbatch", False), ("inbatch", True), ("moco", False)])
def test_grad_cache_equals_one_graph_with_dropout(tiny_dir, objective, symmetric):
    m = chunked_module(tiny_dir, objective, symmetric=symmetric)
    m.train()  # dropout on
    if objective == "moco":
        fill_queue(m)
    batch = make_batch(m.encoder.tokenize)
    loss_gc, g_gc = grads_of(m, batch)
    gc = m.grad_cache
    m.grad_cache = OneGraph(CHUNK)
    loss_ref, g_ref = grads_of(m, batch)
    assert loss_gc == pytest.approx(loss_ref, abs=1e-6)
    assert_same(g_gc, g_ref)
    # the random state matters: dropout is on, another seed gives other gradients
    m.grad_cache = gc
    _, g_other = grads_of(m, batch, seed=2)
    assert max((g_other[n] - g_gc[n]).abs().max() for n in g_gc) > 1e-4


def test_without_replay_the_gradients_are_wrong(tiny_dir):
    m = chunked_module(tiny_dir)
    m.train()
    batch = make_batch(m.encoder.tokenize)
    m.grad_cache = OneGraph(CHUNK)
    _, g_ref = grads_of(m, batch)
    m.grad_cache = GradCache(CHUNK, replay_random_state=False)
    _, g_bad = grads_of(m, batch)
    assert max((g_bad[n] - g_ref[n]).abs().max() for n in g_ref) > 1e-4


def test_grad_cache_equals_full_batch_without_dropout(tiny_dir):
    """No dropout: the cached gradients are those of one plain forward of the whole batch."""
    m = chunked_module(tiny_dir)
    m.eval()
    batch = make_batch(m.encoder.tokenize)
    loss_gc, g_gc = grads_of(m, batch)
    m.grad_cache = None
    loss_full, g_full = grads_of(m, batch)
    assert loss_gc == pytest.approx(loss_full, abs=1e-6)
    assert_same(g_gc, g_full)


def no_dropout(module):
    for mod in module.modules():
        if isinstance(mod, torch.nn.Dropout):  # BERT's attention dropout reads this p too
            mod.p = 0.0
    return module


@pytest.mark.parametrize("objective", ["inbatch", "moco"])
def test_fit_with_grad_cache_clipping_and_accumulation(tiny_dir, tmp_path, objective):
    """Two optimizer steps of two micro-batches each, clipped hard: the same weights (and, for moco,
    the same EMA key encoder and queue) with and without grad cache."""

    def trained(chunk):
        m = no_dropout(chunked_module(tiny_dir, objective, chunk=chunk))
        fit(m, tmp_path, batches=4, batch_size=6, max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05)
        return m

    a, b = trained(4), trained(None)
    assert a.grad_cache is not None and b.grad_cache is None
    moved = 0.0
    for (name, pa), pb, p0 in zip(a.state_dict().items(), b.state_dict().values(), chunked_module(tiny_dir, objective).state_dict().values()):
        torch.testing.assert_close(pa.float(), pb.float(), atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        moved = max(moved, float((pa.float() - p0.float()).abs().max()))
    assert moved > 1e-4  # training did something


def test_chunking_and_arguments(tiny_dir):
    side = {"texts": list("abcdefg"), "input_ids": torch.tensor([[1, 2, 0]] * 6 + [[1, 2, 3]]),
            "attention_mask": torch.tensor([[1, 1, 0]] * 6 + [[1, 1, 1]])}
    parts = split_side(side, 3)
    assert [p["texts"] for p in parts] == [["a", "b", "c"], ["d", "e", "f"], ["g"]]
    assert parts[0]["input_ids"].shape == (3, 2) and parts[2]["input_ids"].shape == (1, 3)  # padding trimmed
    with pytest.raises(ValueError, match="grad_cache_chunk"):
        GradCache(0)
    m = chunked_module(tiny_dir)
    m._trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(model=m))
    with pytest.raises(ValueError, match="needs trainer.strategy=ddp"):
        m.on_fit_start()
