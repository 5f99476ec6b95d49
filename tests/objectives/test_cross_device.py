"""Cross-device in-batch negatives: two gloo ranks against one process on the concatenated batch.

What equals what (W ranks, B rows each, global batch of W*B rows):

* The global loss of one process on the concatenated batch is the mean over all W*B query rows,
  each against every document (and hard negative) of the global batch:
  ``L = (1/(W*B)) * sum_i loss_i``.
* Rank r's loss is the mean over its own B rows against the same global candidates (documents and
  hard negatives are all-gathered with gradient): ``loss_r = (1/B) * sum_{i on r} loss_i``, so
  ``loss_r`` equals the single-process mean over rank r's rows and ``mean_r(loss_r) == L``.
* The all-gather's backward sums, over ranks, the gradient flowing into each rank's slice, so the
  gradient rank r gets for its local q, k and h is ``d(sum_r' loss_r')/d x_r = W * dL/dx_r``.
* DDP averages parameter gradients over ranks: ``(1/W) * sum_r W * (dL/dθ from rank r's rows) =
  dL/dθ``, so the parameter gradients equal those of one process on the concatenated batch.

The test checks each line, for the one-directional and the symmetric loss, with masking by id and
group across ranks (a document on rank 1 shares a group with a positive on rank 0; a hard negative
on rank 1 *is* a positive on rank 0).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.helpers import on_ranks

W, B, N, D, DIN = 2, 3, 2, 8, 6  # ranks, rows per rank, hard negatives per row, dim, input dim
TAU = 0.1


def make_data():
    g = torch.Generator().manual_seed(0)
    x = {k: torch.randn(n, DIN, generator=g) for k, n in [("q", W * B), ("k", W * B), ("h", W * B * N)]}
    ids = torch.arange(W * B) + 1000
    groups = torch.tensor([5, 6, -1, 6, -1, 7])  # row 3 (rank 1) shares row 1's (rank 0) group
    neg_id = torch.arange(W * B * N) + 2000
    neg_id[7] = ids[0]  # a hard negative on rank 1 is rank 0's first positive
    neg_group = torch.full((W * B * N,), -1)
    neg_group[1] = 7  # a hard negative on rank 0 is in rank 1's last positive's group
    weight = torch.randn(D, DIN, generator=g)
    return {"x": x, "doc_id": ids, "group": groups, "neg_id": neg_id, "neg_group": neg_group, "weight": weight}


class Tower(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.lin = torch.nn.Linear(DIN, D, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(weight)

    def forward(self, xq, xk, xh):
        return [F.normalize(self.lin(x), dim=-1) for x in (xq, xk, xh)]


def rows(t, rank, per):
    return t[rank * per : (rank + 1) * per]


def run(data, rank, symmetric, world, ddp=False):
    """Loss, gradients w.r.t. q, k, h (as leaves) and the tower's parameter gradient on this process's
    rows (all rows when world == 1)."""
    from tests.helpers import Given

    from moco_retrieval.objectives.inbatch import InBatchConfig, InBatchObjective

    per = B if world > 1 else W * B
    meta = {key: rows(data[key], rank, per) for key in ("doc_id", "group")}
    meta.update(neg_id=rows(data["neg_id"], rank, per * N), neg_group=rows(data["neg_group"], rank, per * N))
    obj = InBatchObjective(InBatchConfig(temperature=TAU, symmetric=symmetric))
    xs = [rows(data["x"][k], rank, per * (N if k == "h" else 1)) for k in ("q", "k", "h")]
    # (1) embeddings as leaves
    tower = Tower(data["weight"])
    with torch.no_grad():
        q, k, h = (t.detach().requires_grad_() for t in tower(*xs))
    loss, _ = obj(meta, Given(query=q, doc=k, neg=h))
    loss.backward()
    out = {"loss": loss.detach(), "q": q.grad, "k": k.grad, "h": h.grad}
    # (2) parameters, through DDP when distributed
    tower = Tower(data["weight"])
    model = torch.nn.parallel.DistributedDataParallel(tower) if ddp else tower
    q, k, h = model(*xs)
    loss2, _ = obj(meta, Given(query=q, doc=k, neg=h))
    loss2.backward()
    out["weight"] = tower.lin.weight.grad.clone()
    return out


def _ranks_run(data, rank, world):
    return {sym: run(data, rank, sym, world, ddp=True) for sym in (False, True)}


def ref_row_losses(q, k, h, data, symmetric):
    """Per-row losses by explicit loops over the global batch (the definition, independent of the
    objective's code)."""
    ids, groups, nid, ngr = data["doc_id"], data["group"], data["neg_id"], data["neg_group"]

    def excluded(i, j_id, j_group):
        return j_id == ids[i] or (groups[i] >= 0 and j_group == groups[i])

    def direction(a, b, extra):
        out = []
        for i in range(len(a)):
            logits = [a[i] @ b[i] / TAU]
            logits += [a[i] @ b[j] / TAU for j in range(len(b)) if j != i and not excluded(i, ids[j], groups[j])]
            if extra:
                logits += [a[i] @ h[j] / TAU for j in range(len(h)) if not excluded(i, nid[j], ngr[j])]
            out.append(torch.logsumexp(torch.stack(logits), 0) - logits[0])
        return torch.stack(out)

    qd = direction(q, k, True)
    return (qd + direction(k, q, False)) / 2 if symmetric else qd


def test_two_gloo_ranks_equal_one_process_on_the_concatenated_batch(tmp_path):
    data = make_data()
    ranks = on_ranks(_ranks_run, (data,), W, tmp_path)
    for sym in (False, True):
        single = run(data, 0, sym, 1)
        # the definition, to tie per-rank losses to rows
        with torch.no_grad():
            emb = Tower(data["weight"])(data["x"]["q"], data["x"]["k"], data["x"]["h"])
        per_row = ref_row_losses(*emb, data, sym)
        assert float(per_row.mean()) == pytest.approx(float(single["loss"]), abs=1e-5)
        for r, res in enumerate(ranks):
            res = res[sym]
            # loss_r = single-process mean over rank r's rows
            assert float(res["loss"]) == pytest.approx(float(rows(per_row, r, B).mean()), abs=1e-5)
            # local gradients = W x the global loss's gradient w.r.t. this rank's rows
            for key, per in (("q", B), ("k", B), ("h", B * N)):
                torch.testing.assert_close(res[key], W * rows(single[key], r, per), atol=1e-5, rtol=1e-4)
            # after DDP's average, the parameter gradient is the single process's
            torch.testing.assert_close(res["weight"], single["weight"], atol=1e-5, rtol=1e-4)
        assert float(sum(res[sym]["loss"] for res in ranks)) / W == pytest.approx(float(single["loss"]), abs=1e-6)
        # the hard-negative gradient is not trivially zero (masking and gathering are exercised)
        assert single["h"].abs().sum() > 0


# ------------------------------------------------------------------ GradCache under DDP (2 ranks)

GC_B, GC_CHUNK = 4, 3  # rows per rank; chunk (does not divide 4: a short last chunk)


def _gc_texts():
    import random

    from tests.helpers import WORDS

    rng = random.Random(0)
    docs = [" ".join(rng.choices(WORDS, k=rng.randint(3, 10))) for _ in range(W * GC_B)]
    return [" ".join(d.split()[:2]) for d in docs], docs


def _gc_module(tiny_dir, chunk):
    from moco_retrieval.config import ModelConfig, OptimConfig
    from moco_retrieval.objectives.inbatch import InBatchConfig
    from moco_retrieval.training.module import RetrievalModule

    torch.manual_seed(0)
    m = RetrievalModule(ModelConfig(backbone="tiny", path=tiny_dir, grad_cache_chunk=chunk), InBatchConfig(),
                        OptimConfig())
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    return m


def _gc_batch(m, lo, hi):
    queries, docs = _gc_texts()
    q, d = queries[lo:hi], docs[lo:hi]
    return {"query": {"texts": q, **m.encoder.tokenize(q, "query")}, "doc": {"texts": d, **m.encoder.tokenize(d, "doc")},
            "doc_id": torch.arange(lo, hi) + 100, "group": torch.full((hi - lo,), -1), "index": torch.arange(hi - lo)}


class _Step(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, batch):
        return self.module.shared_step(batch)[0]


def _gc_rank(tiny_dir, rank, world):
    from types import SimpleNamespace

    out = {}
    for chunk in (GC_CHUNK, None):
        m = _gc_module(tiny_dir, chunk)
        ddp = torch.nn.parallel.DistributedDataParallel(_Step(m))
        m._trainer = SimpleNamespace(world_size=world, strategy=SimpleNamespace(model=ddp))
        m.on_fit_start()  # under grad cache: turns on DDP's static graph
        m._trainer = None
        assert ddp.static_graph == (chunk is not None)
        for _ in range(2):  # the first iteration of a static graph is special: check two
            m.zero_grad(set_to_none=True)
            loss = ddp(_gc_batch(m, rank * GC_B, (rank + 1) * GC_B))
            loss.backward()
        out[chunk] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return out


def test_grad_cache_under_ddp_equals_one_process_on_the_concatenated_batch(tiny_dir, tmp_path):
    """Two gloo ranks, in-batch objective gathered across ranks, grad cache in chunks of 3: the
    DDP-averaged parameter gradients equal those of one process, without grad cache, on the
    concatenated batch of 8 (no dropout: one plain forward is the reference)."""
    ranks = on_ranks(_gc_rank, (tiny_dir,), W, tmp_path)
    torch.set_num_threads(1)
    m = _gc_module(tiny_dir, None)
    m.zero_grad(set_to_none=True)
    loss, _ = m.shared_step(_gc_batch(m, 0, W * GC_B))
    loss.backward()
    ref = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    for r in range(W):
        got = ranks[r]
        for chunk in (GC_CHUNK, None):
            assert got[chunk].keys() == ref.keys()
            for name in ref:
                torch.testing.assert_close(got[chunk][name], ref[name], atol=1e-5, rtol=1e-4,
                                           msg=lambda s: f"rank {r} chunk {chunk} {name}: {s}")
