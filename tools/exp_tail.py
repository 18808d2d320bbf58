"""Experiment: device cost of the decode graph's tail (argmax of the logits, then ids,
positions and span advanced by cupy kernels), as a chain replayed from one graph."""
import cupy

from benchlib import graph_ms_cupy

for v in (50257, 59264):
    logits = cupy.random.standard_normal((1, v), dtype=cupy.float32)
    ids = cupy.zeros((1, 1), cupy.int64)
    pos = cupy.zeros((1, 1), cupy.int64)
    span = cupy.zeros(2, cupy.int32)

    def tail():
        tokens = logits.argmax(-1)
        ids[:, 0] = tokens
        pos[...] += 1
        span[...] += 1

    def argmax_only():
        logits.argmax(-1)

    print(f"V={v}: tail {graph_ms_cupy(tail) * 1e3:.2f} us, argmax alone {graph_ms_cupy(argmax_only) * 1e3:.2f} us")
