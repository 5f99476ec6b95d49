"""The EMA key encoder (model/momentum.py): its update, and the state-dict prefixes under which the
training module holds the query and key encoders (what the commands load from a checkpoint)."""
import pytest
import torch
from torch import nn

from moco_retrieval.config import ModelConfig, OptimConfig
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.model.momentum import MomentumEncoder, state_dict_prefix
from moco_retrieval.objectives.registry import objective_config
from moco_retrieval.training.module import RetrievalModule


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        return self.drop(self.lin(x))


def test_ema_update_is_exact():
    torch.manual_seed(0)
    q = Net()
    m = MomentumEncoder(q)
    k_before = {n: p.clone() for n, p in m.key_encoder.named_parameters()}
    with torch.no_grad():
        for p in q.parameters():
            p.add_(torch.randn_like(p))
        q.count.fill_(7)
    m.update(q, 0.9)
    for n, p in m.key_encoder.named_parameters():
        assert torch.allclose(p, 0.9 * k_before[n] + 0.1 * dict(q.named_parameters())[n], atol=0, rtol=1e-6)
    assert m.key_encoder.count.item() == 7  # buffers copied


def test_backward_leaves_key_encoder_untouched():
    q = Net()
    m = MomentumEncoder(q)
    x = torch.randn(3, 4)
    loss = q(x).sum() + m(x).sum()
    loss.backward()
    assert all(p.grad is None for p in m.key_encoder.parameters())
    assert all(not p.requires_grad for p in m.key_encoder.parameters())
    assert q.lin.weight.grad is not None


@pytest.mark.parametrize("dropout", [False, True])
def test_key_encoder_dropout_mode(dropout):
    q = Net()
    m = MomentumEncoder(q, dropout=dropout)
    m.train()  # what the trainer does at the start of every epoch
    assert m.key_encoder.training is dropout
    x = torch.ones(64, 4)
    same = torch.equal(m(x), m(x))
    assert same is (not dropout)


def test_frozen_parameters_stay_bit_identical():
    q = Net()
    q.lin.bias.requires_grad_(False)
    with torch.no_grad():
        q.lin.bias.copy_(torch.tensor([0.1, 0.2, 0.3, 0.7]))
    m = MomentumEncoder(q)
    with torch.no_grad():
        q.lin.weight.add_(1.0)
    w_before = m.key_encoder.lin.weight.clone()
    m.update(q, 0.999)
    assert torch.allclose(m.key_encoder.lin.weight, 0.999 * w_before + 0.001 * q.lin.weight)
    for _ in range(3):
        m.update(q, 0.999)
    assert torch.equal(m.key_encoder.lin.bias, q.lin.bias)  # 0.999*x + 0.001*x would round


# --------------------------------------------------------------------------- state_dict_prefix


def module(tiny_dir, objective="moco", **model_kw):
    model = ModelConfig(backbone="tiny", path=tiny_dir, **model_kw)
    obj = {"name": objective, **({"queue_size": 8} if objective != "inbatch" else {})}
    return RetrievalModule(model, objective_config(obj), OptimConfig())


@pytest.mark.parametrize("shared_tower", [True, False])
def test_state_dict_prefix_matches_the_training_module(tiny_dir, shared_tower):
    m = module(tiny_dir, shared_tower=shared_tower, head="linear")
    state = m.state_dict()
    expected = set(build_encoder(m.model_cfg).state_dict())
    for which in ("query", "key"):
        prefix = state_dict_prefix(which)
        inner = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        assert set(inner) == expected, which  # exactly one whole TextEncoder under the prefix
        enc = build_encoder(m.model_cfg)
        enc.load_state_dict(inner, strict=True)
    with torch.no_grad():  # the key prefix is the momentum copy, not a second view of the query encoder
        m.key_encoder.key_encoder.tower_for("query").head.weight.add_(1.0)
    head = "tower.head.weight" if shared_tower else "query_tower.head.weight"
    key, query = state_dict_prefix("key") + head, state_dict_prefix("query") + head
    assert not torch.equal(m.state_dict()[key], m.state_dict()[query])
    assert state_dict_prefix("query") == "encoder." and state_dict_prefix("key") == "key_encoder.key_encoder."
    with pytest.raises(ValueError, match="encoder='doc'"):
        state_dict_prefix("doc")


def test_no_key_prefix_without_a_momentum_encoder(tiny_dir):
    state = module(tiny_dir, objective="inbatch").state_dict()
    assert any(k.startswith(state_dict_prefix("query")) for k in state)
    assert not any(k.startswith(state_dict_prefix("key")) for k in state)
