"""Experiment: warm L2 with the weights of upcoming projections from a side stream of the
decode graph, so a projection's weight loads hit L2 instead of HBM while the dependent chain
is between kernels (HBM averages ~1.4 TB/s over a gpt2 step).

    python tools/exp_l2_prefetch.py [--model gpt2|glm-asr] [--variants 1:32:8,2:32:8] [--out DIR]

Variant A:CAP:PER:KIND: at the j-th projection of the step, a side-stream kernel reads the weight of
projection j + A (when it is at most CAP MB), PER tiles a block, KIND a kernel of TOUCH. The order of
projections is recorded in the eager warm-up that precedes the capture.
"""
from __future__ import annotations

import argparse

import cuda.tile as ct
import cupy
import numpy as np

import tilekernels as tk
from benchlib import gpu_name, versions, write_result
from profile_decode import glm_asr, gpt2, time_graph
from tilekernels._arrays import launch

ConstInt = ct.Constant[int]
LIBRARY_LINEAR = tk.linear


def touch(W, SINK, PER: ConstInt, TILE: ConstInt):
    """Read PER tiles of the flat array W (no wait: weights are constants); the sum is stored
    only if it hits an impossible value, so the loads cannot be dropped."""
    ntiles = ct.cdiv(W.shape[0], TILE)
    base = ct.bid(0) * PER
    acc = ct.full((TILE,), 0.0, dtype=ct.float32)
    for i in range(base, min(base + PER, ntiles)):
        acc = acc + ct.load(W, index=(i,), shape=(TILE,), padding_mode=ct.PaddingMode.ZERO)
    s = ct.sum(acc)
    if s == -1.0e38:
        ct.store(SINK, index=(0,), tile=ct.reshape(s, (1,)))


# TMA loads into shared memory, several stages in flight: (tile, kernel) by name; the occupancy
# hint keeps registers (64 / 30 a thread) and shared memory (50 / 25 KB) off the projections' way
TOUCH = {"t4": (4096, ct.kernel(touch, occupancy=4)), "t8": (1024, ct.kernel(touch, occupancy=8))}


class Prefetcher:
    def __init__(self, ahead: int, cap_mb: float, per: int, kind: str):
        self.ahead, self.cap, self.per = ahead, cap_mb * 2 ** 20, per
        self.tile, self.kernel = TOUCH[kind]
        self.side = cupy.cuda.Stream(non_blocking=True)
        self.sink = cupy.zeros(1, cupy.float32)
        self.order, self.j, self.used = [], 0, False

    def linear(self, x, weight, *args, **kwargs):
        stream = cupy.cuda.get_current_stream()
        if not stream.is_capturing():
            self.order.append(weight)
        else:
            nxt = self.j + self.ahead
            self.j += 1
            if nxt < len(self.order) and self.order[nxt].nbytes <= self.cap:
                w = self.order[nxt].reshape(-1)
                self.side.wait_event(stream.record())
                with self.side:
                    ntiles = -(-w.size // self.tile)
                    launch((-(-ntiles // self.per), 1, 1), self.kernel, (w, self.sink, self.per, self.tile))
                self.used = True
        return LIBRARY_LINEAR(x, weight, *args, **kwargs)

    def wrap(self, step):
        def run(i, p):
            out = step(i, p)
            stream = cupy.cuda.get_current_stream()
            if stream.is_capturing() and self.used:
                stream.wait_event(self.side.record())
            return out
        return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt2", "glm-asr"), default="gpt2")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--variants", default="1:32:8:t4,2:32:8:t4,4:32:8:t4,2:32:16:t8")
    ap.add_argument("--out")
    args = ap.parse_args()
    t = args.context
    ids, pos = np.ones((1, 1)), np.full((1, 1), t)
    result = {"gpu": gpu_name(), "versions": versions(), "model": f"{args.model}, random weights", "context": t,
              "replay_us": {}}
    with cupy.cuda.Stream(non_blocking=True) as stream:
        step, cache = (gpt2 if args.model == "gpt2" else glm_asr)(1, t)
        for rnd in range(2):
            for name in ["library"] + args.variants.split(","):
                if name == "library":
                    tk.linear = LIBRARY_LINEAR
                    run = step
                else:
                    a, cap, per, kind = name.split(":")
                    pf = Prefetcher(int(a), float(cap), int(per), kind)
                    tk.linear = pf.linear
                    run = pf.wrap(step)
                try:
                    replay, chain = time_graph(run, cache, ids, pos, t, stream)
                except Exception as e:      # noqa: BLE001 - an experiment: report and go on
                    print(f"{name}: failed: {type(e).__name__}: {e}")
                    tk.linear = LIBRARY_LINEAR
                    continue
                tk.linear = LIBRARY_LINEAR
                result["replay_us"].setdefault(name, []).append(round(replay, 1))
                print(f"round {rnd} {name:10s}: replay {replay:7.1f} us, greedy {chain:7.1f} us/token", flush=True)
    write_result(f"exp-l2-prefetch-{args.model}", result, args.out)


if __name__ == "__main__":
    main()
