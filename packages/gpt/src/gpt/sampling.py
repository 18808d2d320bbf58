"""Choosing the next token from logits, as HF generate does: repetition penalty, then
temperature, top-k and top-p, then a draw (or argmax when temperature is 0)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0      # 0 means greedy
    top_k: int = 0                # 0 means off
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


def apply_repetition_penalty(logits: np.ndarray, seen: list[np.ndarray], penalty: float) -> np.ndarray:
    """CTRL-style: seen tokens' logits are divided by penalty if positive, else multiplied."""
    if penalty == 1.0:
        return logits
    out = logits.copy()
    for row, ids in zip(out, seen):
        ids = np.unique(ids)
        vals = row[ids]
        row[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def filter_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k, axis=-1)[..., -k, None]
    return np.where(logits < kth, -np.inf, logits)


def filter_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    order = np.argsort(logits, axis=-1)                      # ascending, as HF
    sorted_logits = np.take_along_axis(logits, order, -1).astype(np.float64)
    probs = np.exp(sorted_logits - sorted_logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    drop = np.cumsum(probs, -1) <= 1 - p
    drop[..., -1] = False
    out = logits.copy()
    np.put_along_axis(out, order, np.where(drop, -np.inf, sorted_logits).astype(logits.dtype), -1)
    return out


def next_tokens(logits: np.ndarray, seen: list[np.ndarray], s: Sampling, rng: np.random.Generator) -> np.ndarray:
    """One token id per row of logits (B, V)."""
    logits = apply_repetition_penalty(logits.astype(np.float32), seen, s.repetition_penalty)
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = filter_top_p(filter_top_k(logits / s.temperature, s.top_k), s.top_p).astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.array([rng.choice(len(p), p=p) for p in probs])
