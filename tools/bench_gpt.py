"""GPT-2 text generation on the engine: batched throughput and a mixed load, against transformers
(GPU host).

    python tools/bench_gpt.py [--out DIR] [--batches 1,8,32,64,128] [--precisions bf16,tf32]

gpt2 (124M) with transformers' random initialisation, saved in the HF layout and loaded by our
loader. Batched: B prompts of 32 random tokens, 128 new tokens each (end-of-text ignored, greedy),
end-to-end tokens/s (prefill included; wall time with the device synchronised; a warm-up run
compiles and captures, then the median of 3), ours through tilekernels.runtime.generate on one
Engine(max_batch=B) (at precision bf16 with a bfloat16 KV cache) against transformers eager
generate() (sdpa attention) in fp32 with TF32 and in bf16. Mixed load: 256 requests of 16-512
prompt tokens and 16-256 new tokens (seeded), all queued at once on one engine of max_batch 64 (continuous batching: a finished row's slot goes to
the next request the same step) against the same requests in static batches of 64 (each batch
decodes until its longest row is done); useful tokens/s (the median of 3 runs after a warm one).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import cupy
import numpy as np

from benchlib import gpu_name, markdown_table, versions, write_result

PROMPT, NEW = 32, 128


def sync():
    import torch

    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()


def wall(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--precisions", default="bf16,tf32")
    ap.add_argument("--hf-batches", default="1,8,32")
    args = ap.parse_args()
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt.model import GPT
    from tilekernels.runtime import Engine, generate, set_precision
    from tilekernels.runtime.precision import kv_dtype

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(attn_implementation="sdpa")).cuda().eval()
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = rng.integers(0, 50257, (max(batches), PROMPT)).tolist()
    rows = []

    def row(**kw):
        rows.append(kw)
        print(kw, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        for precision in args.precisions.split(","):
            set_precision(precision)
            model = GPT.load(Path(tmp), "gpu")
            kv = kv_dtype(cupy).name        # the engine's cache at this precision (bf16: bfloat16 keys and values)
            for b in batches:
                engine = Engine(model, b)
                s = wall(lambda: generate(engine, prompts[:b], NEW, ignore_eos=True))
                row(system="tile-inference", model="gpt2", precision=precision, kv_cache=kv,
                    work=f"{PROMPT}-token prompts", batch=b, new_tokens=NEW, tokens_per_s=round(b * NEW / s, 1))
                del engine
            if precision == args.precisions.split(",")[0]:
                load = [(rng.integers(0, 50257, int(rng.integers(16, 513))).tolist(), int(rng.integers(16, 257)))
                        for _ in range(256)]
                useful = sum(n for _, n in load)
                engine = Engine(model, 64)

                def continuous():
                    from tilekernels.runtime import Request
                    from tilekernels.runtime.generation import run
                    list(run(engine, [Request(p, n, eos=frozenset()) for p, n in load]))

                def static():
                    from tilekernels.runtime import Request
                    from tilekernels.runtime.generation import run
                    for i in range(0, len(load), 64):
                        group = load[i:i + 64]
                        longest = max(n for _, n in group)      # a static batch runs until its longest row is done
                        list(run(engine, [Request(p, longest, eos=frozenset()) for p, _ in group]))
                for name, fn in (("continuous batching, max_batch 64", continuous), ("static batches of 64", static)):
                    row(system="tile-inference", model="gpt2", precision=precision, kv_cache=kv,
                        work="256 mixed requests", batch=name, new_tokens="16-256",
                        tokens_per_s=round(useful / wall(fn), 1))
                del engine
            del model
            cupy.get_default_memory_pool().free_all_blocks()
    set_precision("bf16")
    for dtype, name in ((torch.float32, "tf32"), (torch.bfloat16, "bf16")):
        hf = hf.to(dtype)
        for b in [int(x) for x in args.hf_batches.split(",") if x]:
            ids = torch.tensor(prompts[:b], device="cuda")

            def gen():
                with torch.no_grad():
                    hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                min_new_tokens=NEW, pad_token_id=0)
            row(system=f"transformers {transformers.__version__} eager", model="gpt2", precision=name,
                work=f"{PROMPT}-token prompts", batch=b, new_tokens=NEW, tokens_per_s=round(b * NEW / wall(gen, 2), 1))
    md = f"GPU: {gpu_name()}; gpt2 (124M), random weights; tokens/s end to end.\n\n" + markdown_table(
        ["system", "precision", "work", "batch", "tokens/s"],
        [[r["system"], r["precision"], r["work"], r["batch"], r["tokens_per_s"]] for r in rows])
    write_result("gpt-batch", {"gpu": gpu_name(), "versions": versions(), "prompt_tokens": PROMPT, "rows": rows},
                 args.out, md)


if __name__ == "__main__":
    main()
