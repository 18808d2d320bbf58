"""Choosing the next token from logits, as HF generate does: repetition penalty (and OpenAI's
presence and frequency penalties and logit bias), then temperature, top-k, top-p and min-p,
then a draw (or the argmax when temperature is 0), with
tilekernels' sample op on whichever device holds the logits. Every row of a batch has settings
of its own, so greedy and sampled requests decode side by side. A row that asks for logprobs
also gets its token's log-probability under the raw logits and the MAX_TOP likeliest tokens'
(tilekernels' logprobs op, in the same step)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

import tilekernels as tk
from tilekernels.logprobs import MAX_TOP

INT32_MAX = 2 ** 31 - 1


MAX_TEMPERATURE = 100.0       # past it every distribution is flat to float32's precision
MAX_PENALTY = 100.0           # repetition_penalty in [1 / MAX_PENALTY, MAX_PENALTY] (float32 logits overflow past)
MAX_OPENAI_PENALTY = 2.0      # presence and frequency penalties: OpenAI's range
MAX_BIAS = 100                # logit_bias values: OpenAI's range
MAX_SEED = 2 ** 63 - 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0      # 0 means greedy
    top_k: int = 0                # 0 means off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None         # each new token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (its first has none)
    min_p: float = 0.0                  # keep tokens at least min_p times as likely as the likeliest
    presence_penalty: float = 0.0       # minus this for a token generated before (OpenAI's)
    frequency_penalty: float = 0.0      # minus this times the times it was generated (OpenAI's)
    logit_bias: tuple[tuple[int, float], ...] = ()      # (token id, added to its logit), each in [-100, 100]

    def __post_init__(self):
        if not 0 <= self.temperature <= MAX_TEMPERATURE:      # NaN fails every comparison
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < np.float32(self.top_p) <= 1:       # as the kernels hold it (1e-50 is 0 there)
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be in [0, {INT32_MAX}], got {self.top_k}")
        if not 1 / MAX_PENALTY <= self.repetition_penalty <= MAX_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{1 / MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                             f"got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= MAX_TOP):
                raise ValueError(f"{name} must be an integer in [0, {MAX_TOP}], got {v!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_OPENAI_PENALTY <= getattr(self, name) <= MAX_OPENAI_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not all(-MAX_BIAS <= b <= MAX_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-{MAX_BIAS}, {MAX_BIAS}]")

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before the draw (a penalty or a bias)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias))


def check_seed(seed) -> None:
    """A seed the draws accept: None or an integer in [0, 2**63 - 1]."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")


GREEDY = Sampling(temperature=0)


class Mode(NamedTuple):
    """Which parts of the op a batch's rows need: a draw (some row samples), each filter's
    search, the adjusted logits (a penalty or a bias), and whether some row asks for logprobs.
    A captured decode graph runs one mode; all False is one argmax."""
    draws: bool
    top_k: bool
    top_p: bool
    adjust: bool
    logprobs: bool = False


_FIELDS = (("temperature", np.float32, 0.0), ("top_k", np.int32, 0), ("top_p", np.float32, 1.0),
           ("penalty", np.float32, 1.0), ("min_p", np.float32, 0.0), ("presence", np.float32, 0.0),
           ("frequency", np.float32, 0.0))
NO_LOGPROBS = -1


class Sampler:
    """The settings of `batch` rows, row by row (temperature, top_k, top_p, penalties, min_p),
    their random generators and, once a row adjusts its logits, the (batch, V) arrays of that on
    the logits' device: the mask of tokens seen so far (prompt and generated), the counts of
    those generated (the op marks and counts what it chooses) and the bias. Each row draws its
    uniforms from a numpy Generator of its own, one a step, so its tokens depend on its seed
    alone, not on the rows beside it, and a seed draws the same tokens on the CPU and the GPU.

    Sampler(s, xp, batch, vocab, seed) gives every row the settings s, row b drawing from
    [seed, b]; rows(n) is the first n rows as a sampler of their own, sharing all of it, with
    the mode those rows need now fixed (what a decode graph captured for them runs)."""

    def __init__(self, s: Sampling | None, xp, batch: int, vocab: int, seed: int | None = None):
        self.xp, self.batch, self.vocab = xp, batch, vocab
        self.host = {name: np.full(batch, default, dt) for name, dt, default in _FIELDS}
        self.dev = {name: xp.asarray(a) for name, a in self.host.items()}   # numpy: the host arrays themselves
        self.stale = False      # whether dev lags host (set_row writes the host only: sync())
        self.logprobs = np.full(batch, NO_LOGPROBS, np.int32)     # each row's alternatives (host only)
        self.rngs: list = [None] * batch
        self.adjusting = np.zeros(batch, bool)      # which rows adjust their logits (host only)
        self.seen = self.counts = self.bias = None
        self.fixed: Mode | None = None
        self.owner = self
        if s is not None:
            for b in range(batch):
                self.set_row(b, s, (), np.random.default_rng(None if seed is None else [seed, b]))

    # ------------------------------------------------------------ rows
    def set_row(self, row: int, s: Sampling, prompt: Sequence[int], rng: np.random.Generator | None) -> None:
        """Row `row` now continues `prompt` under s, drawing from rng (None: it draws nothing).
        The device copies of the settings follow at the next sync() (the engine admits and
        releases dozens of rows at once: one copy an array, not four copies a row)."""
        o = self.owner
        for (name, _, _), v in zip(_FIELDS, (s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.min_p,
                                             s.presence_penalty, s.frequency_penalty)):
            o.host[name][row] = v
        o.stale = o.xp is not np
        o.logprobs[row] = NO_LOGPROBS if s.logprobs is None else s.logprobs
        o.rngs[row] = rng
        o.adjusting[row] = s.adjusts
        if s.adjusts and o.seen is None:
            o.seen = o.xp.zeros((o.batch, o.vocab), np.uint8)
            o.counts, o.bias = (o.xp.zeros((o.batch, o.vocab), np.float32) for _ in range(2))
        if o.seen is not None:
            mask = np.zeros(o.vocab, np.uint8)
            mask[np.asarray(prompt, np.int64)] = 1
            o.seen[row] = o.xp.asarray(mask)
            o.counts[row] = 0
            bias = np.zeros(o.vocab, np.float32)
            for token, b in s.logit_bias:
                bias[token] = b
            o.bias[row] = o.xp.asarray(bias)

    def sync(self) -> None:
        """Copy the rows' settings to the device, if set_row changed them since: before decode
        steps run (a captured graph reads them where they are)."""
        o = self.owner
        if o.stale:
            for name, a in o.host.items():
                o.dev[name].set(a)
            o.stale = False

    def clear_row(self, row: int) -> None:
        """A free row: greedy, drawing nothing."""
        self.set_row(row, GREEDY, (), None)

    def start(self, prompts: list[list[int]], seed: int | None = None) -> None:
        """Begin a run on every row, settings kept: row b draws from [seed, b] again and only its
        prompt's tokens are marked as seen (again: a decode graph's capture runs steps)."""
        for b, ids in enumerate(prompts):
            self.set_row(b, self.settings(b), ids, np.random.default_rng(None if seed is None else [seed, b]))

    def settings(self, row: int) -> Sampling:
        o = self.owner
        h, lp = o.host, int(o.logprobs[row])
        bias = ()
        if o.bias is not None:
            b = o.xp.asnumpy(o.bias[row]) if o.xp is not np else o.bias[row]
            bias = tuple((int(i), float(b[i])) for i in np.flatnonzero(b))
        return Sampling(float(h["temperature"][row]), int(h["top_k"][row]), float(h["top_p"][row]),
                        float(h["penalty"][row]), None if lp == NO_LOGPROBS else lp, None, float(h["min_p"][row]),
                        float(h["presence"][row]), float(h["frequency"][row]), bias)

    def mode_of(self, rows: Sequence[int]) -> Mode:
        """The mode the given rows need."""
        o, rows = self.owner, np.asarray(rows, np.int64)
        t, k, p = (o.host[name][rows] for name in ("temperature", "top_k", "top_p"))
        draws = t > 0
        return Mode(bool(draws.any()), bool((draws & (k > 0) & (k < self.vocab)).any()),
                    bool((draws & (p < 1)).any()), bool(o.adjusting[rows].any()),
                    bool((o.logprobs[rows] != NO_LOGPROBS).any()))

    @property
    def mode(self) -> Mode:
        return self.fixed or self.mode_of(range(self.batch))

    def rows(self, n: int, mode: Mode | None = None) -> "Sampler":
        """The first n rows as a sampler of their own (sharing settings, generators and mask),
        running `mode` (by default what they need now)."""
        view = Sampler.__new__(Sampler)
        view.__dict__.update(self.__dict__)
        view.batch, view.owner = n, self.owner
        view.fixed = mode or self.mode_of(range(n))
        return view

    # ------------------------------------------------------------ choosing
    @property
    def draws(self) -> bool:
        """Whether a step takes uniforms (some row samples)."""
        return self.mode.draws

    def uniforms(self, steps: int) -> np.ndarray | None:
        """The next `steps` steps' uniforms, (steps, B) float32 in [0, 1), each sampling row's
        from its own generator (zeros for the others); None when no row draws."""
        if not self.draws:
            return None
        o, u = self.owner, np.zeros((steps, self.batch), np.float32)
        for b in range(self.batch):
            if o.rngs[b] is not None and o.host["temperature"][b] > 0:
                u[:, b] = o.rngs[b].random(steps, dtype=np.float32)
        return u

    def pick(self, logits):
        """The next step's token ids (B,) from logits (B, V) on their device, drawing that
        step's uniforms (a step outside a decode graph: the CPU's steps)."""
        u = self.uniforms(1)
        return self(logits, None if u is None else self.xp.asarray(u[0]))

    def scores(self, logits, tokens, out: tuple | None = None) -> tuple | None:
        """(chosen, top values, top ids) of tokens under logits (tk.logprobs, MAX_TOP
        alternatives or the whole vocabulary if smaller) when the mode asks for logprobs, else None."""
        return tk.logprobs(logits, tokens, min(MAX_TOP, self.vocab), out=out) if self.mode.logprobs else None

    def __call__(self, logits, uniforms=None, **tail):
        """Token ids (B,) from logits (B, V), with uniforms (B,) on their device (None when no
        row draws); tail: the op's out, positions, counters and embed."""
        self.sync()
        m, o, n = self.mode, self.owner, self.batch
        if not m.draws and not m.adjust:
            return tk.argmax(logits, **tail)
        return tk.sample(logits, uniforms, **_settings(m, {k: v[:n] for k, v in o.dev.items()},
                                                       (o.seen, o.counts, o.bias), slice(n)), **tail)

    def pick_rows(self, logits, rows: Sequence[int]) -> tuple:
        """Token ids (int64, on the logits' device) for logits (len(rows), V) whose row i belongs
        to row rows[i] (a prefill's first tokens), each drawing one uniform from its row's
        generator, and their scores when one of the rows asks for logprobs (else None). On the
        GPU the pick runs over a power of two of rows (copies of the last row added, their picks
        dropped): cuTile compiles a kernel for each class of its arrays' shapes, and warm_up
        builds the powers of two (another row count could compile a kernel of its own mid-serve)."""
        o, xp = self.owner, self.xp
        idx = np.asarray(rows, np.int64)
        n = len(idx)
        m = self.mode_of(idx)
        h = {name: o.host[name][idx] for name, _, _ in _FIELDS}
        u = None
        if m.draws:
            u = np.array([o.rngs[r].random(dtype=np.float32) if o.rngs[r] is not None and t > 0 else 0.0
                          for r, t in zip(idx, h["temperature"])], np.float32)
        pad = (1 << (n - 1).bit_length()) - n if xp is not np and n else 0
        if pad:
            logits = xp.concatenate([logits, xp.broadcast_to(logits[-1:], (pad, logits.shape[-1]))])
            idx = np.concatenate([idx, np.repeat(idx[-1:], pad)])
            h = {k: np.concatenate([v, np.repeat(v[-1:], pad)]) for k, v in h.items()}
            u = None if u is None else np.concatenate([u, np.zeros(pad, np.float32)])
        if u is not None:
            u = xp.asarray(u)
        if not m.draws and not m.adjust:
            tok = tk.argmax(logits)
        else:       # the adjust arrays gathered (copies: the rows' own are marked below)
            tok = tk.sample(logits, u, **_settings(m, {k: xp.asarray(v) for k, v in h.items()},
                                                   (o.seen, o.counts, o.bias), xp.asarray(idx)))
        scores = tk.logprobs(logits, tok, min(MAX_TOP, self.vocab)) if m.logprobs else None
        tok = tok[:n].astype(np.int64, copy=False)
        if o.seen is not None:
            rows = xp.asarray(idx[:n])
            o.seen[rows, tok] = 1
            o.counts[rows, tok] += 1
        return tok, None if scores is None else tuple(a[:n] for a in scores)

    def marks(self) -> tuple:
        """A copy of what steps change (seen and counts), for restore: building a decode graph
        runs steps."""
        o = self.owner
        return () if o.seen is None else (o.seen.copy(), o.counts.copy())

    def restore(self, marks: tuple) -> None:
        o = self.owner
        if marks:
            o.seen[...], o.counts[...] = marks


def _settings(m: Mode, d: dict, adjust: tuple, rows) -> dict:
    """tk.sample's keyword arguments for mode m from per-row settings d (on the device) and the
    (seen, counts, bias) arrays' rows `rows`: what the mode does not use is left at its no-op."""
    seen, counts, bias = adjust
    out = dict(temperature=d["temperature"] if m.draws else 0, top_k=d["top_k"] if m.top_k else 0,
               top_p=d["top_p"] if m.top_p else 1.0, min_p=d["min_p"] if m.draws else 0.0)
    if m.adjust:
        out.update(penalty=d["penalty"], presence=d["presence"], frequency=d["frequency"], seen=seen[rows],
                   counts=counts[rows], bias=bias[rows])
    return out
