"""Foreign arrays on the CPU side: what an op converts, what passes through, and the one-line
error for an array that is not on a GPU (the GPU side: test_interop_gpu.py)."""
import inspect

import numpy as np
import pytest

import tilekernels as tk
from tilekernels.interop import kind_of

ARRAY_OPS = {"argmax", "attention", "conv1d", "decode_attention", "embedding", "gelu", "layernorm", "linear",
             "logprobs", "lstm", "rmsnorm", "rope", "rope_cos_sin", "sample", "silu", "softmax", "split_qkv",
             "swiglu"}


class HostArray:
    """An array exporting DLPack from host memory (as a CPU torch tensor or JAX array does)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)


class CudaInterface:
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}


def test_every_array_op_is_wrapped_and_keeps_its_signature():
    wrapped = {name for name in tk.__all__ if getattr(getattr(tk, name), "__code__", None) is tk.gelu.__code__}
    assert wrapped == ARRAY_OPS         # every any_array wrapper runs the same code
    for name in ARRAY_OPS:
        op = getattr(tk, name)
        assert inspect.signature(op) == inspect.signature(op.__wrapped__) and op.__doc__ == op.__wrapped__.__doc__


def test_kinds(tmp_path):
    x = np.zeros(3, np.float32)
    m = np.memmap(tmp_path / "m", np.float32, "w+", shape=(3,))
    assert [kind_of(a) for a in (x, m, x.view(np.recarray), 1, 2.0, None, "tanh", (x,), tk.LayerNorm())] == [None] * 9
    assert kind_of(HostArray(x)) == "dlpack" and kind_of(CudaInterface()) == "cai"


def test_numpy_passes_through_unchanged(rng):
    x = rng.standard_normal((7, 769)).astype(np.float32)
    w = rng.standard_normal((5, 769)).astype(np.float32)
    assert np.array_equal(tk.linear(x, w, norm=tk.LayerNorm()), tk.linear.__wrapped__(x, w, norm=tk.LayerNorm()))
    out = np.empty(7, np.int64)
    assert tk.argmax(x, out) is out


@pytest.mark.parametrize("call, name", [
    (lambda x: tk.gelu(HostArray(x)), "x"),
    (lambda x: tk.linear(x, HostArray(np.ones((3, 8), np.float32))), "weight"),
    (lambda x: tk.linear(x, np.ones((3, 8), np.float32), norm=tk.LayerNorm(HostArray(np.ones(8, np.float32)))),
     "norm"),
    (lambda x: tk.attention(x[None, None], x[None, None], v=HostArray(x[None, None])), "v"),
    (lambda x: tk.logprobs(x, np.zeros(2, np.int64), 2, out=(HostArray(np.zeros(2, np.float32)), None, None)),
     "out"),                                                            # inside a tuple too
])
def test_a_host_array_is_one_clear_error(call, name):
    x = np.ones((2, 8), np.float32)
    with pytest.raises(TypeError) as e:
        call(x)
    assert str(e.value) == (f"{name}: a HostArray array on the CPU; tilekernels runs CUDA arrays (torch, JAX, CuPy) "
                            "on the GPU and numpy arrays on the reference")


@pytest.mark.gpu        # where torch is installed (CI has none)
def test_a_cpu_torch_tensor_is_one_clear_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^x: a torch tensor on cpu; tilekernels runs CUDA arrays"):
        tk.softmax(torch.zeros(2, 3))
