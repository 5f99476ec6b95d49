"""Run a function on N CPU processes joined by a gloo process group, and collect what each returns."""
from __future__ import annotations

import os
import socket
import sys

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, folder):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(fn(*args, rank, world), os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Success only (an exception above propagates to mp.spawn as usual). Skipping interpreter
    # finalization: gloo's worker threads can still hold tensors with Python references then, and
    # destroying them aborts the process ("terminate called without an active exception",
    # pytorch/pytorch#179291), failing a test whose result is already saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def on_ranks(fn, args: tuple, world: int, folder, weights_only: bool = True) -> list:
    """``fn(*args, rank, world)`` on ``world`` gloo ranks (``fn`` importable: module level); the
    results, in rank order (``weights_only=False`` for results holding numpy arrays)."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, free_port(), fn, args, str(folder)), nprocs=world, join=True)
    return [torch.load(os.path.join(str(folder), f"rank{r}.pt"), weights_only=weights_only) for r in range(world)]
