"""The engine's cache manager: a KV cache of max_batch slots, one a running request.

Slots, not pages: slot b holds its request's keys at columns [0, length[b]), the row's own
positions, so every kernel that reads a row (flash attention in the prefill, decode attention
in a step) splits and sums its keys at the same places whatever runs beside it and whenever it
joined: a request's logits are the same alone and in any batch. A decode step reads each row's
length from the device (DecodeGraph's positions), so one captured graph per batch bucket serves
every step. Paging would spare the columns past each row's end, at the price of gather-reading
attention kernels; with rows of similar length (GLM-ASR windows) a slot wastes little.
"""
from __future__ import annotations

import numpy as np

from .kvcache import KVCache


class Slots:
    def __init__(self, cache: KVCache):
        self.cache = cache
        self.rows, self.capacity = cache.k.shape[1], cache.k.shape[3]
        self.length = np.zeros(self.rows, np.int64)     # keys cached, per slot
        self.free = list(range(self.rows))

    def take(self) -> int:
        """The lowest free slot (so the running rows stay in the smallest batch bucket)."""
        self.free.sort()
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        """The slot is free; until reused its row decodes from column 0 (computed, ignored)."""
        self.length[slot] = 0
        self.free.append(slot)

    def view(self, rows: int) -> KVCache:
        """The first `rows` slots as a cache of their own (a batch bucket) sharing the memory, with
        a per-row lengths buffer of its own (its decode graph's positions)."""
        c = self.cache
        xp = np if isinstance(c.kv_start, np.ndarray) else _cupy()
        return KVCache(c.k[:, :rows], c.v[:, :rows], c.span, c.kv_start[:rows], c.rope,
                       lengths=xp.zeros(rows, np.int64))


def _cupy():
    import cupy

    return cupy
