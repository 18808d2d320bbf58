"""Decode attention plans at batch 1: one pass per KV head, or split-KV chunks and a merge (GPU host).

    python tools/sweep_decode_attention.py [--out DIR]

For GPT-2 (12 heads of 64) and GLM-ASR's decoder (16 query heads over 4 KV heads of 128), at
several cache lengths, every plan (key tiles per chunk, chunks; a tile is 4096 / head dim keys) runs as a chain of calls over
distinct caches (256 MB or more in all), captured in one CUDA graph with dependent launch, so
each call reads its keys from HBM as a decode step does. The row marked 'rule' is the plan
tilekernels.attention.decode_splits picks.
"""
from __future__ import annotations

import argparse
import itertools
from importlib import import_module

import cupy

from benchlib import copies_for, gpu_name, rotating_ms, versions, write_result

attn = import_module("tilekernels.attention")     # the module (tilekernels.attention is the op)

SHAPES = [("gpt2", 12, 12, 64), ("glm-asr", 16, 4, 128)]     # (name, Hq, Hkv, D)
LENGTHS = (64, 289, 450, 1024, 2048)


def plans(tiles: int) -> list[tuple[int, int]]:
    """(tiles per chunk, chunks) for 1, 2, 4, ... chunks up to one tile each."""
    out = set()
    for want in (1, 2, 4, 8, 16, 32, 64, tiles):
        if want <= min(tiles, attn.MAX_SPLITS):
            per = -(-tiles // want)
            out.add((per, -(-tiles // per)))
    return sorted(out, key=lambda p: p[1])


def chain(hq: int, hkv: int, d: int, keys: int, per: int, splits: int) -> float:
    """Per-call ms of the plan over rotating caches."""
    caches = [(cupy.random.standard_normal((1, hkv, keys, d), dtype=cupy.float32),
               cupy.random.standard_normal((1, hkv, keys, d), dtype=cupy.float32))
              for _ in range(copies_for(2 * hkv * keys * d * 4))]
    q = cupy.random.standard_normal((1, hq, 1, d), dtype=cupy.float32)
    start, length = cupy.zeros(1, cupy.int32), cupy.full(1, keys, cupy.int32)
    return rotating_ms(caches, lambda kv: attn.decode_cupy(q, *kv, start, length, attn.LOG2E / d ** 0.5, per, splits))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = ap.parse_args()
    rows = []
    lengths = [int(v) for v in args.lengths.split(",")]
    for (name, hq, hkv, d), keys in itertools.product(SHAPES, lengths):
        tile = attn.decode_tile_keys(d)
        rule = attn.decode_splits(keys, hq, attn.sm_count(), tile)
        for per, splits in plans(-(-keys // tile)):
            us = round(chain(hq, hkv, d, keys, per, splits) * 1e3, 2)
            rows.append({"shape": name, "keys": keys, "tile_keys": tile, "tiles_per_chunk": per, "chunks": splits,
                         "us": us, "rule": (per, splits) == rule})
            print(f"{name:8s} {keys:5d} keys  {splits:3d} chunks of {per:3d} tiles of {tile}  {us:7.2f} us"
                  f"{'  <- rule' if rows[-1]['rule'] else ''}", flush=True)
    write_result("decode-attention-sweep", {"gpu": gpu_name(), "versions": versions(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
