"""The Lightning module end to end on a tiny encoder: gradients, EMA timing, checkpoint and resume,
and two gloo ranks sharing one queue."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from moco_retrieval.objectives.inbatch import InBatchConfig
from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.training.module import RetrievalModule
from tests.helpers import SyntheticData, fit, make_module, quiet_trainer


class RecordLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_training_step_grads_query_side_only(tiny_dir):
    torch.manual_seed(0)
    m = make_module(tiny_dir)
    m.train()
    dm = SyntheticData(m.encoder.tokenize, batch_size=4)
    m.objective.docs.queue.enqueue(torch.nn.functional.normalize(torch.randn(8, m.encoder.dim), dim=1),
                              torch.arange(8) + 50_000, torch.full((8,), -1), step=0)
    batch = next(iter(dm.train_dataloader()))
    before = {n: p.clone() for n, p in m.key_encoder.named_parameters()}
    loss, stats = m.shared_step(batch)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.encoder.parameters())
    assert all(p.grad is None for p in m.key_encoder.parameters())
    assert all(torch.equal(p, before[n]) for n, p in m.key_encoder.named_parameters())
    assert stats["negatives_per_query"] == pytest.approx(3 + 8)  # 3 batch keys + 8 queued


def test_ema_once_per_optimizer_step_with_accumulation(tiny_dir, tmp_path, monkeypatch):
    torch.manual_seed(0)
    m = make_module(tiny_dir)
    calls = []
    orig = m.key_encoder.update
    monkeypatch.setattr(m.key_encoder, "update", lambda enc, mom: (calls.append(mom), orig(enc, mom)))
    t = fit(m, tmp_path, batches=6, max_steps=3, accumulate_grad_batches=2)
    assert len(calls) == 3 and t.global_step == 3
    # every micro-batch's keys were enqueued: 6 batches of 4
    assert m.objective.docs.queue.fill == 24


def test_key_encoder_follows_ema_of_query_encoder(tiny_dir, tmp_path):
    torch.manual_seed(0)
    m = make_module(tiny_dir)
    k0 = {n: p.clone() for n, p in m.key_encoder.key_encoder.named_parameters()}
    fit(m, tmp_path, batches=1, max_steps=1)
    for (n, k), q in zip(m.key_encoder.key_encoder.named_parameters(), m.encoder.parameters()):
        assert torch.allclose(k, 0.9 * k0[n] + 0.1 * q, atol=1e-6), n


def test_checkpoint_round_trip_and_resume(tiny_dir, tmp_path):
    """Queue, pointer, ids, groups and EMA weights survive a Lightning checkpoint, and the 5 steps
    after resuming give the losses of an uninterrupted seeded run. (Mid-epoch resume of the real
    data module is tested in test_resume.py.)"""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(epochs, ckpt=None, save_dir=None):
        L.seed_everything(7)
        m = make_module(tiny_dir, MoCoConfig(queue_size=12, temperature=0.1, momentum=0.9))  # 5 batches of 4 wrap it
        rec = RecordLosses()
        cbs = [rec] + ([ModelCheckpoint(dirpath=save_dir, save_last=True)] if save_dir else [])
        fit(m, tmp_path, epochs=epochs, batches=5, callbacks=cbs, enable_checkpointing=bool(save_dir), ckpt_path=ckpt)
        return m, rec.losses

    full, full_losses = run(2)
    half, _ = run(1, save_dir=tmp_path / "ck")
    ckpt = str(tmp_path / "ck" / "last.ckpt")
    sd = torch.load(ckpt, weights_only=True)["state_dict"]
    assert any("queue" in k for k in sd) and any("key_encoder" in k for k in sd)
    loaded = RetrievalModule.load_from_checkpoint(ckpt)
    for name in ["queue_keys", "queue_ids", "queue_groups", "queue_steps", "queue_ptr", "queue_fill"]:
        assert torch.equal(getattr(loaded.objective.docs.queue, name), getattr(half.objective.docs.queue, name)), name
    assert loaded.objective.docs.queue.fill == 12 and int(loaded.objective.docs.queue.queue_ptr) == 20 % 12
    for a, b in zip(loaded.key_encoder.parameters(), half.key_encoder.parameters()):
        assert torch.equal(a, b)
    resumed, resumed_losses = run(2, ckpt=ckpt)
    assert len(resumed_losses) == 5
    assert resumed_losses == pytest.approx(full_losses[5:], abs=1e-5)
    for (name, a), b in zip(resumed.state_dict().items(), full.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-5), name


class DumpQueue(Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        q = pl_module.objective.docs.queue
        torch.save({"ids": q.queue_ids.clone(), "keys": q.queue_keys.clone(), "fill": q.fill},
                   f"{self.folder}/rank{trainer.global_rank}.pt")


def test_two_gloo_ranks_share_one_queue(tiny_dir, tmp_path):
    m = make_module(tiny_dir, MoCoConfig(queue_size=64, temperature=0.1, momentum=0.9))
    dm = SyntheticData(m.encoder.tokenize, batch_size=4, batches=3)
    t = quiet_trainer(tmp_path, devices=2, strategy="ddp_spawn", max_steps=3, callbacks=[DumpQueue(tmp_path)],
                      use_distributed_sampler=False)
    t.fit(m, dm)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0["fill"] == r1["fill"] == 24
    assert torch.equal(r0["ids"], r1["ids"]) and torch.equal(r0["keys"], r1["keys"])
    ids = r0["ids"][:24].view(3, 2, 4)  # step, rank, row: each step's slots hold rank 0 then rank 1
    assert (ids[:, 0] < 100_000).all() and (ids[:, 1] >= 100_000).all()


def test_bf16_mixed_precision_trains_with_fp32_logits(tiny_dir, tmp_path):
    """The encoders run under the step's bf16 autocast; the objective scores with autocast off, in fp32."""
    torch.manual_seed(0)
    m = make_module(tiny_dir)
    seen, encoding = [], []
    orig, encoder_forward = m.objective.forward, m.encoder.forward

    def spy(batch, embed):
        loss, stats = orig(batch, embed)
        seen.append((torch.is_autocast_enabled("cpu"), loss.dtype))
        return loss, stats

    def encoder_spy(*args, **kw):
        encoding.append(torch.is_autocast_enabled("cpu"))
        return encoder_forward(*args, **kw)

    m.objective.forward, m.encoder.forward = spy, encoder_spy
    rec = RecordLosses()
    fit(m, tmp_path, batches=3, max_steps=3, callbacks=[rec], precision="bf16-mixed")
    assert seen == [(False, torch.float32)] * 3
    assert encoding and all(encoding)  # the trained encoder ran under the step's autocast
    assert all(torch.isfinite(torch.tensor(rec.losses)))
    assert m.objective.docs.queue.fill == 12


def test_the_module_serves_what_the_objective_asks(tiny_dir, monkeypatch):
    """In-batch asks for the documents by the trained encoder with gradient, and gets no EMA copy;
    MoCo asks for constant keys from the EMA copy. A side asked twice is embedded once, and served
    detached when asked without gradient after it was embedded with gradient (online keys)."""
    inbatch, moco = make_module(tiny_dir, InBatchConfig(temperature=0.1)), make_module(tiny_dir)
    assert inbatch.key_encoder is None and moco.key_encoder is not None
    batch = next(iter(SyntheticData(inbatch.encoder.tokenize, batch_size=4).train_dataloader()))
    seen, calls = {}, []
    for name, m, encoder in (("inbatch", inbatch, "trained"), ("moco", moco, "momentum")):
        m.eval()
        real = m.encode
        monkeypatch.setattr(m, "encode", lambda *a, real=real: calls.append(a[:2]) or real(*a))

        def forward(batch, embed, name=name, encoder=encoder):
            q = embed("query")
            k = embed("doc", encoder, grad=encoder == "trained")
            seen[name] = (q, k, embed("query", grad=False), embed("query"))
            return q.sum(), {}

        monkeypatch.setattr(m.objective, "forward", forward)
        m.shared_step(batch)
    q, k, q_again, q_grad_again = seen["inbatch"]
    assert q.requires_grad and k.requires_grad and not q_again.requires_grad and q_grad_again is q
    assert torch.equal(q_again, q.detach())
    assert [c[0] for c in calls[:2]] == ["trained", "trained"]  # each side once
    assert torch.allclose(k, inbatch.encoder(batch["doc"], "doc"))
    q, k, _, _ = seen["moco"]
    assert q.requires_grad and not k.requires_grad
    with torch.no_grad():  # move the trained encoder: the keys still come from the EMA copy
        for p in moco.encoder.parameters():
            p.add_(0.1)
    assert torch.allclose(k, moco.key_encoder(batch["doc"], "doc"))
    assert not torch.allclose(k, moco.encoder(batch["doc"], "doc"))


def test_query_encoder_trains_with_dropout_key_encoder_without(tiny_dir, tmp_path):
    """HF models load in eval mode and Lightning keeps submodule modes: dropout must be on where it trains."""
    m = make_module(tiny_dir)
    modes = {}

    class Spy(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            modes["query"] = [mod.training for mod in pl_module.encoder.modules() if isinstance(mod, torch.nn.Dropout)]
            modes["key"] = [mod.training for mod in pl_module.key_encoder.modules() if isinstance(mod, torch.nn.Dropout)]

    fit(m, tmp_path, batches=1, max_steps=1, callbacks=[Spy()])
    assert modes["query"] and all(modes["query"])
    assert modes["key"] and not any(modes["key"])


def test_weight_decay_on_weight_matrices_only_and_never_on_the_key_encoder(tiny_dir):
    from moco_retrieval.training.module import decay_groups

    m = make_module(tiny_dir)
    names = {id(p): n for n, p in m.named_parameters()}
    decay, no_decay = decay_groups(m.named_parameters(), 0.01)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.01, 0.0)
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decayed and all(n.endswith("weight") and "norm" not in n.lower() for n in decayed)
    assert any(n.endswith("bias") for n in kept) and any("LayerNorm" in n for n in kept)
    trained = {n for n, p in m.named_parameters() if p.requires_grad and not n.startswith("key_encoder.")}
    assert decayed | kept == trained and not decayed & kept
    assert any(n.startswith("key_encoder.") for n, _ in m.named_parameters())  # present, and left to the EMA
