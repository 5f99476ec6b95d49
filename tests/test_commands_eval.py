"""evaluate / export / search on a tiny model, a tiny BEIR folder and a 2-step training checkpoint."""
from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from moco_retrieval.config import ModelConfig, OptimConfig
from moco_retrieval.objectives.inbatch import InBatchConfig
from moco_retrieval.objectives.moco import MoCoConfig
from moco_retrieval.data.formats import EvalSet, read_beir, write_beir
from moco_retrieval.evaluate import run_evaluate
from moco_retrieval.evaluation.encode import encode_texts
from moco_retrieval.evaluation.metrics import METRIC_NAMES, evaluate_run, read_trec_run
from moco_retrieval.export.__main__ import run_export
from moco_retrieval.export.writer import export_encoder
from moco_retrieval.training.module import RetrievalModule
from moco_retrieval.model.encoder import build_encoder
from moco_retrieval.model.loading import load_checkpoint_encoder, load_model_dir
from moco_retrieval.model.tiny import build_tiny_bert
from moco_retrieval.search import run_search

sys.path.insert(0, str(Path(__file__).parent))
from helpers import SyntheticData  # noqa: E402

WORDS = ("file system network server image audio video text editor library python tool command line "
         "package manager compress archive backup font color terminal shell mail web browser").split()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_bert(tmp_path_factory.mktemp("tiny") / "bert"))


@pytest.fixture(scope="module")
def beir_dir(tmp_path_factory):
    rng = random.Random(0)
    corpus, queries, qrels = {}, {}, {}
    for i in range(40):
        words = rng.sample(WORDS, 6)
        corpus[f"doc-{i:02d}"] = " ".join(words)
        if i % 2 == 0:
            queries[f"q-{i:02d}"] = " ".join(words[:2])
            qrels[f"q-{i:02d}"] = {f"doc-{i:02d}": 1, f"doc-{(i + 1):02d}": 0}
    qrels["q-00"][f"doc-{39:02d}"] = 2  # graded, several relevant
    d = tmp_path_factory.mktemp("beir") / "tiny"
    write_beir(d, EvalSet(corpus=corpus, queries=queries, qrels=qrels), "test")
    return str(d)


@pytest.fixture(scope="module")
def checkpoint(tiny_dir, tmp_path_factory):
    """A real Lightning checkpoint of 2 MoCo steps (query and key encoders differ)."""
    return train_checkpoint(ModelConfig(backbone="tiny", path=tiny_dir),
                            MoCoConfig(queue_size=16, temperature=0.1, momentum=0.5), tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def two_tower_checkpoint(tiny_dir, tmp_path_factory):
    """2 in-batch steps on two towers: both towers trained, apart."""
    return train_checkpoint(ModelConfig(backbone="tiny", path=tiny_dir, shared_tower=False, head="linear", head_dim=8),
                            InBatchConfig(temperature=0.1), tmp_path_factory.mktemp("run2"))


def train_checkpoint(model: ModelConfig, objective, folder: Path, steps: int = 2, **module_options) -> str:
    """``steps`` optimizer steps on synthetic batches of 4, saved as ``folder/checkpoints/last.ckpt``."""
    L.seed_everything(0)
    m = RetrievalModule(model, objective, OptimConfig(lr=1e-2, warmup_steps=0, warmup_ratio=0.0, schedule="constant"),
                        **module_options)
    t = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(folder),
                  num_sanity_val_steps=0, limit_val_batches=0)
    t.fit(m, SyntheticData(m.encoder.tokenize, batch_size=4, batches=steps))
    path = folder / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    t.save_checkpoint(str(path))
    return str(path)


def _compose(name, overrides):
    with initialize_config_module(config_module="moco_retrieval.conf", version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _tiny(tiny_dir):
    return ["model=tiny", f"model.path={tiny_dir}"]


# --------------------------------------------------------------------------- evaluate


def test_evaluate_checkpoint_against_base_side_by_side(tiny_dir, beir_dir, checkpoint, tmp_path):
    cfg = _compose("evaluate", _tiny(tiny_dir) + [
        "data=beir", f"data.dir={beir_dir}", f"checkpoint={checkpoint}", "compare=[base]",
        "progress=false", "device=cpu", "eval.top_k=25",
    ])
    files = run_evaluate(cfg, tmp_path)
    data = json.loads((tmp_path / "eval.json").read_text())
    names = list(data["models"])
    assert names == [f"{Path(checkpoint).parent.parent.name}-last", "base"]
    qrels = read_beir(beir_dir, "test").qrels
    for name in names:
        entry = data["models"][name]
        assert set(entry["metrics"]) == set(METRIC_NAMES)
        assert {"anisotropy", "unrelated_cos_p05", "unrelated_cos_p95", "positive_cos_mean", "cos_gap",
                "alignment", "uniformity"} <= set(entry["geometry"])
        assert {"encode", "search"} <= set(entry["timings"])
        run = read_trec_run(tmp_path / entry["run_file"])
        assert len(run) == 20 and all(len(r) == 25 for r in run.values())
        assert evaluate_run(run, qrels).mean == entry["metrics"]
    assert data["models"][names[0]]["model"]["source"] == "checkpoint"
    assert data["models"][names[0]]["model"]["global_step"] == 2
    assert data["dataset"]["queries"] == 20 and data["dataset"]["documents"] == 40
    md = (tmp_path / "report.md").read_text()
    assert f"| | {names[0]} | base |" in md
    assert (tmp_path / "cosine_hist.png").is_file() and (tmp_path / "recall_at_k.png").is_file()
    assert files["eval_json"] == tmp_path / "eval.json"


def test_evaluate_command_line(tiny_dir, beir_dir, tmp_path):
    """The real entry point: Hydra, the model/data groups, the files, run.trec = eval.json."""
    out = tmp_path / "out"
    env = {**os.environ, "MOCO_RETRIEVAL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "moco_retrieval.evaluate", *_tiny(tiny_dir), "data=beir", f"data.dir={beir_dir}",
         f"out_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}", "progress=false", "device=cpu", "plots=false"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "eval.json").read_text())
    assert data["name"] == "base" and data["model"]["source"] == "base"
    assert set(data["metrics"]) == set(METRIC_NAMES)
    run = read_trec_run(out / "run.trec")
    assert evaluate_run(run, read_beir(beir_dir, "test").qrels).mean == data["metrics"]
    assert "recall@1" in proc.stdout and (out / "report.md").is_file()


def test_configs_are_strict():
    with pytest.raises(ConfigCompositionException):
        _compose("evaluate", ["model.not_a_key=1"])
    with pytest.raises(ConfigCompositionException):
        _compose("search", ["not_a_key=1"])
    cfg = _compose("export", ["out_dir=/tmp/x"])
    assert cfg.encoder == "query" and cfg.model.backbone == "minilm"


# --------------------------------------------------------------------------- export


def test_export_reloads_with_identical_embeddings(tiny_dir, checkpoint, tmp_path):
    st_mod = pytest.importorskip("sentence_transformers")
    texts = ["resize images from the command line", "a shell for the terminal", "backup archive tool " * 12]
    for which in ("query", "key"):
        out = tmp_path / which
        cfg = _compose("export", _tiny(tiny_dir) + [f"checkpoint={checkpoint}", f"out_dir={out}",
                                                           f"encoder={which}"])
        run_export(cfg)
        enc, _ = load_checkpoint_encoder(checkpoint, which)
        q_ref = encode_texts(enc, texts, "query", show_progress=False)
        d_ref = encode_texts(enc, texts, "doc", show_progress=False)
        st = st_mod.SentenceTransformer(str(out), device="cpu")
        np.testing.assert_allclose(st.encode_query(texts), q_ref, atol=1e-5)
        np.testing.assert_allclose(st.encode_document(texts), d_ref, atol=1e-5)
        np.testing.assert_allclose(st.encode(texts), d_ref, atol=1e-5)  # plain encode: document length
        back, desc = load_model_dir(out)
        np.testing.assert_allclose(encode_texts(back, texts, "query", show_progress=False), q_ref, atol=1e-6)
        assert desc["exported"] and desc["exported_from"]["encoder"] == which
    q_key = encode_texts(load_checkpoint_encoder(checkpoint, "key")[0], texts, "query", show_progress=False)
    q_query = encode_texts(load_checkpoint_encoder(checkpoint, "query")[0], texts, "query", show_progress=False)
    assert not np.allclose(q_key, q_query, atol=1e-4)  # two steps apart: the export chose the right weights
    with pytest.raises(FileExistsError):
        run_export(_compose("export", _tiny(tiny_dir) + [f"checkpoint={checkpoint}", f"out_dir={tmp_path / 'key'}"]))


def test_two_towers_export_as_a_router_with_the_trainers_embeddings(tiny_dir, beir_dir, two_tower_checkpoint, tmp_path):
    """model.shared_tower=false: the query tower serves encode_query, the document tower encode_document
    (and plain encode), each equal to the trainer's; evaluate and search model_dir= rebuild both."""
    st_mod = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Router

    texts = ["resize images from the command line", "a shell for the terminal", "backup archive tool " * 12]
    out = tmp_path / "m"
    run_export(_compose("export", _tiny(tiny_dir) + [f"checkpoint={two_tower_checkpoint}", f"out_dir={out}"]))
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
        run_evaluate(_compose("evaluate", _tiny(tiny_dir) + ["data=beir", f"data.dir={beir_dir}", spec, "progress=false",
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


# --------------------------------------------------------------------------- search


def test_search_returns_the_planted_document_first(tiny_dir, beir_dir, tmp_path, capsys):
    planted = "convert and resize images from the command line"
    corpus = {d: t for d, t in read_beir(beir_dir, "test").corpus.items()}
    corpus["planted-doc"] = planted
    folder = tmp_path / "corpus"
    write_beir(folder, EvalSet(corpus=corpus, queries={"q": "x"}, qrels={"q": {"planted-doc": 1}}), "test")
    overrides = _tiny(tiny_dir) + [f"corpus={folder}", f"index_dir={tmp_path / 'index'}", f"query={planted}",
                                   "queries=[shell terminal]", "k=3", "format=json", "progress=false", "device=cpu"]
    out = io.StringIO()
    answers = run_search(_compose("search", overrides), out=out)
    assert [a["query"] for a in answers] == [planted, "shell terminal"]
    first = answers[0]["results"]
    assert first[0]["doc_id"] == "planted-doc" and first[0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert [r["rank"] for r in first] == [1, 2, 3] and first[0]["score"] >= first[1]["score"]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == answers
    assert "built index of 41 documents" in capsys.readouterr().err
    # second call: the saved index is loaded, same answer
    again = run_search(_compose("search", overrides), out=io.StringIO())
    assert again == answers
    assert "loaded index" in capsys.readouterr().err
    assert {p.name for p in (tmp_path / "index").iterdir()} == {"index.faiss", "doc_ids.json", "meta.json"}
