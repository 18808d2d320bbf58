"""Where a GPT-2 decode step spends its time (GPU host): per-step wall times, then a
cProfile of warm steps. python tools/profile_decode.py [--batch 1] [--steps 64]"""
import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import cupy
import numpy as np
import torch

from gpt.model import GPT


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as tmp:
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp)
        model = GPT.load(Path(tmp), "gpu")
    b = args.batch
    cache = model.new_cache(b, 32 + 2 * args.steps)
    logits = model.forward(cupy.asarray(np.ones((b, 32), np.int64)), cupy.arange(32)[None].repeat(b, 0), cache)
    times = []
    for s in range(2 * args.steps):
        t = time.perf_counter()
        tok = cupy.asnumpy(logits).argmax(-1)
        if s == args.steps:
            prof = cProfile.Profile()
            prof.enable()
        logits = model.forward(cupy.asarray(tok[:, None]), cupy.full((b, 1), 32 + s), cache)
        cupy.cuda.Device().synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    prof.disable()
    print("step ms, first pass:", " ".join(f"{x:.1f}" for x in times[: args.steps]))
    print("step ms, second pass:", " ".join(f"{x:.1f}" for x in times[args.steps:]))
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
