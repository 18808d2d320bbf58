"""Time every tilekernels op at the models' shapes against its torch equivalent (GPU host).

    python tools/bench_kernels.py [--out DIR]

Writes kernels-<gpu>.json and .md: copy bandwidth and torch's TF32 matmul rate (the two
rooflines, measured in the same run), then per op and shape: device time (20 calls
captured in a CUDA graph, replays timed with events, median) for us and torch, the time
of one eager call including its launch (what an unfused Python caller pays), the cold
first call (cuTile compiles there) and the fraction of the roofline the device time
reaches (bytes / copy bandwidth or FLOPs / torch TF32 rate, whichever is larger).
"""
from __future__ import annotations

import argparse

import cupy

import tilekernels as tk
from benchlib import (first_call_ms, gpu_name, graph_ms_cupy, graph_ms_torch, markdown_table, time_ms,
                      versions, write_result)


def rand(*shape, scale=1.0):
    return cupy.random.standard_normal(shape, dtype=cupy.float32) * scale


_TORCH = {}


def T(a):
    """The same memory as a torch tensor (converted once: no conversion inside a capture)."""
    import torch

    if id(a) not in _TORCH:
        _TORCH[id(a)] = (a, torch.from_dlpack(a))
    return _TORCH[id(a)][1]


def rooflines():
    import torch

    src = cupy.empty(256 * 2**20, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    ms = time_ms(lambda: dst.__setitem__(Ellipsis, src))
    copy = 2 * src.nbytes / ms / 1e6                                   # GB/s, read + write
    a, b = torch.randn(4096, 4096, device="cuda"), torch.randn(4096, 4096, device="cuda")
    ms = time_ms(lambda: a @ b)
    return copy, 2 * 4096**3 / ms / 1e9                                # TFLOP/s


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output folder (default benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    copy_gbps, tf32 = rooflines()
    rows = []

    def bench(op, shape, ours, theirs, nbytes, flops=0.0):
        cold = first_call_ms(ours)
        theirs()
        o, t = graph_ms_cupy(ours), graph_ms_torch(theirs)
        oc, tc = time_ms(ours), time_ms(theirs)
        floor = max(nbytes / (copy_gbps * 1e6), flops / (tf32 * 1e9))
        rows.append({"op": op, "shape": shape, "ours_ms": round(o, 4), "torch_ms": round(t, 4),
                     "ours_call_ms": round(oc, 4), "torch_call_ms": round(tc, 4),
                     "first_call_ms": round(cold, 1), "fraction_of_roofline": round(floor / o, 3),
                     "bound": "memory" if nbytes / (copy_gbps * 1e6) >= flops / (tf32 * 1e9) else "compute"})
        print(f"{op:14s} {shape:38s} ours {o:8.4f} ms  torch {t:8.4f} ms  roof {floor / o:5.2f}  "
              f"eager call ours {oc:.4f} torch {tc:.4f}", flush=True)

    for n in (768, 1024, 1280, 2048):
        x, w, b = rand(8192, n), rand(n), rand(n)
        bench("layernorm", f"8192x{n}", lambda: tk.layernorm(x, w, b),
              lambda: F.layer_norm(T(x), (n,), T(w), T(b)), 2 * x.nbytes)
    x, w = rand(8192, 2048), rand(2048)
    bench("rmsnorm", "8192x2048", lambda: tk.rmsnorm(x, w, 1e-5),
          lambda: F.rms_norm(T(x), (2048,), T(w), 1e-5), 2 * x.nbytes)
    x = rand(32, 512, 768)
    bench("gelu_tanh", "32x512x768", lambda: tk.gelu(x), lambda: F.gelu(T(x), approximate="tanh"), 2 * x.nbytes)
    x = rand(8192, 5120)
    bench("gelu_erf", "8192x5120", lambda: tk.gelu(x, approximate="none"), lambda: F.gelu(T(x)), 2 * x.nbytes)
    g, u = rand(8192, 6144), rand(8192, 6144)
    bench("swiglu", "8192x6144", lambda: tk.swiglu(g, u), lambda: F.silu(T(g)) * T(u), 3 * g.nbytes)
    x = rand(8, 50257, scale=5.0)
    bench("softmax", "8x50257", lambda: tk.softmax(x), lambda: torch.softmax(T(x), -1), 2 * x.nbytes)
    for rows_ in (1, 8):
        x = rand(rows_, 50257, scale=5.0)
        bench("argmax", f"{rows_}x50257", lambda: tk.argmax(x), lambda: torch.argmax(T(x), -1), x.nbytes)

    shapes = [(768, 2304), (768, 3072), (3072, 768), (768, 50257), (1280, 5120), (5120, 1280),
              (2048, 6144), (6144, 2048), (2048, 59264)]
    for k, n in shapes[:3] if args.quick else shapes:
        w, bias = rand(n, k, scale=0.02), rand(n)
        for m in (1, 16, 512, 4096):
            x = rand(m, k)
            bench("linear", f"M={m} K={k} N={n}", lambda: tk.linear(x, w, bias),
                  lambda: F.linear(T(x), T(w), T(bias)), 4 * (m * k + n * k + m * n), 2.0 * m * n * k)

    # decode projections with their fused prologue / epilogue, against torch's unfused ops
    for m in (1, 8):
        x, r = rand(m, 768), rand(m, 768)
        ln = tk.LayerNorm(rand(768), rand(768))
        w, bias = rand(2304, 768, scale=0.02), rand(2304)
        bench("linear+layernorm", f"M={m} K=768 N=2304", lambda: tk.linear(x, w, bias, norm=ln),
              lambda: F.linear(F.layer_norm(T(x), (768,), T(ln.weight), T(ln.bias)), T(w), T(bias)), w.nbytes)
        w, bias = rand(768, 3072, scale=0.02), rand(768)
        h = rand(m, 3072)
        bench("linear+residual", f"M={m} K=3072 N=768", lambda: tk.linear(h, w, bias, residual=r),
              lambda: T(r) + F.linear(T(h), T(w), T(bias)), w.nbytes)
        x = rand(m, 2048)
        rms = tk.RMSNorm(rand(2048), 1e-5)
        w = rand(12288, 2048, scale=0.02)

        def torch_swiglu():
            gu = F.linear(F.rms_norm(T(x), (2048,), T(rms.weight), 1e-5), T(w))
            return F.silu(gu[:, :6144]) * gu[:, 6144:]
        bench("linear+rmsnorm+swiglu", f"M={m} K=2048 N=2x6144",
              lambda: tk.linear(x, w, activation="swiglu", norm=rms), torch_swiglu, w.nbytes)

    # 3xTF32 (precision 'highest') against torch in full fp32
    x, w, bias = rand(4096, 2048), rand(6144, 2048, scale=0.02), rand(6144)
    tk.set_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    bench("linear highest", "M=4096 K=2048 N=6144", lambda: tk.linear(x, w, bias),
          lambda: F.linear(T(x), T(w), T(bias)), 4 * (x.size + w.size + 4096 * 6144), 2.0 * 4096 * 6144 * 2048)
    tk.set_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = True

    def attn_case(name, b, hq, hkv, tq, tk_, d, causal):
        q, k, v = rand(b, hq, tq, d), rand(b, hkv, tk_, d), rand(b, hkv, tk_, d)
        pairs = tq * tk_ - (tq * (tq - 1) // 2 if causal else 0)
        bench(name, f"B={b} H={hq}/{hkv} Tq={tq} Tk={tk_} D={d}" + (" causal" if causal else ""),
              lambda: tk.attention(q, k, v, causal=causal),
              lambda: F.scaled_dot_product_attention(T(q), T(k), T(v), is_causal=causal and tq > 1,
                                                     enable_gqa=hq != hkv),
              q.nbytes * 2 + k.nbytes + v.nbytes, 4.0 * b * hq * pairs * d)

    attn_case("attention", 8, 12, 12, 1024, 1024, 64, True)
    attn_case("attention", 8, 16, 16, 1024, 1024, 64, True)
    attn_case("attention", 1, 20, 20, 1500, 1500, 64, False)
    attn_case("attention", 8, 20, 20, 1500, 1500, 64, False)
    attn_case("decode_attn", 1, 12, 12, 1, 1024, 64, True)
    attn_case("decode_attn", 8, 12, 12, 1, 1024, 64, True)
    attn_case("decode_attn", 1, 16, 4, 1, 4096, 128, True)
    attn_case("decode_attn", 8, 16, 4, 1, 4096, 128, True)

    x, w, b = rand(1, 128, 3000), rand(1280, 128, 3, scale=0.05), rand(1280)
    bench("conv1d", "(1,128,3000)->1280 k3 s1", lambda: tk.conv1d(x, w, b, 1, 1),
          lambda: F.conv1d(T(x), T(w), T(b), 1, 1), x.nbytes + w.nbytes + 1280 * 3000 * 4, 2.0 * 1280 * 128 * 3 * 3000)
    x, w = rand(1, 1280, 3000), rand(1280, 1280, 3, scale=0.02)
    bench("conv1d", "(1,1280,3000)->1280 k3 s2", lambda: tk.conv1d(x, w, b, 2, 1),
          lambda: F.conv1d(T(x), T(w), T(b), 2, 1), x.nbytes + w.nbytes + 1280 * 1500 * 4, 2.0 * 1280 * 1280 * 3 * 1500)

    x = rand(1, 1500, 20, 64)
    cos, sin = tk.rope_cos_sin(cupy.arange(1500)[None], 32)
    tc, ts = T(cos)[:, :, None, :].repeat(1, 1, 1, 2), T(sin)[:, :, None, :].repeat(1, 1, 1, 2)

    def torch_rope():
        xt = T(x)
        xr, xp = xt[..., :32], xt[..., 32:]
        x1, x2 = xr[..., :16], xr[..., 16:]
        return torch.cat([xr * tc + torch.cat([-x2, x1], -1) * ts, xp], -1)

    bench("rope", "(1,1500,20,64) rotary 32", lambda: tk.rope(x, cos, sin, 32), torch_rope, 2 * x.nbytes)

    payload = {"gpu": gpu_name(), "versions": versions(), "copy_GBps": round(copy_gbps, 1),
               "torch_tf32_TFLOPs": round(tf32, 1), "rows": rows}
    md = (f"GPU: {gpu_name()}; copy bandwidth {copy_gbps:.0f} GB/s (read+write); torch TF32 matmul "
          f"{tf32:.0f} TFLOP/s at 4096^3. Device times from CUDA-graph replays (launch cost excluded); "
          f"'eager call' is one call timed with events, launch included.\n\n" + markdown_table(
              ["op", "shape", "ours ms", "torch ms", "speedup", "roofline fraction", "eager call ours / torch ms",
               "first call ms"],
              [[r["op"], r["shape"], r["ours_ms"], r["torch_ms"], f"{r['torch_ms'] / r['ours_ms']:.2f}x",
                f"{r['fraction_of_roofline']:.2f} ({r['bound']})", f"{r['ours_call_ms']} / {r['torch_call_ms']}",
                r["first_call_ms"]] for r in rows]))
    write_result("kernels", payload, args.out, md)


if __name__ == "__main__":
    main()
