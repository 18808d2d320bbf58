"""tilekernels' ops as torch.library custom ops: `import tilekernels.torch_ops`, then
torch.ops.tilekernels.<name>(...).

A custom op is one opaque node to torch.compile: graphs that call it compile whole
(fullgraph=True), taking its result's shape, dtype and strides from the fake implementation
here and running the cuTile kernel at run time, on torch's current stream. CUDA tensors only
(a CPU tensor is a clear error); inference ops, no autograd. tilekernels itself does not import
torch: only this module does.
"""
from typing import Optional

import torch
from torch import Tensor

import tilekernels as tk

__all__ = ["layernorm", "rmsnorm", "gelu", "silu", "swiglu", "softmax", "linear", "attention", "rope",
           "embedding", "argmax"]


def _float32(x: Tensor, shape=None) -> Tensor:
    return x.new_empty(x.shape if shape is None else shape, dtype=torch.float32)


@torch.library.custom_op("tilekernels::layernorm", mutates_args=())
def layernorm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) [* weight + bias] over the last axis, float32."""
    return tk.layernorm(x, weight, bias, eps)


@layernorm.register_fake
def _(x, weight=None, bias=None, eps=1e-5):
    return _float32(x)


@torch.library.custom_op("tilekernels::rmsnorm", mutates_args=())
def rmsnorm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """x / sqrt(mean(x^2) + eps) [* weight] over the last axis, float32."""
    return tk.rmsnorm(x, weight, eps)


@rmsnorm.register_fake
def _(x, weight=None, eps=1e-6):
    return _float32(x)


@torch.library.custom_op("tilekernels::gelu", mutates_args=())
def gelu(x: Tensor, approximate: str = "tanh") -> Tensor:
    """GELU, approximate 'tanh' (GPT-2's) or 'none' (erf)."""
    return tk.gelu(x, approximate)


@gelu.register_fake
def _(x, approximate="tanh"):
    return _float32(x)


@torch.library.custom_op("tilekernels::silu", mutates_args=())
def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x)."""
    return tk.silu(x)


@silu.register_fake
def _(x):
    return _float32(x)


@torch.library.custom_op("tilekernels::swiglu", mutates_args=())
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up."""
    return tk.swiglu(gate, up)


@swiglu.register_fake
def _(gate, up):
    return _float32(gate)


@torch.library.custom_op("tilekernels::softmax", mutates_args=())
def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax along dim, float32 (laid out with dim innermost)."""
    return tk.softmax(x, dim)


@softmax.register_fake
def _(x, dim=-1):
    return _float32(x.movedim(dim, -1)).movedim(-1, dim)


@torch.library.custom_op("tilekernels::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
           residual: Optional[Tensor] = None) -> Tensor:
    """residual + act(x @ weight.T + bias), float32; weight float32 or bfloat16 (N, K);
    activation None, 'gelu', 'gelu_tanh', 'silu' or 'swiglu' (weight stacks gate and up)."""
    return tk.linear(x, weight, bias, activation, residual=residual)


@linear.register_fake
def _(x, weight, bias=None, activation=None, residual=None):
    n = weight.shape[0] // 2 if activation == "swiglu" else weight.shape[0]
    return _float32(x, (*x.shape[:-1], n))


@torch.library.custom_op("tilekernels::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None) -> Tensor:
    """softmax(q k^T * scale [+ causal mask]) v, q (B, Hq, Tq, D), k and v (B, Hkv, Tk, D);
    the result (B, Hq, Tq, D) of q's dtype, a transposed view of a contiguous (B, Tq, Hq, D)."""
    o = tk.attention(q, k, v, causal, scale)
    b, h, t, d = q.shape
    if o.stride() != (t * h * d, d, h * d, 1) and o.numel() > 1:      # the decode path's layout: as the fake's
        o = q.new_empty((b, t, h, d)).transpose(1, 2).copy_(o)
    return o


@attention.register_fake
def _(q, k, v, causal=False, scale=None):
    b, h, t, d = q.shape
    return q.new_empty((b, t, h, d)).transpose(1, 2)


@torch.library.custom_op("tilekernels::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: Optional[int] = None) -> Tensor:
    """The first rotary_dim channels of each head of x (B, T, H, D) rotated (rotate-half)."""
    return tk.rope(x, cos, sin, rotary_dim)


@rope.register_fake
def _(x, cos, sin, rotary_dim=None):
    return torch.empty_like(x)


@torch.library.custom_op("tilekernels::embedding", mutates_args=())
def embedding(ids: Tensor, table: Tensor, positions: Optional[Tensor] = None,
              pos_table: Optional[Tensor] = None) -> Tensor:
    """table[ids] (+ pos_table[positions]), float32, ids.shape + (C,)."""
    return tk.embedding(ids, table, positions, pos_table)


@embedding.register_fake
def _(ids, table, positions=None, pos_table=None):
    return _float32(table, (*ids.shape, table.shape[1]))


@torch.library.custom_op("tilekernels::argmax", mutates_args=())
def argmax(x: Tensor) -> Tensor:
    """int64 index of the largest value along the last axis (first of equals; NaN largest)."""
    return tk.argmax(x)


@argmax.register_fake
def _(x):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)
