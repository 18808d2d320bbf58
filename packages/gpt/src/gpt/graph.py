"""A decode step captured once as a CUDA graph and replayed for every token.

At batch 1 a step is ~150 (GPT-2) to ~500 (GLM-ASR) kernel launches whose host cost (~30 us
each through Python and ct.launch) exceeds the GPU work several times over; a graph
replays them for ~1 us each. Everything the step reads that changes per token (token ids,
positions, the cache span) lives in fixed device buffers refreshed before each replay.
Temporaries come from a private memory pool so no later allocation can reuse an address
the graph writes.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np

from .kvcache import KVCache


class DecodeGraph:
    """decode(ids (B, 1), positions (B, 1)) -> logits (B, V) on the device, one token per call.

    step(ids, positions) is the model's device work for one token per sequence, reading
    the cache span that cache.begin announces. Create and call it under a non-default
    cupy stream (graphs cannot capture the legacy default stream): see device_stream.
    """

    def __init__(self, step: Callable, cache: KVCache):
        import cupy

        b = cache.k.shape[1]
        self.cache = cache
        self.ids = cupy.zeros((b, 1), cupy.int64)
        self.positions = cupy.zeros((b, 1), cupy.int64)
        self.pool = cupy.cuda.MemoryPool()
        stream = cupy.cuda.get_current_stream()
        cache.begin(1)      # the warm-up writes the next position; the first real step overwrites it
        with cupy.cuda.using_allocator(self.pool.malloc):
            step(self.ids, self.positions)                  # compiles kernels, fills the pool
            stream.begin_capture()
            self.logits = step(self.ids, self.positions)
            self.graph = stream.end_capture()

    def __call__(self, ids: np.ndarray, positions: np.ndarray):
        import cupy

        self.cache.begin(1)
        self.ids.set(np.asarray(ids, np.int64).reshape(-1, 1))
        self.positions.set(np.asarray(positions, np.int64).reshape(-1, 1))
        self.graph.launch(cupy.cuda.get_current_stream())
        self.cache.length += 1
        return self.logits


def device_stream(xp):
    """A non-default stream for GPU runs (CUDA graphs cannot capture the default one),
    ordered after everything already queued on the current stream."""
    if xp is np:
        return contextlib.nullcontext()
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    return stream


def decoder(xp, step: Callable, cache: KVCache) -> Callable:
    """The per-token step: a replayed CUDA graph on the GPU, a plain call on the CPU."""
    if xp is np:
        def plain(ids, positions):
            cache.begin(1)
            logits = step(np.asarray(ids).reshape(-1, 1), np.asarray(positions).reshape(-1, 1))
            cache.length += 1
            return logits
        return plain
    return DecodeGraph(step, cache)
