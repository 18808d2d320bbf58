"""Where a GPT-2 decode step spends its GPU time (GPU host).

    python tools/profile_decode.py [--batch 1] [--context 64]

gpt2 (124M) with random weights: times one replay of the captured decode graph and the
greedy chain per token, then lists each kernel's device time over 5 eager steps
(torch.profiler's CUDA activity, which sees cuTile and cupy kernels alike).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import cupy
import numpy as np
from torch.profiler import ProfilerActivity, profile

from gpt.graph import DecodeGraph
from gpt.model import GPT


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    args = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as tmp:
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp)
        model = GPT.load(Path(tmp), "gpu")
    b, t = args.batch, args.context
    ids, pos = np.ones((b, 1)), np.full((b, 1), t)
    with cupy.cuda.Stream(non_blocking=True) as stream:
        cache = model.new_cache(b, t + 300)
        model.forward(cupy.ones((b, t), cupy.int64), cupy.arange(t)[None].repeat(b, 0), cache)
        graph = DecodeGraph(lambda i, p: model.step(i, p, cache), cache)
        for _ in range(5):
            cache.length = t
            graph(ids, pos)
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            cache.length = t
            graph(ids, pos)
        stream.synchronize()
        print(f"graph replay: {(time.perf_counter() - start) * 1e4:.1f} us per step")
        cache.length = t
        start = time.perf_counter()
        n = sum(1 for _ in graph.greedy(ids[:, 0], pos[:, 0], 200))
        stream.synchronize()
        print(f"greedy chain: {(time.perf_counter() - start) / n * 1e6:.1f} us per token")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                cache.length = t
                model.forward(cupy.ones((b, 1), cupy.int64), cupy.full((b, 1), t), cache)
            stream.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))


if __name__ == "__main__":
    main()
