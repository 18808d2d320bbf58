"""tk.sample against transformers' logits processors on the same logits (GPU host).

    python tools/bench_sampling.py [--out DIR]

GPT-2's vocabulary (50,257), batch 1 and 8, random logits (N(0, 3^2)) with 10% of the tokens
seen. Ours: device us a call, replayed from a CUDA graph of 20 calls (as a decode step runs
it). transformers: RepetitionPenalty, Temperature, TopK and TopP processors, softmax and
torch.multinomial, as generate(do_sample=True) runs them, timed eagerly with CUDA events
(its way) and replayed from a torch CUDA graph. The work is launch- and latency-bound: a pass
reads the logits (201 KB a row, ~0.06 us of HBM time at 3.35 TB/s) at most. Ours is timed
with the library's search setting, WAYS x SUB (splits a pass x elements compared at once),
which names its column (ours_us_16x64); the tool changes no library setting.
"""
from __future__ import annotations

import argparse

import cupy
import numpy as np

import tilekernels as tk
from benchlib import graph_ms_cupy, graph_ms_torch, gpu_name, markdown_table, time_ms, versions, write_result
from tilekernels import sampling

V = 50257
SETTINGS = {"greedy, penalty 1.2": dict(temperature=0, penalty=1.2), "T 0.8": dict(temperature=0.8),
            "T 0.8, top-k 200": dict(temperature=0.8, top_k=200), "T 0.8, top-p 0.9": dict(temperature=0.8, top_p=0.9),
            "T 0.8, top-k 50, top-p 0.9, penalty 1.2": dict(temperature=0.8, top_k=50, top_p=0.9, penalty=1.2)}


def torch_sampler(logits, seen_ids, cfg: dict):
    """transformers' processors for cfg, then the draw (generate's sampling step)."""
    import torch
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    procs = [RepetitionPenaltyLogitsProcessor(cfg["penalty"])] if cfg.get("penalty", 1) != 1 else []
    if cfg["temperature"] > 0:
        procs.append(TemperatureLogitsWarper(cfg["temperature"]))
    if cfg.get("top_k"):
        procs.append(TopKLogitsWarper(cfg["top_k"]))
    if cfg.get("top_p", 1) < 1:
        procs.append(TopPLogitsWarper(cfg["top_p"]))

    def run():
        scores = logits
        for p in procs:
            scores = p(seen_ids, scores)
        if cfg["temperature"] == 0:
            return scores.argmax(-1)
        return torch.multinomial(torch.softmax(scores, -1), 1)[:, 0]
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch

    rng = np.random.default_rng(0)
    rows = []
    for b in (1, 8):
        x = (rng.standard_normal((b, V)) * 3).astype(np.float32)
        seen = (rng.random((b, V)) < 0.1).astype(np.uint8)
        seen_ids = torch.as_tensor(np.stack([np.flatnonzero(s)[:4000] for s in seen]), device="cuda")
        gx, gu, gseen = cupy.asarray(x), cupy.asarray(rng.random(b, dtype=np.float32)), cupy.asarray(seen)
        tx = torch.as_tensor(x, device="cuda")
        for label, cfg in SETTINGS.items():
            row = {"batch": b, "sampling": label}
            call = (lambda: tk.sample(gx, gu, **cfg, seen=gseen)) if "penalty" in cfg else (
                lambda: tk.sample(gx, gu, **cfg))
            row[f"ours_us_{sampling.WAYS}x{sampling.SUB}"] = round(graph_ms_cupy(call) * 1e3, 1)
            run = torch_sampler(tx, seen_ids, cfg)
            row["transformers_eager_us"] = round(time_ms(run, 5, 50) * 1e3, 1)
            try:
                row["transformers_graph_us"] = round(graph_ms_torch(run) * 1e3, 1)
            except Exception as e:  # noqa: BLE001 - report why it could not run
                row["transformers_graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(row, flush=True)
    keys = [k for k in rows[0] if k.startswith("ours_us")]
    md = (f"GPU: {gpu_name()}; vocabulary {V}; device us a call (ours: CUDA graph replays; transformers: "
          f"eager and graph).\n\n" + markdown_table(
              ["batch", "sampling", *keys, "transformers eager us", "transformers graph us"],
              [[r["batch"], r["sampling"], *(r[k] for k in keys), r["transformers_eager_us"],
                r.get("transformers_graph_us", r.get("transformers_graph_error", ""))] for r in rows]))
    write_result("sampling", {"gpu": gpu_name(), "versions": versions(), "vocabulary": V, "rows": rows}, args.out, md)


if __name__ == "__main__":
    main()
