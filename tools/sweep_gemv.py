"""Tile shapes of the batch-1 decode projections, measured as decode sees them (GPU host).

    python tools/sweep_gemv.py [--tiles 2x1024,1x2048] [--shapes gpt2] [--plain] [--out DIR]

Each shape runs as a chain of projections over distinct weight copies (256 MB or more in
all, five times the L2), captured in one CUDA graph, so every call streams its weights from
HBM as in a real decode step. Times are per call, with programmatic dependent launch (and
without it too with --plain), for the GEMV kernel at several (TILE_N, TILE_K) and for the
skinny (mma) kernel. A TILE_K covering all of K puts a block's whole weight slice in flight
before the kernel waits for its input. Chains of one shape flatter the GEMV against whole
decode steps (tools/profile_decode.py --plans), which have the last word.
"""
from __future__ import annotations

import argparse
import itertools
from importlib import import_module

import cupy

import tilekernels._arrays as tk_arrays
from tilekernels._arrays import next_pow2
from benchlib import copies_for, gpu_name, rotating_ms, versions, write_result

lin = import_module("tilekernels.linear")     # the module (tilekernels.linear is the op)

SHAPES = [  # (name, K, N, gated)
    ("gpt2 qkv", 768, 2304, False), ("gpt2 attn proj", 768, 768, False), ("gpt2 fc", 768, 3072, False),
    ("gpt2 mlp proj", 3072, 768, False), ("gpt2 head", 768, 50257, False),
    ("glm qkv", 2048, 3072, False), ("glm o", 2048, 2048, False), ("glm down", 6144, 2048, False),
    ("glm gate_up", 2048, 6144, True), ("glm head", 2048, 59264, False),
]
GEMV = [(tn, tk) for tn, tk in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048, 4096, 8192))
        if 2048 <= tn * tk <= 8192]


def chain(k: int, n: int, gated: bool, kind: str, tiles: tuple) -> float:
    """Per-call ms of the projection over rotating weight copies."""
    rows = 2 * n if gated else n
    ws = [cupy.random.standard_normal((rows, k), dtype=cupy.float32) * 0.02 for _ in range(copies_for(rows * k * 4))]
    x = cupy.random.standard_normal((1, k), dtype=cupy.float32)
    y = cupy.empty((1, n), cupy.float32)
    act = lin.SILU if gated else 0

    def one(w):
        w1, w2 = (w[:n], w[n:]) if gated else (w, w)
        flags = (False, act, gated, False, lin.NO_NORM)
        if kind == "gemv":
            tn, tk = tiles
            tk_arrays.launch((-(-n // tn), 1, 1), lin.gemv_kernel,
                             (x, w1, w2, x, y, y, y, 0.0, tn, tk, *flags, False, False, tk >= k))
        else:
            tm, tn, tk = tiles
            tk_arrays.launch((-(-n // tn), 1, 1), lin.skinny_kernel,
                             (x, w1, w2, x, y, y, y, 0.0, tm, tn, tk, *flags, False, False))

    return rotating_ms(ws, one)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--tiles", help="GEMV (TILE_N x TILE_K) list to try, default all")
    ap.add_argument("--shapes", default="", help="only the shapes whose name starts with this")
    ap.add_argument("--plain", action="store_true", help="also time without dependent launch")
    args = ap.parse_args()
    gemv = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")] if args.tiles else GEMV
    rows = []
    for name, k, n, gated in SHAPES:
        if not name.startswith(args.shapes):
            continue
        nbytes = (2 if gated else 1) * n * k * 4
        configs = [("gemv", t) for t in gemv if t[1] <= next_pow2(k) and (not gated or t[0] * t[1] <= 8192)]
        configs.append(("skinny", lin.SKINNY_GLU if gated else lin.SKINNY))
        for kind, tiles in configs:
            row = {"shape": name, "K": k, "N": n, "gated": gated, "kernel": kind, "tiles": list(tiles)}
            for dependent in (True, False) if args.plain else (True,):
                tk_arrays.DEPENDENT_LAUNCH = dependent
                ms = chain(k, n, gated, kind, tiles)
                key = "dependent" if dependent else "plain"
                row[f"{key}_us"] = round(ms * 1e3, 2)
                row[f"{key}_tb_s"] = round(nbytes / (ms * 1e-3) / 1e12, 3)
            tk_arrays.DEPENDENT_LAUNCH = True
            rows.append(row)
            print(f"{name:16s} {kind:6s} {str(tiles):14s} dependent {row['dependent_us']:8.2f} us "
                  f"({row['dependent_tb_s']:.2f} TB/s)", flush=True)
    best = {}
    for r in rows:
        if r["shape"] not in best or r["dependent_us"] < best[r["shape"]]["dependent_us"]:
            best[r["shape"]] = r
    write_result("gemv-sweep", {"gpu": gpu_name(), "versions": versions(), "rows": rows,
                                "best": {k: [v["kernel"], v["tiles"], v["dependent_us"]] for k, v in best.items()}},
                 args.out)


if __name__ == "__main__":
    main()
