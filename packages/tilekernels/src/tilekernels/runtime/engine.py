"""The continuous-batching engine both models run on: requests join the running batch at any
step and leave it the step they finish, their slot going to the next waiting request.

When no decode is under way, a step admits what fits (scheduler.py), prefills it (runner.py:
ragged prompts in one batch, at most prefill_tokens of them, so running rows wait little) and
starts a flow: the running rows' decode steps, replayed CHAIN at a time from chains of CUDA
graphs, the first queued before the host has the prompts' first tokens (no gap on the GPU). Each
step then folds one replay's tokens into the requests (sequence.py: eos, stop strings, length)
while the GPU already runs the next replay, so the host's share of a step
(tokens to text, stop strings) costs no GPU time. A flow ends when its rows are done, or when
the scheduler says waiting requests are due (Scheduler.admission_due): the flow is stopped, the
replay already queued is folded in, and the same step admits and starts the next flow.
"""
from __future__ import annotations

import threading

from dataclasses import dataclass
from typing import Callable


from .device import device_stream
from .graphs import Pipelined
from .precision import kv_dtype as kv_dtype_of
from .precision import precision as current_precision
from .precision import using
from .protocol import DecoderModel
from .runner import BUCKETS, ModelRunner
from .sampler import Sampling
from .scheduler import Scheduler
from .sequence import Request

MAX_BATCH = 32          # rows decoded together unless the caller says otherwise
CAPACITY = 2048         # positions a slot (slots.py) at most, unless asked: 15 GB for GLM-ASR's
                        # decoder at max_batch 64 (float32 keys and values)
PREFILL_TOKENS = 16384  # padded prompt tokens a step may prefill


@dataclass
class Event:
    """What a step did for one request: the text it added (piece) and whether it has finished."""
    request: Request
    piece: str
    finished: bool


def at(scores: tuple | None, index) -> tuple | None:
    """One place's scores (chosen, top values, top ids) of a step's or prefill's arrays."""
    return None if scores is None else tuple(a[index] for a in scores)


def check_length(model, longest: int, max_new_tokens: int) -> None:
    """Refuse a request the model's positions cannot hold (before any work or output): the prompt
    and its new tokens (a decode step embeds its token's successor at the next position). One
    new token comes from the prompt's pass alone, so a prompt of all the positions can be scored."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if longest + max_new_tokens - (max_new_tokens == 1) > model.max_positions:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's {model.max_positions} positions")


class Engine:
    """engine.add(request) any time; engine.step() until not engine.busy. max_batch: the most
    requests decoding at once; capacity: the KV cache's positions a slot, at most the model's
    (memory: max_batch x capacity x the model's keys and values a position); kv_dtype: the
    cache's, float32 or bfloat16 (half the bytes a decode step reads); None: the precision's
    (precision.kv_dtype). precision: what every step runs at (bf16, tf32, fp32; None: the
    current one), the model's whatever else the process loads. Not thread-safe: callers in several
    threads hold `lock` around add, step and cancel (generation.run does)."""

    def __init__(self, model: DecoderModel, max_batch: int = MAX_BATCH, capacity: int | None = None,
                 prefill_tokens: int = PREFILL_TOKENS, kv_dtype=None, precision: str | None = None):
        if not 1 <= max_batch <= BUCKETS[-1]:     # past the last bucket a step's products would change kernel
            raise ValueError(f"max_batch must be 1 to {BUCKETS[-1]}, got {max_batch}")
        self.model, self.max_batch = model, max_batch
        self.capacity = min(capacity or CAPACITY, model.max_positions)
        self.precision = precision or current_precision()
        self.stream = device_stream(model.xp)      # all of the engine's GPU work, in order
        with self.stream, using(self.precision):
            kv_dtype = kv_dtype_of(model.xp) if kv_dtype is None else kv_dtype
            self.runner = ModelRunner(model, max_batch, self.capacity, kv_dtype)
        self.scheduler = Scheduler(self.runner.slots, max_batch, prefill_tokens)
        self.last: dict[int, int] = {}      # slot -> its last token (the next step's input)
        self.flow: Pipelined | None = None  # the decode under way (runner.decode)
        self.flow_rows: dict = {}           # slot -> request, the rows it decodes
        self.flow_left = 0                  # steps it has still to hand out
        # held by whoever drives the engine from several threads; re-entrant: the collector may close
        # an abandoned stream (its cancels) inside a step of the same thread
        self.lock = threading.RLock()

    def add(self, *requests: Request) -> None:
        """Queue requests, all or none: one that can never run raises ValueError here, before any
        is queued (requests added earlier go on)."""
        for r in requests:
            self.check(r)
        for r in requests:
            self.scheduler.add(r)

    def check(self, request: Request) -> None:
        """Raise ValueError for a request that could never run: everything of its own that a step
        reads (ids, sampling settings, embeddings) is checked here, before it joins a batch."""
        prompt, vocab = request.prompt, self.runner.vocab
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        if not 0 <= min(prompt) <= max(prompt) < vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
        s = request.sampling
        if not isinstance(s, Sampling) or s.top_k > vocab:
            raise ValueError(f"top_k must be in [0, {vocab}] (the vocabulary), got {s.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(s, name) or 0) > vocab:
                raise ValueError(f"{name} must be in [0, {vocab}] (the vocabulary), got {getattr(s, name)}")
        if not all(0 <= token < vocab for token, _ in s.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if request.embeds is not None and s.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs a prompt of token ids, not embeddings")
        width = self.model.embedding_tables[0].shape[1]
        if request.embeds is not None and tuple(request.embeds.shape) != (len(prompt), width):
            raise ValueError(f"embeds must be ({len(prompt)}, {width}) for {len(prompt)} prompt tokens, "
                             f"got {tuple(request.embeds.shape)}")
        check_length(self.model, len(prompt), request.max_new_tokens)
        if len(request.prompt) + request.max_new_tokens - 1 > self.capacity:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                             f"exceeds the engine's {self.capacity} positions a slot")

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def waiting(self) -> int:
        """Requests added and not yet running."""
        return len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        """Requests decoding now, a row each."""
        return len(self.scheduler.running)

    @property
    def free(self) -> int:
        """Rows no request holds or waits for: what more could join now without waiting."""
        return self.max_batch - self.running - self.waiting

    def cancel(self, request: Request) -> None:
        """Drop a request, waiting or running (a client that went away)."""
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        elif self.scheduler.running.get(request.slot) is request:
            with self.stream:       # its row's settings reset in order with the engine's other work
                self._finish(request)

    def cancel_where(self, which: Callable[[Request], bool] = lambda r: True) -> None:
        """Drop every waiting or running request for which which(request) holds (all by default)."""
        for r in [r for r in [*self.scheduler.waiting, *self.scheduler.running.values()] if which(r)]:
            self.cancel(r)

    def step(self) -> list[Event]:
        """Fold in the flow's next replay of tokens. Without a flow under way, or once a waiting
        request can take a free slot (the flow's queued replay folded in first), admit and
        prefill what fits and start a flow for the running rows."""
        events: list[Event] = []
        s = self.scheduler
        with self.stream, using(self.precision):
            if self.flow is not None:
                if not any(self._runs(slot, r) for slot, r in self.flow_rows.items()):
                    self._end_flow()        # its rows have all left (finished or cancelled)
                elif s.admission_due():
                    self.flow.stop()        # the replay already queued is its last
                    events += self._fold()
            if self.flow is None:
                admitted = s.admit()
                first = self.runner.prefill(admitted) if admitted else None
                if s.running:       # queued before the host has the first tokens: no gap on the GPU
                    self._start_flow(admitted, first)
                if admitted:
                    tokens, scores, prompt_scores = first.host()
                    for i, (r, tok) in enumerate(zip(admitted, tokens)):
                        if r.sampling.prompt_logprobs is not None:
                            r.score_prompt(at(prompt_scores, i))
                        events.append(self._push(r, int(tok), at(scores, i)))
            if self.flow is not None:
                events += self._fold()
        return events

    def _fold(self) -> list[Event]:
        """The flow's next replay of tokens into its requests still running (the GPU runs the
        replay after it meanwhile, if one is queued); the flow ends with its last replay."""
        final = self.flow.stopped       # asked for no further replay: none is queued after this one
        chunk = next(self.flow)
        n = len(chunk.tokens)
        self.flow_left -= n
        live = [(slot, r) for slot, r in self.flow_rows.items() if self._runs(slot, r)]
        for slot, _ in live:
            self.runner.slots.length[slot] += n
        events = [self._push(r, int(tokens[slot]), at(chunk.scores, (i, slot)))
                  for i, tokens in enumerate(chunk.tokens) for slot, r in live if not r.finished]
        if final or self.flow_left <= 0:
            self._end_flow()
        return events

    def _runs(self, slot: int, r: Request) -> bool:
        return self.scheduler.running.get(slot) is r

    def _start_flow(self, admitted: list[Request], first) -> None:
        """Decode the running rows as far as the furthest one needs (a row past its end computes
        steps that are ignored), within every row's slot; rows just admitted start from `first`
        (runner.FirstTokens) on the device. Waiting requests end it when the scheduler says they are
        due, not at the first row to finish: a flow cut at each end admits one request at a time,
        which made continuous batching slower than static batches (docs/performance.md)."""
        running = self.scheduler.running
        new = {id(r) for r in admitted}
        room = min(self.capacity - int(self.runner.slots.length[s]) for s in running)
        steps = min(max(r.remaining - (id(r) in new) for r in running.values()), room)
        if steps <= 0:          # every row ends with its first token
            return
        self.flow_rows, self.flow_left = dict(running), steps
        self.flow = self.runner.decode(running, dict(self.last), steps,
                                       ([r.slot for r in admitted], first) if admitted else None)

    def _end_flow(self) -> None:
        """Drop the flow (a replay it queued may still run: the next one's start waits for it)."""
        self.flow, self.flow_rows, self.flow_left = None, {}, 0

    def _push(self, r: Request, token: int, score: tuple | None = None) -> Event:
        try:
            piece = r.push(token, score)
        except Exception as e:      # noqa: BLE001 - its own text or stop strings failed: it alone ends
            r.error, piece = e.with_traceback(None), ""     # no cycle through this step's frames
        if r.finished:
            self._finish(r)
        else:
            self.last[r.slot] = token
        return Event(r, piece, r.finished)

    def _finish(self, r: Request) -> None:
        self.scheduler.finish(r)
        self.runner.release(r.slot)
        self.last.pop(r.slot, None)
        if not self.scheduler.running:
            self._end_flow()        # nothing left to decode: the flow lets go of its rows now
