"""Tile shapes and launch options of the TF32 linear kernel on prefill and encoder products (GPU host).

    python tools/sweep_gemm.py [--shapes glm] [--out DIR]

Each (M, K, N) product of GLM-ASR's prefill (M = 450 prompt tokens) and audio encoder (M = 1500
frames of one window), and of short prompts (M = 32 to 128), runs over distinct weight copies (256 MB or more in all, five times the
L2) chained in one CUDA graph, as a prefill streams each layer's weights once. Times are per
call for the library's plan and for other (TILE_M, TILE_N, TILE_K), CTA-cluster sizes
(num_ctas) and split-K counts, beside torch.matmul (TF32 allowed) on the same operands in the
same run; the fraction is of the best the GPU did here (torch at 8192^3).
"""
from __future__ import annotations

import argparse
from importlib import import_module

import cuda.tile as ct
import cupy

import tilekernels._arrays as tk_arrays
from benchlib import copies_for, gpu_name, graph_ms_torch, rotating_ms, versions, write_result

lin = import_module("tilekernels.linear")     # the module (tilekernels.linear is the op)

SHAPES = [  # (name, M, K, N, gated)
    ("glm prefill qkv", 450, 2048, 3072, False), ("glm prefill o", 450, 2048, 2048, False),
    ("glm prefill gate_up", 450, 2048, 6144, True), ("glm prefill down", 450, 6144, 2048, False),
    ("glm encoder qkv", 1500, 1280, 3840, False), ("glm encoder o", 1500, 1280, 1280, False),
    ("glm encoder fc1", 1500, 1280, 5120, False), ("glm encoder fc2", 1500, 5120, 1280, False),
    # short prompts, where split-K has the most to give
    ("short gpt2 qkv", 32, 768, 2304, False), ("short gpt2 mlp proj", 64, 3072, 768, False),
    ("short glm down", 64, 6144, 2048, False), ("short glm o", 128, 2048, 2048, False),
]
TILES = [(128, 128, 32), (128, 256, 32), (256, 128, 32), (128, 128, 64), (64, 128, 64), (64, 256, 32)]
GLU_TILES = [(128, 64, 32), (128, 128, 32), (64, 128, 32), (128, 64, 64)]
KERNELS = {1: lin.linear_kernel, 2: ct.kernel(lin.linear_kernel._pyfunc, num_ctas=2)}


def run(m: int, k: int, n: int, gated: bool, tiles: tuple, ctas: int, split: int) -> float:
    """Per-call ms of one (tiles, num_ctas, split-K) configuration over rotating weight copies."""
    rows = 2 * n if gated else n
    ws = [cupy.random.standard_normal((rows, k), dtype=cupy.float32) * 0.02 for _ in range(copies_for(rows * k * 4))]
    x = cupy.random.standard_normal((m, k), dtype=cupy.float32)
    y = cupy.empty((m, n), cupy.float32)
    tm, tn, tkk = tiles
    k_tiles = -(-k // tkk)
    per = -(-k_tiles // split)
    split = -(-k_tiles // per)
    grid = (-(-m // tm) * -(-n // tn), split, 1)
    part = cupy.empty((split, m, n), cupy.float32) if split > 1 else y
    act = lin.SILU if gated else 0

    def one(w):
        w1, w2 = (w[:n], w[n:]) if gated else (w, w)
        if split == 1:
            tk_arrays.launch(grid, KERNELS[ctas], (x, w1, w2, w, y, y, per, tm, tn, tkk, False, act, gated, False,
                                                   False, False))
        else:
            tk_arrays.launch(grid, KERNELS[ctas], (x, w1, w2, w, y, part, per, tm, tn, tkk, False, 0, False, False,
                                                   True, False))
            tk_arrays.launch((m, -(-n // lin.REDUCE_TILE), 1), lin.splitk_reduce_kernel,
                             (part, w, y, y, lin.REDUCE_TILE, False, act, False))

    return rotating_ms(ws, one)


def torch_ms(m: int, k: int, n: int, gated: bool) -> float:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    rows = 2 * n if gated else n
    ws = [torch.randn(rows, k, device="cuda") * 0.02 for _ in range(copies_for(rows * k * 4))]
    x = torch.randn(m, k, device="cuda")
    it = iter(range(1 << 30))

    def one():
        w = ws[next(it) % len(ws)]
        y = x @ w.T
        if gated:
            y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
        return y

    ms = graph_ms_torch(one, inner=len(ws), reps=5)
    ws.clear()
    torch.cuda.empty_cache()
    return ms


def torch_peak_tflops() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda")
    return 2 * 8192 ** 3 / (graph_ms_torch(lambda: a @ a, inner=5, reps=5) * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--shapes", default="", help="only the shapes whose name starts with this")
    args = ap.parse_args()
    peak = torch_peak_tflops()
    print(f"torch TF32 at 8192^3: {peak:.0f} TFLOP/s")
    rows, best = [], {}
    for name, m, k, n, gated in SHAPES:
        if not name.startswith(args.shapes):
            continue
        flops = 2 * m * k * (2 * n if gated else n)
        plan = lin.linear_plan(m, n, k, gated, tk_arrays.sm_count())
        configs = [(plan[1], 1, plan[3], "library")]
        for tiles in GLU_TILES if gated else TILES:
            configs.append((tiles, 1, 1, ""))
            if not gated and tiles[0] * tiles[1] >= 128 * 128:
                configs.append((tiles, 2, 1, ""))
        ref = torch_ms(m, k, n, gated)
        print(f"{name:22s} torch {ref * 1e3:8.1f} us ({flops / ref / 1e9:.0f} TFLOP/s)", flush=True)
        rows.append({"shape": name, "M": m, "K": k, "N": n, "gated": gated, "kernel": "torch", "us": round(ref * 1e3, 1),
                     "tflops": round(flops / ref / 1e9, 1)})
        for tiles, ctas, split, note in configs:
            try:
                ms = run(m, k, n, gated, tiles, ctas, split)
            except Exception as e:      # a configuration the compiler rejects is reported, not fatal
                print(f"{name:22s} {tiles} ctas {ctas} split {split}: {type(e).__name__}: {str(e)[:200]}")
                continue
            row = {"shape": name, "M": m, "K": k, "N": n, "gated": gated, "kernel": note or "tiles", "tiles": list(tiles),
                   "num_ctas": ctas, "split_k": split, "us": round(ms * 1e3, 1), "tflops": round(flops / ms / 1e9, 1),
                   "vs_torch": round(ref / ms, 2)}
            rows.append(row)
            print(f"{name:22s} {str(tiles):16s} ctas {ctas} split {split:2d} {ms * 1e3:8.1f} us "
                  f"({row['tflops']:.0f} TFLOP/s, {row['vs_torch']:.2f}x torch) {note}", flush=True)
            if name not in best or ms * 1e3 < best[name]["us"]:
                best[name] = row
    write_result("gemm-sweep", {"gpu": gpu_name(), "versions": versions(), "torch_tf32_peak_tflops": round(peak, 1),
                                "rows": rows, "best": best}, args.out)


if __name__ == "__main__":
    main()
