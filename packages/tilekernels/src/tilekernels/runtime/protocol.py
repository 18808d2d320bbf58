"""What the runtime needs of a model to run its token loop: the whole contract between them.

The runtime owns the loop (prefill, decode steps, sampling, stops) and calls the model;
the model owns its weights and its math and never calls back into the loop.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from .kvcache import KVCache


class DecoderModel(Protocol):
    xp: object                  # numpy or cupy: where the weights live, and so where it runs
    eos_ids: tuple[int, ...]    # any of them ends a sequence
    max_positions: int          # prompt + new tokens may not exceed this

    @classmethod
    def load(cls, directory: Path, device: str = "cpu") -> "DecoderModel":
        """Read a checkpoint directory onto 'cpu' or 'gpu'."""

    @property
    def embedding_tables(self) -> tuple:
        """(token table (V, C), position table (P, C) or None): what a decode step's input
        embeddings are gathered from (on the GPU by the sampler's last kernel)."""

    def embed(self, ids, positions):
        """Input embeddings (B, T, C) of token ids (B, T) at positions (B, T)."""

    def new_cache(self, batch: int, length: int, dtype=np.float32) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `length` positions, its keys and
        values stored as dtype (float32 or bfloat16)."""

    def step(self, x, cache: KVCache):
        """Last-position logits (B, V) of the new tokens' embeddings x (B, T, C), over the span
        cache.begin announced, writing their keys and values. Reads nothing that changes between
        calls except through device memory, so it can be captured once and replayed."""
