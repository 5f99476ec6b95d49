"""Which device: the one a command was asked for (``device=auto|cpu|cuda|cuda:N``), and the one a
model's weights are on."""
from __future__ import annotations

from typing import Any, Optional

import torch


def pick_device(name: str) -> torch.device:
    """``auto``: the GPU when there is one, else the CPU; anything else as torch names it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def module_device(module: Any) -> Optional[torch.device]:
    """The device of ``module``'s first parameter; None for a module without parameters (or an
    encoder that is not a module)."""
    try:
        return next(iter(module.parameters())).device
    except (AttributeError, StopIteration, TypeError):
        return None


__all__ = ["module_device", "pick_device"]
