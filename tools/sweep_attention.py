"""Tile shapes and occupancy of the flash attention kernel on prefill and encoder shapes (GPU host).

    python tools/sweep_attention.py [--out DIR]

GLM-ASR's audio encoder (1500 frames, 20 heads of 64, bidirectional; one window and eight),
its decoder's prefill (450 tokens, 16 query heads on 4 KV heads of 128, causal) and a GPT-2
prefill (1024 tokens, 12 heads of 64, causal). Times per call (CUDA graph of 20 calls, median
of replays) for each (TILE_M, TILE_N) and occupancy hint, beside torch's
scaled_dot_product_attention (TF32 allowed) on the same tensors in the same run.
"""
from __future__ import annotations

import argparse
import math
from importlib import import_module

import cupy
import torch

import tilekernels._arrays as tk_arrays
from benchlib import graph_ms_cupy, graph_ms_torch, gpu_name, versions, write_result

att = import_module("tilekernels.attention")      # the module (tilekernels.attention is the op)

SHAPES = [  # (name, B, Hq, Hkv, T, D, causal)
    ("glm encoder, 1 window", 1, 20, 20, 1500, 64, False), ("glm encoder, 8 windows", 8, 20, 20, 1500, 64, False),
    ("glm prefill", 1, 16, 4, 450, 128, True), ("gpt2 prefill", 1, 12, 12, 1024, 64, True),
]
TILES = [(64, 64), (128, 64), (64, 128), (128, 128)]
KERNELS = {None: att.flash_kernel, 2: att.flash_kernel_occupancy2}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for name, b, hq, hkv, t, d, causal in SHAPES:
        q, k, v = (cupy.random.standard_normal((b, h, t, d), dtype=cupy.float32) for h in (hq, hkv, hkv))
        out = cupy.empty((b, t, hq, d), cupy.float32)
        start = cupy.zeros(b, cupy.int32)
        flops = 4 * b * hq * t * t * d * (0.5 if causal else 1.0)
        tq, tk_, tv = (torch.from_dlpack(a) for a in (q, k, v))
        ref = graph_ms_torch(lambda: torch.nn.functional.scaled_dot_product_attention(
            tq, tk_, tv, is_causal=causal, enable_gqa=hq != hkv))
        rows.append({"shape": name, "kernel": "torch sdpa", "us": round(ref * 1e3, 1), "tflops": round(flops / ref / 1e9, 1)})
        print(f"{name:24s} torch sdpa {ref * 1e3:8.1f} us ({flops / ref / 1e9:.0f} TFLOP/s)", flush=True)
        for (tm, tn), occupancy in [(t_, o) for t_ in TILES for o in KERNELS]:
            def one():
                tk_arrays.launch((-(-t // tm), b * hq, 1), KERNELS[occupancy],
                                 (q, k, v, out, start, math.log2(math.e) / math.sqrt(d), hq // hkv, d, tm, tn, causal,
                                  False))
            try:
                ms = graph_ms_cupy(one)
            except Exception as e:      # a configuration the compiler rejects is reported, not fatal
                print(f"{name:24s} ({tm}, {tn}) occupancy {occupancy}: {type(e).__name__}: {str(e)[:200]}")
                continue
            row = {"shape": name, "kernel": "flash", "tiles": [tm, tn], "occupancy": occupancy, "us": round(ms * 1e3, 1),
                   "tflops": round(flops / ms / 1e9, 1), "vs_torch": round(ref / ms, 2),
                   "library": att.flash_plan(d, causal) == (tm, tn, KERNELS[occupancy])}
            rows.append(row)
            print(f"{name:24s} ({tm:3d}, {tn:3d}) occ {occupancy} {ms * 1e3:8.1f} us ({row['tflops']:.0f} TFLOP/s, "
                  f"{row['vs_torch']:.2f}x torch){' library' if row['library'] else ''}", flush=True)
    write_result("attention-sweep", {"gpu": gpu_name(), "versions": versions(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
