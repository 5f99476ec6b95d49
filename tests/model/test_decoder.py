"""Decoder backbones (model/decoder.py): last-token pooling on either padding side, the end-of-text
token the tokenizer appends, and the whole path on tiny random Llama / Qwen2 models built offline:
LoRA training with the queue and instruction prompts, a bit-exact resume, export, the same
embeddings in sentence-transformers, search over the exported directory."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from moco_retrieval.errors import ConfigError
from moco_retrieval.config import ExportConfig, LoraConfig, ModelConfig, PromptsConfig
from moco_retrieval.objectives.two_queue import TwoQueueConfig
from moco_retrieval.data.formats import EvalSet, write_beir
from moco_retrieval.data.prompts import Prompts
from moco_retrieval.evaluation.encode import encode_texts
from moco_retrieval.model.decoder import last_token
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.model.lora import ADAPTER_MARK
from moco_retrieval.model.tiny import EOS, build_tiny_decoder
from tests.helpers import compose_cfg, fit_to_last_ckpt, make_module

TEXTS = ["resize images from the command line", "a shell", "backup archive tool for the terminal " * 6]
PROMPTS = PromptsConfig(query="Instruct: find the package\nQuery: ", doc="")


@pytest.fixture(scope="module", params=[("llama", "left"), ("qwen2", "right")], ids=["llama-left", "qwen2-right"])
def decoder_dir(request, tmp_path_factory):
    arch, side = request.param
    return str(build_tiny_decoder(tmp_path_factory.mktemp(arch) / arch, arch=arch, padding_side=side))


def decoder_cfg(path, **kw):
    return ModelConfig(backbone=path, pooling="last", doc_max_len=24, lora=LoraConfig(r=4, alpha=8, dropout=0.1), **kw)


def test_last_token_reads_the_last_attended_position_on_either_side():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert torch.equal(last_token(hidden, right), torch.stack([hidden[0, 1], hidden[1, 3]]))
    assert torch.equal(last_token(hidden, left), torch.stack([hidden[0, 3], hidden[1, 3]]))


def test_the_tokenizer_ends_every_text_with_eos_even_truncated(decoder_dir):
    enc = build_encoder(decoder_cfg(decoder_dir)).eval()
    eos = enc.tokenizer.convert_tokens_to_ids(EOS)
    tok = enc.tokenize(TEXTS, "doc")
    ids, mask = tok["input_ids"], tok["attention_mask"]
    assert ids.shape[1] == 24  # the long text was truncated ...
    last = ids.shape[1] - 1 - mask.flip(1).argmax(1)
    assert (ids[torch.arange(len(TEXTS)), last] == eos).all()  # ... and still ends with the end-of-text token
    assert (mask.sum(1) < ids.shape[1]).any()  # padded, on the tokenizer's side
    assert enc.tokenizer.padding_side == ("left" if "llama" in decoder_dir else "right")
    # padding does not change an embedding: each text alone gives what the batch gives
    batch = enc(tok, "doc")
    for i, text in enumerate(TEXTS):
        torch.testing.assert_close(enc(enc.tokenize([text], "doc"), "doc")[0], batch[i], atol=1e-5, rtol=1e-5)


def decoder_module(path):
    return make_module(decoder_cfg(path), TwoQueueConfig(queue_size=16, temperature=0.1, momentum=0.9), lr=1e-2,
                       seed=0, prompts=PROMPTS)


def test_decoder_trains_with_the_queue_resumes_exports_and_searches(decoder_dir, tmp_path, one_thread):
    from sentence_transformers import SentenceTransformer

    from moco_retrieval.export.__main__ import run_export
    from moco_retrieval.model.loading import load_model_dir
    from moco_retrieval.search import run_search

    ref_module = decoder_module(decoder_dir)
    ref = fit_to_last_ckpt(ref_module, tmp_path / "ref", 2)
    fit_to_last_ckpt(decoder_module(decoder_dir), tmp_path / "run", 1)
    resumed = fit_to_last_ckpt(decoder_module(decoder_dir), tmp_path / "run", 2,
                               ckpt_path=str(tmp_path / "run" / "last.ckpt"))
    assert ref["global_step"] == resumed["global_step"] == 6
    assert all(ADAPTER_MARK in k for k in ref["state_dict"] if ".backbone." in k)  # no base weights
    assert "objective.queries.queue.queue_keys" in ref["state_dict"]  # the query queue
    for k, v in ref["state_dict"].items():
        assert torch.equal(v, resumed["state_dict"][k]), k

    out = run_export(ExportConfig(model=decoder_cfg(decoder_dir), checkpoint=str(tmp_path / "ref" / "last.ckpt"),
                                  out_dir=str(tmp_path / "st")))
    enc = ref_module.encoder.eval()
    assert enc.prompts == Prompts(query=PROMPTS.query)
    q_ref = encode_texts(enc, TEXTS, "query", show_progress=False)  # with the instruction prompt
    d_ref = encode_texts(enc, TEXTS, "doc", show_progress=False)
    st = SentenceTransformer(str(out), device="cpu")
    np.testing.assert_allclose(st.encode_query(TEXTS), q_ref, atol=1e-5)
    np.testing.assert_allclose(st.encode_document(TEXTS), d_ref, atol=1e-5)
    assert not np.allclose(q_ref, d_ref, atol=1e-3)  # the prompt is part of what the queries see

    back, desc = load_model_dir(out)
    assert desc["pooling"] == "last" and back.tokenizer.padding_side == enc.tokenizer.padding_side
    np.testing.assert_allclose(encode_texts(back, TEXTS, "doc", show_progress=False), d_ref, atol=1e-5)

    folder = tmp_path / "corpus"
    write_beir(folder, EvalSet(corpus={f"d{i}": t for i, t in enumerate(TEXTS)}, queries={"q": "x"},
                               qrels={"q": {"d0": 1}}), "test")
    query = "convert pictures in a shell"
    answers = run_search(compose_cfg("search", [
        "model=tiny", f"model.path={decoder_dir}", f"model_dir={out}", f"corpus={folder}",
        f"index_dir={tmp_path / 'index'}", f"query={query}", "k=3", "format=json", "progress=false", "device=cpu",
    ]), out=io.StringIO())
    st_scores = (st.encode_query([query]) @ st.encode_document(TEXTS).T)[0]
    assert len(answers[0]["results"]) == 3
    for hit in answers[0]["results"]:
        assert hit["score"] == pytest.approx(float(st_scores[int(hit["doc_id"][1:])]), abs=1e-4)

    from moco_retrieval.evaluate import run_evaluate

    run_evaluate(compose_cfg("evaluate", [
        "model=tiny", f"model.path={decoder_dir}", "data=beir", f"data.dir={folder}", f"model_dir={out}",
        "progress=false", "device=cpu", "eval.top_k=3"]), tmp_path / "eval")
    entry = json.loads((tmp_path / "eval" / "eval.json").read_text())  # one model: its entry at the top
    assert entry["model"]["pooling"] == "last" and entry["model"]["prompts"] == {"query": PROMPTS.query, "doc": ""}
    st_q = st.encode_query(["x"]) @ st.encode_document(TEXTS).T  # the pool's one query, "x", and its positive d0
    assert entry["metrics"]["recall@1"] == float(np.argmax(st_q[0]) == 0)


def test_a_bfloat16_base_trains_float32_adapters(decoder_dir, one_thread):
    """What a 7B model on one 24 GB GPU needs: the frozen base in bfloat16, the adapters in float32."""
    enc = build_encoder(decoder_cfg(decoder_dir, backbone_dtype="bfloat16", gradient_checkpointing=True)).train()
    dtypes = {(p.requires_grad, p.dtype) for p in enc.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    out = enc(enc.tokenize(TEXTS, "doc"), "doc")
    assert out.dtype == torch.float32
    out.pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in enc.named_parameters()
               if "lora_B" in n)  # (B starts at zero, so A's gradient is zero at the first step)
    with pytest.raises(ConfigError, match="model.backbone_dtype='int8': expected one of float32, bfloat16, float16"):
        build_encoder(decoder_cfg(decoder_dir, backbone_dtype="int8"))
