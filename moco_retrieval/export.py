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
(``model.shared_tower=false``: ICoL, two-tower in-batch) both towers are exported, as a
sentence-transformers ``Router`` with a "query" route (the query tower) and a "document" route
(the document tower; also plain ``encode``'s): ``encode_query`` / ``encode_document`` use the right
tower, and ``evaluate`` / ``search model_dir=`` rebuild both.

Supported: ``backbone_kind=transformer`` (fine-tuned, frozen or LoRA backbone). A
``bag_of_wordpieces`` backbone is refused with an explanation. LoRA adapters are merged into the
exported backbone (a plain Hugging Face model); ``adapter_only=true`` writes the adapter alone
(peft's files and the tokenizer: ``PeftModel.from_pretrained(base, DIR)``). ``pooling=last``
(decoder backbones) is sentence-transformers' ``lasttoken``; the saved tokenizer appends the
end-of-text token as in training.

``out_dir`` must be missing or empty; ``overwrite=true`` replaces an earlier export there, removing
only the entries its ``moco_retrieval.json`` lists (other files stay), and refuses a folder that is
not an export. The export is written beside ``out_dir`` first and moved in when complete.

Keys: ExportConfig in config.py (``conf/export.yaml``). The loaders (checkpoint, model directory)
are in ``moco_retrieval/model/loading.py``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from moco_retrieval.command import command
from moco_retrieval.config import register_configs
from moco_retrieval.errors import ConfigError, OutputExistsError
from moco_retrieval.model.loading import META_FILE, load_encoder
from moco_retrieval.model.lora import merged_backbone, save_adapter
from moco_retrieval.model.momentum import ENCODERS

register_configs()
FORMAT_VERSION = 1  # of META_FILE (since "files" was added, it lists the export's entries)
# what exports wrote before META_FILE listed it: sentence-transformers' files and module folders, ours
EXPORT_ENTRIES = ["1_Pooling", "2_Dense", "2_Normalize", "3_Dense", "3_Normalize", "4_Normalize", "README.md",
                  "config.json", "config_sentence_transformers.json", "model.safetensors", "modules.json",
                  "sentence_bert_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
                  "vocab.txt", META_FILE]
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
    """Write ``encoder``'s ``side`` tower (both towers, as a query / document ``Router``, when it
    has two) as a sentence-transformers directory (see the module docstring); returns the directory."""
    if getattr(encoder, "backbone_kind", "transformer") != "transformer":
        raise ConfigError(
            "export supports backbone_kind=transformer; a bag_of_wordpieces encoder has no transformer "
            "layers for sentence-transformers to run (evaluate and search use it directly from the checkpoint)"
        )
    return _install(Path(out_dir).expanduser(), overwrite, lambda folder: _write_export(encoder, folder, side, source))


def _install(out: Path, overwrite: bool, write: Callable[[Path], list[str]]) -> Path:
    """``write`` (folder -> the names it wrote) into a folder beside ``out``, then moved in: a failed
    export leaves ``out`` as it was. What an earlier export there listed is replaced (earlier_export)."""
    replaced = earlier_export(out, overwrite)  # (refused here, before anything is written)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".moco-export-", dir=out.parent) as staging:
        written = write(Path(staging))
        out.mkdir(exist_ok=True)
        for name in replaced:
            _remove(out / name)
        for name in written:
            os.replace(Path(staging) / name, out / name)
    _apply_umask([out, *(out / name for name in written)])
    return out


def earlier_export(out: Path, overwrite: bool) -> list[str]:
    """The entries of ``out`` an export will replace: none for a missing or empty folder; with
    ``overwrite``, those an earlier export wrote there (its META_FILE lists them). Refused
    (OutputExistsError naming out_dir): a non-empty folder without ``overwrite``, a file, and a folder
    that is not an export (nothing of the user's is deleted)."""
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"out_dir={out}: a file; expected a folder for the exported model")
    if not out.exists() or not any(out.iterdir()):
        return []
    if not overwrite:
        raise OutputExistsError(f"out_dir={out} exists and is not empty (overwrite=true replaces an earlier export "
                                "there; or choose another out_dir)")
    if not (out / META_FILE).is_file():
        raise OutputExistsError(
            f"out_dir={out} holds files but no {META_FILE}: not an export of this project, so overwrite=true "
            "does not touch it (it replaces only what an export wrote). Choose another out_dir, or empty this one")
    meta = json.loads((out / META_FILE).read_text(encoding="utf-8"))
    listed = meta.get("files") or EXPORT_ENTRIES  # (an export from before the list: the names exports write)
    return [name for name in listed if (out / name).exists() or (out / name).is_symlink()]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _write_export(encoder: Any, folder: Path, side: str, source: Optional[dict]) -> list[str]:
    """The export's files in ``folder`` (META_FILE lists them, itself included); their names."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Router

    towers = {"query": encoder.tower_for("query"), "document": encoder.tower_for("doc")}
    if encoder.shared_tower:
        towers = {"": encoder.tower_for(side)}
    with tempfile.TemporaryDirectory(prefix="moco-export-") as tmp:
        routes = {route: _tower_modules(encoder, tower, Path(tmp) / (route or "tower")) for route, tower in towers.items()}
        modules = routes[""] if encoder.shared_tower else [Router.for_query_document(routes["query"], routes["document"])]
        if encoder.normalize:
            modules.append(Normalize())
        prompts, default_prompt = encoder.prompts.sentence_transformers()
        st = SentenceTransformer(modules=modules, device="cpu",
                                 similarity_fn_name="cosine" if encoder.normalize else "dot",
                                 prompts=prompts, default_prompt_name=default_prompt)
        st.save(str(folder))
    tower = towers["" if encoder.shared_tower else "query"]
    cfg = {
        "backbone_kind": "transformer",
        "pooling": tower.pooling,
        "head": _head_kind(tower.head),
        "head_dim": int(encoder.dim),
        "normalize": bool(encoder.normalize),
        "query_max_len": int(encoder.query_max_len),
        "doc_max_len": int(encoder.doc_max_len),
        "shared_tower": bool(encoder.shared_tower),
    }
    files = sorted({p.name for p in folder.iterdir()} | {META_FILE})
    meta = {"format_version": FORMAT_VERSION, "model": cfg, "side": side, "source": source or {}, "files": files,
            "prompts": encoder.prompts.to_dict()}
    if (source or {}).get("matryoshka_dims"):  # trained for these prefixes (SentenceTransformer(truncate_dim=d))
        meta["matryoshka_dims"] = list(source["matryoshka_dims"])
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return files


def _tower_modules(encoder: Any, tower: Any, folder: Path) -> list[torch.nn.Module]:
    """One tower as sentence-transformers modules: Transformer (its backbone, saved to ``folder``
    with the tokenizer), Pooling, and a Dense module per linear layer of its head."""
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer

    folder.mkdir(parents=True)
    _save_backbone(merged_backbone(tower.backbone), folder)
    encoder.tokenizer.save_pretrained(folder)
    modules: list[torch.nn.Module] = [
        Transformer(str(folder), max_seq_length=int(encoder.doc_max_len), query_length=int(encoder.query_max_len),
                    document_length=int(encoder.doc_max_len)),
        Pooling(int(encoder.hidden_size), pooling_mode=ST_POOLING[tower.pooling]),
    ]
    for lin, act in _head_layers(tower.head):
        dense = Dense(lin.in_features, lin.out_features, bias=lin.bias is not None, activation_function=act)
        with torch.no_grad():
            dense.linear.weight.copy_(lin.weight)
            if lin.bias is not None:
                dense.linear.bias.copy_(lin.bias)
        modules.append(dense)
    return modules


def export_adapter(encoder: Any, out_dir: str | Path, *, side: str = "query", overwrite: bool = False) -> Path:
    """Write ``encoder``'s ``side`` LoRA adapter alone, with the tokenizer (``adapter_only=true``),
    under the same out_dir rules as :func:`export_encoder`."""
    tower = encoder.tower_for(side)
    if not isinstance(tower.head, torch.nn.Identity):
        raise ConfigError("adapter_only=true would leave out the trained head (model.head): export the merged model")
    return _install(Path(out_dir).expanduser(), overwrite, lambda folder: _write_adapter(encoder, tower, folder))


def _write_adapter(encoder: Any, tower: Any, folder: Path) -> list[str]:
    """peft's adapter files and the tokenizer in ``folder``; META_FILE marks them as an adapter alone
    (so overwrite=true may replace them, and our loaders refuse them as a model)."""
    save_adapter(tower.backbone, folder)
    encoder.tokenizer.save_pretrained(folder)
    files = sorted({p.name for p in folder.iterdir()} | {META_FILE})
    meta = {"format_version": FORMAT_VERSION, "adapter_only": True, "files": files}
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return files


def _apply_umask(paths: list[Path]) -> None:
    """Ordinary permissions (0666 / 0777 less the umask) on what an export wrote (``paths`` and all
    below them; nothing else in out_dir): some writers (the safetensors file) create private 0600
    files, which another user or a serving container cannot read."""
    umask = os.umask(0o022)
    os.umask(umask)
    for top in paths:
        for p in [top, *(top.rglob("*") if top.is_dir() and not top.is_symlink() else [])]:
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
    card = out / "README.md"  # (an entry the export lists: sentence-transformers wrote its generic card there)
    card.write_text(model_card(desc, model_cfg, side, record, metrics, name), encoding="utf-8")
    _apply_umask([card])
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
    earlier_export(Path(cfg.out_dir).expanduser(), bool(cfg.overwrite))  # refused before the model loads
    enc, desc = load_encoder(checkpoint=cfg.checkpoint, model=cfg.model, encoder=cfg.encoder)
    side = "doc" if cfg.encoder == "key" else "query"
    if cfg.adapter_only:
        out = export_adapter(enc, cfg.out_dir, side=side, overwrite=bool(cfg.overwrite))
        print(f"exported the {cfg.encoder} encoder's LoRA adapter to {out}")
        return out
    out = export_encoder(enc, cfg.out_dir, side=side, source=desc, overwrite=bool(cfg.overwrite))
    write_model_card(out, desc, cfg.checkpoint, side, str(cfg.out_dir))
    towers = "its query and document towers, as a Router" if not enc.shared_tower else "one tower"
    print(f"exported the {cfg.encoder} encoder ({desc['source']}, dim {enc.dim}; {towers}) to {out}")
    print(f"load it with: SentenceTransformer({str(out)!r})")
    return out


@command("export")
def main(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("missing required config values: " + ", ".join(missing) + " (e.g. out_dir=DIR)")
    run_export(cfg)


if __name__ == "__main__":
    main()
