"""Negative-cache refresh: every training step, a few queued keys are re-encoded by the current key
encoder and written over their stale versions.

Queued keys come from past key encoders, and the older a key, the further it sits from what the
current encoder would make of its text (and that drift lets the space narrow into a cone: memory.py).
Lindgren et al., "Efficient Training of Retrieval Models using Negative Cache" (NeurIPS 2021), keep
a large cache of possibly stale document embeddings as negatives and update a small fraction of it
every iteration, and show that this small fraction suffices for fast convergence. Here the cache
is the objective's queue: ``QueueRefresh`` keeps the token ids of every queued key, slot for slot,
and each training step re-encodes ``per_step`` of the queue's negatives, drawn uniformly without
replacement, with the current EMA key encoder (the queue's key space stays one encoder's), before
that step's logits are computed. Ids, groups and enqueue steps (which set the ``max_age`` window)
do not change; each slot's encoding step does, and ``{prefix}_key_age`` reports the negatives' mean
age since encoding (``{prefix}_age`` stays the age since enqueue).

The draw depends only on the step, the micro-batch within it and the queue's state (a generator
seeded by them, not the global one), so a resumed run and every rank draw the same slots. Under DDP
each rank encodes its block of the drawn documents and the new keys are all-gathered in rank order,
so every rank writes the same keys. Tokens are stored as int32 with padding as -1 (the attention
mask is ``tokens >= 0``), in a buffer checkpoints carry.

Default (the objectives' ``queue_refresh``): 0, off. Each refreshed key costs one forward of its
text by the key encoder, without gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from moco_retrieval.distributed import all_gather_blocks, all_gather_no_grad, rank, shard_range, world_size

PAD = -1
SALT = {"query": 0x51, "doc": 0xD0C}  # the two queues of one objective draw independently


def token_rows(side: dict, width: int) -> Tensor:
    """A tokenized batch side (input_ids, attention_mask [n, L], L <= width) as int32 rows [n, width],
    padding as -1."""
    ids, mask = side["input_ids"], side["attention_mask"]
    if ids.shape[1] > width:
        raise ValueError(f"{ids.shape[1]} tokens per text, but the queue stores at most {width}")
    rows = torch.where(mask.bool(), ids, torch.full_like(ids, PAD)).to(torch.int32)
    return nn.functional.pad(rows, (0, width - rows.shape[1]), value=PAD)


def side_of(rows: Tensor) -> dict:
    """Stored rows back as a batch side the encoder takes (columns no row uses dropped)."""
    mask = rows >= 0
    used = mask.any(dim=0)
    return {"input_ids": rows[:, used].clamp(min=0).long(), "attention_mask": mask[:, used].long()}


class QueueRefresh(nn.Module):
    """The texts of ``queue``'s keys as tokens (``width`` per text) and ``per_step`` re-encodings a step.

    The objective that owns the queue calls :meth:`store` with the slots each enqueue wrote,
    :meth:`inputs` when the module asks for the texts to re-encode (before the step's forward) and
    :meth:`write` with their new keys at the start of its forward.
    """

    def __init__(self, queue, per_step: int, width: int, kind: str):
        super().__init__()
        self._queue = (queue,)  # the objective's queue, not a submodule here: its state is saved once
        self.per_step, self.kind = int(per_step), kind
        self.register_buffer("queue_tokens", torch.full((queue.size, width), PAD, dtype=torch.int32))
        self.register_buffer("queue_encoded_steps", torch.full((queue.size,), -1, dtype=torch.long))
        self._drawn: Tensor | None = None  # the slots of the last draw, until their keys are written
        self._draw_at: tuple[int, int] = (-1, 0)  # (step, micro-batch within it) of the last draw

    @property
    def queue(self):
        return self._queue[0]

    @property
    def drawn(self) -> Tensor | None:
        """The slots of the last draw whose keys are not written yet (None: none pending)."""
        return self._drawn

    @torch.no_grad()
    def store(self, slots: Tensor, sides: list[dict], step: int) -> None:
        """Keep the tokens of the keys just enqueued in ``slots`` (the queue's return value):
        ``sides``, this rank's tokenized texts in the order of its keys, all-gathered in rank order
        as the keys were."""
        width = self.queue_tokens.shape[1]
        rows = all_gather_no_grad(torch.cat([token_rows(s, width) for s in sides]).to(self.queue_tokens.device))
        rows = rows[rows.shape[0] - slots.shape[0] :]  # a batch larger than the queue keeps its last rows
        self.queue_tokens[slots] = rows
        self.queue_encoded_steps[slots] = step

    def draw(self, step: int) -> Tensor | None:
        """The slots to re-encode at ``step``: ``per_step`` negatives (all, when fewer), or None."""
        n = self.queue.fill
        if n == 0:
            return None
        micro = self._draw_at[1] + 1 if self._draw_at[0] == step else 0
        self._draw_at = (step, micro)
        gen = torch.Generator().manual_seed(((SALT[self.kind] * 1_000_003 + step) * 1009 + micro) % (2**63 - 1))
        picked = torch.randperm(n, generator=gen)[: min(self.per_step, n)]
        return self.queue.window_slots()[picked.to(self.queue_tokens.device)]

    def inputs(self, step: int) -> dict | None:
        """This rank's block of the texts drawn at ``step``, tokenized; None when the queue is empty.
        Remembers the draw for :meth:`write`."""
        self._drawn = self.draw(step)
        if self._drawn is None:
            return None
        if not self.sharded(self._drawn.shape[0]):
            return side_of(self.queue_tokens[self._drawn])
        start, stop = shard_range(self._drawn.shape[0], rank(), world_size())
        return side_of(self.queue_tokens[self._drawn[start:stop]])

    @staticmethod
    def sharded(n: int) -> bool:
        """Whether the ranks split ``n`` drawn texts (fewer than one per rank: every rank encodes all)."""
        return world_size() > 1 and n >= world_size()

    @torch.no_grad()
    def write(self, keys: Tensor, step: int) -> None:
        """Write the new keys of this rank's block of the last draw (all-gathered: every rank's)."""
        if self._drawn is None:
            raise RuntimeError("QueueRefresh.write without a draw: inputs() was not called for this step")
        slots, self._drawn = self._drawn, None
        keys = keys.detach()
        self.queue.overwrite(slots, all_gather_blocks(keys, slots.shape[0]) if self.sharded(slots.shape[0]) else keys)
        self.queue_encoded_steps[slots] = step

    def stats(self, step: int, prefix: str = "queue") -> dict[str, float]:
        """``{prefix}_key_age``: the negatives' mean age in steps since their keys were encoded."""
        if self.queue.fill == 0:
            return {f"{prefix}_key_age": 0.0}
        return {f"{prefix}_key_age": step - int(self.queue.window(self.queue_encoded_steps).sum()) / self.queue.fill}

