"""``python -m moco_retrieval.export``: a trained encoder as a sentence-transformers model directory.

    python -m moco_retrieval.export checkpoint=RUN/checkpoints/last.ckpt out_dir=DIR [encoder=key]

Writes a Hugging Face model directory with sentence-transformers metadata, so that
``SentenceTransformer(DIR)`` loads it; ``encode_query`` / ``encode_document`` return the
trainer's query / document embeddings (same truncation: ``query_max_len`` / ``doc_max_len``;
plain ``encode`` truncates at ``doc_max_len``). Modules: Transformer (backbone + tokenizer at the
top level), Pooling (mean or CLS, as trained), Dense layer(s) for a ``linear`` / ``mlp`` head,
Normalize when the model normalizes (similarity ``cosine``; ``dot`` otherwise). A
``moco_retrieval.json`` next to them records the ModelConfig and the source, so the trainer's own
commands (``evaluate model_dir=DIR``, ``search model_dir=DIR``) rebuild the same encoder.
The prompts trained with (``data.prompts``, data/prompts.py) become the model's ``prompts``
``{"query", "document"}`` (``default_prompt_name`` "document" when there is a document prompt, so
plain ``encode`` stays the document side) and are recorded in ``moco_retrieval.json`` too.

``encoder=query`` (default) exports the query-side encoder that training optimised;
``encoder=key`` the momentum (EMA) key encoder of a MoCo checkpoint. With separate towers
(``model.shared_tower=false``) both towers are exported, as a
sentence-transformers ``Router`` with a "query" route (the query tower) and a "document" route
(the document tower; also plain ``encode``'s): ``encode_query`` / ``encode_document`` use the right
tower, and ``evaluate`` / ``search model_dir=`` rebuild both.

Supported: ``backbone_kind=transformer`` (fine-tuned, frozen or LoRA backbone). A
``bag_of_wordpieces`` backbone is refused with an explanation. LoRA adapters are merged into the
exported backbone (a plain Hugging Face model); ``adapter_only=true`` writes the adapter alone
(peft's files and the tokenizer: ``PeftModel.from_pretrained(base, DIR)``). ``pooling=last``
(decoder backbones) is sentence-transformers' ``lasttoken``; the saved tokenizer appends the
end-of-text token as in training.

``format=onnx`` adds the ONNX form of the transformer, ``onnx/model.onnx``, beside the weights (two
towers: in each tower's subfolder, the same ``file_name`` loading both) (``SentenceTransformer(DIR, backend="onnx")``); ``quantize=int8`` adds its dynamically quantized
int8 copy, ``onnx/model_qint8_quantized.onnx`` (``model_kwargs={"file_name": ...}``). Prompts and
Matryoshka truncation are sentence-transformers' own and stay as they are (export/onnx.py).

``out_dir`` must be missing or empty; ``overwrite=true`` replaces an earlier export there, removing
only the entries its ``moco_retrieval.json`` lists (other files stay), and refuses a folder that is
not an export. The export is written beside ``out_dir`` first and moved in when complete.

Keys: ExportConfig in config.py (``conf/export.yaml``). The files: writer.py; out_dir's rules:
folder.py; the loaders (checkpoint, model directory): ``moco_retrieval/model/loading.py``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from moco_retrieval.command import command
from moco_retrieval.config import check_export
from moco_retrieval.errors import CheckpointError, ConfigError
from moco_retrieval.export.folder import apply_umask, earlier_export
from moco_retrieval.export.writer import export_adapter, export_encoder
from moco_retrieval.model.backbone import quiet_transformers
from moco_retrieval.model.loading import META_FILE, load_encoder
from moco_retrieval.model.momentum import ENCODERS



def write_model_card(out: Path, desc: dict, checkpoint: Optional[str], side: str, name: str) -> Path:
    """``out/README.md``: the card of card.py in place of sentence-transformers' generic one."""
    from moco_retrieval.export.card import (
        model_card,
        run_dir_of,
        training_record,
        validation_at,
    )

    record = training_record(checkpoint)
    metrics = None
    if checkpoint and run_dir_of(checkpoint) is not None:
        metrics = validation_at(run_dir_of(checkpoint), int(desc.get("global_step", -1)), Path(checkpoint).name)
    from moco_retrieval.export.onnx import written_files

    model_cfg = json.loads((out / META_FILE).read_text(encoding="utf-8"))["model"]
    card = out / "README.md"  # (an entry the export lists: sentence-transformers wrote its generic card there)
    card.write_text(model_card(desc, model_cfg, side, record, metrics, name, written_files(out)), encoding="utf-8")
    apply_umask([card])
    return card


PROBE = ["a probe sentence for the exported model", "x"]


def check_finite(encoder: Any, what: str) -> None:
    """Refuse (CheckpointError) a model whose embeddings of a probe are not finite: weights that overflow
    the forward pass would export a model that returns NaN for every input."""
    encoder.eval()
    with torch.no_grad():
        bad = [kind for kind in ("query", "doc") if not torch.isfinite(encoder(encoder.tokenize(PROBE, kind), kind)).all()]
    if bad:
        raise CheckpointError(
            f"checkpoint={what}: its {' and '.join(bad)} embeddings of a probe text are not finite (inf or NaN): the "
            "exported model would return NaN for every input. Export an earlier checkpoint of the run (best-STEP.ckpt)")


def run_export(cfg: Any) -> Path:
    """Export the configured encoder (an ``ExportConfig``, or a DictConfig of one); returns the directory."""
    if cfg.encoder not in ENCODERS:
        raise ConfigError(f"encoder={cfg.encoder!r}: expected one of {ENCODERS}")
    if cfg.encoder == "key" and not cfg.checkpoint:
        raise ConfigError("encoder=key needs checkpoint=PATH (a base model has no key encoder)")
    check_export(cfg)
    onnx = str(cfg.format) == "onnx"
    if onnx:
        from moco_retrieval.export import onnx as onnx_form

        onnx_form.require_onnx()
    earlier_export(Path(cfg.out_dir).expanduser(), bool(cfg.overwrite))  # refused before the model loads
    enc, desc = load_encoder(checkpoint=cfg.checkpoint, model=cfg.model, encoder=cfg.encoder)
    side = "doc" if cfg.encoder == "key" else "query"
    check_finite(enc, cfg.checkpoint or "the base model")
    if cfg.adapter_only:
        with quiet_transformers():
            out = export_adapter(enc, cfg.out_dir, side=side, overwrite=bool(cfg.overwrite))
        print(f"exported the {cfg.encoder} encoder's LoRA adapter to {out}")
        return out
    extra = (lambda folder: onnx_form.write_onnx(folder, str(cfg.quantize))) if onnx else None
    with quiet_transformers():  # (no "Writing model shards" bar per file)
        out = export_encoder(enc, cfg.out_dir, side=side, source=desc, overwrite=bool(cfg.overwrite), extra=extra)
    write_model_card(out, desc, cfg.checkpoint, side, str(cfg.out_dir))
    towers = "its query and document towers, as a Router" if not enc.shared_tower else "one tower"
    print(f"exported the {cfg.encoder} encoder ({desc['source']}, dim {enc.dim}; {towers}) to {out}")
    print(f"load it with: SentenceTransformer({str(out)!r})")
    if onnx:
        for name in onnx_form.written_files(out):
            print(f"or with onnxruntime: {onnx_form.loading_line(str(out), name)}")
    return out


@command("export")
def main(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("missing required config values: " + ", ".join(missing) + " (e.g. out_dir=DIR)")
    run_export(cfg)


if __name__ == "__main__":
    main()
