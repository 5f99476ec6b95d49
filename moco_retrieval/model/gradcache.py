"""Gradient caching: a large contrastive batch on the memory of a small one.

Gao, Zhang, Han and Callan, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup" (RepL4NLP 2021; github.com/luyug/GradCache).

**Two batch sizes, not one.**

* The *contrastive batch* is ``data.batch_size`` (per rank): the rows whose documents (and hard
  negatives) every query is scored against. It alone decides the loss and its gradient; grad
  cache does not change either.
* The *chunk* is ``model.grad_cache_chunk``: how many texts go through the encoder at once.
  It decides the peak activation memory (one chunk's graph at a time), not the loss.

So ``data.batch_size=512 model.grad_cache_chunk=32`` trains with 511 in-batch negatives per
query on the activation memory of 32 texts, at the cost of a second forward pass (about a third
more compute). ``trainer.accumulate_grad_batches`` is a third, unrelated thing: it sums the
gradients of several contrastive batches, each with its own negatives, and does not enlarge the
contrastive batch.

**Algorithm.** The loss ``L(e_1..e_B)`` depends on the encoder's parameters only through the
embeddings ``e_i = f(x_i)``, so ``dL/dθ = sum_i (de_i/dθ)^T dL/de_i``:

1. embed the batch chunk by chunk *without* a graph (and record each chunk's random state);
2. compute the loss on all embeddings and back-propagate it to the embeddings only: ``dL/de``;
3. re-run each chunk *with* a graph, replaying its recorded random state (so dropout draws the
   same masks as in step 1, and the embeddings and their gradients are the ones of step 2), and
   back-propagate ``dL/de`` of its rows: ``torch.autograd.backward(e_chunk, dL/de_chunk)``. The
   parameter gradients add up over chunks.

Here steps 2-3 ride on autograd: :meth:`GradCache.embed` returns the embeddings from a custom
autograd function, so the ordinary ``loss.backward()`` (Lightning's automatic optimization,
with its gradient clipping, accumulation, schedulers and hooks unchanged) stops at them with
``dL/de`` and runs step 3 in the function's backward. The ``re-forward in backward`` pattern is
that of reentrant activation checkpointing (``torch.utils.checkpoint``); autocast settings of the
forward are re-entered for the re-run.

Objectives: the in-batch objective (documents and hard negatives are re-run too) and MoCo (the
query side is re-run; keys come from the momentum encoder without a graph and are only embedded
in chunks). Under DDP the chunks' re-runs fire every parameter's gradient hook once per chunk
inside one backward; plain DDP then averages wrong gradients without any error (checked by
hand: off by O(1) on two gloo ranks), so ``RetrievalModule.on_fit_start`` switches DDP to its static graph (``static_graph=True``
semantics: hooks counted in the first iteration, one all-reduce when all have fired).

Exactness: with the random states replayed, the parameter gradients equal those of the same loss
computed in one graph over the same chunks (identical dropout masks), to float rounding. Without
dropout they equal those of one full-batch forward (chunks are trimmed to their own longest text;
padding never changes a text's embedding, up to float rounding).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

Side = dict  # {"texts": list[str], optional "input_ids"/"attention_mask": Long[B, L], ...}


def side_rows(side: Side) -> int:
    if side.get("texts") is not None:
        return len(side["texts"])
    for v in side.values():
        if torch.is_tensor(v) and v.dim() >= 1:
            return int(v.shape[0])
    raise ValueError("cannot tell the number of rows of a side without texts or tensors")


def _trim_padding(part: Side) -> Side:
    """Drop trailing columns that are padding in every row (right padding only)."""
    mask = part.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2 or mask.shape[1] == 0:
        return part
    length = int(mask.sum(1).max())
    if length >= mask.shape[1] or bool(mask[:, length:].any()):
        return part
    return {k: (v[:, :length] if torch.is_tensor(v) and v.dim() == 2 and v.shape == mask.shape else v) for k, v in part.items()}


def split_side(side: Side, chunk: int, trim: bool = True) -> list[Side]:
    """``side`` cut into sub-batches of ``chunk`` rows (texts and row-aligned tensors sliced)."""
    if chunk < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk}")
    n = side_rows(side)
    parts = []
    for s in range(0, n, chunk):
        part: Side = {}
        for k, v in side.items():
            if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == n:
                part[k] = v[s : s + chunk]
            elif isinstance(v, (list, tuple)) and len(v) == n:
                part[k] = list(v[s : s + chunk])
            else:
                part[k] = v
        parts.append(_trim_padding(part) if trim else part)
    return parts


class RandState:
    """The CPU random state (and the current CUDA device's, on a GPU) at construction;
    ``with state.replay():`` runs its block from that state and restores the state around it."""

    def __init__(self, device: torch.device):
        self.cpu = torch.get_rng_state()
        self.cuda_device: Optional[int] = None
        if device.type == "cuda":
            self.cuda_device = torch.cuda.current_device() if device.index is None else device.index
            self.cuda = torch.cuda.get_rng_state(self.cuda_device)

    @contextmanager
    def replay(self) -> Iterator[None]:
        devices = [self.cuda_device] if self.cuda_device is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda_device is not None:
                torch.cuda.set_rng_state(self.cuda, self.cuda_device)
            yield


def autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    """The autocast settings now (CPU's and ``device_type``'s), to re-enter later with ``autocast_to``."""
    types = ["cpu"] + ([device_type] if device_type != "cpu" else [])
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


@contextmanager
def autocast_to(states: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    ctxs = [torch.autocast(device_type=t, dtype=d, enabled=e) for t, e, d in states]
    for c in ctxs:
        c.__enter__()
    try:
        yield
    finally:
        for c in reversed(ctxs):
            c.__exit__(None, None, None)


class _CachedEmbed(torch.autograd.Function):
    """Forward: embed chunks without a graph. Backward: re-embed each chunk with a graph (random
    state replayed) and back-propagate its rows of the incoming gradient into the parameters."""

    @staticmethod
    def forward(ctx, anchor: Tensor, fn: Callable[[Side], Tensor], chunks: list[Side], device: torch.device, replay: bool):
        ctx.fn, ctx.chunks, ctx.replay = fn, chunks, replay
        ctx.autocast = autocast_state(device.type)
        ctx.states, outs = [], []
        for c in chunks:
            ctx.states.append(RandState(device))
            outs.append(fn(c))
        ctx.sizes = [int(o.shape[0]) for o in outs]
        return torch.cat(outs).detach()

    @staticmethod
    def backward(ctx, grad: Tensor):
        offset = 0
        with torch.enable_grad(), autocast_to(ctx.autocast):
            for c, state, n in zip(ctx.chunks, ctx.states, ctx.sizes):
                with state.replay() if ctx.replay else nullcontext():
                    emb = ctx.fn(c)
                if emb.requires_grad:
                    torch.autograd.backward(emb, grad[offset : offset + n].to(emb.dtype))
                del emb  # this chunk's graph is freed before the next chunk runs
                offset += n
        return None, None, None, None, None


class GradCache:
    """Embeds sides of a batch in chunks of ``chunk_size`` texts (see the module docstring).

    ``embed(fn, side)`` returns ``fn(side)``'s embeddings ``[B, d]`` as if computed in one call,
    but keeps no activations: the gradient reaching them is pushed into ``fn``'s parameters chunk
    by chunk during the backward pass. ``replay_random_state=False`` is for tests only (it shows
    what the replay is for: dropout then draws new masks in the re-run and gradients are wrong).
    """

    def __init__(self, chunk_size: int, replay_random_state: bool = True):
        if int(chunk_size) < 1:
            raise ValueError(f"model.grad_cache_chunk must be >= 1, got {chunk_size}")
        self.chunk_size = int(chunk_size)
        self.replay_random_state = replay_random_state

    def embed(self, fn: Callable[[Side], Tensor], side: Side, *, device: Optional[torch.device] = None,
              grad: bool = True) -> Tensor:
        """Embeddings of ``side``; with ``grad`` (and grad mode on) differentiable as described."""
        chunks = split_side(side, self.chunk_size)
        if not (grad and torch.is_grad_enabled()):
            return torch.cat([fn(c) for c in chunks])
        device = device or _device_of(side)
        anchor = torch.empty(0, device=device, requires_grad=True)  # makes the output require grad
        return _CachedEmbed.apply(anchor, fn, chunks, device, self.replay_random_state)


def _device_of(side: Side) -> torch.device:
    for v in side.values():
        if torch.is_tensor(v):
            return v.device
    return torch.device("cpu")


__all__ = ["GradCache", "RandState", "split_side", "side_rows"]
