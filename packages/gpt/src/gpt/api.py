"""GPT-2 from Python: load a model once, then generate, stream or score.

    import gpt
    lm = gpt.load("shakespeare")                 # a bundled name, a hub id or a local directory
    outs = lm.generate(["ROMEO:", "JULIET:"], max_new_tokens=50, temperature=0.8, seed=1)
    outs[0].text, outs[0].tokens, outs[0].finish_reason
    for piece in lm.stream("ROMEO:", max_new_tokens=50): print(piece, end="")
    scores = lm.score(["ROMEO: O", "JULIET:"])   # each token's log-probability (the first: None)
    logits = lm.logits([[464, 3290]])           # (B, T, vocab) on the model's device
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from tilekernels.runtime import (MAX_BATCH, CheckpointError, Completion, Engine, Sampling, TokenLogprob,
                                 generate, load_tokenizer, pick_device, requests, resolve, text_pieces, using)
from tilekernels.runtime.precision import DEFAULT as DEFAULT_PRECISION
from tilekernels.runtime.precision import precision as current_precision

from .model import GPT

DATA = Path(__file__).resolve().parent / "data"
BUNDLED = {"shakespeare": DATA / "shakespeare"}


class GPTError(ValueError):
    """Bad input to the gpt package (a checkpoint that cannot be read, an out-of-range value, a
    prompt too long for the model): the message is one line for the user."""


@contextlib.contextmanager
def _one_line():
    try:
        yield
    except GPTError:
        raise
    except (CheckpointError, ValueError, OSError) as e:
        raise GPTError(str(e)) from None


def load(model: str = "shakespeare", device: str = "auto", revision: str | None = None,
         precision: str = DEFAULT_PRECISION) -> "LanguageModel":
    """A LanguageModel (generate, stream, score, logits): a GPT-2-architecture model and its
    tokenizer from a bundled name ('shakespeare'), a hub id ('gpt2', 'gpt2-medium', ...; through
    the HF cache) or a local checkpoint directory, on device 'auto' (the GPU when one works),
    'gpu' or 'cpu'. precision (GPU): 'bf16', 'tf32' or 'fp32' (tilekernels.runtime.precision),
    kept by this model whatever other models or settings the process has. Raises GPTError (one
    line) for a checkpoint that cannot be found or read."""
    with _one_line():
        directory = BUNDLED[model] if model in BUNDLED else resolve(str(model), revision)
        with using(precision):
            gpt = GPT.load(directory, pick_device(device))
        return LanguageModel(gpt, load_tokenizer(directory), precision)


class LanguageModel:
    """A loaded model: generate, stream, score and logits (on one continuous-batching engine, whose KV
    cache and CUDA graphs are kept between calls of the same max_batch)."""

    def __init__(self, model: GPT, tokenizer, precision: str | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.precision = precision or current_precision()       # what its products run at
        self.device = "cpu" if model.xp is np else "gpu"
        self._engine: Engine | None = None

    def engine(self, max_batch: int = MAX_BATCH) -> Engine:
        """The engine decoding up to max_batch rows at once (a new one for another max_batch)."""
        if self._engine is None or self._engine.max_batch != max_batch:
            self._engine = None         # its cache goes before the next is allocated
            self._engine = Engine(self.model, max_batch, precision=self.precision)
        return self._engine

    def encode(self, prompts: str | Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Token ids of each prompt (text, or already ids; one text or one list of ids is one
        prompt); an empty one starts from <|endoftext|>."""
        eos = self.model.config.eos_token_id
        return [(self.tokenizer.encode(p).ids if isinstance(p, str) else _ids(p)) or [eos]
                for p in _prompt_list(prompts)]

    def generate(self, prompts: str | Sequence[str | Sequence[int]], max_new_tokens: int = 100,
                 temperature: float = 0.8, top_k: int = 200, top_p: float = 1.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, num_samples: int = 1, stop: str | Sequence[str] | None = (),
                 max_batch: int = MAX_BATCH, logprobs: int | None = None, min_p: float = 0.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None) -> list[Completion]:
        """num_samples completions of each prompt (prompt-major order): .text and .tokens hold the
        continuation only (an eos that ended it is its last token, with no text, as vLLM's),
        .finish_reason is 'stop' (eos or a stop string) or 'length'.
        temperature 0 is greedy; a seed draws the same tokens on the CPU and the GPU, and for a
        prompt the same wherever it sits in `prompts`; stop: one
        string or several; at most max_batch rows decode at once (each row's tokens are the same
        whatever else runs beside it). logprobs (0 to 20): .logprobs holds each token's
        log-probability under the model (whatever the sampling settings) and that many likeliest
        alternatives (runtime.TokenLogprob). min_p, presence_penalty, frequency_penalty and
        logit_bias ({token id: -100 to 100}) as OpenAI's and vLLM's."""
        with _one_line():
            _numbers(min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
            ids, sampling = self._request(prompts, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                                          num_samples, logprobs, min_p=float(min_p),
                                          presence_penalty=float(presence_penalty),
                                          frequency_penalty=float(frequency_penalty), logit_bias=_biases(logit_bias))
            return generate(self.engine(max_batch), ids, max_new_tokens, sampling, seed, _stops(stop), self.tokenizer,
                            samples=num_samples)

    def score(self, texts: str | Sequence[str | Sequence[int]], top: int = 0,
              max_batch: int = MAX_BATCH) -> list[list[TokenLogprob | None]]:
        """Each text's tokens with their log-probabilities given the tokens before them (teacher
        forced; the first token has none: None) and `top` (0 to 20) likeliest alternatives at
        each place. Many texts share each prefill (what an evaluation harness asks for)."""
        with _one_line():
            ids, _ = self._request(texts, 1, 0, 0, 1.0, 1.0, 1)
            outs = generate(self.engine(max_batch), ids, 1, Sampling(0, prompt_logprobs=top))
            return [o.prompt_logprobs for o in outs]

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 100, temperature: float = 0.8,
               top_k: int = 200, top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = None,
               stop: str | Sequence[str] | None = ()) -> Iterator[str]:
        """The text of one completion in pieces as it is generated (never a broken character nor
        part of a stop string); the pieces join to generate's text for the same settings. Bad
        settings raise GPTError here, before the first piece is asked for."""
        with _one_line():
            if not (isinstance(prompt, str) or _token_ids(prompt)):
                raise ValueError("stream takes one prompt (text or token ids); generate takes several")
            ids, sampling = self._request([prompt], max_new_tokens, temperature, top_k, top_p, repetition_penalty, 1)
            self.engine().check(requests(self.engine(), ids, max_new_tokens, sampling, seed)[0])
            return self._pieces(ids, max_new_tokens, sampling, seed, _stops(stop))

    def _pieces(self, ids, max_new_tokens, sampling, seed, stop) -> Iterator[str]:
        with _one_line():
            for _, piece in text_pieces(self.engine(), ids, max_new_tokens, sampling, seed, stop, self.tokenizer):
                yield piece

    def logits(self, ids) -> object:
        """Logits (B, T, vocab) of token ids (B, T) (or (T,)) on the model's device: numpy on the
        CPU, cupy on the GPU."""
        xp = self.model.xp
        with _one_line():
            ids = np.asarray(ids, dtype=np.int64)
            ids = ids[None] if ids.ndim == 1 else ids
            if ids.ndim != 2 or ids.size == 0:
                raise ValueError(f"ids must be (B, T) token ids, got shape {ids.shape}")
            if ids.min() < 0 or ids.max() >= self.model.config.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.model.config.vocab_size})")
            if ids.shape[1] > self.model.max_positions:
                raise ValueError(f"{ids.shape[1]} tokens exceed the model's {self.model.max_positions} positions")
            cache = self.model.new_cache(ids.shape[0], ids.shape[1])
            positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
            with using(self.precision):
                return self.model.forward(xp.asarray(ids), xp.asarray(positions), cache, last_only=False)

    def _request(self, prompts, max_new_tokens, temperature, top_k, top_p, repetition_penalty, num_samples,
                 logprobs=None, **more):
        _integer("max_new_tokens", max_new_tokens, 1)
        _integer("num_samples", num_samples, 1)
        _integer("top_k", top_k, 0)
        _numbers(temperature=temperature, top_p=top_p, repetition_penalty=repetition_penalty)
        sampling = Sampling(float(temperature), int(top_k), float(top_p), float(repetition_penalty), logprobs, **more)
        return [p for p in self.encode(prompts) for _ in range(num_samples)], sampling


def _integer(name: str, v, least: int) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")


def _numbers(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"{name} must be a number, got {v!r}")


def _stops(stop) -> tuple[str, ...]:
    """stop as a tuple of strings (None: none; one string: that one; any iterable of strings)."""
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    try:
        stop = tuple(stop)
    except TypeError:
        stop = (stop,)
    if not all(isinstance(t, str) for t in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    return stop


def _biases(logit_bias) -> tuple[tuple[int, float], ...]:
    """logit_bias {token id: bias} (ids as ints or as OpenAI's JSON strings) as pairs."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id: bias, got {type(logit_bias).__name__}")
    out = []
    for k, v in logit_bias.items():
        try:
            out.append((int(k), float(v)))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {k!r}: {v!r}") from None
        if isinstance(k, (bool, float)) or out[-1][0] < 0:
            raise ValueError(f"logit_bias token ids must be integers >= 0, got {k!r}")
    return tuple(out)


def _token_ids(p) -> bool:
    """Whether p is one prompt given as token ids (an empty list too)."""
    if isinstance(p, np.ndarray):
        return p.ndim == 1 and (p.dtype.kind in "iu" or p.size == 0)
    return isinstance(p, (list, tuple)) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                for t in p)


def _prompt_list(prompts) -> list:
    """prompts as a list of prompts: one text or one list of token ids is one prompt; else any
    iterable of prompts."""
    if isinstance(prompts, str) or (_token_ids(prompts) and len(prompts)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts must be text, token ids, or a list of them, got {type(prompts).__name__}")
    return list(prompts)


def _ids(p) -> list[int]:
    """A prompt given as token ids, as a list of ints (ValueError for anything else)."""
    if not _token_ids(p):
        raise ValueError(f"a prompt must be text or a list of token ids, got {type(p).__name__}"
                         + (f" of {type(p[0]).__name__}" if isinstance(p, (list, tuple)) and p else ""))
    return [int(t) for t in p]
