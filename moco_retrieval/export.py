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
(``model.shared_tower=false``) the query tower (or, for ``encoder=key``, the key encoder's
document tower) is exported: a single tower serves both sides in sentence-transformers.

Supported: ``backbone_kind=transformer`` (fine-tuned, frozen or LoRA backbone). A
``bag_of_wordpieces`` backbone is refused with an explanation. LoRA adapters are merged into the
exported backbone (a plain Hugging Face model); ``adapter_only=true`` writes the adapter alone
(peft's files and the tokenizer: ``PeftModel.from_pretrained(base, DIR)``). ``pooling=last``
(decoder backbones) is sentence-transformers' ``lasttoken``; the saved tokenizer appends the
end-of-text token as in training.

Keys: ExportConfig in config.py (``conf/export.yaml``). The loaders (checkpoint, model directory)
are in ``moco_retrieval/model/loading.py``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from moco_retrieval.config import register_configs
from moco_retrieval.errors import ConfigError, reports_user_errors
from moco_retrieval.model.loading import META_FILE, load_encoder
from moco_retrieval.model.lora import merged_backbone, save_adapter
from moco_retrieval.model.momentum import ENCODERS

register_configs()
FORMAT_VERSION = 1  # of META_FILE
ST_POOLING = {"mean": "mean", "cls": "cls", "last": "lasttoken"}  # our model.pooling -> sentence-transformers'


# --------------------------------------------------------------------------- export


def export_encoder(
    encoder: Any,
    out_dir: str | Path,
    *,
    side: str = "query",
    source: Optional[dict] = None,
    overwrite: bool = False,
) -> Path:
    """Write ``encoder``'s ``side`` tower as a sentence-transformers directory (see the module
    docstring); returns the directory."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    if getattr(encoder, "backbone_kind", "transformer") != "transformer":
        raise ValueError(
            "export supports backbone_kind=transformer; a bag_of_wordpieces encoder has no transformer "
            "layers for sentence-transformers to run (evaluate and search use it directly from the checkpoint)"
        )
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"out_dir={out_dir} exists and is not empty (set overwrite=true to replace it)")
        shutil.rmtree(out)
    tower = encoder.tower_for(side)
    with tempfile.TemporaryDirectory(prefix="moco-export-") as tmp:
        tmp_dir = Path(tmp)
        _save_backbone(merged_backbone(tower.backbone), tmp_dir)
        encoder.tokenizer.save_pretrained(tmp_dir)
        modules: list[torch.nn.Module] = [
            Transformer(
                str(tmp_dir),
                max_seq_length=int(encoder.doc_max_len),
                query_length=int(encoder.query_max_len),
                document_length=int(encoder.doc_max_len),
            ),
            Pooling(int(encoder.hidden_size), pooling_mode=ST_POOLING[tower.pooling]),
        ]
        for lin, act in _head_layers(tower.head):
            dense = Dense(lin.in_features, lin.out_features, bias=lin.bias is not None, activation_function=act)
            with torch.no_grad():
                dense.linear.weight.copy_(lin.weight)
                if lin.bias is not None:
                    dense.linear.bias.copy_(lin.bias)
            modules.append(dense)
        if encoder.normalize:
            modules.append(Normalize())
        prompts, default_prompt = encoder.prompts.sentence_transformers()
        st = SentenceTransformer(modules=modules, device="cpu",
                                 similarity_fn_name="cosine" if encoder.normalize else "dot",
                                 prompts=prompts, default_prompt_name=default_prompt)
        st.save(str(out))
    cfg = {
        "backbone_kind": "transformer",
        "pooling": tower.pooling,
        "head": _head_kind(tower.head),
        "head_dim": int(encoder.dim),
        "normalize": bool(encoder.normalize),
        "query_max_len": int(encoder.query_max_len),
        "doc_max_len": int(encoder.doc_max_len),
    }
    meta = {"format_version": FORMAT_VERSION, "model": cfg, "side": side, "source": source or {},
            "prompts": encoder.prompts.to_dict()}
    (out / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _apply_umask(out)
    return out


def export_adapter(encoder: Any, out_dir: str | Path, *, side: str = "query", overwrite: bool = False) -> Path:
    """Write ``encoder``'s ``side`` LoRA adapter alone, with the tokenizer (``adapter_only=true``)."""
    tower = encoder.tower_for(side)
    if not isinstance(tower.head, torch.nn.Identity):
        raise ConfigError("adapter_only=true would leave out the trained head (model.head): export the merged model")
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"out_dir={out_dir} exists and is not empty (set overwrite=true to replace it)")
    with tempfile.TemporaryDirectory(prefix="moco-adapter-", dir=out.parent if out.parent.is_dir() else None) as tmp:
        save_adapter(tower.backbone, Path(tmp))
        encoder.tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(tmp, out)
    _apply_umask(out)
    return out


def _apply_umask(folder: Path) -> None:
    """Ordinary permissions (0666 / 0777 less the umask) on everything written: some writers (the
    safetensors file) create private 0600 files, which another user or a serving container cannot read."""
    umask = os.umask(0o022)
    os.umask(umask)
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def write_model_card(out: Path, desc: dict, checkpoint: Optional[str], side: str, name: str) -> Path:
    """``out/README.md``: the card of model_card.py in place of sentence-transformers' generic one."""
    from moco_retrieval.model_card import model_card, run_dir_of, training_record, validation_at

    record = training_record(checkpoint)
    metrics = None
    if checkpoint and run_dir_of(checkpoint) is not None:
        metrics = validation_at(run_dir_of(checkpoint), int(desc.get("global_step", -1)), Path(checkpoint).name)
    model_cfg = json.loads((out / META_FILE).read_text(encoding="utf-8"))["model"]
    card = out / "README.md"
    card.write_text(model_card(desc, model_cfg, side, record, metrics, name), encoding="utf-8")
    _apply_umask(out)
    return card


def _save_backbone(backbone: torch.nn.Module, folder: Path) -> None:
    """``save_pretrained``, with a (never used) pooler put back when training dropped it, so that
    loading the directory with a plain AutoModel reports no missing weights."""
    restore = False
    if getattr(backbone, "pooler", "absent") is None:
        try:
            backbone.pooler = type(backbone)(backbone.config).pooler
            restore = backbone.pooler is not None
        except Exception:  # noqa: BLE001 - a model class without the add_pooling_layer default
            backbone.pooler = None
    try:
        backbone.save_pretrained(folder)
    finally:
        if restore:
            backbone.pooler = None


def _head_kind(head: torch.nn.Module) -> str:
    if isinstance(head, torch.nn.Identity):
        return "none"
    if isinstance(head, torch.nn.Linear):
        return "linear"
    return "mlp"


def _head_layers(head: torch.nn.Module) -> list[tuple[torch.nn.Linear, torch.nn.Module]]:
    """(linear, activation after it) pairs of a head: none -> [], linear -> [(l, Identity)],
    mlp (Linear, GELU, Linear) -> [(l0, GELU), (l2, Identity)]."""
    if isinstance(head, torch.nn.Identity):
        return []
    if isinstance(head, torch.nn.Linear):
        return [(head, torch.nn.Identity())]
    layers = list(head)
    out: list[tuple[torch.nn.Linear, torch.nn.Module]] = []
    for i, m in enumerate(layers):
        if isinstance(m, torch.nn.Linear):
            nxt = layers[i + 1] if i + 1 < len(layers) and not isinstance(layers[i + 1], torch.nn.Linear) else None
            out.append((m, type(nxt)() if nxt is not None else torch.nn.Identity()))
    return out


# --------------------------------------------------------------------------- command


def run_export(cfg: Any) -> Path:
    """Export the configured encoder (an ``ExportConfig``, or a DictConfig of one); returns the directory."""
    if cfg.encoder not in ENCODERS:
        raise ConfigError(f"encoder={cfg.encoder!r}: expected one of {ENCODERS}")
    if cfg.encoder == "key" and not cfg.checkpoint:
        raise ConfigError("encoder=key needs checkpoint=PATH (a base model has no key encoder)")
    enc, desc = load_encoder(checkpoint=cfg.checkpoint, model=cfg.model, encoder=cfg.encoder)
    side = "doc" if cfg.encoder == "key" else "query"
    if cfg.adapter_only:
        out = export_adapter(enc, cfg.out_dir, side=side, overwrite=bool(cfg.overwrite))
        print(f"exported the {cfg.encoder} encoder's LoRA adapter to {out}")
        return out
    out = export_encoder(enc, cfg.out_dir, side=side, source=desc, overwrite=bool(cfg.overwrite))
    write_model_card(out, desc, cfg.checkpoint, side, str(cfg.out_dir))
    print(f"exported the {cfg.encoder} encoder ({desc['source']}, dim {enc.dim}) to {out}")
    print(f"load it with: SentenceTransformer({str(out)!r})")
    return out


@hydra.main(config_path="pkg://moco_retrieval.conf", config_name="export", version_base="1.3")
@reports_user_errors("export")
def main(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("missing required config values: " + ", ".join(missing) + " (e.g. out_dir=DIR)")
    run_export(cfg)


if __name__ == "__main__":
    main()
