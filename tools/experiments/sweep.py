"""Tile sweep for #72's slower rows (experiment, not shipped): fp32 TF32 linear at M=512/4096,
3xTF32, elementwise tile. --warm I N: compile variants I::N; --time: time all, JSON to argv out."""
import json, sys
sys.path.insert(0, "tools")
import cupy
import tilekernels as tk
import importlib
L = importlib.import_module("tilekernels.linear")      # the package exports a function named linear
import tilekernels.activations as A
from benchlib import graph_ms_cupy, graph_ms_torch

TILES = [(128, 128, 32, 0), (128, 128, 32, 2), (128, 64, 32, 0), (128, 64, 32, 2), (64, 128, 32, 2),
         (64, 64, 32, 2), (128, 128, 64, 0), (64, 128, 64, 2), (128, 256, 32, 0), (256, 128, 32, 0)]
SHAPES = [(512, 3072, 768), (512, 1280, 5120), (512, 5120, 1280), (512, 2048, 6144), (512, 6144, 2048),
          (512, 2048, 59264), (4096, 768, 2304), (4096, 768, 3072), (4096, 3072, 768), (4096, 1280, 5120),
          (4096, 5120, 1280), (4096, 2048, 6144), (4096, 6144, 2048)]
HIGHEST = [(4096, 2048, 6144)]
ETILES = [1024, 2048, 4096, 8192, 16384]
orig_plan, orig_kernel = L.linear_plan, L.linear_kernel
kernels = {}


def use(tile, split_auto):
    tm, tn, tk_, occ = tile
    kern = kernels.get(occ)
    if kern is None:
        kern = kernels[occ] = orig_kernel if occ == 0 else orig_kernel.replace_hints(occupancy=occ)
    L.linear_kernel = kern

    def plan(m, n, k, glu=False, sms=132, bf16_mma=False, sequence=False, itemsize=4, layer_norm=False):
        if m <= 128:
            return orig_plan(m, n, k, glu, sms, bf16_mma, sequence, itemsize, layer_norm)
        out_tiles = -(-m // tm) * -(-n // tn)
        k_tiles = -(-k // tk_)
        split = 1 if not split_auto or 4 * out_tiles > sms else min(k_tiles, -(-2 * sms // out_tiles), 64)
        per = -(-k_tiles // split)
        return "tiles", (tm, tn, tk_), per, -(-k_tiles // per)
    L.linear_plan = plan


def variants():
    out = []
    for tile in TILES:
        for auto in (True, False):
            out.append(("high", tile, auto))
            out.append(("highest", tile, auto))
    return out


def rand(*s, scale=1.0):
    return cupy.random.standard_normal(s, dtype=cupy.float32) * scale


def main():
    mode = sys.argv[1]
    vs = variants()
    if mode == "--warm":
        i, n = int(sys.argv[2]), int(sys.argv[3])
        x, w, b = rand(4096, 256), rand(384, 256), rand(384)
        x5 = rand(512, 256)
        for prec, tile, auto in vs[i::n]:
            use(tile, auto)
            tk.set_matmul_precision(prec)
            try:
                tk.linear(x, w, b); tk.linear(x5, w, b)
            except Exception as e:
                print("FAIL", prec, tile, auto, repr(e)[:200], flush=True)
        if i == 0:
            for t in ETILES:
                A.ELEMENTWISE_TILE = t
                g = rand(1000); tk.gelu(g); tk.gelu(g, approximate="none"); tk.swiglu(g, g)
        cupy.cuda.Device().synchronize()
        return
    import torch
    import torch.nn.functional as F
    rows = []
    T = lambda a: torch.from_dlpack(a)
    # elementwise
    for name, shape in (("gelu_tanh", (32 * 512, 768)), ("gelu_erf", (8192, 5120)), ("swiglu", (8192, 6144))):
        x = rand(*shape)
        u = rand(*shape)
        tx, tu = T(x), T(u)
        if name == "gelu_tanh":
            ours, theirs = (lambda: tk.gelu(x)), (lambda: F.gelu(tx, approximate="tanh"))
        elif name == "gelu_erf":
            ours, theirs = (lambda: tk.gelu(x, approximate="none")), (lambda: F.gelu(tx))
        else:
            ours, theirs = (lambda: tk.swiglu(x, u)), (lambda: F.silu(tx) * tu)
        t = graph_ms_torch(theirs)
        for et in ETILES:
            A.ELEMENTWISE_TILE = et
            o = graph_ms_cupy(ours)
            rows.append(dict(op=name, tile=et, ours_ms=round(o, 4), torch_ms=round(t, 4), x=round(t / o, 3)))
            print(rows[-1], flush=True)
    A.ELEMENTWISE_TILE = 4096
    torch.backends.cuda.matmul.allow_tf32 = True
    for prec, shapes in (("high", SHAPES), ("highest", HIGHEST)):
        torch.backends.cuda.matmul.allow_tf32 = prec == "high"
        tk.set_matmul_precision(prec)
        for m, k, n in shapes:
            x, w, b = rand(m, k), rand(n, k, scale=0.02), rand(n)
            tx, tw, tb = T(x), T(w), T(b)
            t = graph_ms_torch(lambda: F.linear(tx, tw, tb))
            ref = (x.astype(cupy.float64) @ w.T.astype(cupy.float64) + b).astype(cupy.float32)
            for _, tile, auto in [v for v in vs if v[0] == prec]:
                use(tile, auto)
                try:
                    y = tk.linear(x, w, b)
                    err = float(cupy.abs(y - ref).max() / cupy.abs(ref).max())
                    o = graph_ms_cupy(lambda: tk.linear(x, w, b))
                except Exception as e:
                    print("FAIL", prec, tile, auto, repr(e)[:200], flush=True)
                    continue
                rows.append(dict(op="linear " + prec, shape=f"M={m} K={k} N={n}", tile=list(tile), split_auto=auto,
                                 ours_ms=round(o, 4), torch_ms=round(t, 4), x=round(t / o, 3), err=err))
                print(rows[-1], flush=True)
            L.linear_plan, L.linear_kernel = orig_plan, orig_kernel
            y = tk.linear(x, w, b)
            o = graph_ms_cupy(lambda: tk.linear(x, w, b))
            rows.append(dict(op="linear " + prec, shape=f"M={m} K={k} N={n}", tile="shipped", ours_ms=round(o, 4),
                             torch_ms=round(t, 4), x=round(t / o, 3)))
            print(rows[-1], flush=True)
            with open(sys.argv[2], "w") as f:
                json.dump(rows, f)
    tk.set_matmul_precision("high")
    with open(sys.argv[2], "w") as f:
        json.dump(rows, f)


main()
