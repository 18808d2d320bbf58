"""The token loop: one batched prefill, then one decode step per new token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .graph import decoder, device_stream
from .model import GPT
from .sampling import Sampler, Sampling
from .tokenizer import TextStream


@dataclass
class Completion:
    prompt: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0           # characters of text already handed to on_text
    done: bool = False


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of text could still begin a stop string."""
    for n in range(min(len(text), max((len(s) for s in stops), default=0)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def generate(model: GPT, tokenizer, prompts: list, max_new_tokens: int, sampling: Sampling,
             seed: int | None = None, num_samples: int = 1, stop: list[str] | tuple = (),
             on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
    """Complete every prompt (a string, or a list of token ids) num_samples times in one
    batch (left padded). An empty prompt starts from the eos token, as GPT-2 does.

    on_text(i, piece) receives each completion's text as it is produced, never a broken
    character and never part of a stop string.
    """
    cfg, xp = model.config, model.xp
    eos = cfg.eos_token_id
    encoded = [list(p) if not isinstance(p, str) else tokenizer.encode(p).ids for p in prompts]
    ids = [e or [eos] for e in encoded for _ in range(num_samples)]
    outs = [Completion(p if isinstance(p, str) else "") for p in prompts for _ in range(num_samples)]
    longest = max(len(i) for i in ids)
    if longest + max_new_tokens > cfg.n_positions:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's {cfg.n_positions} positions")
    b = len(ids)
    start = np.array([longest - len(i) for i in ids], np.int32)
    batch = np.array([[eos] * s + i for s, i in zip(start, ids)], np.int64)
    pos = np.maximum(np.arange(longest)[None, :] - start[:, None], 0)
    lengths = np.array([len(i) for i in ids])
    streams = [TextStream(tokenizer) if tokenizer else None for _ in range(b)]
    with device_stream(xp):
        cache = model.new_cache(b, longest + max_new_tokens, kv_start=start)
        logits = model.forward(xp.asarray(batch), xp.asarray(pos), cache)
        sampler = Sampler(sampling, xp, b, logits.shape[-1], seed)
        decode = decoder(xp, model.embedding_tables, lambda x: model.step(x, cache), cache, sampler)
        sampler.start(ids)
        _loop(_tokens(decode, sampler, logits, lengths, max_new_tokens), outs, streams, stop, eos, on_text)
    for j, o in enumerate(outs):          # flush what a stop-string prefix held back
        if on_text and len(o.text) > o.emitted:
            on_text(j, o.text[o.emitted:])
        o.emitted = len(o.text)
    return outs


def _tokens(decode, sampler: Sampler, logits, lengths, max_new_tokens):
    """The chosen ids (B,) of every step: the first from the prompt's logits, the rest from
    the decoder's steps, all picked on the logits' device (only the ids come back)."""
    tok = sampler.pick(logits)
    tok = tok.get() if hasattr(tok, "get") else tok
    yield tok
    yield from decode.tokens(tok, lengths, max_new_tokens - 1)


def _loop(tokens, outs, streams, stop, eos, on_text):
    for tok in tokens:
        for j, (o, t) in enumerate(zip(outs, tok)):
            if o.done:
                continue
            if t == eos:
                o.done = True
            else:
                o.tokens.append(int(t))
                o.text += streams[j].push(t) if streams[j] else ""
                hit = [o.text.index(s) for s in stop if s in o.text]
                if hit:
                    o.text, o.done = o.text[:min(hit)], True
            upto = len(o.text) if o.done else len(o.text) - _held_back(o.text, list(stop))
            if on_text and upto > o.emitted:
                on_text(j, o.text[o.emitted:upto])
            o.emitted = max(o.emitted, upto)
        if all(o.done for o in outs):
            break
