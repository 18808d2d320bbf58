"""Running a workload through an engine, shared by the CPU and GPU engine tests."""
from __future__ import annotations

from tilekernels.runtime import Engine, Request, Sampling

GREEDY = Sampling(temperature=0)


def run(engine: Engine, work, sampling=GREEDY, seeds=None, arrive_every: int = 0) -> list[list[int]]:
    """Every request's tokens (eos ignored) for work [(prompt, max_new_tokens)]; sampling: one
    Sampling for all, or one a request. With arrive_every, a request joins every that many steps
    while the others run, instead of all at the start."""
    settings = sampling if isinstance(sampling, list) else [sampling] * len(work)
    reqs = [Request(p, n, settings[i], None if seeds is None else seeds[i], tag=i) for i, (p, n) in enumerate(work)]
    pending = list(reqs)
    while pending or engine.busy:
        for _ in range(len(pending) if not arrive_every else 1):
            if pending:
                engine.add(pending.pop(0))
        for _ in range(max(arrive_every, 1)):
            engine.step()
    assert all(r.finished for r in reqs)
    return [r.out.tokens for r in reqs]
