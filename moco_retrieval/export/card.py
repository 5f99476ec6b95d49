"""The model card (``README.md``) of an exported model directory, filled with what training knows,
as sentence-transformers' own trainer fills it: base model, objective and its settings, data,
steps, the held-out metrics of the exported step, and how to load it.

What a checkpoint does not hold is read from its run directory (``RUN/checkpoints/X.ckpt``):
``config.yaml`` (data) and ``metrics.csv`` (training/records.py; the validation of the exported step, else
``metrics.json`` for ``last.ckpt``). Whatever is missing is left out, never guessed. A run validated on
several ``data.eval_dirs`` gets a row per set and one of their mean.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf

from moco_retrieval.config import MEAN_SET, eval_set_names
from moco_retrieval.objectives.registry import OBJECTIVES

# the packaged backbones by their published names
KNOWN_BACKBONES = {"minilm": "sentence-transformers/all-MiniLM-L6-v2"}
SHOWN_METRICS = ("recall@1", "recall@10", "mrr@10", "ndcg@10", "map@100")


def run_dir_of(checkpoint: str | Path) -> Optional[Path]:
    p = Path(checkpoint).expanduser().resolve()
    return p.parent.parent if p.parent.name == "checkpoints" else None


def validation_at(run_dir: Path, step: int, checkpoint_name: str) -> Optional[dict[str, float]]:
    """The held-out metrics logged at ``step`` in the run's merged ``metrics.csv`` (else its CSV
    logs: a run from before the merged file); for ``last.ckpt`` the run's final ``metrics.json``
    when the CSV has none. Of several validations of the step (a resumed attempt redoes it), the last."""
    merged = run_dir / "metrics.csv"
    for path in [merged] if merged.is_file() else sorted(run_dir.glob("csv/**/metrics.csv")):
        with open(path, newline="", encoding="utf-8") as f:
            found = [row for row in csv.DictReader(f) if _validation_row(row) and int(float(row["step"])) == step]
        if found:
            return {k[4:]: float(v) for k, v in found[-1].items() if k.startswith("val/") and v}
    final = run_dir / "metrics.json"
    if checkpoint_name == "last.ckpt" and final.is_file():
        return {k[4:]: float(v) for k, v in json.loads(final.read_text(encoding="utf-8")).items() if k.startswith("val/")}
    return None


def _validation_row(row: dict) -> bool:
    """A row of validation metrics (``val/recall@1``; several sets: ``val/SET/recall@1``) at a step."""
    return bool(row.get("step")) and any(k.startswith("val/") and k.endswith("recall@1") and v for k, v in row.items())


def training_record(checkpoint: Optional[str]) -> dict[str, Any]:
    """What the card says about training: ``objective``, ``optim`` (the checkpoint's
    hyperparameters) and ``data`` (the run's config.yaml)."""
    record: dict[str, Any] = {}
    if not checkpoint:
        return record
    import torch

    # mmap: only the small hyperparameters are read, not the weights again
    hp = torch.load(Path(checkpoint).expanduser(), map_location="cpu", weights_only=True, mmap=True).get("hyper_parameters") or {}
    for key in ("objective", "optim"):
        if key in hp:
            record[key] = hp[key]
    run_dir = run_dir_of(checkpoint)
    if run_dir is None:
        return record
    config = run_dir / "config.yaml"
    if config.is_file():
        record["data"] = OmegaConf.to_container(OmegaConf.load(config).get("data", {}))
    record["run_dir"] = str(run_dir)
    return record


def _source_prompts(data: dict) -> list[str]:
    """``name: query '...', document '...'`` for each of ``data.sources`` trained with prompts of its own."""
    out = []
    for i, source in enumerate(data.get("sources") or []):
        p = source.get("prompts") or {}
        if p.get("query") or p.get("doc"):
            out.append(f"{source.get('name') or i}: query {p.get('query') or ''!r}, document {p.get('doc') or ''!r}")
    return out


def _data_line(data: dict) -> str:
    kind = data.get("kind")
    if kind == "debian":
        what = "Debian package descriptions (query: short description, document: long description, group: source package)"
    elif kind == "jsonl":
        what = f"JSONL pairs `{data.get('train_path')}`" + (f", validated on `{data['eval_dir']}`" if data.get("eval_dir") else "")
    elif kind == "beir":
        what = f"the BEIR folder `{data.get('dir')}` (qrels/{data.get('train_split')}.tsv, validated on qrels/{data.get('eval_split')}.tsv)"
    elif kind == "documents":
        views = data.get("views") or {}
        what = (f"the documents of `{data.get('path')}` alone, each drawn as a pair of views "
                f"({views.get('pairs', 'crops')}: spans of {views.get('crop_min')}-{views.get('crop_max')} of its words, "
                f"word deletion {views.get('deletion')})")
    else:
        what = f"data kind {kind!r}"
    if data.get("eval_dirs"):
        what += f"; validated on {len(data['eval_dirs'])} sets: " + ", ".join(f"`{n}`" for n in eval_set_names(data["eval_dirs"]))
    cap = data.get("max_train_examples")
    return what + (f", capped at {cap:,} pairs" if cap else "") + f"; batch size {data.get('batch_size')}"


def _settings(cfg: dict, skip: tuple = ("name",)) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in cfg.items() if k not in skip)


def _unused_warmup(optim: dict) -> str:
    """The warmup setting training did not use: ``warmup_steps`` wins when set (lightning_module)."""
    return "warmup_ratio" if optim.get("warmup_steps") else "warmup_steps"


def base_model_name(backbone: str) -> str:
    """How an export names its base model: a packaged backbone by its published name, a local
    folder by its name (not this machine's path)."""
    base = KNOWN_BACKBONES.get(Path(backbone).name if "/" in backbone else backbone, backbone)
    if backbone and base == backbone and Path(backbone).name:
        base = Path(backbone).name
    return base


def adapter_card(base: str, lora: dict, tower: dict, out_name: str) -> str:
    """The README.md of a LoRA adapter exported alone (in place of peft's blank template): its base
    model, its LoRA settings (``r``, ``alpha``, ``targets``), how the encoder pools its outputs
    (``tower``: ``pooling``, ``normalize``, ``dim``, ``query_max_len``, ``doc_max_len``) and how to load it."""
    targets = ", ".join(lora.get("targets") or []) or "peft's defaults"
    norm = "L2-normalized (cosine similarity)" if tower.get("normalize") else "not normalized (dot product)"
    return "\n".join([
        "---", "library_name: peft", f"base_model: {base}", "tags:", "- lora", "- sentence-similarity",
        "- feature-extraction", "- moco-retrieval", "---", "", f"# {out_name}", "",
        f"A LoRA adapter (r={lora.get('r')}, alpha={lora.get('alpha'):g}, on {targets}) of `{base}`, trained with "
        f"moco-retrieval as a dense-retrieval encoder: {tower.get('pooling')} pooling of the last hidden states, "
        f"{tower.get('dim')} dimensions, {norm}; queries truncated at {tower.get('query_max_len')} tokens, documents "
        f"at {tower.get('doc_max_len')}. This folder holds the adapter and the tokenizer alone: load them onto the "
        "base model (or export the merged model, adapter_only=false, for sentence-transformers).", "",
        "## Usage", "", "```python", "from peft import PeftModel", "from transformers import AutoModel, AutoTokenizer", "",
        f'model = PeftModel.from_pretrained(AutoModel.from_pretrained("{base}"), "{out_name}").eval()',
        f'tokenizer = AutoTokenizer.from_pretrained("{out_name}")',
        "```", "",
        f"Embed as in training: tokenize, run the model, {tower.get('pooling')}-pool `last_hidden_state` over the "
        f"attention mask{', then L2-normalize' if tower.get('normalize') else ''}.", ""])


def model_card(desc: dict, model_cfg: dict, side: str, record: dict, metrics: Optional[dict], out_name: str,
               onnx_files: Sequence[str] = ()) -> str:
    """The README.md text: YAML front matter for the Hugging Face hub, then the card; ``onnx_files``: the
    ONNX files the export wrote (export/onnx.py), each with its loading line."""
    base = base_model_name(str(desc.get("backbone") or model_cfg.get("backbone") or ""))
    objective = record.get("objective") or {}
    front = ["---", "library_name: sentence-transformers", "pipeline_tag: sentence-similarity",
             "tags:", "- sentence-transformers", "- sentence-similarity", "- feature-extraction", "- moco-retrieval"]
    if base:
        front.append(f"base_model: {base}")
    front.append("---")
    lines = [*front, "", f"# {out_name}", "",
             f"A dense-retrieval bi-encoder trained with moco-retrieval from `{base or 'a random init'}`: "
             f"{desc.get('dim')}-dimensional embeddings, {model_cfg.get('pooling')} pooling, head `{model_cfg.get('head')}`, "
             f"{'cosine similarity (normalized)' if model_cfg.get('normalize') else 'dot product (not normalized)'}; "
             f"queries truncated at {model_cfg.get('query_max_len')} tokens, documents at {model_cfg.get('doc_max_len')}.", ""]
    if not model_cfg.get("shared_tower", True):
        lines += ["Two towers, exported whole as a sentence-transformers `Router`: `encode_query` runs the query "
                  "tower (route `query`), `encode_document` and plain `encode` the document tower (route `document`).", ""]
    lines += ["## Training", ""]
    if desc.get("source") == "checkpoint":
        lines.append(f"- Exported: the {'query' if side == 'query' else 'momentum key'} encoder at step "
                     f"{desc.get('global_step')} (epoch {desc.get('epoch')}) of `{Path(str(desc.get('path'))).name}`")
    else:
        lines.append("- Exported: the untrained base encoder (no checkpoint)")
    if objective:
        name = objective.get("name")
        text = OBJECTIVES[name].description if name in OBJECTIVES else name
        lines.append(f"- Objective: {text} (`objective={name}`); {_settings(objective)}")
    if record.get("optim"):
        lines.append(f"- Optimizer: AdamW, {_settings(record['optim'], skip=('name', _unused_warmup(record['optim'])))}")
    if record.get("data"):
        lines.append(f"- Data: {_data_line(record['data'])}")
    if desc.get("prompts"):  # encode_query / encode_document put them before the texts
        p = desc["prompts"]
        lines.append(f"- Prompts: query {p.get('query', '')!r}, document {p.get('doc', '')!r} "
                     "(the model's `prompts`; `encode_query` / `encode_document` apply them)")
    own = _source_prompts(record.get("data") or {})
    if own:  # validation and this model apply data.prompts; these trained only their source's rows
        lines.append("- Source prompts (not in the model's `prompts`, which are `data.prompts`, those validation used): "
                     + "; ".join(own) + ". Put them before texts like that source's yourself")
    lines.append("")
    sets = eval_set_names((record.get("data") or {}).get("eval_dirs")) if metrics else []
    if len(sets) > 1:
        lines += _sets_lines(sets, metrics, record.get("data") or {}, desc.get("global_step"))
        metrics = {k[len(MEAN_SET) + 1:]: v for k, v in metrics.items() if k.startswith(f"{MEAN_SET}/")}
    elif metrics:
        shown = [k for k in SHOWN_METRICS if k in metrics]
        lines += [f"## Held-out metrics (validation at step {desc.get('global_step')})", "",
                  "| " + " | ".join(shown) + " | mean unrelated cosine |",
                  "|" + "---|" * (len(shown) + 1),
                  "| " + " | ".join(f"{metrics[k]:.4f}" for k in shown)
                  + f" | {metrics.get('unrelated_cos_mean', float('nan')):+.3f} |", "",
                  _pool_line(metrics, record.get("data") or {}, out_name), ""]
    lines += _matryoshka_lines(objective.get("matryoshka_dims") or desc.get("matryoshka_dims"), metrics, out_name)
    lines += ["## Usage", "", "```python", "from sentence_transformers import SentenceTransformer", "",
              f'model = SentenceTransformer("{out_name}")',
              'queries = model.encode_query(["resize images from the command line"])',
              'docs = model.encode_document(["ImageMagick converts, edits and composes images."])',
              "print(model.similarity(queries, docs))", "```", "",
              "`encode_query` / `encode_document` truncate as in training; the moco-retrieval commands "
              f"also read this folder: `python -m moco_retrieval.evaluate model_dir={out_name}`.", ""]
    lines += _onnx_lines(onnx_files, out_name)
    return "\n".join(lines)


def _onnx_lines(files: Sequence[str], out_name: str) -> list[str]:
    """The ONNX section: each file and the line that loads it (sentence-transformers' ``backend="onnx"``)."""
    if not files:
        return []
    from moco_retrieval.export.onnx import INT8_FILE, loading_line

    what = {INT8_FILE: "its weights dynamically quantized to int8 (smaller and faster on a CPU; embeddings close "
                       "in cosine, not equal)"}
    return ["## ONNX", "", "The transformer is also here in ONNX form, run by onnxruntime (`pip install "
            "sentence-transformers[onnx]`); tokenizer, pooling, prompts and `truncate_dim` stay as above:", "",
            *[f"- `{f}`" + (f": {what[f]}" if f in what else ": the same model in fp32") for f in files], "",
            "```python", "from sentence_transformers import SentenceTransformer", "",
            *[f"model = {loading_line(out_name, f)}" for f in files], "```", ""]


def _sets_lines(sets: list[str], metrics: dict, data: dict, step: Any) -> list[str]:
    """The held-out metrics of several evaluation sets: a row per set (with its pool's size), then their mean."""
    shown = [k for k in SHOWN_METRICS if f"{MEAN_SET}/{k}" in metrics]

    def row(name: str, pool: str) -> str:
        return f"| {name} | {pool} | " + " | ".join(
            f"{metrics[f'{name}/{k}']:.4f}" if f"{name}/{k}" in metrics else "" for k in shown) + " |"

    def pool(name: str) -> str:
        q, d = metrics.get(f"{name}/pool_queries"), metrics.get(f"{name}/pool_docs")
        return f"{int(q):,} / {int(d):,}" if q is not None and d is not None else ""

    caps = ", ".join(f"`data.{k}={data[k]}`" for k in ("max_eval_queries", "max_eval_docs") if data.get(k))
    return [f"## Held-out metrics (validation at step {step}, {len(sets)} sets)", "",
            "| set | queries / documents | " + " | ".join(shown) + " |", "|" + "---|" * (len(shown) + 2),
            *[row(n, pool(n)) for n in sets], row(MEAN_SET, "(unweighted)"), "",
            "Measured during training on each set of `data.eval_dirs`" + (f", capped by {caps}" if caps else "")
            + "; the mean counts each set once, whatever its size.", ""]


def _pool_line(metrics: dict, data: dict, out_name: str) -> str:
    """What the held-out numbers were measured on: the pool's size as validated, and whether the
    run capped it (``data.max_eval_queries`` / ``data.max_eval_docs``: fewer distractors, higher numbers)."""
    size = (f"{int(metrics['pool_queries']):,} queries against {int(metrics['pool_docs']):,} documents"
            if "pool_queries" in metrics and "pool_docs" in metrics else "a pool whose size the run did not record")
    caps = {k: data.get(k) for k in ("max_eval_queries", "max_eval_docs") if data.get(k)}
    if caps:
        given = ", ".join(f"`data.{k}={v}`" for k, v in caps.items())
        return (f"Measured during training on the validation pool: {size}, capped by {given}; not the full held-out "
                "set, where the same model scores lower (more documents compete). "
                f"`python -m moco_retrieval.evaluate model_dir={out_name} data.max_eval_queries=null "
                "data.max_eval_docs=null` measures the full pool.")
    if not data:
        return f"Measured during training on the validation pool: {size} (the run's data settings were not found)."
    return f"Measured during training on the full held-out pool: {size}."


def _matryoshka_lines(dims: Optional[list], metrics: Optional[dict], out_name: str) -> list[str]:
    """A Matryoshka model's section: the prefixes it was trained for, their held-out metrics when
    validated (``dim<d>/<metric>``), and how to load it truncated."""
    if not dims:
        return []
    lines = ["## Matryoshka dimensions", "",
             f"Trained with the loss summed over the first {', '.join(str(d) for d in dims)} dimensions "
             f"(`objective.matryoshka_dims`), so the embeddings can be truncated to any of them: "
             f'`SentenceTransformer("{out_name}", truncate_dim={min(dims)})`.', ""]
    rows = [(d, {m: metrics[f"dim{d}/{m}"] for m in SHOWN_METRICS if f"dim{d}/{m}" in metrics})
            for d in dims] if metrics else []
    rows = [(d, m) for d, m in rows if m]
    if rows:
        shown = [m for m in SHOWN_METRICS if m in rows[0][1]]
        lines += ["| dimensions | " + " | ".join(shown) + " |", "|" + "---|" * (len(shown) + 1)]
        lines += [f"| {d} | " + " | ".join(f"{m[k]:.4f}" for k in shown) + " |" for d, m in rows]
        lines.append("")
    return lines


__all__ = ["adapter_card", "base_model_name", "model_card", "training_record", "validation_at", "run_dir_of",
           "KNOWN_BACKBONES"]
