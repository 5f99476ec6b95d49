"""format=onnx and quantize=int8 (moco_retrieval/export/onnx.py): the ONNX files sit where
sentence-transformers' backend="onnx" reads them and give the torch model's embeddings (int8: close
in cosine), prompts and Matryoshka truncation kept; contradicting options are refused before the
model loads; an earlier export's ONNX files are replaced, the user's files never."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moco_retrieval.config import ExportConfig, ModelConfig
from moco_retrieval.data.prompts import Prompts
from moco_retrieval.errors import ConfigError, OutputExistsError
from moco_retrieval.export.__main__ import run_export
from moco_retrieval.export.writer import export_encoder
from moco_retrieval.model.encoder import build_encoder
from tests.helpers import compose_cfg, tiny_overrides

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
st_mod = pytest.importorskip("sentence_transformers")
from moco_retrieval.export.onnx import INT8_FILE, ONNX_FILE, load_onnx, transformer_folders, write_onnx  # noqa: E402

TEXTS = ["resize images from the command line", "a shell for the terminal", "backup archive tool " * 12]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def onnx_export(tiny_dir, tmp_path_factory):
    """A tiny model with a head, E5-style prompts and Matryoshka prefixes, exported with both ONNX files."""
    torch.manual_seed(0)
    enc = build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, head="linear", head_dim=8))
    enc.prompts = Prompts(query="query: ", doc="passage: ")
    out = tmp_path_factory.mktemp("onnx") / "m"
    export_encoder(enc, out, source={"source": "base", "matryoshka_dims": [8, 4]},
                   extra=lambda folder: write_onnx(folder, "int8"))
    return out


def test_onnx_and_int8_give_the_torch_models_embeddings_with_prompts_and_truncation(onnx_export):
    out = onnx_export
    torch_st = st_mod.SentenceTransformer(str(out), device="cpu")
    onnx_st = load_onnx(out, ONNX_FILE, threads=1)
    int8_st = load_onnx(out, INT8_FILE, threads=1)
    for encode in ("encode_query", "encode_document", "encode"):
        ref = getattr(torch_st, encode)(TEXTS)
        np.testing.assert_allclose(getattr(onnx_st, encode)(TEXTS), ref, atol=1e-5)
        assert cosine(getattr(int8_st, encode)(TEXTS), ref).min() > 0.99
    # the prompts are applied (a query differs from the same text as a document), by both backends
    assert not np.allclose(onnx_st.encode_query(TEXTS), onnx_st.encode_document(TEXTS), atol=1e-3)
    ref4 = st_mod.SentenceTransformer(str(out), device="cpu", truncate_dim=4).encode_query(TEXTS)
    np.testing.assert_allclose(load_onnx(out, ONNX_FILE, truncate_dim=4).encode_query(TEXTS), ref4, atol=1e-5)
    assert ref4.shape == (len(TEXTS), 4)
    meta = json.loads((out / "moco_retrieval.json").read_text())
    assert "onnx" in meta["files"] and meta["matryoshka_dims"] == [8, 4]  # overwrite=true replaces the ONNX files too
    import onnx

    int8_weights = {t.name for t in onnx.load(str(out / INT8_FILE)).graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert len(int8_weights) >= 2 * 4  # the tiny model's 2 layers hold 4 weight matrices or more each, all int8


def test_sentence_transformers_onnx_backend_loads_the_export(onnx_export):
    """backend="onnx" itself (optimum): skipped where optimum-onnx cannot be installed beside
    transformers 5 (its newest release requires transformers < 4.58)."""
    pytest.importorskip("optimum.onnxruntime", exc_type=ImportError)
    ref = st_mod.SentenceTransformer(str(onnx_export), device="cpu").encode_query(TEXTS)
    for name, tol in ((ONNX_FILE, 1e-5), (INT8_FILE, None)):
        st = st_mod.SentenceTransformer(str(onnx_export), device="cpu", backend="onnx", model_kwargs={"file_name": name})
        got = st.encode_query(TEXTS)
        if tol:
            np.testing.assert_allclose(got, ref, atol=tol)
        else:
            assert cosine(got, ref).min() > 0.99


@pytest.mark.parametrize("overrides, message", [
    (["quantize=int8"], "quantize=int8: the int8 model is an ONNX model; add format=onnx"),
    (["format=onnx", "adapter_only=true"], "format=onnx: adapter_only=true writes a LoRA adapter alone"),
])
def test_contradicting_options_are_refused_before_the_model_loads(tiny_dir, tmp_path, overrides, message):
    cfg = compose_cfg("export", ["model=tiny", f"model.path={tmp_path / 'no-such-model'}", f"out_dir={tmp_path / 'm'}",
                                 *overrides])
    with pytest.raises(ConfigError, match=message):
        run_export(cfg)  # (the model path does not exist: the rule is checked first)
    with pytest.raises(ConfigError, match=message):
        ExportConfig(out_dir="m", **dict(o.split("=") for o in overrides))
    assert not (tmp_path / "m").exists()


@pytest.mark.slow  # ~15 s: two towers exported to ONNX and int8, four models compared
def test_two_towers_get_each_towers_onnx_files_and_their_embeddings(tiny_dir, tmp_path):
    from sentence_transformers.backend.utils import backend_should_export

    torch.manual_seed(0)
    enc = build_encoder(ModelConfig(backbone="tiny", path=tiny_dir, shared_tower=False))
    with torch.no_grad():  # towers apart, so a route mix-up shows
        for p in enc.tower_for("doc").parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = tmp_path / "m"
    export_encoder(enc, out, source={"source": "base"}, extra=lambda folder: write_onnx(folder, "int8"))
    towers = transformer_folders(out)
    assert set(towers) == {"query", "document"} and towers["query"] != towers["document"]
    torch_st = st_mod.SentenceTransformer(str(out), device="cpu")
    onnx_st, int8_st = load_onnx(out, ONNX_FILE, threads=1), load_onnx(out, INT8_FILE, threads=1)
    assert not np.allclose(torch_st.encode_query(TEXTS), torch_st.encode_document(TEXTS), atol=1e-3)
    for encode in ("encode_query", "encode_document"):
        ref = getattr(torch_st, encode)(TEXTS)
        np.testing.assert_allclose(getattr(onnx_st, encode)(TEXTS), ref, atol=1e-5)
        assert cosine(getattr(int8_st, encode)(TEXTS), ref).min() > 0.99
    for route, tower in towers.items():  # backend="onnx" resolves file_name inside each route's subfolder, no export
        for name in (ONNX_FILE, INT8_FILE):
            export, kwargs = backend_should_export(out, True, {"subfolder": tower.name, "file_name": name},
                                                   "model.onnx", "*.onnx", "ONNX")
            assert not export and out / kwargs["subfolder"] / kwargs["file_name"] == tower / name


def test_overwrite_replaces_the_onnx_files_and_keeps_the_users(onnx_export, tiny_dir, tmp_path):
    import shutil

    out = tmp_path / "m"
    shutil.copytree(onnx_export, out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="out_dir"):
        run_export(compose_cfg("export", tiny_overrides(tiny_dir) + [f"out_dir={out}", "format=onnx"]))
    run_export(compose_cfg("export", tiny_overrides(tiny_dir) + [f"out_dir={out}", "overwrite=true"]))
    assert not (out / "onnx").exists() and (out / "notes.txt").read_text() == "mine"  # the earlier ONNX files went
    assert "## ONNX" not in (out / "README.md").read_text() and "onnx" not in (out / "README.md").read_text()
    theirs = tmp_path / "theirs"
    (theirs / "onnx").mkdir(parents=True)
    (theirs / "onnx" / "model.onnx").write_text("not ours")
    with pytest.raises(OutputExistsError):
        run_export(compose_cfg("export", tiny_overrides(tiny_dir) + [f"out_dir={theirs}", "format=onnx", "overwrite=true"]))
    assert (theirs / "onnx" / "model.onnx").read_text() == "not ours"


@pytest.mark.parametrize("quantize, files", [("none", [ONNX_FILE]), ("int8", [ONNX_FILE, INT8_FILE])])
def test_the_model_card_names_the_onnx_files_written_and_how_to_load_them(tiny_dir, tmp_path, capsys, quantize, files):
    import re

    out = tmp_path / "m"
    run_export(compose_cfg("export", tiny_overrides(tiny_dir) + [f"out_dir={out}", "format=onnx", f"quantize={quantize}"]))
    card = (out / "README.md").read_text()
    section = card[card.index("## ONNX"):]
    loaded = re.findall(r'SentenceTransformer\("(.+?)", backend="onnx", model_kwargs=\{"file_name": "(.+?)"\}\)', section)
    assert loaded == [(str(out), f) for f in files] and all((out / f).is_file() for f in files)
    assert [f for f in (ONNX_FILE, INT8_FILE) if f"`{f}`" in section] == files
    printed = capsys.readouterr().out  # the command prints the same lines
    assert all(f'model_kwargs={{"file_name": "{f}"}}' in printed for f in files)
