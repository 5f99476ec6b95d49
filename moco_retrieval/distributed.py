"""torch.distributed helpers: rank queries, all-gather with and without gradient, teardown.

All of them are no-ops on a single process, so the same code runs with and without DDP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


@torch.no_grad()
def all_gather_no_grad(x: Tensor) -> Tensor:
    """Concatenate ``x`` from every rank along dim 0, in rank order (equal shapes required)."""
    if world_size() == 1:
        return x
    out = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out, dim=0)


def all_gather_with_grad(x: Tensor) -> Tensor:
    """Concatenate ``x`` from every rank, in rank order, keeping the autograd graph.

    Gradients flowing into other ranks' slices are sent back to them (summed over ranks by
    ``torch.distributed.nn``'s backward), so a loss over the global batch trains every rank.
    """
    if world_size() == 1:
        return x
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x.contiguous()), dim=0)


def teardown() -> None:
    """Destroy the process group: gloo otherwise aborts at interpreter exit now and then."""
    if is_dist():
        dist.barrier()
        dist.destroy_process_group()
