"""Memory of one training step on a CPU: what stays resident, and what a step adds at its peak.

A process's peak RSS covers its whole life (loading, evaluation, every run in it), so it cannot
tell two training steps apart. Two measures that can, the CPU stand-ins for a GPU's
``torch.cuda.max_memory_allocated``:

* ``resident_mib``: the bytes of every distinct tensor a run keeps between steps (parameters and
  their gradients, buffers such as the EMA copy and the queues, optimizer state), counted once
  per storage, so a key encoder that shares the frozen base weights with the trained one costs
  only its own tensors.
* ``peak_during``: how far the process's resident memory rises above its level at a step's start
  while the step runs (activations and temporaries): glibc's free lists are trimmed and
  Linux's high-water mark (``VmHWM``) reset first (``/proc/self/clear_refs``), so the mark is this
  step's. Where Linux offers no reset it returns None rather than a lifetime figure.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import re
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")
_MIB = 2**20


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.M).group(1))


def _trim() -> None:
    """Hand freed heap pages back to the OS, so an earlier step's free lists do not hide this one's."""
    name = ctypes.util.find_library("c")
    if name:
        getattr(ctypes.CDLL(name), "malloc_trim", lambda _: 0)(0)


def peak_during(fn: Callable[[], object]) -> Optional[float]:
    """The MiB the process's RSS rose above its start while ``fn()`` ran (None, with ``fn`` still
    run, where the high-water mark cannot be reset)."""
    try:
        _trim()
        _CLEAR.write_text("5")  # 5: reset VmHWM to the current RSS (Linux >= 4.0)
        start = _status_kib("VmRSS")
    except OSError:
        fn()
        return None
    fn()
    return (_status_kib("VmHWM") - start) * 1024 / _MIB


def resident_mib(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer] = ()) -> float:
    """MiB of the distinct storages behind ``modules``' parameters, gradients and buffers and ``optimizers``' state."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if torch.is_tensor(t):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    for m in modules:
        for t in (*m.parameters(), *(p.grad for p in m.parameters()), *m.buffers()):
            add(t)
    for opt in optimizers:
        for state in opt.state.values():
            for t in state.values():
                add(t)
    return sum(seen.values()) / _MIB
