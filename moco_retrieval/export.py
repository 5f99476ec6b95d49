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

``encoder=query`` (default) exports the query-side encoder that training optimised;
``encoder=key`` the momentum (EMA) key encoder of a MoCo checkpoint. With separate towers
(``model.shared_tower=false``) the query tower (or, for ``encoder=key``, the key encoder's
document tower) is exported: a single tower serves both sides in sentence-transformers.

Supported: ``backbone_kind=transformer`` (fine-tuned or frozen backbone). A
``bag_of_wordpieces`` backbone is refused with an explanation.

The checkpoint and model-directory loaders used by ``evaluate`` and ``search`` live here too.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING, DictConfig, OmegaConf

from moco_retrieval.config import ModelConfig, register_configs

META_FILE = "moco_retrieval.json"
FORMAT_VERSION = 1
ENCODER_CHOICES = ("query", "key")


# --------------------------------------------------------------------------- loading models


def model_config(node: Any) -> ModelConfig:
    """A ``ModelConfig`` from a dataclass, DictConfig or plain dict (strict: unknown keys fail)."""
    if isinstance(node, ModelConfig):
        return node
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))


def load_checkpoint(path: str | Path) -> dict:
    """A Lightning checkpoint of ``RetrievalModule`` (tensors and plain containers only)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint={path}: no such file")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise OSError(f"checkpoint={path}: cannot read it as a checkpoint ({type(e).__name__}: {e})") from e
    if "state_dict" not in ckpt or "model" not in (ckpt.get("hyper_parameters") or {}):
        raise ValueError(
            f"checkpoint={path}: not a moco_retrieval training checkpoint (expected state_dict and "
            "hyper_parameters.model)"
        )
    return ckpt


def load_checkpoint_encoder(path: str | Path, encoder: str = "query") -> tuple[torch.nn.Module, dict]:
    """The ``TextEncoder`` of a training checkpoint: its query encoder, or (``encoder="key"``) its
    momentum key encoder. Returns ``(encoder, description)``."""
    from moco_retrieval.model.encoder import build_encoder

    if encoder not in ENCODER_CHOICES:
        raise ValueError(f"encoder={encoder!r}: expected one of {ENCODER_CHOICES}")
    ckpt = load_checkpoint(path)
    cfg = model_config(ckpt["hyper_parameters"]["model"])
    prefix = "encoder." if encoder == "query" else "key_encoder.key_encoder."
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise ValueError(
            f"checkpoint={path} has no {'key' if encoder == 'key' else 'query'} encoder weights"
            + (" (in-batch objective or model.key_encoder=query: use encoder=query)" if encoder == "key" else "")
        )
    enc = build_encoder(cfg)
    enc.load_state_dict(state, strict=True)
    enc.eval()
    desc = {
        "source": "checkpoint",
        "path": str(Path(path).expanduser().resolve()),
        "encoder": encoder,
        "global_step": int(ckpt.get("global_step", -1)),
        "epoch": int(ckpt.get("epoch", -1)),
        **_arch(cfg, enc),
    }
    return enc, desc


def _arch(cfg: ModelConfig, enc: Any) -> dict:
    return {
        "backbone": str(cfg.path or cfg.backbone),
        "backbone_kind": cfg.backbone_kind,
        "pooling": cfg.pooling,
        "head": cfg.head,
        "dim": int(getattr(enc, "dim", 0)),
        "normalize": bool(cfg.normalize),
        "query_max_len": int(cfg.query_max_len),
        "doc_max_len": int(cfg.doc_max_len),
    }


def load_model_dir(path: str | Path, fallback: Optional[ModelConfig] = None) -> tuple[torch.nn.Module, dict]:
    """An encoder from a model directory: one written by :func:`export_encoder` (rebuilt exactly),
    or any local Hugging Face model directory, built with ``fallback``'s pooling/head/normalize."""
    from moco_retrieval.model.encoder import build_encoder

    d = Path(path).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"model_dir={path}: no such directory")
    meta_path = d / META_FILE
    if not meta_path.is_file():
        if fallback is None:
            raise FileNotFoundError(f"model_dir={path}: no {META_FILE} (not written by moco_retrieval.export)")
        cfg = model_config({**OmegaConf.to_container(OmegaConf.structured(fallback)), "path": str(d)})
        enc = build_encoder(cfg)
        enc.eval()
        return enc, {"source": "model_dir", "path": str(d.resolve()), "exported": False, **_arch(cfg, enc)}
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    cfg = model_config({**meta["model"], "backbone": str(d), "path": None, "frozen_backbone": False,
                        "feature_cache_dir": None, "shared_tower": True})
    enc = build_encoder(cfg)
    head = enc.tower_for("query").head
    dense_dirs = [d / m["path"] for m in json.loads((d / "modules.json").read_text()) if m["type"].endswith("Dense")]
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    if len(linears) != len(dense_dirs):
        raise ValueError(f"model_dir={path}: {len(dense_dirs)} Dense modules for a head with {len(linears)} layers")
    for lin, dd in zip(linears, dense_dirs):
        sd = _read_dense(dd)
        with torch.no_grad():
            lin.weight.copy_(sd["linear.weight"])
            if lin.bias is not None:
                lin.bias.copy_(sd["linear.bias"])
    enc.eval()
    return enc, {"source": "model_dir", "path": str(d.resolve()), "exported": True,
                 "exported_from": meta.get("source", {}), **_arch(cfg, enc)}


def _read_dense(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)


def load_encoder(
    *, checkpoint: Optional[str] = None, model_dir: Optional[str] = None, model: Any = None, encoder: str = "query"
) -> tuple[torch.nn.Module, dict]:
    """The encoder of a checkpoint, of an exported model directory, or (neither) the untrained
    base encoder described by ``model`` (a ModelConfig)."""
    if checkpoint and model_dir:
        raise ValueError("give checkpoint=PATH or model_dir=PATH, not both")
    if checkpoint:
        return load_checkpoint_encoder(checkpoint, encoder)
    fallback = model_config(model) if model is not None else ModelConfig()
    if model_dir:
        return load_model_dir(model_dir, fallback)
    from moco_retrieval.model.encoder import build_encoder

    enc = build_encoder(fallback)
    enc.eval()
    return enc, {"source": "base", **_arch(fallback, enc)}


def describe_spec(spec: str) -> dict[str, Optional[str]]:
    """``"base"``, a checkpoint file or a model directory -> keyword arguments of :func:`load_encoder`."""
    if spec in ("base", ""):
        return {}
    p = Path(spec).expanduser()
    if p.is_dir():
        return {"model_dir": spec}
    if p.is_file():
        return {"checkpoint": spec}
    raise FileNotFoundError(f"{spec!r}: not 'base', a checkpoint file or a model directory")


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
        _save_backbone(tower.backbone, tmp_dir)
        encoder.tokenizer.save_pretrained(tmp_dir)
        modules: list[torch.nn.Module] = [
            Transformer(
                str(tmp_dir),
                max_seq_length=int(encoder.doc_max_len),
                query_length=int(encoder.query_max_len),
                document_length=int(encoder.doc_max_len),
            ),
            Pooling(int(encoder.hidden_size), pooling_mode="cls" if tower.pooling == "cls" else "mean"),
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
        st = SentenceTransformer(modules=modules, device="cpu",
                                 similarity_fn_name="cosine" if encoder.normalize else "dot")
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
    meta = {"format_version": FORMAT_VERSION, "model": cfg, "side": side, "source": source or {}}
    (out / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


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


@dataclass
class ExportConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # the base encoder when no checkpoint
    checkpoint: Optional[str] = None  # a training checkpoint (.ckpt)
    encoder: str = "query"  # query | key (the momentum key encoder of a MoCo checkpoint)
    out_dir: str = MISSING  # the model directory to write
    overwrite: bool = False


def store_command(name: str, schema: type, groups: dict[str, str], *, quiet: bool) -> None:
    """Register a command's primary config ``name``: its schema, the default ``conf/`` group
    options, then the command line. ``quiet``: no Hydra output folder or log file (the command
    writes where it is told)."""
    from hydra.core.config_store import ConfigStore

    register_configs()
    cs = ConfigStore.instance()
    cs.store(name=f"{name}_schema", node=schema)
    defaults: list[Any] = [f"{name}_schema", *({g: o} for g, o in groups.items()), "_self_"]
    node: dict[str, Any] = {"defaults": defaults}
    if quiet:
        defaults.append({"override hydra/job_logging": "stdout"})
        node["hydra"] = {"run": {"dir": "."}, "output_subdir": None, "job": {"chdir": False}}
    cs.store(name=name, node=node)


def register() -> None:
    store_command("export_command", ExportConfig, {"model": "minilm"}, quiet=True)


register()


def run_export(cfg: Any) -> Path:
    if cfg.encoder not in ENCODER_CHOICES:
        raise SystemExit(f"encoder={cfg.encoder!r}: expected one of {ENCODER_CHOICES}")
    if cfg.encoder == "key" and not cfg.checkpoint:
        raise SystemExit("encoder=key needs checkpoint=PATH (a base model has no key encoder)")
    enc, desc = load_encoder(checkpoint=cfg.checkpoint, model=cfg.model, encoder=cfg.encoder)
    side = "doc" if cfg.encoder == "key" else "query"
    out = export_encoder(enc, cfg.out_dir, side=side, source=desc, overwrite=bool(cfg.overwrite))
    print(f"exported the {cfg.encoder} encoder ({desc['source']}, dim {enc.dim}) to {out}")
    print(f"load it with: SentenceTransformer({str(out)!r})")
    return out


def _main() -> None:
    import hydra

    @hydra.main(config_path="pkg://moco_retrieval.conf", config_name="export_command", version_base="1.3")
    def main(cfg: DictConfig) -> None:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise SystemExit("missing required config values: " + ", ".join(missing) + " (e.g. out_dir=DIR)")
        run_export(cfg)

    main()


if __name__ == "__main__":
    _main()
