"""The token loop as one call: a list of prompts through the engine, each continued until an eos
id, a stop string or its length, their text streamed as it comes."""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

from .engine import Engine
from .sampler import GREEDY, Sampling, check_seed
from .sequence import Completion, Request


def requests(engine: Engine, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
             seed: int | None = None, stop: Sequence[str] | str = (), tokenizer=None, embeds: list | None = None,
             ignore_eos: bool = False, samples: int = 1) -> list[Request]:
    """One Request a prompt; prompts come `samples` at a time (each prompt's samples in a row),
    sample s of each drawing from [seed, s]: a prompt's tokens do not depend on which other
    prompts run beside it, nor on where it sits among them (as vLLM's per-request seed)."""
    check_seed(seed)
    eos = frozenset() if ignore_eos else frozenset(engine.model.eos_ids)
    return [Request(list(p), max_new_tokens, sampling, None if seed is None else [seed, i % samples], stop, eos,
                    None if embeds is None else embeds[i], tokenizer, i) for i, p in enumerate(prompts)]


def generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
             seed: int | None = None, stop: Sequence[str] | str = (), tokenizer=None,
             on_text: Callable[[int, str], None] | None = None, embeds: list | None = None,
             ignore_eos: bool = False, samples: int = 1) -> list[Completion]:
    """Continue every prompt (token ids; embeds: their input embeddings (T, C) each, when the
    model builds them itself) and return one Completion per prompt, in order. With a tokenizer
    each completion's text is built as it comes: a stop string ends it (and is cut off), and
    on_text(i, piece) receives the text of prompt i as it is produced, never a broken character
    nor part of a stop string. ignore_eos: decode max_new_tokens whatever comes (benchmarks).
    samples: prompts come that many at a time, the samples of one prompt (requests' seeds)."""
    reqs = requests(engine, prompts, max_new_tokens, sampling, seed, stop, tokenizer, embeds, ignore_eos, samples)
    for i, piece in run(engine, reqs):
        if on_text and piece:
            on_text(i, piece)
    return [r.out for r in reqs]


def text_pieces(engine: Engine, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
                seed: int | None = None, stop: Sequence[str] | str = (), tokenizer=None, embeds: list | None = None,
                ignore_eos: bool = False, outs: list[Completion] | None = None) -> Iterator[tuple[int, str]]:
    """generate's work as it happens: (prompt index, text piece) pairs, the pieces of each prompt
    joining to its completion's text; outs (one Completion per prompt) is filled as they come."""
    reqs = requests(engine, prompts, max_new_tokens, sampling, seed, stop, tokenizer, embeds, ignore_eos)
    if outs is not None:
        for r, o in zip(reqs, outs):
            r.out = o
    for i, piece in run(engine, reqs):
        if piece:
            yield i, piece


def run(engine: Engine, reqs: list[Request]) -> Iterator[tuple[int, str]]:
    """Add the requests (all checked first: a bad one refuses the call before any work) and step
    the engine until they are done: (request tag, piece) as they come. Stopping the iteration
    cancels what has not finished. Several runs may be open on one engine at once (two
    streams read in turn, or calls from several threads, which take engine.lock to step): a
    step's pieces go to their requests (Request.unread) before any is handed out, and each run
    hands out its own, in order, whichever run stepped."""
    if not reqs:
        return
    for r in reqs:
        r.unread = []
    with engine.lock:       # runs in several threads step one engine in turn, each taking its own pieces
        engine.add(*reqs)
    try:
        while True:
            with engine.lock:
                done = all(r.finished for r in reqs)        # first: what another run adds meanwhile is drained
                taken = []
                for r in reqs:
                    if r.error is not None:
                        raise r.error
                    taken += [(r.tag, p) for p in r.unread]
                    r.unread = []
            yield from taken
            if done:
                break
            with engine.lock:
                for e in engine.step():
                    if e.request.unread is not None and e.piece:
                        e.request.unread.append(e.piece)
    finally:
        with engine.lock:
            for r in reqs:
                if not r.finished:
                    engine.cancel(r)


def warm_up(engine: Engine, samplings: Sequence[Sampling] = (GREEDY,), prompt_tokens: int = 16) -> None:
    """Build the decode steps of every batch size engine.max_batch can run (its buckets, and
    max_batch itself) in each of the samplings' modes, before any request: on the GPU their
    kernels compile and their graphs are captured on first use, seconds that a server's first
    requests at each concurrency would otherwise wait for. What they built is then frozen out of
    the garbage collector's full passes (freeze_heap)."""
    from .device import freeze_heap
    from .runner import BUCKETS

    prompt = [engine.model.eos_ids[0]] * prompt_tokens
    for rows in sorted({min(b, engine.max_batch) for b in BUCKETS}):
        for sampling in samplings:
            generate(engine, [prompt] * rows, 2, sampling, seed=0, ignore_eos=True)
    freeze_heap()
