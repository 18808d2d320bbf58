"""Which requests run: waiting ones join the running batch, first come first served, whenever a
slot is free; finished ones leave at once."""
from __future__ import annotations

from collections import deque

from .sequence import Request
from .slots import Slots


class Scheduler:
    def __init__(self, slots: Slots, max_batch: int, prefill_tokens: int):
        self.slots, self.max_batch, self.prefill_tokens = slots, max_batch, prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}       # slot -> request

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """The waiting requests (in order) that join now, each given a free slot. At most
        prefill_tokens prompt tokens (padded) join a step, so the running rows are never held up
        long by a burst of long prompts (a longer prompt than that joins alone)."""
        chosen: list[Request] = []
        while self.waiting and len(self.running) + len(chosen) < self.max_batch:
            longest = max([len(q.prompt) for q in chosen] + [len(self.waiting[0].prompt)])
            if chosen and longest * (len(chosen) + 1) > self.prefill_tokens:
                break
            chosen.append(self.waiting.popleft())
        for r in chosen:
            r.slot = self.slots.take()
            self.running[r.slot] = r
        return chosen

    def finish(self, request: Request) -> None:
        del self.running[request.slot]
        self.slots.release(request.slot)
