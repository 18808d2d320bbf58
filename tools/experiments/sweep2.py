"""#72 sweep (experiment, out of tree): fp32 linear at M=1/16 (skinny kernel: block width, K chunk,
splits, occupancy), M=512 (tiles, split), M=4096 (tiles, num_ctas). --warm I N compiles variants
I::N; --time OUT times all (graph replays, torch beside) and writes JSON rows."""
import json, sys, importlib
sys.path.insert(0, "tools")
import cupy
import numpy as np
import tilekernels as tk
L = importlib.import_module("tilekernels.linear")
T_ = importlib.import_module("tilekernels.tiling")
from tilekernels._arrays import launch, last_block_counters
from tilekernels.precision import mma_mode
from benchlib import graph_ms_cupy, graph_ms_torch

SHAPES = [(768, 2304), (768, 3072), (3072, 768), (1280, 5120), (5120, 1280), (2048, 6144), (6144, 2048)]
BIG = SHAPES + [(768, 50257), (2048, 59264)]
KERNS = {}


def kern(base, occ=None, ctas=None):
    key = (base, occ, ctas)
    if key not in KERNS:
        k = getattr(L, base)
        h = {}
        if occ is not None:
            h["occupancy"] = occ
        if ctas is not None:
            h["num_ctas"] = ctas
        KERNS[key] = k.replace_hints(**h) if h else k
    return KERNS[key]


def skinny_variants(m, k, n):
    tm, tn0, tk0 = T_.skinny_tiles(m, n, False, 4)
    per0, split0 = T_.skinny_splits(n, k, tn0, tk0, False, 132)
    units0 = per0 * tk0 // 256
    k_units = -(-k // 256)
    out = []
    for units in sorted({units0, max(1, units0 // 2), min(k_units, 2 * units0), k_units}):
        for tn in (32, 64):
            for tkk in (64, 128, 256):
                if (units * 256) % tkk:
                    continue
                for occ in (None, 2):
                    out.append(("skinny", m, k, n, dict(tm=tm, tn=tn, tk=tkk, units=units, occ=occ)))
    return out


def tile_variants(m, k, n):
    out = []
    if m == 512:
        for t in ((128, 64, 32), (64, 64, 32), (128, 128, 32), (64, 128, 32)):
            for split in (1, 2, 3, 4, 6):
                for occ in (None, 2):
                    out.append(("tiles", m, k, n, dict(t=t, split=split, occ=occ, ctas=None)))
    else:
        for t in ((128, 128, 32), (128, 64, 32), (128, 256, 32), (256, 128, 32)):
            for ctas in (None, 2):
                for occ in (None, 2):
                    out.append(("tiles", m, k, n, dict(t=t, split=1, occ=occ, ctas=ctas)))
    return out


def variants():
    out = []
    for k, n in SHAPES:
        for m in (1, 16):
            out += skinny_variants(m, k, n)
    for k, n in BIG:
        for m in (512, 4096):
            out += tile_variants(m, k, n)
    return out


def run(v, x, w, b):
    kind, m, k, n, p = v
    mode = mma_mode(w.dtype)
    y = cupy.empty((m, n), cupy.float32)
    if kind == "skinny":
        tm, tn, tkk, units, occ = p["tm"], p["tn"], p["tk"], p["units"], p["occ"]
        per = units * 256 // tkk
        split = -(-(-(-k // 256)) // units)
        nb = -(-n // tn)
        pp = s_ = c = y
        if split > 1:
            pp = cupy.empty((split, nb * tn, tm), cupy.float32)
            s_ = cupy.empty((split, 2, tm), cupy.float32)
            c = last_block_counters(nb)
        kk = kern("skinny_kernel", 2) if occ == 2 else kern("skinny_kernel_one_an_sm")
        launch((1, nb, split), kk, (x, w, w, x, b, y, y, y, y, pp, pp, s_, c, 0.0, per, tm, tn, tkk,
                                     True, 0, False, False, L.NO_NORM, False, mode, split, False, False, False))
        return y
    tm, tn, tkk = p["t"]
    split = p["split"]
    kt = -(-k // tkk)
    per = -(-kt // split)
    split = -(-kt // per)
    grid = (-(-m // tm) * -(-n // tn), split, 1)
    kk = kern("linear_kernel", p["occ"], p["ctas"])
    if split == 1:
        launch(grid, kk, (x, w, w, b, y, y, per, tm, tn, tkk, True, 0, False, False, False, mode))
    else:
        part = cupy.empty((split, m, n), cupy.float32)
        launch(grid, kk, (x, w, w, b, y, part, per, tm, tn, tkk, False, 0, False, False, True, mode))
        launch((m, -(-n // 256), 1), L.splitk_reduce_kernel, (part, b, y, y, 256, True, 0, False))
    return y


def rand(*s, scale=1.0):
    return cupy.random.standard_normal(s, dtype=cupy.float32) * scale


def main():
    vs = variants()
    if sys.argv[1] == "--warm":
        i, nproc = int(sys.argv[2]), int(sys.argv[3])
        for v in vs[i::nproc]:
            _, m, k, n, _ = v
            x, w, b = rand(m, k), rand(n, k), rand(n)
            try:
                run(v, x, w, b)
            except Exception as e:
                print("FAIL", v, repr(e)[:300], flush=True)
        cupy.cuda.Device().synchronize()
        return
    import torch
    import torch.nn.functional as F
    torch.backends.cuda.matmul.allow_tf32 = True
    rows, data = [], {}
    for v in vs:
        _, m, k, n, p = v
        if (m, k, n) not in data:
            x, w, b = rand(m, k), rand(n, k, scale=0.02), rand(n)
            tx, tw, tb = (torch.from_dlpack(a) for a in (x, w, b))
            t = graph_ms_torch(lambda: F.linear(tx, tw, tb))
            ref = x.astype(cupy.float64) @ w.T.astype(cupy.float64) + b
            ship = tk.linear(x, w, b)
            s = graph_ms_cupy(lambda: tk.linear(x, w, b))
            data[(m, k, n)] = (x, w, b, t, ref, ship)
            rows.append(dict(kind="shipped", m=m, k=k, n=n, ours_ms=round(s, 4), torch_ms=round(t, 4), x=round(t / s, 3)))
            print(rows[-1], flush=True)
        x, w, b, t, ref, ship = data[(m, k, n)]
        try:
            y = run(v, x, w, b)
            err = float(cupy.abs(y - ref).max() / cupy.abs(ref).max())
            same = bool((y == ship).all())
            o = graph_ms_cupy(lambda: run(v, x, w, b))
        except Exception as e:
            print("FAIL", v, repr(e)[:200], flush=True)
            continue
        rows.append(dict(kind=v[0], m=m, k=k, n=n, p={a: (list(c) if isinstance(c, tuple) else c) for a, c in p.items()},
                         ours_ms=round(o, 4), torch_ms=round(t, 4), x=round(t / o, 3), err=err, same_bits=same))
        print(rows[-1], flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(rows, f)


main()
