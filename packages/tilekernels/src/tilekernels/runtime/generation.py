"""The token loop: prompts in batches of at most max_batch, each one prefill then one decode step
per new token, until every row has met an eos id, a stop string or its length."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .runner import ModelRunner
from .sampling import GREEDY, Sampling
from .tokenizer import TextStream

MAX_BATCH = 32      # rows decoded together unless the caller says otherwise


@dataclass
class Completion:
    """One continuation: its token ids and text (the prompt excluded) and why it ended:
    'stop' (an eos id or a stop string) or 'length' (max_new_tokens)."""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    emitted: int = 0           # characters of text already handed to on_text

    @property
    def done(self) -> bool:
        return self.finish_reason == "stop"


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of text could still begin a stop string."""
    for n in range(min(len(text), max((len(s) for s in stops), default=0)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def check_length(model, longest: int, max_new_tokens: int) -> None:
    """Refuse a request the model's positions cannot hold (before any work or output)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if longest + max_new_tokens > model.max_positions:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's {model.max_positions} positions")


def generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
             seed: int | None = None, stop: Sequence[str] | str = (), tokenizer=None,
             on_text: Callable[[int, str], None] | None = None, embeds: list | None = None,
             max_batch: int = MAX_BATCH, ignore_eos: bool = False) -> list[Completion]:
    """Continue every prompt (token ids; embeds: their input embeddings (T, C) each, when the
    model builds them itself) and return one Completion per prompt, in order.

    Prompts run max_batch at a time (left padded), so memory is bounded however many come; the
    first batch draws from seed, batch k from [seed, k]. With a tokenizer each completion's text
    is built as it comes: a stop string ends it (and is cut off), and on_text(i, piece) receives
    the text of prompt i as it is produced, never a broken character nor part of a stop string.
    ignore_eos: decode max_new_tokens whatever comes (benchmarks: the same work every run).
    """
    outs = [Completion() for _ in prompts]
    for i, piece in text_pieces(runner, prompts, max_new_tokens, sampling, seed, stop, tokenizer, embeds,
                                max_batch, ignore_eos, outs):
        if on_text:
            on_text(i, piece)
    return outs


def text_pieces(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
                seed: int | None = None, stop: Sequence[str] | str = (), tokenizer=None, embeds: list | None = None,
                max_batch: int = MAX_BATCH, ignore_eos: bool = False,
                outs: list[Completion] | None = None) -> Iterator[tuple[int, str]]:
    """generate's work as it happens: (prompt index, text piece) pairs, the pieces of each prompt
    joining to its completion's text; outs (one Completion per prompt) is filled as they come."""
    model = runner.model
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: give at least one token")
    check_length(model, max(len(p) for p in prompts), max_new_tokens)
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    stop = [stop] if isinstance(stop, str) else list(stop)
    outs = [Completion() for _ in prompts] if outs is None else outs
    eos = set() if ignore_eos else set(model.eos_ids)
    for k, first in enumerate(range(0, len(prompts), max_batch)):
        rows = range(first, min(first + max_batch, len(prompts)))
        x = _inputs(model, [prompts[i] for i in rows], None if embeds is None else [embeds[i] for i in rows])
        chunk_seed = seed if k == 0 or seed is None else [seed, k]
        tokens = runner.tokens(x, [prompts[i] for i in rows], max_new_tokens, sampling, chunk_seed)
        yield from _loop(tokens, [outs[i] for i in rows], list(rows), tokenizer, stop, eos)


def _inputs(model, prompts: list[list[int]], embeds: list | None):
    """The left-padded input embeddings (B, T, C) of a batch of prompts."""
    xp, longest = model.xp, max(len(p) for p in prompts)
    start = np.array([longest - len(p) for p in prompts])
    if embeds is not None:
        if len(prompts) == 1:
            return xp.asarray(embeds[0])[None]
        x = xp.zeros((len(prompts), longest, embeds[0].shape[-1]), np.float32)
        for row, (s, e) in enumerate(zip(start, embeds)):
            x[row, s:] = e
        return x
    pad = model.eos_ids[0]
    ids = np.array([[pad] * s + list(p) for s, p in zip(start, prompts)], np.int64)
    positions = np.maximum(np.arange(longest)[None, :] - start[:, None], 0)
    return model.embed(xp.asarray(ids), xp.asarray(positions))


def _loop(tokens, outs: list[Completion], index: list[int], tokenizer, stop: list[str],
          eos: set) -> Iterator[tuple[int, str]]:
    """Fold each step's tokens (B,) into the batch's completions until all have ended, yielding
    the text each step adds that can no longer turn out to be part of a stop string."""
    streams = [TextStream(tokenizer) if tokenizer else None for _ in outs]
    for tok in tokens:
        for o, t, stream, i in zip(outs, tok, streams, index):
            if o.done:
                continue
            if t in eos:
                o.finish_reason = "stop"
            else:
                o.tokens.append(int(t))
                o.text += stream.push(t) if stream else ""
                hit = [o.text.index(s) for s in stop if s in o.text]
                if hit:
                    o.text, o.finish_reason = o.text[:min(hit)], "stop"
            upto = len(o.text) if o.done else len(o.text) - held_back(o.text, stop)
            if upto > o.emitted:
                yield i, o.text[o.emitted:upto]
            o.emitted = max(o.emitted, upto)
        if all(o.done for o in outs):
            break
    for o, i in zip(outs, index):       # what a stop-string prefix held back at the length limit
        if len(o.text) > o.emitted:
            yield i, o.text[o.emitted:]
        o.emitted = len(o.text)
