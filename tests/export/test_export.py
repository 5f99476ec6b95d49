"""The export command and writer (moco_retrieval/export/): sentence-transformers loads the exported
folder with the trainer's embeddings (query or key encoder of a checkpoint, two towers as a router,
heads, pooling and the similarity), and the package loads it back."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moco_retrieval.config import ModelConfig
from moco_retrieval.evaluate import run_evaluate
from moco_retrieval.evaluation.encode import encode_texts
from moco_retrieval.export.__main__ import run_export
from moco_retrieval.export.writer import export_encoder
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.model.loading import load_checkpoint_encoder, load_model_dir
from tests.helpers import compose_cfg, tiny_overrides


def test_export_reloads_with_identical_embeddings(tiny_dir, moco_checkpoint, tmp_path):
    st_mod = pytest.importorskip("sentence_transformers")
    texts = ["resize images from the command line", "a shell for the terminal", "backup archive tool " * 12]
    for which in ("query", "key"):
        out = tmp_path / which
        cfg = compose_cfg("export", tiny_overrides(tiny_dir) + [f"checkpoint={moco_checkpoint}", f"out_dir={out}",
                                                           f"encoder={which}"])
        run_export(cfg)
        enc, _ = load_checkpoint_encoder(moco_checkpoint, which)
        q_ref = encode_texts(enc, texts, "query", show_progress=False)
        d_ref = encode_texts(enc, texts, "doc", show_progress=False)
        st = st_mod.SentenceTransformer(str(out), device="cpu")
        np.testing.assert_allclose(st.encode_query(texts), q_ref, atol=1e-5)
        np.testing.assert_allclose(st.encode_document(texts), d_ref, atol=1e-5)
        np.testing.assert_allclose(st.encode(texts), d_ref, atol=1e-5)  # plain encode: document length
        back, desc = load_model_dir(out)
        np.testing.assert_allclose(encode_texts(back, texts, "query", show_progress=False), q_ref, atol=1e-6)
        assert desc["exported"] and desc["exported_from"]["encoder"] == which
    q_key = encode_texts(load_checkpoint_encoder(moco_checkpoint, "key")[0], texts, "query", show_progress=False)
    q_query = encode_texts(load_checkpoint_encoder(moco_checkpoint, "query")[0], texts, "query", show_progress=False)
    assert not np.allclose(q_key, q_query, atol=1e-4)  # two steps apart: the export chose the right weights
    with pytest.raises(FileExistsError):
        run_export(compose_cfg("export", tiny_overrides(tiny_dir) + [f"checkpoint={moco_checkpoint}", f"out_dir={tmp_path / 'key'}"]))


def test_two_towers_export_as_a_router_with_the_trainers_embeddings(tiny_dir, beir_dir, two_tower_checkpoint, tmp_path):
    """model.shared_tower=false: the query tower serves encode_query, the document tower encode_document
    (and plain encode), each equal to the trainer's; evaluate and search model_dir= rebuild both."""
    st_mod = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Router

    texts = ["resize images from the command line", "a shell for the terminal", "backup archive tool " * 12]
    out = tmp_path / "m"
    run_export(compose_cfg("export", tiny_overrides(tiny_dir) + [f"checkpoint={two_tower_checkpoint}", f"out_dir={out}"]))
    enc, _ = load_checkpoint_encoder(two_tower_checkpoint, "query")
    q_ref, d_ref = (encode_texts(enc, texts, kind, show_progress=False) for kind in ("query", "doc"))
    # the query tower embeds the queries and the document tower the documents: the two towers differ
    assert not np.allclose(encode_texts(enc, texts, "query", show_progress=False),
                           encode_texts(_swap_towers(enc), texts, "query", show_progress=False), atol=1e-4)
    st = st_mod.SentenceTransformer(str(out), device="cpu")
    assert isinstance(st[0], Router)
    np.testing.assert_allclose(st.encode_query(texts), q_ref, atol=1e-5)
    np.testing.assert_allclose(st.encode_document(texts), d_ref, atol=1e-5)
    np.testing.assert_allclose(st.encode(texts), d_ref, atol=1e-5)  # plain encode: the document route
    back, desc = load_model_dir(out)
    assert not back.shared_tower and desc["exported"]
    for kind, ref in (("query", q_ref), ("doc", d_ref)):
        np.testing.assert_allclose(encode_texts(back, texts, kind, show_progress=False), ref, atol=1e-6)
    assert "Router" in (out / "README.md").read_text()
    # evaluate model_dir= scores exactly as the checkpoint it was exported from
    metrics = {}
    for name, spec in (("ckpt", f"checkpoint={two_tower_checkpoint}"), ("dir", f"model_dir={out}")):
        run_evaluate(compose_cfg("evaluate", tiny_overrides(tiny_dir) + ["data=beir", f"data.dir={beir_dir}", spec, "progress=false",
                                                            "device=cpu", "plots=false"]), tmp_path / name)
        metrics[name] = json.loads((tmp_path / name / "eval.json").read_text())["metrics"]
    assert metrics["dir"] == pytest.approx(metrics["ckpt"], abs=1e-6)


def _swap_towers(enc):
    """A copy of a two-tower encoder whose query tower is its document tower."""
    import copy

    other = copy.deepcopy(enc)
    other.query_tower = other.doc_tower
    return other


@pytest.mark.parametrize("kw", [dict(head="linear", head_dim=8), dict(head="mlp", head_dim=8, pooling="cls", normalize=False)])
def test_export_heads_pooling_and_dot_product(tiny_dir, tmp_path, kw):
    st_mod = pytest.importorskip("sentence_transformers")
    torch.manual_seed(0)
    enc = build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, **kw))
    export_encoder(enc, tmp_path / "m")
    st = st_mod.SentenceTransformer(str(tmp_path / "m"), device="cpu")
    texts = ["one text", "another longer text about files"]
    np.testing.assert_allclose(st.encode_query(texts), encode_texts(enc, texts, "query", show_progress=False), atol=1e-5)
    assert st.similarity_fn_name == ("cosine" if kw.get("normalize", True) else "dot")
    back, _ = load_model_dir(tmp_path / "m")
    np.testing.assert_allclose(encode_texts(back, texts, "doc", show_progress=False),
                               encode_texts(enc, texts, "doc", show_progress=False), atol=1e-6)


def test_export_refuses_bag_of_wordpieces(tiny_dir, tmp_path):
    enc = build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, backbone_kind="bag_of_wordpieces"))
    with pytest.raises(ValueError, match="backbone_kind=transformer"):
        export_encoder(enc, tmp_path / "m")


def test_export_prints_no_bar_per_written_file(tiny_dir, tmp_path, capfd, caplog):
    """Issue 46, point 17: transformers' "Writing model shards" bar is noise in a job's log, and so is
    sentence-transformers' "Saving model to /tmp/.moco-export-..." (a temp folder the user never sees)."""
    import logging

    from moco_retrieval.export.__main__ import run_export

    caplog.set_level(logging.INFO)  # as the commands' logging is set up
    run_export(compose_cfg("export", tiny_overrides(tiny_dir) + [f"out_dir={tmp_path / 'model'}"]))
    captured = capfd.readouterr()
    assert "exported the query encoder" in captured.out
    assert "Writing model shards" not in captured.err + captured.out and "Loading weights" not in captured.err
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("sentence_transformers")]
