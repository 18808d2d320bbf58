"""The model runner: the engine's device work. Prefill of newly admitted requests (ragged prompts,
right padded, so each row's keys sit at its own positions from column 0, in a staging cache whose
keys are then copied into their slots) and decode steps of the running slots, replayed from CUDA
graphs captured per batch bucket (the smallest power of two holding every running slot; rows
beyond the running ones are computed and ignored). On the CPU the same steps simply run
(PlainDecoder).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

import tilekernels as tk
from tilekernels.logprobs import MAX_TOP

from .device import to_host
from .graphs import Chunk, DecodeGraph, Pipelined, ShapeGraphs, chunk_sizes, step_input
from .kvcache import KVCache
from .protocol import DecoderModel
from .sampler import Mode, Sampler
from .sequence import Request
from .slots import Slots

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
GRAPHED_PREFILL = 2048      # padded prompt tokens up to which a prefill replays a graph (launch bound below)


class PlainDecoder:
    """DecodeGraph's chunks for numpy arrays: the steps simply run (CPU), a chunk as the GPU
    replays them, each computed before the one before it is handed out, as the GPU queues it."""

    def __init__(self, embed: tuple, step: Callable, cache: KVCache, sampler: Sampler):
        (self.table, self.pos_table), self.step, self.cache, self.sampler = embed, step, cache, sampler

    def chunks(self, ids: np.ndarray, positions: np.ndarray, steps: int) -> Pipelined:
        at = {"ids": np.asarray(ids).reshape(-1, 1), "pos": np.asarray(positions).reshape(-1, 1)}

        def run(n: int) -> Chunk:
            out, scores = [], []
            for _ in range(n):
                self.cache.begin(1)
                self.cache.lengths[...] = at["pos"][:, 0]
                logits = self.step(step_input(at["ids"], at["pos"], self.table, self.pos_table))
                out.append(self.sampler.pick(logits))
                scores.append(self.sampler.scores(logits, out[-1]))
                at["ids"], at["pos"] = out[-1].reshape(-1, 1), at["pos"] + 1
            return Chunk(np.array(out), None if scores[0] is None else tuple(map(np.stack, zip(*scores))))
        return Pipelined([lambda n=n: run(n) for n in chunk_sizes(steps)], lambda out: out)


def bucket(rows: int) -> int:
    return next(b for b in BUCKETS + (rows,) if b >= rows)


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class ModelRunner:
    """Runs a DecoderModel for the engine over `rows` slots of `capacity` positions."""

    def __init__(self, model: DecoderModel, rows: int, capacity: int, kv_dtype=np.float32):
        self.model, self.xp, self.kv_dtype = model, model.xp, kv_dtype
        self.slots = Slots(model.new_cache(rows, capacity, kv_dtype))
        self.vocab = model.embedding_tables[0].shape[0]
        self.sampler = Sampler(None, self.xp, rows, self.vocab)
        self.decoders: dict[tuple[int, Mode], DecodeGraph | PlainDecoder] = {}
        self.stage: KVCache | None = None
        self.prefills: dict[int, Callable] = {}

    # ------------------------------------------------------------------ prefill
    def _staging(self, rows: int, length: int) -> KVCache:
        """A staging cache of at least rows x length (grown by powers of two: few regrowths, and
        each drops the prefill graphs captured on the old one)."""
        s = self.stage
        if s is None or s.k.shape[1] < rows or s.k.shape[3] < length:
            self.stage = self.prefills = None
            have = (0, 0) if s is None else (s.k.shape[1], s.k.shape[3])
            self.stage = self.model.new_cache(max(rows, have[0]), max(bucket(length), 64, have[1]), self.kv_dtype)
            self.prefills = {}
        return self.stage

    def _prefill_fn(self, rows: int) -> Callable:
        """model.step over the first `rows` staging rows, graphed on the GPU per input shape."""
        if rows not in self.prefills:
            s, xp = self.stage, self.xp
            view = KVCache(s.k[:, :rows], s.v[:, :rows], s.span, s.kv_start[:rows], s.rope,
                           last=xp.zeros(rows, np.int64))
            step = lambda x: self.model.step(x, view)      # noqa: E731
            self.prefills[rows] = (view, step, ShapeGraphs(step, "prefill") if xp is not np else None)
        return self.prefills[rows]

    def prefill(self, requests: list[Request]) -> "FirstTokens":
        """Run the prompts of requests just given their slots: their keys into their slots, and
        the first token of each, in order (on the device, and copied to the host as the GPU
        gets there: the decode steps can be queued before the host has them)."""
        xp, slots = self.xp, self.slots
        lengths = np.array([len(r.prompt) for r in requests])
        width = round_up(int(lengths.max()), 16)
        rows = bucket(len(requests)) if width * bucket(len(requests)) <= GRAPHED_PREFILL else len(requests)
        stage = self._staging(rows, width)
        ends = np.full(rows, 1)                     # rows past the requests: one token of padding
        ends[:len(requests)] = lengths
        x = self._inputs(requests, ends, width, rows)
        view, step, graph = self._prefill_fn(rows)
        view.last[...] = xp.asarray(ends - 1)
        view.length = 0
        view.begin(width)
        scored = None
        if any(r.sampling.prompt_logprobs is not None for r in requests):
            view.every = True           # every position's logits, eagerly (no graph keeps them)
            try:
                logits = step(x)
            finally:
                view.every = False
            scored = self._prompt_scores(requests, logits)
            logits = logits[xp.arange(rows), xp.asarray(ends - 1)]
        else:
            logits = (graph if graph is not None and rows * width <= GRAPHED_PREFILL else step)(x)
        for i, r in enumerate(requests):
            n = len(r.prompt)
            for src, dst in zip(stage.raw(), slots.cache.raw()):
                dst[:, r.slot, :, :n] = src[:, i, :, :n]
            slots.length[r.slot] = n
        return self._first_tokens(requests, logits[:len(requests)], scored)

    def _prompt_scores(self, requests: list[Request], logits) -> tuple:
        """Scores (sampler.scores' arrays, on the device) of every prompt position's next
        prompt token under logits (rows, width, V): (rows, width) and (rows, width, MAX_TOP)
        (one launch over all positions: columns past a prompt's end score a stand-in token)."""
        rows, width, vocab = logits.shape
        nxt = np.zeros((rows, width), np.int64)
        for i, r in enumerate(requests):
            nxt[i, :len(r.prompt) - 1] = r.prompt[1:]
        flat = tk.logprobs(logits.reshape(rows * width, vocab), self.xp.asarray(nxt.reshape(-1)), min(MAX_TOP, vocab))
        return tuple(a.reshape(rows, width, *a.shape[1:]) for a in flat)

    def _inputs(self, requests: list[Request], ends: np.ndarray, width: int, rows: int):
        """The right-padded input embeddings (rows, width, C): prompt i in columns [0, ends[i]),
        its own embeds where it brings them (GLM-ASR's audio prompts), else its ids embedded."""
        xp, m = self.xp, self.model
        if all(r.embeds is not None for r in requests):
            x = xp.zeros((rows, width, requests[0].embeds.shape[-1]), np.float32)
        else:
            ids = np.full((rows, width), m.eos_ids[0], np.int64)
            for i, r in enumerate(requests):
                ids[i, :ends[i]] = r.prompt
            positions = np.minimum(np.arange(width)[None, :], ends[:, None] - 1)
            x = m.embed(xp.asarray(ids), xp.asarray(positions))
        for i, r in enumerate(requests):
            if r.embeds is not None:
                x[i, :ends[i]] = xp.asarray(r.embeds)
        return x

    def _first_tokens(self, requests: list[Request], logits, prompt_scores: tuple | None = None) -> "FirstTokens":
        """Each request's first token, drawn with its own generator, and its scores; its row of
        the sampler (settings, repetition mask, generator) set up for the decode steps."""
        for r in requests:
            self.sampler.set_row(r.slot, r.sampling, r.prompt, r.rng)
        tokens, scores = self.sampler.pick_rows(logits, [r.slot for r in requests])
        return FirstTokens(tokens, scores, prompt_scores)

    def release(self, slot: int) -> None:
        """A slot left free: its row greedy again (a free row changes no batch's mode)."""
        self.sampler.clear_row(slot)

    # ------------------------------------------------------------------ decode
    def _decoder(self, rows: int, mode: Mode):
        """The decode steps of the first `rows` slots in one sampling mode, built on first use
        (a capture runs steps: at each row's next column, which the next real step overwrites,
        and marking the repetition mask, which is restored)."""
        key = (rows, mode)
        if key not in self.decoders:
            m, sampler = self.model, self.sampler.rows(rows, mode)
            view = self.slots.view(rows)
            view.lengths[...] = self.xp.asarray(self.slots.length[:rows])   # building writes at the next columns
            step = lambda x: m.step(x, view)      # noqa: E731
            marks = self.sampler.marks()
            if self.xp is np:
                self.decoders[key] = PlainDecoder(m.embedding_tables, step, view, sampler)
            else:
                self.decoders[key] = DecodeGraph(m.embedding_tables, step, view, sampler)
            self.sampler.restore(marks)
        return self.decoders[key]

    def decode(self, requests: dict[int, Request], ids: dict[int, int], steps: int,
               new: tuple | None = None) -> Pipelined:
        """Up to `steps` tokens of the running slots from their last tokens (ids by slot; new:
        (slots, FirstTokens) of rows just prefilled), a replay at a time: (n, rows) arrays, the
        first queued now, until the iterator is stopped (DecodeGraph.chunks). The caller
        advances the lengths of the slots still running by each chunk's steps (Engine)."""
        slots, xp = self.slots, self.xp
        rows = min(bucket(max(requests) + 1), slots.rows)
        dec = self._decoder(rows, self.sampler.mode_of(range(rows)))
        dec.cache.length = 0
        first = np.zeros(rows, np.int64)
        positions = slots.length[:rows].copy()       # free rows: 0 (their columns are overwritten on reuse)
        for slot, tok in ids.items():
            first[slot] = tok
        if new is not None:
            first = xp.asarray(first)
            first[xp.asarray(np.asarray(new[0], np.int64))] = new[1].device
        return dec.chunks(first, positions, steps)


class FirstTokens:
    """A prefill's first tokens on the device, and on the host with their scores and the
    prompts' (host(): (tokens, scores, prompt scores), copies queued behind the pick, waited for
    alone, not behind the decode steps queued after it; scores None where none was asked)."""

    def __init__(self, device, scores: tuple | None = None, prompt_scores: tuple | None = None):
        self.device = device
        self._host = (device, scores, prompt_scores)
        self._ready = None
        if isinstance(device, np.ndarray):
            return
        import cupy

        stream = cupy.cuda.get_current_stream()
        self._host = (to_host(device, stream), *(None if s is None else tuple(to_host(a, stream) for a in s)
                                                 for s in (scores, prompt_scores)))
        self._ready = stream.record()

    def host(self) -> tuple:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host
