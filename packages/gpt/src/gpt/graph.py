"""A decode step captured once as a CUDA graph and replayed for every token (DecodeGraph), and
whole stages replayed from a graph per input shape (ShapeGraphs: GLM-ASR's encoder and prefill).

At batch 1 a step is ~60 (GPT-2) to ~140 (GLM-ASR) kernel launches whose host cost (~30 us
each through Python and ct.launch) exceeds the GPU work several times over; a graph
replays them back to back, each kernel launched as a programmatic dependent of the one
before (see tilekernels._arrays.launch), so it is scheduled while its predecessor runs. Everything the step reads that changes per token (token ids,
positions, the cache span) lives in fixed device buffers refreshed before each replay.
Temporaries come from a private memory pool so no later allocation can reuse an address
the graph writes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import numpy as np

import tilekernels as tk

from .kvcache import KVCache


class DecodeGraph:
    """decode(ids (B, 1), positions (B, 1)) -> logits (B, V) on the device, one token per call.

    step(ids, positions) is the model's device work for one token per sequence, reading
    the cache span that cache.begin announces. The captured graph also takes the argmax
    of the logits and advances ids, positions and span to it on the device, so greedy
    decoding chains replays with no host work in between (see greedy). The step is captured
    twice, reading token ids from one buffer and writing the next ids to the other, and the
    two graphs alternate: a step's tokens are copied to the host on a stream of their own
    while the next step runs, instead of between steps. Create and call it under a
    non-default cupy stream (graphs cannot capture the legacy default stream): see
    device_stream.
    """

    def __init__(self, step: Callable, cache: KVCache):
        import cupy

        b = cache.k.shape[1]
        self.cache = cache
        self.ids = [cupy.zeros((b, 1), cupy.int64) for _ in range(2)]   # graph p reads ids[p], writes ids[1 - p]
        self.positions = cupy.zeros((b, 1), cupy.int64)
        self.parity = 0         # the graph the next step replays
        self.copies = cupy.cuda.Stream(non_blocking=True)
        self.pools = [cupy.cuda.MemoryPool() for _ in range(2)]
        self.graphs, self.logits = [], []
        stream = cupy.cuda.get_current_stream()
        for p, pool in enumerate(self.pools):
            cache.begin(1)      # the warm-up writes the next position; the first real step overwrites it
            with cupy.cuda.using_allocator(pool.malloc):
                self._step(step, p)                         # compiles kernels, fills the pool
                cache.begin(1)
                stream.begin_capture()
                self.logits.append(self._step(step, p))
                self.graphs.append(stream.end_capture())

    def _step(self, step: Callable, p: int):
        logits = step(self.ids[p], self.positions)
        tk.argmax(logits, out=self.ids[1 - p][:, 0])       # the next step's input ids
        tk.increment(self.positions, self.cache.span)
        return logits

    def launch(self):
        """Replay one step from the ids, positions and span already on the device; returns
        its logits and the (B,) token ids it chose (device arrays its graph rewrites when
        it next runs)."""
        import cupy

        p = self.parity
        self.graphs[p].launch(cupy.cuda.get_current_stream())
        self.cache.length += 1
        self.parity = 1 - p
        return self.logits[p], self.ids[1 - p][:, 0]

    def _seed(self, ids: np.ndarray, positions: np.ndarray) -> None:
        """Host values of the next step's token ids, positions and cache span."""
        self.cache.begin(1)
        self.ids[self.parity].set(np.asarray(ids, np.int64).reshape(-1, 1))
        self.positions.set(np.asarray(positions, np.int64).reshape(-1, 1))

    def __call__(self, ids: np.ndarray, positions: np.ndarray):
        self._seed(ids, positions)
        return self.launch()[0]

    def greedy(self, ids: np.ndarray, positions: np.ndarray, steps: int) -> Iterator[np.ndarray]:
        """The (B,) argmax tokens of `steps` steps starting from ids at positions.

        Each replay feeds its own argmax to the next; the host reads every token through
        pinned memory one step behind the GPU, so the GPU never waits for the host. A step's
        tokens are copied on the side stream while the next step runs (that step only reads
        them); the step after, which overwrites them, is launched once the copy is done.
        Stopping early leaves at most one extra step in the cache.
        """
        import cupy
        import cupyx

        self._seed(ids, positions)
        stream = cupy.cuda.get_current_stream()
        host = [cupyx.empty_pinned(self.ids[0].shape[:1], np.int64) for _ in range(2)]
        ready = [None, None]

        def issue(s: int) -> None:
            _, tokens = self.launch()
            self.copies.wait_event(stream.record())
            tokens.get(stream=self.copies, out=host[s % 2], blocking=False)
            ready[s % 2] = self.copies.record()

        if steps > 0:
            issue(0)
        for s in range(steps):
            if s + 1 < steps:
                issue(s + 1)
            ready[s % 2].synchronize()
            yield host[s % 2].copy()


class ShapeGraphs:
    """fn(*arrays) -> array on the GPU, replayed from a CUDA graph captured once per input
    shapes (and matmul precision): a stage of a few hundred kernels, an encoder pass or a
    prompt prefill, then costs one launch instead of a Python call per kernel.

    The first call of a shape runs fn eagerly (compiling its kernels), then captures it on
    a private stream and memory pool. Inputs are copied into the graph's buffers and the
    result is copied out, so it outlives the next replay. fn must read nothing else that
    changes between calls except through device memory (a KV cache's span).
    """

    def __init__(self, fn: Callable):
        self.fn, self.graphs = fn, {}

    def __call__(self, *arrays):
        import cupy

        key = (tuple((a.shape, a.dtype.str) for a in arrays), tk.get_matmul_precision())
        if key not in self.graphs:
            self.graphs[key] = self._capture(arrays)
        inputs, out, graph, _ = self.graphs[key]
        for buf, a in zip(inputs, arrays):
            buf[...] = a
        graph.launch(cupy.cuda.get_current_stream())
        return out.copy()

    def _capture(self, arrays):
        import cupy

        pool = cupy.cuda.MemoryPool()
        current = cupy.cuda.get_current_stream()
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.wait_event(current.record())
        with cupy.cuda.using_allocator(pool.malloc), stream:
            inputs = [a.copy() for a in arrays]
            self.fn(*inputs)                    # compiles every kernel, fills the pool
            stream.begin_capture()
            out = self.fn(*inputs)
            graph = stream.end_capture()
        current.wait_event(stream.record())
        return inputs, out, graph, pool


def graphed(xp, fn: Callable) -> Callable:
    """fn as ShapeGraphs on the GPU, fn itself on the CPU."""
    return fn if xp is np else ShapeGraphs(fn)


def device_stream(xp):
    """A non-default stream for GPU runs (CUDA graphs cannot capture the default one),
    ordered after everything already queued on the current stream."""
    if xp is np:
        return contextlib.nullcontext()
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    return stream


class PlainDecoder:
    """DecodeGraph's calls for numpy arrays: each step simply runs (CPU)."""

    def __init__(self, step: Callable, cache: KVCache):
        self.step, self.cache = step, cache

    def __call__(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        self.cache.begin(1)
        logits = self.step(np.asarray(ids).reshape(-1, 1), np.asarray(positions).reshape(-1, 1))
        self.cache.length += 1
        return logits

    def greedy(self, ids: np.ndarray, positions: np.ndarray, steps: int) -> Iterator[np.ndarray]:
        positions = np.asarray(positions).reshape(-1, 1)
        for s in range(steps):
            ids = self(ids, positions + s).argmax(-1)
            yield ids


def decoder(xp, step: Callable, cache: KVCache) -> DecodeGraph | PlainDecoder:
    """The per-token step: a replayed CUDA graph on the GPU, a plain call on the CPU."""
    return PlainDecoder(step, cache) if xp is np else DecodeGraph(step, cache)
