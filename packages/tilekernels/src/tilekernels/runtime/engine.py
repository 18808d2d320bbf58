"""The continuous-batching engine both models run on: requests join the running batch at any
step and leave it the step they finish, their slot going to the next waiting request.

Each step admits what fits (scheduler.py), prefills it (runner.py: ragged prompts in one
batch, at most prefill_tokens of them, so running rows wait little), then runs up to CHAIN
decode steps of every running row from one replayed chain of CUDA graphs, and folds the tokens
into the requests (sequence.py: eos, stop strings, length).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import precision
from .device import device_stream
from .graphs import CHAIN
from .protocol import DecoderModel
from .runner import BUCKETS, ModelRunner
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


def check_length(model, longest: int, max_new_tokens: int) -> None:
    """Refuse a request the model's positions cannot hold (before any work or output)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if longest + max_new_tokens > model.max_positions:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's {model.max_positions} positions")


class Engine:
    """engine.add(request) any time; engine.step() until not engine.busy. max_batch: the most
    requests decoding at once; capacity: the KV cache's positions a slot (memory: max_batch x
    capacity x the model's keys and values a position); kv_dtype: the cache's, float32 or
    bfloat16 (half the bytes a decode step reads); None: the precision's (precision.kv_dtype)."""

    def __init__(self, model: DecoderModel, max_batch: int = MAX_BATCH, capacity: int | None = None,
                 prefill_tokens: int = PREFILL_TOKENS, kv_dtype=None):
        if not 1 <= max_batch <= BUCKETS[-1]:     # past the last bucket a step's products would change kernel
            raise ValueError(f"max_batch must be 1 to {BUCKETS[-1]}, got {max_batch}")
        self.model, self.max_batch = model, max_batch
        self.capacity = capacity or min(CAPACITY, model.max_positions)
        kv_dtype = precision.kv_dtype(model.xp) if kv_dtype is None else kv_dtype
        with device_stream(model.xp):
            self.runner = ModelRunner(model, max_batch, self.capacity, kv_dtype)
        self.scheduler = Scheduler(self.runner.slots, max_batch, prefill_tokens)
        self.last: dict[int, int] = {}      # slot -> its last token (the next step's input)

    def add(self, request: Request) -> None:
        """Queue a request; one that can never run raises ValueError here (the others go on)."""
        self.check(request)
        self.scheduler.add(request)

    def check(self, request: Request) -> None:
        """Raise ValueError for a request that could never run."""
        if not request.prompt:
            raise ValueError("empty prompt: give at least one token")
        check_length(self.model, len(request.prompt), request.max_new_tokens)
        if len(request.prompt) + request.max_new_tokens - 1 > self.capacity:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                             f"exceeds the engine's {self.capacity} positions a slot")

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def cancel(self, request: Request) -> None:
        """Drop a request, waiting or running (a client that went away)."""
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        elif self.scheduler.running.get(request.slot) is request:
            self._finish(request)

    def step(self) -> list[Event]:
        """Admit and prefill what fits, then decode the running rows a chain of steps."""
        events: list[Event] = []
        with device_stream(self.model.xp):
            admitted = self.scheduler.admit()
            if admitted:
                for r, tok in zip(admitted, self.runner.prefill(admitted)):
                    events.append(self._push(r, int(tok)))
            running = self.scheduler.running
            if running:
                ahead = max(r.remaining for r in running.values())
                soonest = min(r.remaining for r in running.values())
                room = min(self.capacity - int(self.runner.slots.length[s]) for s in running)
                steps = min(CHAIN, ahead, room)         # rows past their end keep writing: not past the slot
                if self.scheduler.waiting and soonest < steps:      # free that slot for a waiting request
                    steps = soonest
                tokens = self.runner.decode(running, dict(self.last), steps)
                for s in range(steps):
                    for slot, r in list(running.items()):
                        events.append(self._push(r, int(tokens[s, slot])))
        return events

    def _push(self, r: Request, token: int) -> Event:
        piece = r.push(token)
        if r.finished:
            self._finish(r)
        else:
            self.last[r.slot] = token
        return Event(r, piece, r.finished)

    def _finish(self, r: Request) -> None:
        self.scheduler.finish(r)
        self.runner.release(r.slot)
        self.last.pop(r.slot, None)
