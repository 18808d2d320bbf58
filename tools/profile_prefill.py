"""Where GLM-ASR's audio encoder and prompt prefill spend their time (GPU host).

    python tools/profile_prefill.py [--windows 1] [--prompt 450] [--weights bf16|fp32] [--precision bf16] [--out DIR]

Full size, random weights (benchlib.random_glm_asr). Each stage, after a warm-up call: its wall time run eagerly (each
kernel launched from Python) and replayed from a CUDA graph (as transcription runs the encoder
and the prefill), the sum of its kernels' device time (torch.profiler's CUDA activity, eager,
dependent launch off) and its kernels by total device time. An eager wall time well above the
device sum means the stage waits on host launches, not on the GPU.
"""
from __future__ import annotations

import argparse
import time

import cupy

import tilekernels as tk
from benchlib import gpu_name, rand, random_glm_asr, versions, write_result
from tilekernels.runtime import ShapeGraphs
from tilekernels.runtime.precision import DEFAULT, PRECISIONS, kv_dtype, set_precision


def wall_ms(fn) -> float:
    sync = cupy.cuda.Device().synchronize
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def stage(eager, graph) -> dict:
    """Wall times of the eager and the graph-replayed stage, and the eager stage's kernels (with
    dependent launch off, so that no kernel's time includes waiting for the one before it)."""
    from torch.profiler import ProfilerActivity, profile

    result = {"wall_ms": round(wall_ms(eager), 2), "graph_wall_ms": round(wall_ms(graph), 2)}
    with tk.dependent_launch(False):
        eager()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eager()
            cupy.cuda.Device().synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    kernels = [{"name": e.key[:60], "calls": e.count, "us_per_call": round(e.device_time_total / e.count, 2),
                "ms_total": round(e.device_time_total / 1e3, 3)} for e in events if e.device_time_total > 0]
    return {**result, "device_ms": round(sum(k["ms_total"] for k in kernels), 2),
            "launches": sum(k["calls"] for k in kernels), "kernels": kernels}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=1, help="30 s windows encoded together")
    ap.add_argument("--prompt", type=int, default=450, help="prompt tokens of the prefill")
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16",
                    help="matrices of bfloat16 values stored as such (the hub checkpoint's), or float32 ones")
    ap.add_argument("--precision", choices=tuple(PRECISIONS), default=DEFAULT,
                    help="the precision the products run at (the KV cache's dtype follows)")
    ap.add_argument("--out")
    args = ap.parse_args()
    set_precision(args.precision)
    model = random_glm_asr(encoder=True, weights=args.weights)
    e, d = model.config.encoder, model.config.decoder
    feats = rand(args.windows, e.num_mel_bins, 3000) * 50
    states = model.audio_tower_eager(feats)
    x = rand(1, args.prompt, d.hidden_size)
    cache = model.new_cache(1, args.prompt, kv_dtype(cupy))
    step = ShapeGraphs(lambda x: model.step(x, cache))

    def prefill_eager():
        cache.length = 0
        return model.forward(x, cache)

    def prefill_graph():
        cache.length = 0
        cache.begin(args.prompt)
        return step(x)

    result = {"gpu": gpu_name(), "versions": versions(), "model": "glm-asr, random weights", "windows": args.windows,
              "prompt": args.prompt, "weights": args.weights, "precision": args.precision,
              "encoder": stage(lambda: model.audio_tower_eager(feats), lambda: model.audio_tower(feats)),
              "projector": stage(lambda: model.project(states), lambda: model.project(states)),
              "prefill": stage(prefill_eager, prefill_graph)}
    for name in ("encoder", "projector", "prefill"):
        s = result[name]
        print(f"{name}: wall {s['wall_ms']:.2f} ms eager, {s['graph_wall_ms']:.2f} ms as a graph; "
              f"device {s['device_ms']:.2f} ms in {s['launches']} kernels")
        for k in s["kernels"][:12]:
            print(f"   {k['name'][:44]:44s} {k['calls']:5d} x {k['us_per_call']:8.2f} us = {k['ms_total']:7.3f} ms")
    write_result(f"prefill-profile-glm-asr-w{args.windows}-{args.weights}", result, args.out)


if __name__ == "__main__":
    main()
