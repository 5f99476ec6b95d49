"""Query / document prompts: in training and validation batches, in the commands' encoding, stored in
checkpoints and exported models (sentence-transformers' encode_query / encode_document give what our
encoder and search give), refused when contradicting a model's own or a resumed run's."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from moco_retrieval.files import atomic_torch_save
from moco_retrieval.config import ModelConfig, PromptsConfig
from moco_retrieval.objectives.inbatch import InBatchConfig
from moco_retrieval.data.collate import EvalCollator, collate
from moco_retrieval.data.datamodule import RetrievalDataModule
from moco_retrieval.data.formats import EvalSet, Negative, Pair, write_beir
from moco_retrieval.data.prompts import NO_PROMPTS, Prompts, model_prompts, to_prompts
from moco_retrieval.errors import CheckpointError, ConfigError
from moco_retrieval.evaluation.encode import encode_texts
from moco_retrieval.export.__main__ import run_export
from moco_retrieval.model.loading import load_checkpoint_encoder, load_encoder, load_model_dir
from moco_retrieval.search import run_search
from tests.helpers import compose_cfg, fake_tokenize, make_cfg, tiny_overrides, train_checkpoint

E5 = Prompts(query="query: ", doc="passage: ")
TEXTS = ["resize images from the command line", "a shell for the terminal", "backup archive tool " * 12]


@pytest.fixture(scope="module")
def e5_checkpoint(tiny_dir, tmp_path_factory):
    """A 1-step checkpoint trained with E5's prompts."""
    return train_checkpoint(ModelConfig(backbone="tiny", path=tiny_dir), InBatchConfig(temperature=0.1),
                            tmp_path_factory.mktemp("run"), steps=1, prompts=PromptsConfig(query="query: ", doc="passage: "))


# --------------------------------------------------------------------------- the module


def test_prompts_prefix_each_side_and_map_to_sentence_transformers():
    assert E5.apply(["a", "b"], "query") == ["query: a", "query: b"]
    assert E5.apply(["a"], "doc") == ["passage: a"] and NO_PROMPTS.apply(["a"], "doc") == ["a"]
    assert E5.sentence_transformers() == ({"query": "query: ", "document": "passage: "}, "document")
    assert Prompts(query="q: ").sentence_transformers() == ({"query": "q: ", "document": ""}, None)
    assert Prompts.from_sentence_transformers({"query": "q: ", "passage": "p: "}) == Prompts("q: ", "p: ")
    assert to_prompts(OmegaConf.structured(PromptsConfig(query="query: "))) == Prompts(query="query: ")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['document'\]"):
        to_prompts({"document": "x"})
    assert model_prompts(None, {"query": "q: "}, "m") == Prompts(query="q: ")  # a base model takes the given
    assert model_prompts(E5, None, "m") == E5 and model_prompts(E5, {"query": "query: ", "doc": "passage: "}, "m") == E5
    with pytest.raises(ConfigError, match=r"m was trained with data.prompts.query='query: ' .* leave data.prompts unset"):
        model_prompts(E5, {"query": "q: "}, "m")


def test_batches_carry_the_prompted_texts_and_tokens():
    items = [(0, Pair(query="find files", positive="a file finder", doc_id=1,
                      negatives=[Negative(doc_id=2, text="a mail reader")]))]
    batch = collate(items, fake_tokenize, n_negatives=1, prompts=E5)
    assert batch["query"]["texts"] == ["query: find files"]
    assert batch["doc"]["texts"] == ["passage: a file finder"] and batch["neg"]["texts"] == ["passage: a mail reader"]
    assert batch["query"]["input_ids"].tolist() == fake_tokenize(["query: find files"], "query")["input_ids"].tolist()
    ev = EvalCollator(fake_tokenize, E5)([("query", "q1", "find files")])
    assert ev["texts"] == ["query: find files"]


def test_data_prompts_reach_training_and_validation_batches(tmp_path):
    cfg = make_cfg(tmp_path, prompts=PromptsConfig(query="query: ", doc="passage: "))
    dm = RetrievalDataModule(cfg, fake_tokenize, rank=0, world_size=1)
    batch = next(iter(dm.train_dataloader()))
    assert all(t.startswith("query: query ") for t in batch["query"]["texts"])
    assert all(t.startswith("passage: document ") for t in batch["doc"]["texts"])
    val = list(dm.val_dataloader())
    assert val[0]["kind"] == "doc" and val[0]["texts"][0] == "passage: eval document 0"
    assert val[-1]["kind"] == "query" and all(t.startswith("query: eval query") for t in val[-1]["texts"])
    plain = next(iter(RetrievalDataModule(make_cfg(tmp_path), fake_tokenize, rank=0, world_size=1).train_dataloader()))
    assert not plain["query"]["texts"][0].startswith("query: ")


# --------------------------------------------------------------------------- models and commands


def test_checkpoint_keeps_its_prompts_and_encodes_with_them(tiny_dir, e5_checkpoint):
    enc, desc = load_checkpoint_encoder(e5_checkpoint)
    assert enc.prompts == E5
    with_prompts = encode_texts(enc, TEXTS, "query", show_progress=False)
    enc.prompts = NO_PROMPTS
    np.testing.assert_allclose(with_prompts, encode_texts(enc, E5.apply(TEXTS, "query"), "query", show_progress=False),
                               atol=1e-6)
    assert not np.allclose(with_prompts, encode_texts(enc, TEXTS, "query", show_progress=False), atol=1e-3)
    _, desc = load_encoder(checkpoint=e5_checkpoint, prompts={"query": "query: ", "doc": "passage: "})
    assert desc["prompts"] == {"query": "query: ", "doc": "passage: "}
    with pytest.raises(ConfigError, match=f"checkpoint={e5_checkpoint} was trained with"):
        load_encoder(checkpoint=e5_checkpoint, prompts={"query": "Represent this question: "})


def test_exported_model_gives_our_embeddings_with_encode_query_and_encode_document(tiny_dir, e5_checkpoint, tmp_path):
    st_mod = pytest.importorskip("sentence_transformers")
    out = tmp_path / "m"
    run_export(compose_cfg("export", tiny_overrides(tiny_dir) + [f"checkpoint={e5_checkpoint}", f"out_dir={out}"]))
    assert "- Prompts: query 'query: ', document 'passage: '" in (out / "README.md").read_text()
    st_cfg = json.loads((out / "config_sentence_transformers.json").read_text())
    assert st_cfg["prompts"] == {"query": "query: ", "document": "passage: "}
    assert st_cfg["default_prompt_name"] == "document"
    enc, _ = load_checkpoint_encoder(e5_checkpoint)
    q_ref = encode_texts(enc, TEXTS, "query", show_progress=False)
    d_ref = encode_texts(enc, TEXTS, "doc", show_progress=False)
    st = st_mod.SentenceTransformer(str(out), device="cpu")
    np.testing.assert_allclose(st.encode_query(TEXTS), q_ref, atol=1e-5)
    np.testing.assert_allclose(st.encode_document(TEXTS), d_ref, atol=1e-5)
    np.testing.assert_allclose(st.encode(TEXTS), d_ref, atol=1e-5)  # default prompt: the document's
    back, _ = load_model_dir(out)  # our commands on the exported directory: its stored prompts
    assert back.prompts == E5
    np.testing.assert_allclose(encode_texts(back, TEXTS, "query", show_progress=False), q_ref, atol=1e-5)
    with pytest.raises(ConfigError, match=f"model_dir={out} was trained with"):
        load_encoder(model_dir=str(out), model=ModelConfig(backbone="tiny", path=tiny_dir), prompts={"query": "x: "})

    # search over the exported model: the scores are sentence-transformers' query . document
    folder = tmp_path / "corpus"
    corpus = {f"d{i}": t for i, t in enumerate(TEXTS)}
    write_beir(folder, EvalSet(corpus=corpus, queries={"q": "x"}, qrels={"q": {"d0": 1}}), "test")
    query = "convert pictures in a shell"
    answers = run_search(compose_cfg("search", tiny_overrides(tiny_dir) + [
        f"model_dir={out}", f"corpus={folder}", f"index_dir={tmp_path / 'index'}", f"query={query}", "k=3",
        "format=json", "progress=false", "device=cpu"]), out=io.StringIO())
    st_scores = (st.encode_query([query]) @ st.encode_document(TEXTS).T)[0]
    for hit in answers[0]["results"]:
        assert hit["score"] == pytest.approx(float(st_scores[int(hit["doc_id"][1:])]), abs=1e-4)


def test_base_model_takes_the_commands_prompts_and_search_keys_its_index_by_them(tiny_dir, tmp_path):
    enc, desc = load_encoder(model=ModelConfig(backbone="tiny", path=tiny_dir), prompts=PromptsConfig(query="q: "))
    assert enc.prompts == Prompts(query="q: ") and desc["prompts"] == {"query": "q: ", "doc": ""}
    folder = tmp_path / "corpus"
    write_beir(folder, EvalSet(corpus={"d0": "a text"}, queries={"q": "x"}, qrels={"q": {"d0": 1}}), "test")
    base = tiny_overrides(tiny_dir) + [f"corpus={folder}", "query=a text", "format=json", "progress=false", "device=cpu"]
    plain = run_search(compose_cfg("search", base), out=io.StringIO())
    prompted = run_search(compose_cfg("search", base + ["data.prompts.doc='passage: '"]), out=io.StringIO())
    assert plain[0]["results"][0]["score"] != pytest.approx(prompted[0]["results"][0]["score"], abs=1e-4)


def test_resume_with_other_prompts_is_refused(tmp_path):
    from moco_retrieval.train import prepare_run_dir

    last = tmp_path / "checkpoints" / "last.ckpt"
    atomic_torch_save({"global_step": 3, "hyper_parameters": {"objective": {"name": "moco"},
                                                              "prompts": {"query": "query: ", "doc": ""}}}, last)

    def resume(*overrides):
        cfg = compose_cfg("train", ["+experiment=smoke", "ckpt_path=last", *overrides])
        return prepare_run_dir(OmegaConf.to_object(cfg), tmp_path)

    with pytest.raises(CheckpointError) as err:
        resume()
    assert (f"ckpt_path={last}: trained with data.prompts.query='query: ', but this run's config has "
            "data.prompts.query=''") in str(err.value)
    assert resume("data.prompts.query='query: '") == str(last)
    # a checkpoint from before prompts existed trained without any
    atomic_torch_save({"global_step": 3, "hyper_parameters": {"objective": {"name": "moco"}}}, last)
    assert resume() == str(last)
    with pytest.raises(CheckpointError, match=r"trained with data.prompts.doc=''"):
        resume("data.prompts.doc='passage: '")


def test_a_sentence_transformers_directory_brings_its_prompts(tiny_dir, tmp_path):
    """A model directory not written by our export (e.g. an E5 model saved by sentence-transformers)."""
    import shutil

    d = tmp_path / "st"
    shutil.copytree(tiny_dir, d)
    (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "query: ", "passage": "passage: "}}))
    fallback = ModelConfig(backbone="tiny", path=tiny_dir)
    enc, desc = load_encoder(model_dir=str(d), model=fallback)
    assert enc.prompts == E5 and desc["prompts"] == {"query": "query: ", "doc": "passage: "}
    (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "", "document": ""}}))
    enc, _ = load_encoder(model_dir=str(d), model=fallback, prompts={"query": "q: "})  # empty: none on record
    assert enc.prompts == Prompts(query="q: ")
