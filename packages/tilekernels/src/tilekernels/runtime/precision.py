"""One name for the precision a model runs at, as the command lines and APIs take it.

- bf16 (DEFAULT): products on bfloat16 inputs with float32 accumulation, of bfloat16 matrices:
  a bfloat16 checkpoint's as published (GLM-ASR's decoder), a float32 one's rounded as
  transformers' bfloat16 model rounds them (gpt; GLM-ASR's encoder keeps its folded
  query-key-value matrices float32: TF32). The residual stream, every accumulation, the norms,
  attention and the softmax stay float32 (tk matmul precision 'medium'). It is the default
  because it is the fastest precision whose logits agree with transformers fp32 at least as
  well as transformers' own bfloat16 model does, prefill and decode steps alike, for gpt2 and
  GLM-ASR (tools/parity_gpt.py, tools/parity_glm_asr.py; docs/performance.md).
- tf32: every product on TF32 tensor cores ('high'), float32 matrices.
- fp32: float32-accurate products (3xTF32, 'highest').

A loaded model keeps its precision: load(precision=...) prepares its weights at it, and its engine
runs every step at it (using), whatever the process's setting or another model's.

On the GPU the KV cache follows: bfloat16 keys and values at bf16 (half the bytes a decode step
reads), float32 otherwise; the CPU's is always float32, and the CPU computes in float32 at any
precision. Engine(kv_dtype=...) overrides it.
"""
from __future__ import annotations

import numpy as np

import tilekernels as tk
from tilekernels.weights import BF16

PRECISIONS = {"bf16": "medium", "tf32": "high", "fp32": "highest"}
DEFAULT = "bf16"


def _mode(name: str) -> str:
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


def set_precision(name: str) -> None:
    """Run the tilekernels products at `name` (bf16, tf32 or fp32) from now on: the process's
    setting, for whatever runs outside a `using` block."""
    tk.set_matmul_precision(_mode(name))


def using(name: str):
    """A block whose kernels (launched from this thread) run at `name`."""
    return tk.matmul_precision(_mode(name))


def precision() -> str:
    """The current precision's name."""
    return {v: k for k, v in PRECISIONS.items()}[tk.get_matmul_precision()]


def kv_dtype(xp) -> np.dtype:
    """The KV cache's dtype at the current precision for arrays of module xp (see above)."""
    return BF16 if precision() == "bf16" and xp is not np else np.dtype(np.float32)
