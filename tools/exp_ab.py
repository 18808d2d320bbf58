"""Experiment: same-run A/B of whole decode steps: the library against cupy's argmax and
cupy's += 1 for the step's counters, and against the GEMV for vocabulary heads too."""
import argparse
import cupy
import numpy as np

import tilekernels as tk
from benchlib import gpu_name, versions, write_result
from profile_decode import glm_asr, gpt2, time_graph, use_plan

TK_ARGMAX, TK_INCREMENT = tk.argmax, tk.increment


def cupy_argmax(logits, out):
    out[...] = logits.argmax(-1)
    return out


def cupy_increment(*arrays):
    for a in arrays:
        a += 1


VARIANTS = {"library": ("library", TK_ARGMAX, TK_INCREMENT), "cupy-advance": ("library", TK_ARGMAX, cupy_increment),
            "cupy-tail": ("library", cupy_argmax, cupy_increment), "gemv-heads": ("gemv-heads", TK_ARGMAX, TK_INCREMENT)}

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="gpt2")
ap.add_argument("--context", type=int, default=160)
ap.add_argument("--out")
args = ap.parse_args()
t = args.context
ids, pos = np.ones((1, 1)), np.full((1, 1), t)
res = {"gpu": gpu_name(), "versions": versions(), "model": args.model, "context": t, "replay_us": {}, "greedy_us": {}}
with cupy.cuda.Stream(non_blocking=True) as stream:
    step, cache = (gpt2 if args.model == "gpt2" else glm_asr)(1, t)
    for rnd in range(3):
        for name, (plan, am, inc) in VARIANTS.items():
            use_plan(plan)
            tk.argmax, tk.increment = am, inc
            replay, chain = time_graph(step, cache, ids, pos, t, stream)
            res["replay_us"].setdefault(name, []).append(round(replay, 1))
            res["greedy_us"].setdefault(name, []).append(round(chain, 1))
            print(f"round {rnd} {name:12s} replay {replay:7.1f} us greedy {chain:7.1f} us/token", flush=True)
    use_plan("library")
    tk.argmax, tk.increment = TK_ARGMAX, TK_INCREMENT
write_result(f"exp-ab-{args.model}", res, args.out)
