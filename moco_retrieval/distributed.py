"""torch.distributed helpers: rank queries, all-gather with and without gradient, teardown, and
the exit of a rank whose peers stopped answering.

All of them are no-ops on a single process, so the same code runs with and without DDP.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the process group, ``(0, 1)`` without one."""
    return rank(), world_size()


@torch.no_grad()
def all_gather_no_grad(x: Tensor) -> Tensor:
    """Concatenate ``x`` from every rank along dim 0, in rank order (equal shapes required)."""
    if world_size() == 1:
        return x
    out = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out, dim=0)


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s contiguous block of ``n`` items: blocks in rank order,
    sizes differing by at most one, so concatenating them in rank order gives the items back."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@torch.no_grad()
def all_gather_blocks(local: Tensor, total: int) -> Tensor:
    """Every rank's ``shard_range`` block of ``total`` rows, concatenated in rank order (the
    inverse of splitting by ``shard_range``), on the tensors' device. The block sizes follow from
    ``total``, so, unlike ``all_gather_rows`` (numpy, sizes gathered first), one collective."""
    world = world_size()
    if world == 1:
        return local
    sizes = [shard_range(total, r, world) for r in range(world)]
    width = max(stop - start for start, stop in sizes)
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = all_gather_no_grad(padded).view(world, width, *local.shape[1:])
    return torch.cat([gathered[r, : stop - start] for r, (start, stop) in enumerate(sizes)])


def _comm_device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo only CPU ones
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def row_counts(n_local: int) -> list[int]:
    """Every rank's ``n_local``, in rank order."""
    if world_size() == 1:
        return [int(n_local)]
    return [int(c) for c in all_gather_no_grad(torch.tensor([int(n_local)], device=_comm_device())).tolist()]


@torch.no_grad()
def all_gather_rows(local: np.ndarray, out: np.ndarray | None = None, chunk_rows: int = 65_536) -> np.ndarray:
    """Every rank's rows ``[n_r, d]`` (float32; ``n_r`` may differ, 0 included) concatenated in
    rank order, on every rank: into ``out`` (``[sum n_r, d]``, e.g. a ``np.memmap``) or a new array.

    Sent ``chunk_rows`` rows per rank at a time, so the transfer buffers stay small whatever the
    total. ``local`` may be this rank's block of ``out`` itself (other ranks' rows land elsewhere).
    """
    counts = row_counts(len(local))
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    d = local.shape[1]
    if out is None:
        out = np.empty((int(starts[-1]), d), np.float32)
    if out.shape != (int(starts[-1]), d):
        raise ValueError(f"out has shape {out.shape}, the gathered rows {(int(starts[-1]), d)}")
    device = _comm_device() if world_size() > 1 else torch.device("cpu")
    for c in range(0, max(counts), chunk_rows):
        rows = min(chunk_rows, max(counts) - c)
        piece = torch.zeros((rows, d), dtype=torch.float32)
        mine = np.asarray(local[c : c + rows], dtype=np.float32)
        piece[: len(mine)] = torch.from_numpy(np.ascontiguousarray(mine))
        gathered = all_gather_no_grad(piece.to(device)).cpu().numpy()
        for r, n_r in enumerate(counts):
            valid = max(0, min(n_r - c, rows))
            if valid:
                out[starts[r] + c : starts[r] + c + valid] = gathered[r * rows : r * rows + valid]
    return out


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


_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)


def is_collective_timeout(e: BaseException) -> bool:
    """A collective gave up waiting for a peer (gloo: "Timed out waiting ...ms for recv")."""
    return isinstance(e, RuntimeError) and bool(_TIMEOUT.search(str(e)))


# gloo's words (and the OS's) for a peer whose process died: its sockets closed under a collective
_LOST = re.compile(r"connection (reset|closed) by peer|broken pipe|ECONNRESET|EPIPE|connection refused", re.IGNORECASE)


def is_lost_peer(e: BaseException) -> bool:
    """A collective failed because a peer's connection closed (the rank was killed or crashed)."""
    return isinstance(e, RuntimeError) and bool(_LOST.search(str(e)))


@contextmanager
def exit_when_peers_stall(timeout_s: int, step: Callable[[], int]) -> Iterator[None]:
    """A collective that timed out (a rank stopped, stuck or gone; ``trainer.process_group_timeout``)
    or whose peer's connection closed (a rank killed, e.g. SIGKILL or out of memory) ends this rank
    with one message saying what happened, status 1, instead of a traceback."""
    try:
        yield
    except RuntimeError as e:
        lost = is_lost_peer(e)
        if not (world_size() > 1 and (lost or is_collective_timeout(e))):
            raise
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        what = ("lost another rank in a collective at step {step}: its connection closed (the process was killed, "
                "crashed or ran out of memory, or its node went down)" if lost else
                "waited {timeout} s (trainer.process_group_timeout) for the other ranks in a collective at step {step} "
                "and they did not come: a rank is stopped, stuck or gone")
        raise SystemExit(
            f"[moco_retrieval] rank {rank()} of {world_size()}: " + what.format(step=step(), timeout=timeout_s)
            + f". Resume with ckpt_path=last once every rank runs. (torch.distributed: {first})"
        ) from None
