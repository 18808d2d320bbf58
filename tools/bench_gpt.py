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

    python tools/bench_gpt.py --grid [--grid-models gpt2 --grid-batches 1,8 --grid-prompts 64]

The grid (gpt-grid-<gpu>.json): end-to-end tokens/s (prefill + 128 greedy decode steps, eos
ignored, wall time with the device synchronised; a warm-up run (ours: the full run, which
compiles and captures the shape's graphs; transformers eager compiles nothing: 16 tokens of
the same shape), then the median of 3) for
gpt2, gpt2-medium and gpt2-large x batch 1, 4, 8, 16 x random prompts of 64, 256, 768 tokens,
ours through tilekernels.runtime.generate (the token loop gpt.load's models run, one
ModelRunner per model) against transformers eager generate(do_sample=False, 128 new tokens).
About 6-7 minutes on an H100, most of it transformers.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import cupy
import numpy as np

from benchlib import gpu_name, markdown_table, prompted_decoder, time_ms, versions, write_result
from gpt.model import GPT
from tilekernels.runtime import GREEDY, Sampler, Sampling

CONFIGS = {"gpt2": dict(n_embd=768, n_layer=12, n_head=12), "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16)}
GRID_CONFIGS = {**CONFIGS, "gpt2-large": dict(n_embd=1280, n_layer=36, n_head=20)}
GRID_BATCHES, GRID_PROMPTS, GRID_NEW_TOKENS = (1, 4, 8, 16), (64, 256, 768), 128
HF_WARMUP_TOKENS = 16   # transformers eager compiles nothing: a short run of the same shape warms it
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


def random_pair(dims: dict):
    """(transformers' GPT2LMHeadModel with random weights (seed 0) on the GPU, eval mode, sdpa
    attention; ours loaded on the GPU from its save_pretrained directory: the same weights in
    the Hugging Face layout)."""
    import tempfile
    from pathlib import Path

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**dims, attn_implementation="sdpa")).cuda().eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        ours = GPT.load(Path(tmp), "gpu")
    return hf, ours


def grid_ours(runner, batch: int, prompt: int, new: int, reps: int) -> float:
    """End-to-end tokens/s of tilekernels.runtime.generate (prefill + new greedy steps, eos
    ignored) on random prompt ids: a warm-up run (compiles, captures this shape's graphs),
    then the median of reps."""
    from tilekernels.runtime import generate

    ids = np.random.default_rng(0).integers(0, 50257, (batch, prompt)).tolist()

    def run() -> float:
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        outs = generate(runner, ids, new, GREEDY, ignore_eos=True)
        cupy.cuda.Device().synchronize()
        dt = time.perf_counter() - t
        assert all(len(o.tokens) == new for o in outs), [len(o.tokens) for o in outs]
        return dt

    run()
    return batch * new / statistics.median(run() for _ in range(reps))


def grid_hf(hf, batch: int, prompt: int, new: int, reps: int) -> float:
    """The same for transformers' generate (greedy, exactly `new` tokens): a short warm-up run
    of the same shape, then the median of reps."""
    import torch

    ids = torch.as_tensor(np.random.default_rng(0).integers(0, 50257, (batch, prompt)), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), pad_token_id=50256, do_sample=False)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, min_new_tokens=n, max_new_tokens=n, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        assert out.shape == (batch, prompt + n), tuple(out.shape)
        return dt

    run(HF_WARMUP_TOKENS)
    return batch * new / statistics.median(run(new) for _ in range(reps))


def free_gpu():
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def comma_list(kind, allowed=None):
    def parse(text: str) -> list:
        try:
            items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__}, got {text!r}") from None
        bad = [x for x in items if allowed is not None and x not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"got {text!r}; choose from {', '.join(map(str, allowed or []))}")
        return items
    return parse


def run_grid(args):
    """Model size x batch x prompt length, end to end; rows written after each model, so a run
    cut short keeps what it measured."""
    import datetime

    import torch

    from tilekernels.runtime import ModelRunner

    torch.backends.cuda.matmul.allow_tf32 = True
    new, reps = GRID_NEW_TOKENS, args.grid_reps
    too_long = [p for p in args.grid_prompts if p + new > 1024]
    if too_long:
        raise SystemExit(f"error: prompts {too_long} + {new} new tokens exceed GPT-2's 1024 positions")
    start, rows = time.perf_counter(), []
    payload = {"gpu": gpu_name(), "versions": versions(), "date": datetime.date.today().isoformat(),
               "new_tokens": new, "reps": reps,
               "measure": "end-to-end tokens/s: batch x new_tokens / wall time of one generate call (prefill + "
                          "decode, greedy, eos ignored, device synchronised), median of reps after a warm-up run "
                          f"(ours: a full one; transformers: {HF_WARMUP_TOKENS} new tokens)",
               "ours": "tilekernels.runtime.generate(ModelRunner(GPT.load(dir, 'gpu')), ids, new_tokens, GREEDY, "
                       "ignore_eos=True)",
               "transformers": "GPT2LMHeadModel eager (sdpa attention) generate(do_sample=False, min_new_tokens="
                               "max_new_tokens=new_tokens), fp32, TF32 allowed",
               "rows": rows}
    for name in args.grid_models:
        print(f"[{time.perf_counter() - start:5.0f} s] loading {name}", flush=True)
        hf, ours = random_pair(GRID_CONFIGS[name])
        runner = ModelRunner(ours)
        for b in args.grid_batches:
            for t in sorted(args.grid_prompts):    # ascending: each shape gets a cache of its own size
                ot = grid_ours(runner, b, t, new, reps)
                ht = grid_hf(hf, b, t, new, reps)
                rows.append({"model": name, "batch": b, "prompt": t, "new_tokens": new, "ours_tok_s": round(ot, 1),
                             "transformers_tok_s": round(ht, 1), "speedup": round(ot / ht, 2)})
                print(f"[{time.perf_counter() - start:5.0f} s] {rows[-1]}", flush=True)
        del hf, ours, runner
        free_gpu()
        md = (f"GPU: {payload['gpu']}; {payload['date']}; random fp32 weights, TF32 allowed; {new} new tokens, "
              "greedy, eos ignored; end-to-end tokens/s (prefill + decode); transformers eager (sdpa).\n\n"
              + markdown_table(["model", "batch", "prompt", "ours tok/s", "transformers tok/s", "speedup"],
                               [[r["model"], r["batch"], r["prompt"], r["ours_tok_s"], r["transformers_tok_s"],
                                 f"{r['speedup']:.2f}x"] for r in rows]))
        write_result("gpt-grid", payload, args.out, md)
    print(f"grid done in {time.perf_counter() - start:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="result folder (default benchmarks/results)")
    ap.add_argument("--steps", type=int, default=256, help="decode steps (not with --grid)")
    ap.add_argument("--grid", action="store_true",
                    help="instead: end-to-end tokens/s over model x batch x prompt length, 128 new tokens "
                         "(writes gpt-grid-<gpu>.json; about 6-7 minutes on an H100)")
    ap.add_argument("--grid-models", type=comma_list(str, GRID_CONFIGS), default=list(GRID_CONFIGS),
                    help=f"with --grid: comma list (default {','.join(GRID_CONFIGS)})")
    ap.add_argument("--grid-batches", type=comma_list(int), default=list(GRID_BATCHES),
                    help=f"with --grid: comma list (default {','.join(map(str, GRID_BATCHES))})")
    ap.add_argument("--grid-prompts", type=comma_list(int), default=list(GRID_PROMPTS),
                    help=f"with --grid: prompt lengths, comma list (default {','.join(map(str, GRID_PROMPTS))})")
    ap.add_argument("--grid-reps", type=int, default=3, help="with --grid: timed runs per cell, median (default 3)")
    args = ap.parse_args()
    if args.grid:
        if args.grid_reps < 1 or min(args.grid_batches) < 1 or min(args.grid_prompts) < 1:
            ap.error("--grid-reps, --grid-batches and --grid-prompts must be >= 1")
        return run_grid(args)

    import torch

    torch.backends.cuda.matmul.allow_tf32 = True

    rows = []
    for name, dims in CONFIGS.items():
        hf, ours = random_pair(dims)
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
