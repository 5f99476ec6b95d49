"""The ONNX form of an export (``format=onnx``, ``quantize=int8``): the folder's transformer as
``onnx/model.onnx`` and, its weights dynamically quantized to int8, ``onnx/model_qint8_quantized.onnx``,
where ``SentenceTransformer(DIR, backend="onnx", model_kwargs={"file_name": ...})`` looks for them.
Only the transformer changes form: the tokenizer, Pooling, Dense, Normalize, the prompts and
Matryoshka truncation (``truncate_dim``) stay sentence-transformers' own, read from the same folder.

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
    """The ONNX files an export wrote into ``folder`` (none: an export without format=onnx)."""
    return [name for name in (ONNX_FILE, INT8_FILE) if (Path(folder) / name).is_file()]


def require_onnx() -> None:
    """ConfigError naming the missing packages of ``format=onnx`` (checked before the model loads)."""
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError(f"format=onnx needs {', '.join(missing)}, not installed here: "
                          "pip install 'moco-retrieval[onnx]'")


def check_onnx_encoder(encoder: Any) -> None:
    """ConfigError for a model whose export has no single transformer at the folder's top."""
    if not encoder.shared_tower:
        raise ConfigError("format=onnx: this model has two towers (model.shared_tower=false), exported as a "
                          "sentence-transformers Router, which backend=\"onnx\" does not load; export it without format=onnx")


def write_onnx(folder: Path, quantize: str = "none") -> list[str]:
    """The ONNX files of the sentence-transformers folder ``folder`` (its transformer saved at the
    top), written into ``folder``; with ``quantize="int8"`` the quantized file too. Returns their paths."""
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
    module = st[0]
    module.model = OnnxTransformer(Path(folder) / file_name, module.model.config, threads)
    return st


__all__ = ["ONNX_FILE", "INT8_FILE", "loading_line", "written_files", "require_onnx", "check_onnx_encoder", "write_onnx", "load_onnx", "OnnxTransformer"]
