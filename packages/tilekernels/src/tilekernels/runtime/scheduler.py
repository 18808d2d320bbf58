"""Which requests run: waiting ones join the running batch, first come first served, whenever a
slot is free; finished ones leave at once. While the engine decodes a flow of steps, the scheduler
says when waiting requests are worth ending it for (admission_due): a flow cut at each arrival
admits one request at a time, while a few idle rows of a wide batch cost almost nothing (a decode
step reads the same weights for 56 rows as for 64), so arrivals one at a time join in groups."""
from __future__ import annotations

import time
from collections import deque

from .sequence import Request
from .slots import Slots

ADMIT_WAIT_S = 0.02     # the longest a flow keeps a free slot from a waiting request


class Scheduler:
    def __init__(self, slots: Slots, max_batch: int, prefill_tokens: int):
        self.slots, self.max_batch, self.prefill_tokens = slots, max_batch, prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}       # slot -> request
        self.held_since: float | None = None        # since when a free slot has waited for a request

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def admission_due(self) -> bool:
        """Whether the decode under way should end for the waiting requests: some can take a free
        slot, and they are at least an eighth of the running rows or a slot has waited
        ADMIT_WAIT_S."""
        joinable = min(len(self.waiting), self.max_batch - len(self.running))
        if joinable <= 0:
            return False
        if joinable >= max(1, len(self.running) // 8):
            return True
        now = time.monotonic()
        if self.held_since is None:
            self.held_since = now
        return now - self.held_since >= ADMIT_WAIT_S

    def admit(self) -> list[Request]:
        """The waiting requests (in order) that join now, each given a free slot. At most
        prefill_tokens prompt tokens (padded) join a step, so the running rows are never held up
        long by a burst of long prompts (a longer prompt than that joins alone)."""
        self.held_since = None
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
