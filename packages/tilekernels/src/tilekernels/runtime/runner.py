"""The model runner: a model's prefill and decode steps over one KV cache, yielding tokens.

On the GPU the prefill is replayed from a CUDA graph per prompt shape and the decode steps
from DecodeGraph's chained graphs; on the CPU every step simply runs (PlainDecoder).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .device import device_stream
from .graphs import DecodeGraph, graphed, step_input
from .kvcache import KVCache
from .protocol import DecoderModel
from .sampling import GREEDY, Sampler, Sampling


class PlainDecoder:
    """DecodeGraph's tokens for numpy arrays: each step simply runs (CPU)."""

    def __init__(self, embed: tuple, step: Callable, cache: KVCache, sampler: Sampler | None = None):
        (self.table, self.pos_table), self.step, self.cache = embed, step, cache
        self.sampler = sampler or Sampler(GREEDY, np, cache.k.shape[1], self.table.shape[0])

    def tokens(self, ids: np.ndarray, positions: np.ndarray, steps: int) -> Iterator[np.ndarray]:
        positions = np.asarray(positions).reshape(-1, 1)
        for s in range(steps):
            self.cache.begin(1)
            logits = self.step(step_input(np.asarray(ids).reshape(-1, 1), positions + s, self.table, self.pos_table))
            self.cache.length += 1
            ids = self.sampler.pick(logits)
            yield ids


def decoder(xp, embed: tuple, step: Callable, cache: KVCache,
            sampler: Sampler | None = None) -> DecodeGraph | PlainDecoder:
    """The per-token steps from embeddings (embed: the tables, (table, pos_table or None)),
    their tokens picked by sampler (greedy by default): replayed CUDA graphs on the GPU,
    plain calls on the CPU."""
    return (PlainDecoder if xp is np else DecodeGraph)(embed, step, cache, sampler)


@dataclass
class _Slot:
    """A cache with what was built on it: kept while requests fit it."""
    batch: int
    sampling: Sampling
    cache: KVCache
    sampler: Sampler
    prefill: Callable
    decode: DecodeGraph | PlainDecoder


class ModelRunner:
    """Runs a model's token steps. The KV cache, its captured prefill and decode graphs and the
    sampler are kept across calls while the batch size and the sampling settings stay the same
    and the prompt fits: a decode graph's capture costs as much as hundreds of steps, so
    GLM-ASR's requests all reuse one."""

    def __init__(self, model: DecoderModel):
        self.model = model
        self._slot: _Slot | None = None

    def _fit(self, batch: int, length: int, sampling: Sampling) -> _Slot:
        s = self._slot
        if s is None or s.batch != batch or s.sampling != sampling or s.cache.k.shape[3] < length:
            self._slot = s = None           # free the old cache and graphs first
            m = self.model
            cache = m.new_cache(batch, length)
            table = m.embedding_tables[0]
            sampler = Sampler(sampling, m.xp, batch, table.shape[0])
            step = lambda x: m.step(x, cache)        # noqa: E731
            s = self._slot = _Slot(batch, sampling, cache, sampler, graphed(m.xp, step),
                                   decoder(m.xp, m.embedding_tables, step, cache, sampler))
        s.cache.length = 0
        return s

    def tokens(self, x, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
               seed: int | None = None) -> Iterator[np.ndarray]:
        """The token ids (B,) of each of max_new_tokens steps continuing prompts, whose input
        embeddings x (B, T, C) are left padded (row b starts at T - len(prompts[b])). The prompt
        pass always starts from an empty cache (its graph is captured per shape)."""
        xp, (b, t) = self.model.xp, x.shape[:2]
        lengths = np.array([len(p) for p in prompts], np.int64)
        with device_stream(xp):
            s = self._fit(b, t + max_new_tokens, sampling)
            s.cache.kv_start[...] = xp.asarray(t - lengths, dtype=np.int32)
            s.sampler.start(prompts, seed)
            s.cache.begin(t)
            logits = s.prefill(x)
            s.cache.length += t
            tok = s.sampler.pick(logits)
            tok = tok.get() if hasattr(tok, "get") else tok
            yield tok
            yield from s.decode.tokens(tok, lengths, max_new_tokens - 1)
