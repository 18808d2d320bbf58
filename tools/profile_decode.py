"""Where a decode step spends its GPU time (GPU host).

    python tools/profile_decode.py [--model gpt2|glm-asr] [--batch 1] [--context 64] [--plans library,split-qkv]
                                   [--weights bf16|fp32] [--out DIR]

gpt2 (124M) or the GLM-ASR-Nano text decoder, random weights (GLM-ASR's bfloat16 values, as the
hub checkpoint holds, stored as such: --weights fp32 for float32 ones): times greedy steps from graphs
of 1 to 16 steps back to back (tilekernels.runtime.graphs.CHAIN's choice), then one replay of a
single-step decode graph and the greedy chain per token, with programmatic dependent launch on and
off (tk.dependent_launch; a graph captured for each), then lists each kernel's device time over 5
eager steps (torch.profiler's CUDA activity, which sees cuTile and cupy kernels alike), taken with
dependent launch off so that no kernel's time includes waiting for the one before it.
--plans first times the replay with other routes for the decode attention (PLANS), each in a
graph of its own; the route is an attribute of the tool's own KV cache subclass, so no library
setting is changed.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, fields

import cupy
import numpy as np

import tilekernels as tk
from benchlib import gpu_name, rand, random_glm_asr, random_gpt2, versions, write_result
from tilekernels.runtime import DecodeGraph, KVCache

# decode attention routes (a step of one new token per sequence; the prefill always takes the library's):
# the library's choice (fused at batch 1, split_qkv then attention above), split_qkv then attention at every
# batch, the fused kernel at every batch, and an ablation without attention (timing only: wrong output)
PLANS = ("library", "split-qkv", "fused-any-batch", "no-attention")


@dataclass
class RoutedCache(KVCache):
    """The library's KV cache with the decode attention taken by the route `plan` (PLANS)."""
    plan: str = "library"

    @classmethod
    def of(cls, cache: KVCache) -> "RoutedCache":
        return cls(**{f.name: getattr(cache, f.name) for f in fields(KVCache)})

    def attend(self, layer: int, qkv, heads: int, scale: float):
        if qkv.shape[1] != 1 or self.plan == "library":
            return super().attend(layer, qkv, heads, scale)
        if self.plan == "split-qkv":
            return self.split_then_attend(layer, qkv, heads, scale)
        if self.plan == "fused-any-batch":
            return self.fused_decode(layer, qkv, heads, scale)
        b, d = qkv.shape[0], self.k.shape[-1]       # no-attention: q passed on as the attention output
        return qkv[:, 0, :heads * d].reshape(b, heads, 1, d)


def gpt2(batch: int, context: int):
    """(embedding tables, step(x), cache) of gpt2 with `context` tokens already in the cache."""
    model = random_gpt2()
    cache = RoutedCache.of(model.new_cache(batch, context + 300))
    model.forward(cupy.ones((batch, context), cupy.int64), cupy.arange(context)[None].repeat(batch, 0), cache)
    return model.embedding_tables, (lambda x: model.step(x, cache)), cache


def glm_asr(batch: int, context: int, weights: str = "bf16"):
    """The same for GLM-ASR-Nano's decoder (no encoder needed)."""
    if batch != 1:
        raise SystemExit("glm-asr decodes one request at a time: --batch 1")
    model = random_glm_asr(weights=weights)
    cache = RoutedCache.of(model.new_cache(1, context + 300))
    model.forward(rand(1, context, model.config.decoder.hidden_size), cache)
    return model.embedding_tables, (lambda x: model.step(x, cache)), cache


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
    graphs of n steps each (as DecodeGraph captures them), for each n in counts (the choice of
    tilekernels.runtime.graphs.CHAIN); n = 1 alternates DecodeGraph's two single-step graphs."""
    graph = DecodeGraph(embed, step, cache)
    per_round = 96          # steps between resets of the cache span (the cache has 300 free slots)
    out = {}
    for n in counts:
        replays = graph.single if n == 1 else [graph._capture(step, 0, n)]
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
                    help=f"also time whole steps with these decode attention routes: {', '.join(PLANS)}")
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16", help="GLM-ASR's matrices (gpt2: fp32)")
    ap.add_argument("--out")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    b, t = args.batch, args.context
    ids, pos = np.ones((b, 1)), np.full((b, 1), t)
    result = {"gpu": gpu_name(), "versions": versions(), "model": f"{args.model}, random weights", "batch": b,
              "context": t, "weights": "fp32" if args.model == "gpt2" else args.weights}
    with cupy.cuda.Stream(non_blocking=True) as stream:
        embed, step, cache = gpt2(b, t) if args.model == "gpt2" else glm_asr(b, t, args.weights)
        for name in args.plans:
            cache.plan = name
            replay, _ = time_graph(embed, step, cache, ids, pos, t, stream)
            result.setdefault("plans_replay_us", {}).setdefault(name, []).append(round(replay, 1))
            print(f"plan {name}: graph replay {replay:.1f} us per step")
        cache.plan = "library"
        result["steps_per_graph_us_per_token"] = time_steps_per_graph(embed, step, cache, ids, pos, t, stream)
        for dependent in (True, False):
            with tk.dependent_launch(dependent):
                replay, chain = time_graph(embed, step, cache, ids, pos, t, stream)
            key = "dependent_launch" if dependent else "plain_launch"
            result[key] = {"graph_replay_us": round(replay, 1), "greedy_us_per_token": round(chain, 1),
                           "tokens_per_s": round(1e6 / chain, 1)}
            print(f"{key}: graph replay {replay:.1f} us per step, greedy chain {chain:.1f} us per token "
                  f"({1e6 / chain:.0f} tok/s)")
        with tk.dependent_launch(False), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                cache.length = t
                cache.begin(1)
                step(cupy.ones((b, 1, embed[0].shape[1]), cupy.float32))
            stream.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    result["kernels"] = [{"name": e.key[:60], "calls_per_step": e.count / 5, "us_per_call": round(e.device_time_total / e.count, 2),
                          "us_per_step": round(e.device_time_total / 5, 2)} for e in events if e.device_time_total > 0]
    for k in result["kernels"][:16]:
        print(f"{k['name'][:40]:40s} {k['calls_per_step']:6.1f}/step {k['us_per_call']:8.2f} us {k['us_per_step']:9.1f} us/step")
    write_result(f"decode-profile-{args.model}-b{b}" + ("" if args.model == "gpt2" else f"-{args.weights}"), result,
                 args.out)


if __name__ == "__main__":
    main()
