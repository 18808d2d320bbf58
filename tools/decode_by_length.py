"""GPT-2 batch-1 decode time by cache capacity and sequence length (GPU host).

    python tools/decode_by_length.py [--capacities 289,1024] [--lengths 32,64,128,256,900] [--tag T] [--out DIR]

gpt2 with random weights. For each KV cache capacity (gpt.generate allocates prompt +
max_new_tokens positions): greedy us a token over 256 steps from a 32-token prompt, as
bench_gpt times it (three runs), and us a step of single-step graph replays starting at
each length (20 replays: lengths L .. L + 19). Shows whether a step costs what its keys do
or what the cache could hold (the decode attention's grid covers the whole capacity).
--tag names the result file, for A/Bs of library versions run one after another.
"""
from __future__ import annotations

import argparse
import time

import cupy
import numpy as np
import torch

from benchlib import gpu_name, prompted_decoder, random_gpt2, versions, write_result


def ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacities", type=ints, default=[289, 1024])
    ap.add_argument("--lengths", type=ints, default=[32, 64, 128, 256, 900])
    ap.add_argument("--tag", default="")
    ap.add_argument("--out")
    args = ap.parse_args()
    prompt, steps, replays = 32, 256, 20
    if min(args.capacities) <= prompt:
        ap.error(f"--capacities: each must exceed the {prompt}-token prompt, got {min(args.capacities)}")
    torch.manual_seed(0)
    model = random_gpt2()
    rows = []
    with cupy.cuda.Stream(non_blocking=True) as stream:
        for cap in args.capacities:
            decode, cache, ids, _ = prompted_decoder(model, 1, prompt, cap)
            greedy = []
            for _ in range(3):
                cache.length = prompt
                stream.synchronize()
                t = time.perf_counter()
                n = sum(1 for _ in decode.tokens(ids[:, -1], np.array([prompt]), min(steps, cap - prompt)))
                stream.synchronize()
                greedy.append(round((time.perf_counter() - t) / n * 1e6, 1))
            one, by_length = decode.single[0].graph, {}
            for length in args.lengths:
                if length + replays > cap:
                    continue
                cache.length = length
                decode._seed(ids[:, -1], np.array([length]))
                stream.synchronize()
                t = time.perf_counter()
                for _ in range(replays):        # each replay advances the length by one
                    one.launch(stream)
                stream.synchronize()
                by_length[length] = round((time.perf_counter() - t) / replays * 1e6, 1)
            rows.append({"capacity": cap, "greedy_us_per_token": greedy, "replay_us_by_length": by_length})
            print(rows[-1], flush=True)
    write_result("decode-lengths-gpt2-b1" + (f"-{args.tag}" if args.tag else ""),
                 {"gpu": gpu_name(), "versions": versions(), "model": "gpt2, random weights", "prompt": prompt,
                  "greedy_steps": steps, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
