"""A GPT-2 decode step captured once as a CUDA graph and replayed for every token.

At batch 1 a step is ~150 kernel launches whose host cost (~30 us each through Python and
ct.launch) exceeds the GPU work several times over; a graph replays them for ~1 us each.
Everything the step reads that changes per token (token ids, positions, the cache span)
lives in fixed device buffers refreshed before each replay. Temporaries come from a
private memory pool so no later allocation can reuse an address the graph writes.
"""
from __future__ import annotations

import numpy as np

from .model import GPT, KVCache


class DecodeGraph:
    """decode(ids (B, 1), positions (B, 1)) -> logits (B, V) on the device, one token per call.

    Must be created and called under a non-default cupy stream (graphs cannot capture the
    legacy default stream).
    """

    def __init__(self, model: GPT, cache: KVCache):
        import cupy

        b = cache.k.shape[1]
        self.model, self.cache = model, cache
        self.ids = cupy.zeros((b, 1), cupy.int64)
        self.positions = cupy.zeros((b, 1), cupy.int64)
        self.pool = cupy.cuda.MemoryPool()
        stream = cupy.cuda.get_current_stream()
        cache.begin(1)      # the warm-up writes the next position; the first real step overwrites it
        with cupy.cuda.using_allocator(self.pool.malloc):
            model.step(self.ids, self.positions, cache)        # compiles kernels, fills the pool
            stream.begin_capture()
            self.logits = model.step(self.ids, self.positions, cache)
            self.graph = stream.end_capture()

    def __call__(self, ids: np.ndarray, positions: np.ndarray):
        import cupy

        self.cache.begin(1)
        self.ids.set(np.asarray(ids, np.int64).reshape(-1, 1))
        self.positions.set(np.asarray(positions, np.int64).reshape(-1, 1))
        self.graph.launch(cupy.cuda.get_current_stream())
        self.cache.length += 1
        return self.logits
