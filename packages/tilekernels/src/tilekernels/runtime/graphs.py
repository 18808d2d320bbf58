"""A decode step captured once as a CUDA graph and replayed for every token (DecodeGraph), and
whole stages replayed from a graph per input shape (ShapeGraphs: GLM-ASR's encoder and prefill).

At batch 1 a step is tens of kernel launches (GPT-2) to over a hundred (GLM-ASR) whose host
cost through Python and ct.launch exceeds the GPU work several times over; a graph
replays them back to back, each kernel launched as a programmatic dependent of the one
before (see tilekernels.dependent_launch), so it is scheduled while its predecessor runs.
Everything a step reads that changes per token (its input embeddings, positions, the cache
span) lives in fixed device buffers, which the step's last kernel advances for the next.
Temporaries come from a private memory pool so no later allocation can reuse an address
the graph writes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import numpy as np

from .. import embedding, full_wait_next, get_matmul_precision
from ..logprobs import MAX_TOP
from .device import copy_to_host
from .kvcache import KVCache
from .profile import stage
from .sampler import GREEDY, Sampler


CHAIN = 8       # greedy steps a replay: longer chains gain nothing more (docs/performance.md)


def step_input(ids, positions, table, pos_table):
    """What a decode step starts from: the embeddings (B, 1, C) of tokens ids (B, 1), with those
    of their positions (B, 1) added where the model has a position table (pos_table, else None)."""
    return embedding(ids, table, None if pos_table is None else positions, pos_table)


class Chunk(NamedTuple):
    """n decode steps' tokens (n, B) and, when the steps score their tokens, the scores
    (chosen (n, B), top values (n, B, MAX_TOP), top ids (n, B, MAX_TOP): Sampler.scores)."""
    tokens: np.ndarray
    scores: tuple | None = None


@dataclass
class Replay:
    """A captured graph of n decode steps, the logits of its last step (kept: the graph writes
    them), the pinned host arrays its last nodes copy the steps' tokens (n, B) and scores into
    and, when its steps draw, the pinned (n, B) uniforms its first node copies to the device."""
    graph: object
    logits: object
    tokens: np.ndarray
    uniforms: np.ndarray | None
    scores: tuple | None = None
    device: tuple = ()      # the device arrays the graph writes its tokens and scores and reads its uniforms
                            # from, held as long as the graph: dropped, their memory went to other arrays

    @property
    def n(self) -> int:
        return len(self.tokens)


class DecodeGraph:
    """tokens(ids, positions, steps): the tokens (B,) of a continuation, chosen on the device.

    step(x) is the model's device work for one token per sequence from their embeddings x
    (B, 1, C), reading the cache span that cache.begin announces; embed = (table, pos_table or
    None) are the model's embedding tables; sampler picks the tokens (greedy by default).
    Every captured step ends in the sampler's launches (one argmax when greedy), the last of
    which also advances positions and span and gathers the chosen tokens' embeddings into the
    other of two input buffers, so steps chain on the device with no host work between them:
    chunks replays graphs of CHAIN steps (one graph launch and one token copy for CHAIN
    tokens).
    Create and call it under a non-default cupy stream (graphs cannot capture the legacy
    default stream): see device_stream. Building it runs steps, which mark tokens in the
    sampler's seen mask: start the sampler after.
    """

    def __init__(self, embed: tuple, step: Callable, cache: KVCache, sampler: Sampler | None = None):
        import cupy

        b = cache.k.shape[1]
        self.cache = cache
        self.table, self.pos_table = embed
        self.sampler = sampler or Sampler(GREEDY, cupy, b, self.table.shape[0])
        self.x = [cupy.zeros((b, 1, self.table.shape[1]), cupy.float32) for _ in range(2)]
        # a cache of the engine's slots reads each row's length from the positions (KVCache.lengths)
        self.positions = cupy.zeros(b, cupy.int64) if cache.lengths is None else cache.lengths
        self.at = self.positions.get()          # where building writes keys: each row's next column
        self.pool = cupy.cuda.MemoryPool()      # temporaries: no later allocation reuses what a graph writes
        self.queued = None                      # the event of the last replay queued (its pinned buffers)
        with stage("decode graphs"):
            self._seed(np.zeros(b, np.int64), self.at)   # compiles the seeding embedding now, not in tokens
            # the step from x[0] (into x[1]) and from x[1]; CHAIN steps from x[0] (back into x[0]) twice, so
            # that consecutive replays copy their tokens into different host arrays
            self.single = [self._capture(step, p, 1) for p in (0, 1)]
            self.chains = [self._capture(step, 0, CHAIN) for _ in range(2)]
            self._warm()

    def _warm(self) -> None:
        """Replay the first graph captured once, now. Until it has run, the graphs uploaded after
        it replay slower however often they run themselves (docs/performance.md). One replay of
        it ends that for good; a replay of another graph or eager
        steps do not; without graph.upload each graph's first replay pays its upload (why, inside
        the driver, is not known). The replay
        writes one step's keys at the cache's next slot, which the next real step overwrites,
        and advances positions and span, which every call seeds again."""
        import cupy

        self._seed(np.zeros(len(self.at), np.int64), self.at)
        stream = cupy.cuda.get_current_stream()
        self.single[0].graph.launch(stream)
        stream.synchronize()

    def _step(self, step: Callable, p: int, tokens, uniforms, scores: tuple | None):
        """One step from x[p]: its logits; the sampler's choice into tokens (B,) and, embedded,
        into x[1 - p]; their scores into scores (when the sampler's mode asks). Its first kernel
        starts once the step before has finished: kernels read earlier steps' cached keys before
        their dependency wait."""
        full_wait_next()
        logits = step(self.x[p])
        nxt = self.x[1 - p]
        self.sampler(logits, uniforms, out=tokens, positions=self.positions, counters=self.cache.span,
                     embed=(self.table, self.pos_table, nxt.reshape(nxt.shape[0], -1)))
        self.sampler.scores(logits, tokens, scores)
        return logits

    def _capture(self, step: Callable, p: int, n: int) -> Replay:
        import cupy
        import cupyx

        stream = cupy.cuda.get_current_stream()
        b = self.x[0].shape[0]
        tokens = cupy.zeros((n, b), cupy.int64)
        draws = self.sampler.draws
        u = cupy.zeros(tokens.shape, cupy.float32) if draws else [None] * n
        u_host = cupyx.zeros_pinned(tokens.shape, np.float32) if draws else None
        scores = ((cupy.zeros((n, b), cupy.float32), cupy.zeros((n, b, MAX_TOP), cupy.float32),
                   cupy.zeros((n, b, MAX_TOP), cupy.int64)) if self.sampler.mode.logprobs else None)
        outputs = (tokens, *(scores or ()))
        hosts = [cupyx.empty_pinned(a.shape, a.dtype) for a in outputs]

        def step_scores(i):
            return None if scores is None else tuple(a[i] for a in scores)
        with cupy.cuda.using_allocator(self.pool.malloc):
            self.positions.set(self.at)
            self.cache.begin(1)
            self._step(step, p, tokens[0], u[0], step_scores(0))        # compiles kernels, fills the pool
            self.cache.begin(1)
            stream.begin_capture()
            if draws:
                cupy.cuda.runtime.memcpyAsync(u.data.ptr, u_host.ctypes.data, u.nbytes,
                                              cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            for i in range(n):
                logits = self._step(step, (p + i) % 2, tokens[i], u[i], step_scores(i))
            for host, a in zip(hosts, outputs):
                copy_to_host(host, a, stream)
            graph = stream.end_capture()
        graph.upload(stream)        # not in the first replay's time
        return Replay(graph, logits, hosts[0], u_host, tuple(hosts[1:]) or None, (outputs, u))

    def _seed(self, ids, positions: np.ndarray) -> None:
        """The next step's input (x[0]) from token ids (host or device) and host positions; the
        cache span."""
        import cupy

        self.cache.begin(1)
        ids = cupy.asarray(ids, np.int64).reshape(-1, 1)
        self.positions.set(np.asarray(positions, np.int64).reshape(-1))
        self.x[0][...] = step_input(ids, self.positions[:, None], self.table, self.pos_table)

    def _launch(self, replay: Replay):
        """Queue a replay on the current stream, with the next uniforms when its steps draw
        (its pinned buffer is free: the replay of the same graph before it has been waited
        for); the event its tokens are ready at."""
        import cupy

        stream = cupy.cuda.get_current_stream()
        if replay.uniforms is not None:
            replay.uniforms[...] = self.sampler.uniforms(replay.n)
        replay.graph.launch(stream)
        self.cache.length += replay.n
        self.queued = stream.record()
        return self.queued

    def chunks(self, ids, positions: np.ndarray, steps: int) -> Pipelined:
        """The tokens the sampler picks in `steps` steps from ids (B,; host or device) at
        positions (host), a replay at a time: Chunks of n steps, as chunk_sizes cuts them.

        The first replay is queued now, each further one before the host waits for the one
        before it. Once stopped (Pipelined.stop), the replay already queued is still handed out
        and then the iteration ends. Dropping it otherwise leaves at most one replay's steps extra
        in the cache, never more than `steps`.
        """
        if self.queued is not None:     # a replay an earlier call left running: its pinned buffers
            self.queued.synchronize()   # (the stream's other work, a prefill, need not be done)
        self.sampler.sync()             # rows set since the last replay (set_row)
        self._seed(ids, positions)
        # chunk_sizes' replays: a chain ends where it began, at x[0]; consecutive replays are
        # different graphs, so a graph's pinned buffers are read before it is queued again
        replays, singles, chains = [], 0, 0
        for n in chunk_sizes(steps):
            replays.append(self.chains[chains % 2] if n == CHAIN else self.single[singles % 2])
            chains, singles = chains + (n == CHAIN), singles + (n == 1)

        def collect(launched) -> Chunk:
            replay, ready = launched
            ready.synchronize()
            scores = None if replay.scores is None else tuple(a.copy() for a in replay.scores)
            return Chunk(replay.tokens.copy(), scores)
        return Pipelined([lambda r=r: (r, self._launch(r)) for r in replays], collect)

    def tokens(self, ids: np.ndarray, positions: np.ndarray, steps: int) -> Iterator[np.ndarray]:
        """chunks' tokens a step at a time: (B,) arrays."""
        for chunk in self.chunks(ids, positions, steps):
            yield from chunk.tokens


def chunk_sizes(steps: int) -> list[int]:
    """How `steps` decode steps are replayed: two single steps, chains of CHAIN, then single steps
    (an even number of singles ahead of the chains, so that each chain starts from x[0]). Launching
    a chain costs the host about as long as several steps take on the GPU, which with nothing
    queued would wait; a single step's launch is short, and while the GPU runs the two the host
    launches the first chain."""
    lead = [1, 1] if steps >= CHAIN + 2 else []
    rest = steps - len(lead)
    return lead + [CHAIN] * (rest // CHAIN) + [1] * (rest % CHAIN)


class Pipelined:
    """collect(launch()) for each launch in order, as an iterator: the first launched now, each
    next one before this one is collected (so the device works while the caller handles a
    result). stop(): no further one is launched; the one already launched is still handed out."""

    def __init__(self, launches: list[Callable], collect: Callable):
        self.launches, self.collect, self.stopped = launches, collect, False
        self.pending, self.next_index = (launches[0](), 1) if launches else (None, 0)

    def stop(self) -> None:
        self.stopped = True

    def __iter__(self) -> "Pipelined":
        return self

    def __next__(self):
        if self.pending is None:
            raise StopIteration
        j = self.next_index
        nxt = self.launches[j]() if j < len(self.launches) and not self.stopped else None
        done, self.pending, self.next_index = self.pending, nxt, j + 1
        return self.collect(done)


class ShapeGraphs:
    """fn(*arrays) -> array on the GPU, replayed from a CUDA graph captured once per input
    shapes (and matmul precision): a stage of a few hundred kernels, an encoder pass or a
    prompt prefill, then costs one launch instead of a Python call per kernel.

    The first call of a shape runs fn eagerly (compiling its kernels), then captures it on
    a private stream and memory pool. Inputs are copied into the graph's buffers and the
    result is copied out, so it outlives the next replay. fn must read nothing else that
    changes between calls except through device memory (a KV cache's span).
    """

    def __init__(self, fn: Callable, name: str):
        self.fn, self.graphs, self.name = fn, {}, name

    def __call__(self, *arrays):
        import cupy

        key = (tuple((a.shape, a.dtype.str) for a in arrays), get_matmul_precision())
        if key not in self.graphs:
            with stage(f"{self.name} graphs"):
                self.graphs[key] = self._capture(arrays)
        inputs, out, graph, *_ = self.graphs[key]
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
        # the stream is kept with the graph: kernels' counters are per stream (last_block_counters),
        # and a stream made later at a freed one's address would share the graph's
        return inputs, out, graph, pool, stream


def graphed(xp, fn: Callable, name: str) -> Callable:
    """fn as ShapeGraphs on the GPU (its captures timed as stage '<name> graphs'), fn itself on the CPU."""
    return fn if xp is np else ShapeGraphs(fn, name)
