"""Choosing the next token from logits, as HF generate does: repetition penalty, then
temperature, top-k and top-p, then a draw (or the argmax when temperature is 0), with
tilekernels' sample op on whichever device holds the logits."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import tilekernels as tk


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


GREEDY = Sampling(temperature=0)


class Sampler:
    """Picks a batch's tokens step by step under one Sampling: tk.sample, or tk.argmax when
    greedy without a penalty. The uniforms for the draws come from one numpy Generator in
    step order, so a seed draws the same tokens on the CPU and the GPU. The tokens seen so
    far (for the repetition penalty) are a (B, V) mask on the logits' device, which the op
    marks as it chooses."""

    def __init__(self, s: Sampling, xp, batch: int, vocab: int, seed: int | None = None):
        self.s, self.batch, self.xp = s, batch, xp
        self.rng = np.random.default_rng(seed)
        self.seen = None if s.repetition_penalty == 1 else xp.zeros((batch, vocab), np.uint8)

    def start(self, prompts: list[list[int]], seed: int | None = None) -> None:
        """Begin a run: the draws start again from seed, and only the prompts' tokens are marked
        as seen (again: a decode graph's capture runs steps)."""
        self.rng = np.random.default_rng(seed)
        if self.seen is not None:
            mask = np.zeros(self.seen.shape, np.uint8)
            for row, ids in zip(mask, prompts):
                row[ids] = 1
            self.seen[...] = self.xp.asarray(mask)

    @property
    def draws(self) -> bool:
        """Whether tokens are drawn (temperature > 0), each step taking B uniforms."""
        return self.s.temperature > 0

    def uniforms(self, steps: int) -> np.ndarray | None:
        """The next `steps` steps' uniforms, (steps, B) float32 in [0, 1); None when greedy."""
        return self.rng.random((steps, self.batch), dtype=np.float32) if self.draws else None

    def pick(self, logits):
        """The next step's token ids (B,) from logits (B, V) on their device, drawing that
        step's uniforms (a step outside a decode graph: the prompt's first token, CPU steps)."""
        u = self.uniforms(1)
        return self(logits, None if u is None else self.xp.asarray(u[0]))

    def __call__(self, logits, uniforms=None, **tail):
        """Token ids (B,) from logits (B, V), with uniforms (B,) on their device (None when
        greedy); tail: the op's out, positions, counters and embed."""
        s = self.s
        if s.temperature == 0 and s.repetition_penalty == 1:
            return tk.argmax(logits, **tail)
        return tk.sample(logits, uniforms, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                         penalty=s.repetition_penalty, seen=self.seen, **tail)
