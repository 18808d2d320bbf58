"""One name for the precision a model runs at, as the command lines and APIs take it.

- tf32 (DEFAULT, gpt's: a float32 checkpoint has no bfloat16 weights to gain from bf16): every
  product on TF32 tensor cores ('high').
- bf16 (GLM-ASR's default): the large products (encoders, prefills) of bfloat16 weights on
  bfloat16 inputs with float32 accumulation; decode-step products stay TF32, the residual stream,
  norms and softmax float32 (tk matmul precision 'medium'). GLM-ASR's prefill logits then agree
  with transformers' fp32 to 5.4e-3, transformers' own bf16 run to 2.3e-2
  (glm_asr-parity-h100.json).
- fp32: float32-accurate products (3xTF32, 'highest').

On the GPU the KV cache follows: bfloat16 keys and values at bf16 (half the bytes a decode step
reads), float32 otherwise; the CPU's is always float32. Engine(kv_dtype=...) overrides it.
"""
from __future__ import annotations

import numpy as np

import tilekernels as tk
from tilekernels.weights import BF16

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


def kv_dtype(xp) -> np.dtype:
    """The KV cache's dtype at the current precision for arrays of module xp (see above)."""
    return BF16 if precision() == "bf16" and xp is not np else np.dtype(np.float32)
