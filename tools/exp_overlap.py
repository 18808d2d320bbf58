"""Experiment: greedy decode with each step's tokens copied to the host on a side stream
while the next step runs (DecodeGraph.greedy) against the copy queued between steps on the
decode stream (the previous loop), same run, same graphs."""
import argparse
import time

import cupy
import cupyx
import numpy as np

from benchlib import gpu_name, versions, write_result
from gpt.graph import DecodeGraph
from profile_decode import glm_asr, gpt2


def serial_greedy(g: DecodeGraph, ids, positions, steps):
    g._seed(ids, positions)
    stream = cupy.cuda.get_current_stream()
    host = [cupyx.empty_pinned(g.ids[0].shape[:1], np.int64) for _ in range(2)]
    ready = [None, None]

    def issue(s):
        _, tokens = g.launch()
        tokens.get(stream=stream, out=host[s % 2], blocking=False)
        ready[s % 2] = stream.record()

    issue(0)
    for s in range(steps):
        if s + 1 < steps:
            issue(s + 1)
        ready[s % 2].synchronize()
        yield host[s % 2].copy()


ap = argparse.ArgumentParser()
ap.add_argument("--model", default="gpt2")
ap.add_argument("--context", type=int, default=160)
ap.add_argument("--out")
args = ap.parse_args()
t = args.context
res = {"gpu": gpu_name(), "versions": versions(), "model": args.model, "context": t, "greedy_us": {}}
with cupy.cuda.Stream(non_blocking=True) as stream:
    step, cache = (gpt2 if args.model == "gpt2" else glm_asr)(1, t)
    g = DecodeGraph(step, cache)
    for rnd in range(4):
        for name, fn in (("side-stream copy", DecodeGraph.greedy), ("copy between steps", serial_greedy)):
            cache.length = t
            start = time.perf_counter()
            toks = [int(x[0]) for x in fn(g, np.ones(1), np.full(1, t), 200)]
            stream.synchronize()
            us = (time.perf_counter() - start) / len(toks) * 1e6
            res["greedy_us"].setdefault(name, []).append(round(us, 1))
            res.setdefault("tokens", {})[name] = toks[:8]
            print(f"round {rnd} {name:20s} {us:7.1f} us/token", flush=True)
write_result(f"exp-overlap-{args.model}", res, args.out)
