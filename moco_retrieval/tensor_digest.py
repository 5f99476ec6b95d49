"""One sha256 over named tensors (place, dtype, shape and bytes, in order): the checksum a
checkpoint carries (checkpoint_file.py) and the per-rank fingerprints of unsynced state
(fingerprints.py)."""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Iterator

import torch


def named_tensors(obj: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts, lists and tuples, with its place (``/key/0/...``), in order."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from named_tensors(v, f"{where}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from named_tensors(v, f"{where}/{i}")


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 (hex) over ``(name, tensor)`` pairs: each name, dtype, shape and the tensor's bytes."""
    h = hashlib.sha256()
    for where, t in named:
        h.update(f"{where}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


__all__ = ["named_tensors", "tensors_sha256"]
