"""One name for the precision a model runs at, as the command lines and APIs take it.

- tf32 (the default): every product on TF32 tensor cores ('high').
- bf16: the large products (encoders, prefills) of bfloat16 weights on bfloat16 inputs with
  float32 accumulation; decode-step products stay TF32, the residual stream, norms and softmax
  float32 (tk matmul precision 'medium'). Whether it agrees with transformers' fp32 at least as
  well as transformers' own bf16 run does is what tools/parity_glm_asr.py reports; until that has
  run on this code, tf32 stays the default.
- fp32: float32-accurate products (3xTF32, 'highest').

The KV cache is float32 at every precision; Engine(kv_dtype=bfloat16) halves what a decode step
reads (GPU-tested at head dim 64 only).
"""
from __future__ import annotations

import tilekernels as tk

PRECISIONS = {"bf16": "medium", "tf32": "high", "fp32": "highest"}
DEFAULT = "tf32"


def set_precision(name: str) -> None:
    """Run the tilekernels products at `name` (bf16, tf32 or fp32) from now on."""
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    tk.set_matmul_precision(PRECISIONS[name])


def precision() -> str:
    """The current precision's name."""
    return {v: k for k, v in PRECISIONS.items()}[tk.get_matmul_precision()]
