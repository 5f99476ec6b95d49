"""The ONNX form of an export (``format=onnx``, ``quantize=int8``): the folder's transformer as
``onnx/model.onnx`` and, its weights dynamically quantized to int8, ``onnx/model_qint8_quantized.onnx``,
where ``SentenceTransformer(DIR, backend="onnx", model_kwargs={"file_name": ...})`` looks for them.
Only the transformer changes form: the tokenizer, Pooling, Dense, Normalize, the prompts and
Matryoshka truncation (``truncate_dim``) stay sentence-transformers' own, read from the same folder.
Two towers (a Router) get the files in each tower's subfolder: sentence-transformers 6.3's Router.load
hands ``backend`` and ``model_kwargs`` to each route's Transformer with that subfolder, so the same
``file_name`` loads both.

The graph has the interface of optimum's ``ORTModelForFeatureExtraction`` (what ``backend="onnx"``
runs): inputs ``input_ids``, ``attention_mask`` and, when the tokenizer gives them,
``token_type_ids``, batch and sequence axes dynamic; output ``last_hidden_state``. It is traced by
torch's dynamo exporter: the TorchScript exporter traces transformers 5's attention masks wrongly
(hidden states off by about 2 on a BERT). Quantization is onnxruntime's dynamic int8 (weights int8
per channel, activations quantized per batch): no calibration data.

:func:`load_onnx` runs such a file with onnxruntime inside a SentenceTransformer built from the
folder (the tests and B17 use it): ``backend="onnx"`` needs optimum-onnx, whose newest release
(0.1.0) requires transformers < 4.58, so it cannot be installed beside this project's transformers.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from moco_retrieval.errors import ConfigError

ONNX_FILE = "onnx/model.onnx"
INT8_FILE = "onnx/model_qint8_quantized.onnx"  # sentence-transformers' name for a dynamically quantized file
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "last_hidden_state"
PACKAGES = ("onnx", "onnxscript", "onnxruntime")
SINGLE_FILE_BYTES = 2**31  # protobuf's limit: larger graphs keep their weights in model.onnx.data beside it


def loading_line(folder: str, file_name: str) -> str:
    """The sentence-transformers call that runs ``folder``'s ONNX file ``file_name`` (printed and in the card)."""
    return f'SentenceTransformer("{folder}", backend="onnx", model_kwargs={{"file_name": "{file_name}"}})'


def written_files(folder: Path) -> list[str]:
    """The ``file_name``s of the ONNX files an export wrote for each of its transformers (none: an
    export without format=onnx)."""
    towers = transformer_folders(folder).values()
    return [name for name in (ONNX_FILE, INT8_FILE) if all((t / name).is_file() for t in towers)]


def require_onnx() -> None:
    """ConfigError naming the missing packages of ``format=onnx`` (checked before the model loads)."""
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError(f"format=onnx needs {', '.join(missing)}, not installed here: "
                          "pip install 'moco-retrieval[onnx]'")


def transformer_folders(folder: Path) -> dict[str, Path]:
    """Where each transformer of the exported ``folder`` is saved, by route: ``{"": folder}`` for one
    tower; two towers (a Router): ``{"query": folder/query_0_Transformer, "document": ...}``, the
    subfolders that Router.load reads each route's first module from."""
    folder = Path(folder)
    router = folder / "router_config.json"
    if not router.is_file():
        return {"": folder}
    structure = json.loads(router.read_text(encoding="utf-8"))["structure"]
    return {route: folder / modules[0] for route, modules in structure.items()}


def write_onnx(folder: Path, quantize: str = "none") -> list[str]:
    """The ONNX files of the sentence-transformers folder ``folder``, each transformer's beside it
    (one tower: ``folder/onnx/``; two: each route's subfolder's ``onnx/``, where backend="onnx" with
    the same ``file_name`` finds them); with ``quantize="int8"`` the quantized files too. Their paths."""
    written = []
    for tower in transformer_folders(folder).values():
        written += [str((tower / name).relative_to(folder)) for name in _write_tower(tower, quantize)]
    return written


def _write_tower(folder: Path, quantize: str) -> list[str]:
    """:func:`write_onnx` of one transformer saved in ``folder``."""
    from transformers import AutoModel, AutoTokenizer

    folder = Path(folder)
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    names = [n for n in INPUTS if n in tokenizer.model_input_names]
    sample = tokenizer(["a probe sentence for the exported model", "x"], padding=True, return_tensors="pt")
    big = sum(p.numel() * p.element_size() for p in model.parameters()) >= SINGLE_FILE_BYTES
    out = folder / ONNX_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    batch, length = torch.export.Dim("batch_size"), torch.export.Dim("sequence_length")
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # (it lists the torchvision operators it skips)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (axis names merged, deprecations inside torch.export)
            torch.onnx.export(_HiddenStates(model).eval(), (), str(out), kwargs={n: sample[n] for n in names},
                              dynamo=True, input_names=names, output_names=[OUTPUT], external_data=big,
                              verbose=False, dynamic_shapes={n: {0: batch, 1: length} for n in names})
    finally:
        exporter_log.setLevel(level)
    written = [ONNX_FILE]
    if quantize == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quiet = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # (its advice to pre-process the graph first: for static quantization)
        try:
            # the plain graph, every op type, int8 weights per channel: no variant tried was faster on an
            # AVX2 CPU (fused by onnxruntime's transformer optimizer, MatMuls only, unsigned, reduce_range;
            # per tensor lost accuracy), see benchmarks/README.md's B17
            quantize_dynamic(out, folder / INT8_FILE, weight_type=QuantType.QInt8, per_channel=True,
                             use_external_data_format=big)
        finally:
            logging.getLogger().setLevel(quiet)
        written.append(INT8_FILE)
    return written


class _HiddenStates(nn.Module):
    """The backbone's last hidden states as a function of its token tensors (the graph's one output)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        given = {"attention_mask": attention_mask, "token_type_ids": token_type_ids}
        return self.model(input_ids=input_ids, **{k: v for k, v in given.items() if v is not None}).last_hidden_state


class OnnxTransformer(nn.Module):
    """An ONNX file run by onnxruntime where sentence-transformers' Transformer module calls its model."""

    def __init__(self, path: Path, config: Any, threads: Optional[int] = None) -> None:
        import onnxruntime as ort

        super().__init__()
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.config = config

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, **_: Any) -> dict[str, torch.Tensor]:
        given = {"input_ids": input_ids, "attention_mask": attention_mask,
                 "token_type_ids": token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)}
        feed = {name: given[name].cpu().numpy() for name in self.inputs}
        return {OUTPUT: torch.from_numpy(self.session.run([OUTPUT], feed)[0])}


def load_onnx(folder: str | Path, file_name: str = ONNX_FILE, threads: Optional[int] = None, **kwargs: Any):
    """A SentenceTransformer of the exported ``folder`` whose transformer is ``folder/file_name`` run by
    onnxruntime (``threads``: its intra-op threads; None: onnxruntime's default); ``kwargs`` go to
    SentenceTransformer (``truncate_dim``, ...)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu", **kwargs)
    for route, tower in transformer_folders(Path(folder)).items():
        module = st[0].sub_modules[route][0] if route else st[0]
        module.model = OnnxTransformer(tower / file_name, module.model.config, threads)
    return st


__all__ = ["ONNX_FILE", "INT8_FILE", "loading_line", "written_files", "require_onnx", "transformer_folders", "write_onnx", "load_onnx", "OnnxTransformer"]
