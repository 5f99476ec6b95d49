"""Where an export goes: ``out_dir`` must be missing or empty, or hold an earlier export that
``overwrite=true`` replaces (only the entries its ``moco_retrieval.json`` lists; a folder that is
not an export is refused). The export is written beside ``out_dir`` first and moved in when
complete, with ordinary permissions."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from moco_retrieval.errors import OutputExistsError
from moco_retrieval.files import claim_output_dir, ordinary_mode, remove_entries
from moco_retrieval.model.loading import META_FILE

# what exports wrote before META_FILE listed it: sentence-transformers' files and module folders, ours
EXPORT_ENTRIES = ["1_Pooling", "2_Dense", "2_Normalize", "3_Dense", "3_Normalize", "4_Normalize", "README.md",
                  "config.json", "config_sentence_transformers.json", "model.safetensors", "modules.json",
                  "sentence_bert_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
                  "vocab.txt", META_FILE]


def install_export(out: Path, overwrite: bool, write: Callable[[Path], list[str]]) -> Path:
    """``write`` (folder -> the names it wrote) into a folder beside ``out``, then moved in: a failed
    export leaves ``out`` as it was. What an earlier export there listed is replaced (earlier_export)."""
    replaced = earlier_export(out, overwrite)  # (refused here, before anything is written)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".moco-export-", dir=out.parent) as staging:
        written = write(Path(staging))
        out.mkdir(exist_ok=True)
        remove_entries(out, replaced)
        for name in written:
            os.replace(Path(staging) / name, out / name)
    apply_umask([out, *(out / name for name in written)])
    return out


def earlier_export(out: Path, overwrite: bool) -> list[str]:
    """The entries of ``out`` an export replaces (files.claim_output_dir): with ``overwrite``, those
    an earlier export wrote there (its META_FILE lists them)."""
    def listed(folder: Path):
        if not (folder / META_FILE).is_file():
            return None
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
        return meta.get("files") or EXPORT_ENTRIES  # (an export from before the list: the names exports write)

    return claim_output_dir(out, "out_dir", overwrite, listed, "export")


def apply_umask(paths: list[Path]) -> None:
    """Ordinary permissions (0666 / 0777 less the umask) on what an export wrote (``paths`` and all
    below them; nothing else in out_dir): some writers (the safetensors file) create private 0600
    files, which another user or a serving container cannot read."""
    for top in paths:
        for p in [top, *(top.rglob("*") if top.is_dir() and not top.is_symlink() else [])]:
            if not p.is_symlink():
                os.chmod(p, ordinary_mode(p.is_dir()))


__all__ = ["EXPORT_ENTRIES", "apply_umask", "earlier_export", "install_export"]
