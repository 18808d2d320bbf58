"""GPT-2 prefill latency and decode throughput, ours vs transformers eager (GPU host).

    python tools/bench_gpt.py [--out DIR]

gpt2 and gpt2-medium configurations with random weights, fp32 (TF32 allowed for both).
Prefill: one forward over B x T tokens. Decode: 256 steps after a 32-token prompt as
gpt.generate runs them: replays of captured CUDA graphs of 8 steps, each step choosing its
token on the device (greedy: one argmax launch; sampled: tk.sample's launches, the uniforms
copied in by the replay) and feeding the next, the host reading each replay's tokens while
the next replay runs. transformers runs generate() for 256 new tokens with the same
settings, eagerly and (gpt2, batch 1, greedy) with its static cache under torch.compile,
transformers' own fast path.
"""
from __future__ import annotations

import argparse
import time

import cupy
import numpy as np

from benchlib import gpu_name, markdown_table, prompted_decoder, time_ms, versions, write_result
from gpt.model import GPT
from tilekernels.runtime import GREEDY, Sampler, Sampling

CONFIGS = {"gpt2": dict(n_embd=768, n_layer=12, n_head=12), "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16)}
SAMPLINGS = {"greedy": GREEDY, "T 0.8, top-k 200 (gpt.generate's default)": Sampling(0.8, 200),
             "T 0.8, top-k 50, top-p 0.9, penalty 1.2": Sampling(0.8, 50, 0.9, 1.2)}


def ours_decode(model: GPT, batch: int, prompt: int, steps: int, sampling: Sampling = GREEDY) -> float:
    """Tokens/s of the decode chain as gpt.generate runs it."""
    with cupy.cuda.Stream(non_blocking=True) as stream:
        sampler = Sampler(sampling, cupy, batch, model.config.vocab_size, seed=0)
        decode, _, _, logits = prompted_decoder(model, batch, prompt, prompt + steps + 1, sampler)
        first = sampler.pick(logits).get()
        stream.synchronize()
        t = time.perf_counter()
        n = sum(1 for _ in decode.tokens(first, np.full(batch, prompt), steps))
        stream.synchronize()
    return batch * n / (time.perf_counter() - t)


def hf_decode(hf, batch: int, prompt: int, steps: int, sampling: Sampling = GREEDY, **extra) -> float:
    import torch

    ids = torch.randint(0, 50257, (batch, prompt), device="cuda")
    s = sampling
    how = dict(do_sample=False, repetition_penalty=s.repetition_penalty) if s.temperature == 0 else dict(
        do_sample=True, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, repetition_penalty=s.repetition_penalty)
    kw = dict(pad_token_id=50256, attention_mask=torch.ones_like(ids), **how, **extra)
    with torch.no_grad():
        def gen(n):
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()

        for n in (1, steps + 1):        # warm-up: compiles (static cache) every shape timed below
            gen(n)
        t = time.perf_counter()
        gen(1)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        gen(steps + 1)
    return batch * steps / (time.perf_counter() - t - prefill)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=256)
    args = ap.parse_args()
    import tempfile
    from pathlib import Path

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.backends.cuda.matmul.allow_tf32 = True

    rows = []
    for name, dims in CONFIGS.items():
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(GPT2Config(**dims, attn_implementation="sdpa")).cuda().eval()
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp, safe_serialization=True)
            ours = GPT.load(Path(tmp), "gpu")
        for b in (1, 8):
            for t in (128, 512, 1024):
                ids = np.random.default_rng(1).integers(0, 50257, (b, t))
                gids, gpos = cupy.asarray(ids), cupy.arange(t)[None].repeat(b, 0)
                ms = time_ms(lambda: ours.forward(gids, gpos, ours.new_cache(b, t), last_only=False), 2, 5)
                tids = torch.as_tensor(ids, device="cuda")
                with torch.no_grad():
                    hms = time_ms(lambda: hf(tids), 2, 5)
                rows.append({"model": name, "phase": "prefill", "batch": b, "tokens": t, "ours_ms": round(ms, 3),
                             "transformers_ms": round(hms, 3), "ours_tok_s": round(b * t / ms * 1e3),
                             "transformers_tok_s": round(b * t / hms * 1e3)})
                print(rows[-1], flush=True)
            for label, sampling in SAMPLINGS.items():
                ours_tok_s = ours_decode(ours, b, 32, args.steps, sampling)
                ht = hf_decode(hf, b, 32, args.steps, sampling)
                rows.append({"model": name, "phase": "decode", "batch": b, "tokens": args.steps, "sampling": label,
                             "ours_tok_s": round(ours_tok_s, 1), "transformers_tok_s": round(ht, 1)})
                print(rows[-1], flush=True)
                if sampling is GREEDY:
                    ot = ours_tok_s
            if name == "gpt2" and b == 1:
                try:     # transformers' fast path: static KV cache, forward compiled by torch.compile
                    hc = hf_decode(hf, b, 32, args.steps, cache_implementation="static")
                    rows.append({"model": name, "phase": "decode", "batch": b, "tokens": args.steps,
                                 "sampling": "greedy", "ours_tok_s": round(ot, 1), "transformers_tok_s": round(hc, 1),
                                 "transformers_mode": "static cache + torch.compile"})
                except Exception as e:  # noqa: BLE001 - report why it could not run
                    rows.append({"model": name, "phase": "decode", "batch": b, "tokens": args.steps,
                                 "sampling": "greedy",
                                 "transformers_mode": "static cache + torch.compile",
                                 "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
                print(rows[-1], flush=True)
        del hf, ours
    md = f"GPU: {gpu_name()}; fp32 weights, TF32 allowed; transformers eager (sdpa) unless noted.\n\n" + markdown_table(
        ["model", "phase", "batch", "tokens", "sampling", "ours tok/s", "transformers tok/s", "speedup",
         "transformers mode"],
        [[r["model"], r["phase"], r["batch"], r["tokens"], r.get("sampling", ""), r.get("ours_tok_s", ""),
          r.get("transformers_tok_s", ""),
          f"{r['ours_tok_s'] / r['transformers_tok_s']:.2f}x" if "transformers_tok_s" in r else r.get("error", ""),
          r.get("transformers_mode", "eager")] for r in rows])
    write_result("gpt", {"gpu": gpu_name(), "versions": versions(), "rows": rows}, args.out, md)


if __name__ == "__main__":
    main()
