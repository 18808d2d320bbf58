"""Where a decode step spends its GPU time (GPU host).

    python tools/profile_decode.py [--model gpt2|glm-asr] [--batch 1] [--context 64] [--plans library,fat-tma]
                                   [--weights bf16|fp32] [--out DIR]

gpt2 (124M) or the GLM-ASR-Nano text decoder, random weights (GLM-ASR's bfloat16 values, as the
hub checkpoint holds, stored as such: --weights fp32 for float32 ones): times greedy steps from graphs
of 1 to 16 steps back to back (gpt.graph.CHAIN's choice), then one replay of a single-step decode graph
and the greedy chain per token, with programmatic dependent launch on and off (a graph captured for
each), then lists each kernel's device time over 5 eager steps
(torch.profiler's CUDA activity, which sees cuTile and cupy kernels alike), taken with
dependent launch off so that no kernel's time includes waiting for the one before it.
--plans first times the replay under other rules for the batch-1 projections or the decode
attention route (PLANS), each in a graph of its own.
"""
from __future__ import annotations

import argparse
import time
from importlib import import_module

import cupy
import numpy as np
from torch.profiler import ProfilerActivity, profile

import tilekernels as tk
import tilekernels._arrays as tk_arrays
from tilekernels._arrays import next_pow2
from benchlib import gpu_name, random_gpt2, versions, write_result
import gpt.graph as gpt_graph
from gpt.graph import DecodeGraph
from gpt.kvcache import KVCache

lin = import_module("tilekernels.linear")     # the module (tilekernels.linear is the op)
attn = import_module("tilekernels.attention")


def gpt2(batch: int, context: int):
    """(embedding tables, step(x), cache) of gpt2 with `context` tokens already in the cache."""
    model = random_gpt2()
    cache = model.new_cache(batch, context + 300)
    model.forward(cupy.ones((batch, context), cupy.int64), cupy.arange(context)[None].repeat(batch, 0), cache)
    return model.embedding_tables, (lambda x: model.step(x, cache)), cache


def rand(*shape):
    return cupy.random.standard_normal(shape, dtype=cupy.float32) * 0.02


def random_glm_asr(encoder: bool = False, weights: str = "bf16"):
    """GLM-ASR-Nano at full size with weights drawn on the GPU, stored as GlmAsr.to leaves
    them: the text decoder's matrices of bfloat16 values in bfloat16 (weights='bf16', the hub
    checkpoint's dtype) or float32 ones ('fp32'), RMSNorms with their weight, the encoder in
    float32 with its LayerNorms folded; the audio encoder and projector only when asked."""
    from transformers import GlmAsrConfig

    from glm_asr.config import GlmAsrConfig as Config
    from glm_asr.model import DecoderLayer, EncoderLayer, GlmAsr

    def mat(*shape):
        m = rand(*shape)
        return tk.compact((m.view(cupy.uint32) & 0xFFFF0000).view(cupy.float32)) if weights == "bf16" else m

    cfg = Config.from_hf(GlmAsrConfig().to_dict())
    d, e = cfg.decoder, cfg.encoder
    n, hd = d.hidden_size, d.head_dim

    def rms():
        return tk.RMSNorm(rand(n) + 1, d.rms_norm_eps)
    w = {"decoder": [DecoderLayer(rms(), mat((d.num_heads + 2 * d.num_kv_heads) * hd, n), mat(n, d.num_heads * hd),
                                  rms(), mat(2 * d.intermediate_size, n), mat(n, d.intermediate_size))
                     for _ in range(d.num_layers)],
         "embed": mat(d.vocab_size, n), "norm": rms(), "lm_head": mat(d.vocab_size, n)}
    if encoder:
        c, inner = e.hidden_size, e.intermediate_size
        ln = tk.LayerNorm(None, None)

        def lin_(n_out, n_in):
            return rand(n_out, n_in), rand(n_out)
        w["encoder"] = [EncoderLayer(ln, lin_((e.num_heads + 2 * e.num_kv_heads) * e.head_dim, c),
                                     lin_(c, e.num_heads * e.head_dim), ln, lin_(inner, c), lin_(c, inner))
                        for _ in range(e.num_layers)]
        w["conv1"] = rand(c, e.num_mel_bins, 3), rand(c)
        w["conv2"] = rand(c, c, 3), rand(c)
        w["enc_norm"] = tk.LayerNorm(rand(c) + 1, rand(c))
        w["proj1"] = lin_(2 * n, inner)
        w["proj2"] = lin_(n, 2 * n)
    return GlmAsr(cfg, w)


def glm_asr(batch: int, context: int, weights: str = "bf16"):
    """The same for GLM-ASR-Nano's decoder (no encoder needed)."""
    if batch != 1:
        raise SystemExit("glm-asr decodes one request at a time: --batch 1")
    model = random_glm_asr(weights=weights)
    cache = model.new_cache(context + 300)
    model.forward(rand(1, context, model.config.decoder.hidden_size), cache)
    return (model.w["embed"], None), (lambda x: model.step(x, cache)), cache


LIBRARY_PLAN = lin.linear_plan


def skinny_heads(m: int, n: int, k: int, glu: bool = False, sms: int = 132, itemsize: int = 4):
    """The library's rule with vocabulary heads (N > 4096) on the mma kernel, float32 ones too."""
    if m == 1 and n > 4096:
        return "skinny", lin.SKINNY
    return LIBRARY_PLAN(m, n, k, glu, sms, itemsize)


def rows1(m: int, n: int, k: int, glu: bool = False, sms: int = 132, itemsize: int = 4):
    """The library's rule with one weight row a block for K <= 1024 ((1, 1024) tiles)."""
    plan = LIBRARY_PLAN(m, n, k, glu, sms, itemsize)
    if plan[0] == "gemv" and itemsize == 4 and k <= 1024:
        return "gemv", (1, 1024), False
    return plan


def fat_tma(m: int, n: int, k: int, glu: bool = False, sms: int = 132, itemsize: int = 4):
    """The previous rule: 8-32 rows per block, TMA loads, the mma kernel for wide heads."""
    if m == 1 and n <= (8192 if glu else 4096):
        tn = (8 if k > 1024 else 16) if n < 1024 else (16 if glu or n < 2304 else 32)
        return "gemv", (tn, 512 if k >= 2048 and tn <= 16 and not glu else 256), True
    return LIBRARY_PLAN(m, n, k, glu, sms, itemsize)


def plain_bf16(m: int, n: int, k: int, glu: bool = False, sms: int = 132, itemsize: int = 4):
    """The GEMV on bfloat16 weights in the float32 rule's tiles with twice the rows, plain loads."""
    plan = LIBRARY_PLAN(m, n, k, glu, sms)
    if plan[0] == "gemv" and itemsize == 2:
        (tn, tk), _ = plan[1:]
        return "gemv", (2 * tn, tk), False
    return plan


def previous_gemv(m: int, n: int, k: int, glu: bool = False, sms: int = 132, itemsize: int = 4):
    """The float32 batch-1 rule before the current one: (2, 1024) tiles for K <= 1024, one row of
    next_pow2(K) above."""
    if m == 1 and itemsize == 4:
        tk = min(next_pow2(k), 8192)
        return "gemv", (max(1, 2048 // tk), tk), False
    return LIBRARY_PLAN(m, n, k, glu, sms, itemsize)


def fat_rows(qkv: int, proj: int, fc: int, head: int, wide: int):
    """float32 batch-1 GEMV rule with this many weight rows a block for each of GPT-2's projections:
    K <= 1024 in (rows, 1024) tiles by N (N = K: proj, N = 3K: qkv, N = 4K: fc, N > 4096: the
    vocabulary head), wider K in (wide, next_pow2(K)) tiles."""
    def plan(m: int, n: int, k: int, glu: bool = False, sms: int = 132, itemsize: int = 4):
        if m == 1 and itemsize == 4:
            tk = min(next_pow2(k), 8192)
            tn = wide if tk > 1024 else head if n > 4096 else proj if n <= k else qkv if n <= 3 * k else fc
            return "gemv", (tn, tk), False
        return LIBRARY_PLAN(m, n, k, glu, sms, itemsize)
    return plan


LIBRARY_ATTEND = KVCache.attend
LIBRARY_TILE_KEYS = attn.decode_tile_keys


def no_attention(cache: KVCache, layer: int, qkv, heads: int, scale: float):
    """Ablation, wrong output: q passed on as the attention output (no cache, no attention
    kernels), so the step's time without its attention path can be read off."""
    if qkv.shape[1] != 1:
        return LIBRARY_ATTEND(cache, layer, qkv, heads, scale)
    b, d = qkv.shape[0], cache.k.shape[-1]
    return qkv[:, 0, :heads * d].reshape(b, heads, 1, d)


def fused_any_batch(cache: KVCache, layer: int, qkv, heads: int, scale: float):
    """KVCache.fused_decode at every batch size, not only batch 1."""
    if qkv.shape[1] != 1:
        return LIBRARY_ATTEND(cache, layer, qkv, heads, scale)
    return cache.fused_decode(layer, qkv, heads, scale)


# whole-step variants: the batch-1 projection rule, the decode attention route and its key tile (no-attention
# is an ablation: timing only)
PLANS = {"library": {}, "skinny-heads": {"linear_plan": skinny_heads}, "fat-tma": {"linear_plan": fat_tma},
         "rows1": {"linear_plan": rows1}, "previous-gemv": {"linear_plan": previous_gemv},
         **{"r" + "".join(map(str, rows)): {"linear_plan": fat_rows(*rows)}
            for rows in ((4, 4, 4, 4, 2), (2, 4, 4, 4, 2), (4, 2, 4, 4, 2), (4, 4, 2, 4, 2), (4, 4, 4, 2, 2),
                         (4, 4, 4, 4, 4), (8, 4, 4, 4, 2), (4, 8, 4, 4, 2), (4, 4, 8, 4, 2), (4, 4, 4, 8, 2),
                         (4, 1, 4, 4, 2), (2, 2, 2, 2, 1), (2, 1, 4, 4, 2), (1, 1, 4, 4, 2), (2, 1, 4, 8, 2),
                         (2, 1, 4, 4, 1), (2, 1, 8, 4, 2), (2, 1, 2, 4, 2), (2, 2, 4, 4, 2), (2, 1, 4, 4, 4), (4, 1, 4, 8, 2),
                         (4, 1, 4, 4, 1), (4, 1, 4, 4, 4), (8, 1, 4, 4, 2), (4, 1, 2, 4, 2), (4, 1, 4, 2, 2),
                         (4, 1, 8, 4, 2))},
         "keys32": {"tile_keys": lambda d: 2048 // d}, "keys128": {"tile_keys": lambda d: 8192 // d},
         "plain-bf16": {"linear_plan": plain_bf16},
         "split-qkv": {"attend": KVCache.split_then_attend}, "no-attention": {"attend": no_attention},
         "fused-any-batch": {"attend": fused_any_batch}}


def use_plan(name: str) -> None:
    plan = PLANS[name]
    lin.linear_plan = plan.get("linear_plan", LIBRARY_PLAN)
    KVCache.attend = plan.get("attend", LIBRARY_ATTEND)
    attn.decode_tile_keys = plan.get("tile_keys", LIBRARY_TILE_KEYS)


def plan_names(value: str) -> list[str]:
    """--plans: comma-separated names of PLANS."""
    names = value.split(",")
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown plan {', '.join(unknown)}; choose from {', '.join(PLANS)}")
    return names


def time_graph(embed, step, cache, ids, pos, t: int, stream) -> tuple[float, float]:
    """(us per replay of a one-step graph, back to back from the same input, us per token of a
    200-step greedy chain) of a fresh DecodeGraph."""
    graph = DecodeGraph(embed, step, cache)
    cache.length = t
    graph._seed(ids[:, 0], pos[:, 0])
    one = graph.single[0].graph
    for _ in range(5):
        one.launch(stream)
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(100):
        one.launch(stream)
    stream.synchronize()
    replay = (time.perf_counter() - start) * 1e4
    cache.length = t
    start = time.perf_counter()
    n = sum(1 for _ in graph.tokens(ids[:, 0], pos[:, 0], 200))
    stream.synchronize()
    return replay, (time.perf_counter() - start) / n * 1e6


def time_steps_per_graph(embed, step, cache, ids, pos, t: int, stream, counts=(1, 2, 4, 8, 16)) -> dict:
    """us per token of greedy steps replayed back to back with no host work between them, from
    graphs of n steps each (DecodeGraph._capture), for each n in counts (the choice of
    gpt.graph.CHAIN; 'n-overlapped': without its step boundary, where a step's first kernels may
    start before the step before has finished, unsafe); n = 1 alternates DecodeGraph's two
    single-step graphs."""
    graph = DecodeGraph(embed, step, cache)
    per_round = 96          # steps between resets of the cache span (the cache has 300 free slots)
    out = {}
    for n in (*counts, "8-overlapped"):
        if n == "8-overlapped":
            gpt_graph.full_wait_next = lambda: None
        replays = graph.single if n == 1 else [graph._capture(step, 0, int(str(n).split("-")[0]))]
        gpt_graph.full_wait_next = tk_arrays.full_wait_next
        rounds = []
        for _ in range(4):
            cache.length = t
            graph._seed(ids[:, 0], pos[:, 0])
            stream.synchronize()
            start = time.perf_counter()
            steps = replays[0].n
            for r in range(per_round // steps):
                replays[r % len(replays)].graph.launch(stream)
            stream.synchronize()
            rounds.append((time.perf_counter() - start) / (per_round // steps * steps) * 1e6)
        out[n] = round(float(np.median(rounds[1:])), 1)
        print(f"{n} steps a graph: {out[n]:.1f} us per token")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt2", "glm-asr"), default="gpt2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--plans", type=plan_names, default=[],
                    help=f"also time whole steps under these plans: {', '.join(PLANS)}")
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16", help="GLM-ASR's matrices (gpt2: fp32)")
    ap.add_argument("--out")
    args = ap.parse_args()
    b, t = args.batch, args.context
    ids, pos = np.ones((b, 1)), np.full((b, 1), t)
    result = {"gpu": gpu_name(), "versions": versions(), "model": f"{args.model}, random weights", "batch": b,
              "context": t, "weights": "fp32" if args.model == "gpt2" else args.weights}
    with cupy.cuda.Stream(non_blocking=True) as stream:
        embed, step, cache = gpt2(b, t) if args.model == "gpt2" else glm_asr(b, t, args.weights)
        for name in args.plans:
            use_plan(name)
            replay, _ = time_graph(embed, step, cache, ids, pos, t, stream)
            result.setdefault("plans_replay_us", {}).setdefault(name, []).append(round(replay, 1))
            print(f"plan {name}: graph replay {replay:.1f} us per step")
        use_plan("library")
        result["steps_per_graph_us_per_token"] = time_steps_per_graph(embed, step, cache, ids, pos, t, stream)
        for dependent in (True, False):
            tk_arrays.DEPENDENT_LAUNCH = dependent
            replay, chain = time_graph(embed, step, cache, ids, pos, t, stream)
            key = "dependent_launch" if dependent else "plain_launch"
            result[key] = {"graph_replay_us": round(replay, 1), "greedy_us_per_token": round(chain, 1),
                           "tokens_per_s": round(1e6 / chain, 1)}
            print(f"{key}: graph replay {replay:.1f} us per step, greedy chain {chain:.1f} us per token "
                  f"({1e6 / chain:.0f} tok/s)")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:      # dependent launch still off
            for _ in range(5):
                cache.length = t
                cache.begin(1)
                step(cupy.ones((b, 1, embed[0].shape[1]), cupy.float32))
            stream.synchronize()
        tk_arrays.DEPENDENT_LAUNCH = True
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    result["kernels"] = [{"name": e.key[:60], "calls_per_step": e.count / 5, "us_per_call": round(e.device_time_total / e.count, 2),
                          "us_per_step": round(e.device_time_total / 5, 2)} for e in events if e.device_time_total > 0]
    for k in result["kernels"][:16]:
        print(f"{k['name'][:40]:40s} {k['calls_per_step']:6.1f}/step {k['us_per_call']:8.2f} us {k['us_per_step']:9.1f} us/step")
    write_result(f"decode-profile-{args.model}-b{b}" + ("" if args.model == "gpt2" else f"-{args.weights}"), result,
                 args.out)


if __name__ == "__main__":
    main()
