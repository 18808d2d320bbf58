"""One request's life in the engine: what was asked, and what has come of it so far."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from .sampler import GREEDY, Sampling
from .tokenizer import TextStream


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model's raw logits (log_softmax, whatever the
    sampling settings) and the likeliest tokens at its place with theirs, likeliest first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(token: int, score: tuple, top: int) -> TokenLogprob:
    """TokenLogprob of one place's scores (chosen, top values (MAX_TOP,), top ids (MAX_TOP,))
    with `top` alternatives."""
    chosen, values, ids = score
    return TokenLogprob(int(token), float(chosen), tuple(zip(ids[:top].tolist(), values[:top].tolist())))


@dataclass
class Completion:
    """One continuation: its token ids and text (the prompt excluded) and why it ended:
    'stop' (an eos id or a stop string) or 'length' (max_new_tokens). The eos id that ended it
    is its last token (a token generated and counted, as vLLM's token_ids and usage), with no
    text. logprobs: one TokenLogprob a token when the request asked (Sampling.logprobs);
    prompt_logprobs: the prompt's, None for its first token (Sampling.prompt_logprobs)."""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    emitted: int = 0           # characters of text already handed out
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason == "stop"


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of text could still begin a stop string."""
    for n in range(min(len(text), max((len(s) for s in stops), default=0)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


@dataclass(eq=False)
class Request:
    """A prompt to continue (token ids; embeds: its input embeddings (T, C) when the model builds
    them itself, GLM-ASR's audio prompts) for up to max_new_tokens, ended early by an eos id or a
    stop string. seed: its own draws (a row's tokens never depend on the other rows'). tag: the
    caller's, handed back with the results. error: what ended it, when something of its own
    failed in a step (its text, its stop strings): it alone ends, the rows beside it go on."""
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    seed: int | Sequence[int] | None = None
    stop: Sequence[str] = ()
    eos: frozenset = frozenset()
    embeds: object = None
    tokenizer: object = None
    tag: object = None
    out: Completion = field(default_factory=Completion)
    slot: int = -1
    error: BaseException | None = None
    unread: list[str] | None = None     # its pieces not yet handed out by its generation.run (whichever stepped)

    def __post_init__(self):
        self.stop = [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]   # "" stops nothing
        self.rng = np.random.default_rng(self.seed)
        self.stream = TextStream(self.tokenizer) if self.tokenizer is not None else None

    @property
    def finished(self) -> bool:
        return self.out.done or len(self.out.tokens) >= self.max_new_tokens or self.error is not None

    @property
    def remaining(self) -> int:
        """Decode steps it may still take."""
        return 0 if self.finished else self.max_new_tokens - len(self.out.tokens)

    def score_prompt(self, scores: tuple) -> None:
        """The prompt's token logprobs from its row of a scored prefill: scores (chosen
        (width,), top values (width, MAX_TOP), top ids (width, MAX_TOP)), place j scoring
        prompt token j + 1."""
        k, p = self.sampling.prompt_logprobs, self.prompt
        self.out.prompt_logprobs = [None] + [token_logprob(p[j + 1], tuple(a[j] for a in scores), k)
                                             for j in range(len(p) - 1)]

    def push(self, token: int, score: tuple | None = None) -> str:
        """Fold in the next generated token (and its scores: chosen, top values, top ids, when
        the step computed them); the text that can no longer turn out to be part of a stop
        string (all of it once the request has finished)."""
        o = self.out
        o.tokens.append(int(token))
        if self.sampling.logprobs is not None and score is not None:
            if o.logprobs is None:
                o.logprobs = []
            o.logprobs.append(token_logprob(token, score, self.sampling.logprobs))
        if token in self.eos:
            o.finish_reason = "stop"
        elif self.stream is not None:
            o.text += self.stream.push(token)
            hit = [o.text.index(s) for s in self.stop if s in o.text]
            if hit:
                o.text, o.finish_reason = o.text[:min(hit)], "stop"
        upto = len(o.text) if self.finished else len(o.text) - held_back(o.text, self.stop)
        piece = o.text[o.emitted:upto] if upto > o.emitted else ""
        o.emitted = max(o.emitted, upto)
        return piece
