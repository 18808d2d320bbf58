"""tilekernels: cuTile kernels for transformer (and recurrent) inference, each with a numpy reference.

Every public op dispatches on the array type: numpy arrays run the float32 numpy
reference (the specification), cupy arrays run the cuTile kernel.
"""
from ._arrays import array_module, dependent_launch, full_wait_next, is_device, set_dependent_launch
from .block import Block
from .activations import gelu, silu, swiglu
from .argmax import argmax
from .attention import attention
from .decode_attention import decode_attention
from .conv1d import conv1d
from .embedding import embedding
from .linear import linear
from .logprobs import logprobs
from .lstm import lstm
from .norm import LayerNorm, RMSNorm, fold_norm, layernorm, rmsnorm
from .qkv import split_qkv
from .precision import get_matmul_precision, matmul_precision, set_matmul_precision
from .rope import rope, rope_cos_sin
from .sampling import sample
from .softmax import softmax
from .weights import compact, stack_rows, widen

__version__ = "0.1.0"
__all__ = [
    "Block", "LayerNorm", "RMSNorm", "dependent_launch", "full_wait_next", "set_dependent_launch", "get_matmul_precision", "matmul_precision",
    "set_matmul_precision", "argmax", "array_module", "attention", "compact", "conv1d", "decode_attention", "embedding", "fold_norm", "gelu",
    "is_device",
    "layernorm", "linear", "logprobs", "lstm", "rmsnorm", "rope", "rope_cos_sin", "sample", "silu", "softmax", "split_qkv", "stack_rows", "swiglu", "widen",
]
