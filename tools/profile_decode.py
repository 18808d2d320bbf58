"""Host (CPU) versus device (GPU) time of a GPT-2 decode step and of its ops (GPU host).

    python tools/profile_decode.py

Uses cupyx.profiler.benchmark, which reports the host time of each call and the GPU
time between events around it: when host time exceeds GPU time the step is launch-bound.
"""
import tempfile
from pathlib import Path

import cupy
import numpy as np
from cupyx.profiler import benchmark

import tilekernels as tk
from gpt.model import GPT


def show(name, fn, n=50):
    r = benchmark(fn, n_repeat=n, n_warmup=5)
    print(f"{name:34s} cpu {np.median(r.cpu_times) * 1e6:8.1f} us   gpu {np.median(r.gpu_times[0]) * 1e6:8.1f} us")


def main():
    from transformers import GPT2Config, GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as tmp:
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp)
        model = GPT.load(Path(tmp), "gpu")
    for b in (1, 8):
        cache = model.new_cache(b, 600)
        model.forward(cupy.ones((b, 512), cupy.int64), cupy.arange(512)[None].repeat(b, 0), cache)
        tok, pos = cupy.ones((b, 1), cupy.int64), cupy.full((b, 1), 512)

        def step():
            cache.length = 512
            model.forward(tok, pos, cache)

        cache.length = 512
        show(f"decode step B={b} (T=512)", step, 20)
        blk = model.blocks[0]
        h = cupy.random.standard_normal((b, 1, 768), dtype=cupy.float32)
        show("  linear qkv 768->2304", lambda: tk.linear(h, blk.attn_w, blk.attn_b))
        show("  linear fc 768->3072 gelu", lambda: tk.linear(h, blk.fc_w, blk.fc_b, activation="gelu_tanh"))
        show("  layernorm", lambda: blk.ln_2(h))
        cache.length = 512
        show("  attention block (qkv..proj)", lambda: (cache.begin(1), model.attention(0, blk, h, cache)))
        q = cupy.random.standard_normal((b, 12, 1, 64), dtype=cupy.float32)
        show("  tk.attention decode", lambda: tk.attention(q, cache.k[0, :, :, :513], cache.v[0, :, :, :513], True))
        show("  cupy ascontiguousarray", lambda: cupy.ascontiguousarray(q.transpose(0, 2, 1, 3)))
        show("  lm_head", lambda: tk.linear(h[:, 0], model.lm_head))


if __name__ == "__main__":
    main()
