"""objective=icol: both phases' loss and gradient against a loop reference, the queue emptied when the
phase turns and restored from a checkpoint, the config's refusals, and two DDP ranks training the
towers in turns (unused parameters) with identical queues."""
from __future__ import annotations

import lightning as L
import pytest
import torch

from moco_retrieval.config import ICoLConfig
from moco_retrieval.objectives.icol import ICoLObjective
from moco_retrieval.objectives.step import StepInput
from test_two_queue import TAU, D, ref_direction, unit

B = 6
IDS = torch.tensor([10, 11, 12, 13, 10, 15])  # rows 0 and 4 share a positive document
GROUPS = torch.tensor([1, 2, 2, -1, 1, -1])  # rows 1 and 2 are duplicates


def make(phase_steps=2, **kw):
    return ICoLObjective(ICoLConfig(queue_size=32, temperature=TAU, phase_steps=phase_steps, **kw), D).train()


def batch(seed):
    return unit(B, D, seed=seed), unit(B, D, seed=seed + 1)


def one_step(obj, q, k, step, neg=None):
    """A training step as the module runs it: the phase's trained side with gradient; loss, grads."""
    trains_queries = obj.phase(step) == 0
    q, k = q.clone().requires_grad_(trains_queries), k.clone().requires_grad_(not trains_queries)
    meta = {"doc_id": IDS, "group": GROUPS}
    if neg is not None:
        meta.update(neg=neg[0], neg_id=neg[1], neg_group=neg[2])
    loss, stats = obj(StepInput(q, k, **meta, step=step))
    loss.backward()
    obj.after_backward()
    return loss, (q.grad if trains_queries else k.grad), stats


@pytest.mark.parametrize("step", [0, 1, 2, 3])  # phase_steps 2: queries train at 0 and 1, documents at 2 and 3
def test_loss_and_gradient_equal_loop_reference(step):
    obj = make()
    history = []
    for s in range(step):  # what the queue holds at `step`: the phase's earlier steps only
        q, k = batch(100 + 10 * s)
        one_step(obj, q, k, s)
        history.append((s, q, k))
    q, k = batch(7)
    neg = (unit(4, D, seed=9), torch.tensor([12, 50, 51, 52]), torch.tensor([-1, 1, -1, -1]))  # 12, group 1: false negatives
    trains_queries = obj.phase(step) == 0
    anchors, positives = (q, k) if trains_queries else (k, q)
    same_phase = [(hq, hk) for s, hq, hk in history if obj.phase(s) == obj.phase(step)]
    extra = []
    if trains_queries:
        extra.append((neg[0], neg[1], neg[2]))
    if same_phase:  # queued: the untrained side's embeddings of this phase, with the pairs' ids and groups
        queued = torch.cat([hk if trains_queries else hq for hq, hk in same_phase])
        extra.append((queued, IDS.repeat(len(same_phase)), GROUPS.repeat(len(same_phase))))
    a = anchors.clone().requires_grad_()
    want = ref_direction(a, positives, positives, IDS, GROUPS, extra)
    (want_grad,) = torch.autograd.grad(want, [a])
    loss, grad, stats = one_step(obj, q, k, step, neg)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert obj.stats(step)["trained_side_is_doc"] == float(not trains_queries)


def test_the_queue_holds_this_phases_untrained_side_and_empties_when_the_phase_turns():
    obj = make(phase_steps=2)
    seen = {}
    for s in range(5):
        seen[s] = batch(200 + 10 * s)
        one_step(obj, *seen[s], s)
        if s == 1:  # two query steps: the document tower's embeddings of both batches
            torch.testing.assert_close(obj.memory.queue.keys(), torch.cat([seen[0][1], seen[1][1]]))
        if s == 2:  # the documents' turn: emptied, then this step's queries
            torch.testing.assert_close(obj.memory.queue.keys(), seen[2][0])
    torch.testing.assert_close(obj.memory.queue.keys(), seen[4][1])  # the queries' turn again, from step 4
    assert torch.equal(obj.memory.queue.ids(), IDS)
    # a resumed run knows which phase filled the queue: a step of that phase uses it, the next phase does not
    fresh = make(phase_steps=2)
    fresh.load_state_dict(obj.state_dict())
    q, k = batch(300)
    for o in (obj, fresh):
        o.eval()
    with torch.no_grad():
        same = [o(StepInput(q, k, doc_id=IDS, group=GROUPS, step=5))[1]["negatives_per_query"] for o in (obj, fresh)]
        other = fresh(StepInput(q, k, doc_id=IDS, group=GROUPS, step=6))[1]["negatives_per_query"]
    assert same[0] == same[1] > other  # step 5 counts the 6 queued keys (minus masked), step 6 only the batch


def test_config_refuses_a_shared_tower_and_options_it_does_not_use():
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from moco_retrieval.config import register_configs
    from moco_retrieval.errors import ConfigError

    register_configs()
    with initialize_config_module("moco_retrieval.conf", version_base="1.3"):
        with pytest.raises(ConfigError, match="model.shared_tower=false"):
            OmegaConf.to_object(compose("train", overrides=["objective=icol"]))
        cfg = OmegaConf.to_object(compose("train", overrides=["objective=icol", "model.shared_tower=false"]))
        assert cfg.objective.phase_steps == 128 and cfg.objective.queue_size == 4096
        with pytest.raises(ConfigCompositionException):  # EMA options belong to moco / two_queue
            compose("train", overrides=["objective=icol", "model.shared_tower=false", "objective.momentum=0.9"])
    with pytest.raises(ValueError, match="no guide"):
        ICoLObjective(ICoLConfig(guide="base"), D)


# ------------------------------------------------------------------ two DDP ranks through Lightning


class TowerGrads(L.Callback):
    """Per step: which tower got gradient; at the end every rank's state, in ``folder``."""

    def __init__(self, folder):
        self.folder, self.grads = str(folder), []

    def on_after_backward(self, trainer, module):
        towers = {"query": module.encoder.query_tower, "doc": module.encoder.doc_tower}
        self.grads.append({k: any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.parameters())
                           for k, t in towers.items()})

    def on_train_end(self, trainer, module):
        torch.save({"grads": self.grads, "state": {k: v.clone() for k, v in module.state_dict().items()}},
                   f"{self.folder}/rank{trainer.global_rank}.pt")


def test_two_ddp_ranks_train_the_towers_in_turns(tmp_path_factory, tmp_path):
    from moco_retrieval.config import ModelConfig, OptimConfig
    from moco_retrieval.training.module import RetrievalModule
    from moco_retrieval.model.tiny import build_tiny_bert
    from moco_retrieval.train import ddp_strategy
    from synthetic import SyntheticData

    tiny = str(build_tiny_bert(tmp_path_factory.mktemp("tiny") / "bert"))
    m = RetrievalModule(ModelConfig(backbone="tiny", path=tiny, shared_tower=False),
                        ICoLConfig(queue_size=64, temperature=0.1, phase_steps=2),
                        OptimConfig(lr=1e-3, warmup_steps=0, warmup_ratio=0.0, schedule="constant"))
    assert m.objective.unused_parameters
    # train.py's strategy, started by spawning (the default relaunches the command: here, pytest)
    strategy = ddp_strategy(60, m.objective.unused_parameters, start_method="spawn")
    t = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                  num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(tmp_path),
                  callbacks=[TowerGrads(tmp_path)], use_distributed_sampler=False)
    t.fit(m, SyntheticData(m.encoder.tokenize, batch_size=4, batches=4))
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0["grads"] == [{"query": True, "doc": False}] * 2 + [{"query": False, "doc": True}] * 2
    for k, v in r0["state"].items():  # both towers and the queue: identical on both ranks
        assert torch.equal(v, r1["state"][k]), k
    assert int(r0["state"]["objective.memory.queue.queue_fill"]) == 16  # the documents' phase: 2 steps x 2 ranks x 4
    assert int(r0["state"]["objective.queue_phase"]) == 1
