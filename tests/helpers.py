"""What many tests share: fixed embeddings for objectives, unit vectors."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Given's keywords -> (side, encoder) as objectives ask embed() for them
SIDES = {
    "query": ("query", "trained"), "doc": ("doc", "trained"), "neg": ("neg", "trained"),
    "query_key": ("query", "momentum"), "doc_key": ("doc", "momentum"), "neg_key": ("neg", "momentum"),
    "guide_query": ("query", "guide"), "guide_doc": ("doc", "guide"), "guide_neg": ("neg", "guide"),
}


def unit(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g), dim=-1)


class Given:
    """An ``embed`` (objectives/base.py) serving fixed embeddings: ``Given(step, query=q, doc_key=k, ...)``;
    ``tokens``: what stored texts embed to (a function of the side and kind); ``features`` /
    ``project``: the frozen features of "doc" and the head's projection (a function)."""

    def __init__(self, step: int = 0, *, tokens=None, features=None, project=None, **embeddings):
        self.step = step
        self.table = {SIDES[name]: t for name, t in embeddings.items() if t is not None}
        self._tokens, self._features, self._project = tokens, features, project
        self.asked: list[tuple[str, str, bool]] = []

    def __call__(self, side, encoder="trained", grad=True):
        self.asked.append((side, encoder, grad))
        t = self.table.get((side, encoder))
        return t if t is None or grad else t.detach()

    def tokens(self, side, kind, encoder="momentum"):
        self.asked.append(("stored " + kind, encoder, False))
        return self._tokens(side, kind)

    def features(self, side):
        return self._features

    def project(self, features):
        return self._project(features)


def labels(ids, groups, **more) -> dict:
    """A batch's labels as the collate gives them: the positives' ids and groups (and more entries)."""
    return {"doc_id": ids, "group": groups, **more}


def momentum_step(obj, q, k, meta: dict, step: int = 0):
    """A momentum objective (moco, two_queue) on one step's embeddings: queries ``q``, EMA document
    keys ``k``, and from ``meta`` the trained documents "d", the EMA query keys "q_key", the EMA hard
    negatives "neg", a fixed guide's "g_q" / "g_k" / "g_neg", and the batch's labels."""
    m = dict(meta)
    given = Given(step, query=q, doc_key=k, doc=m.pop("d", None), query_key=m.pop("q_key", None),
                  neg_key=m.pop("neg", None), guide_query=m.pop("g_q", None), guide_doc=m.pop("g_k", None),
                  guide_neg=m.pop("g_neg", None))
    return obj(labels(m.pop("doc_id"), m.pop("group"), **m), given)


def excluded(i, ids, groups, j_id, j_group):
    return bool(j_id == ids[i] or (groups[i] >= 0 and j_group == groups[i]))


def ref_direction(a, pos, batch_keys, ids, groups, extra, tau, mask=True):
    """The loop reference of one InfoNCE direction: the mean over rows i of -log softmax of
    a_i . pos_i / tau among the positive, the other batch keys and ``extra`` blocks [(vectors, ids,
    groups)], candidates sharing row i's id or group masked (``mask``)."""
    out = []
    for i in range(a.shape[0]):
        logits = [a[i] @ pos[i] / tau]
        logits += [a[i] @ batch_keys[j] / tau for j in range(len(batch_keys))
                   if j != i and not (mask and excluded(i, ids, groups, ids[j], groups[j]))]
        for vecs, v_ids, v_groups in extra:
            logits += [a[i] @ vecs[j] / tau for j in range(len(vecs))
                       if not (mask and excluded(i, ids, groups, v_ids[j], v_groups[j]))]
        out.append(torch.logsumexp(torch.stack(logits), 0) - logits[0])
    return torch.stack(out).mean()


def train_steps(obj, steps, batch, rank, world, extra=None) -> dict:
    """``steps`` through ``obj`` on this rank's ``batch`` rows (every row in one process): each
    step's loss and gradients and the final state. ``extra(step, rows)``: more ``meta`` entries (momentum_step)."""
    per = batch if world > 1 else len(steps[0]["q"])
    sl = slice(rank * per, (rank + 1) * per)
    obj.train()
    out = {"loss": [], "gq": [], "gd": []}
    for s, st in enumerate(steps):
        q, d = st["q"][sl].clone().requires_grad_(), st["d"][sl].clone().requires_grad_()
        more = extra(st, per) if extra else {}
        meta = {"doc_id": st["ids"][sl], "group": st["groups"][sl], "d": d, "q_key": st["q_key"][sl], **more}
        loss, _ = momentum_step(obj, q, st["k"][sl], meta, s)
        loss.backward()
        obj.after_backward()
        out["loss"].append(loss.item())
        out["gq"].append(q.grad)
        out["gd"].append(d.grad)
    out["state"] = {k: v.clone() for k, v in obj.state_dict().items()}
    return out
