"""Compile every kernel, in every specialization the models use, for four GPU generations.

No GPU is needed: export_kernel runs the cuTile front end and tileiras, which catches
typing and lowering errors on a CPU-only machine.
"""
import io

import cuda.tile as ct
import pytest
from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature,
                                   ScalarConstraint, export_kernel)

from importlib import import_module

from tilekernels._arrays import next_pow2

# the op functions shadow their module names on the package, so import the modules by path
act, attention, conv1d, linear, norm, rope, softmax = (
    import_module(f"tilekernels.{m}")
    for m in ("activations", "attention", "conv1d", "linear", "norm", "rope", "softmax"))

ARCHS = ["sm_80", "sm_90", "sm_100", "sm_120"]
I32, F32 = ScalarConstraint(ct.int32), ScalarConstraint(ct.float32)


def iarr(ndim):
    return arr(ndim, dtype=ct.int32)


def arr(ndim, contiguous=True, dtype=ct.float32):
    return ArrayConstraint(dtype, ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False,
                           stride_constant=(None,) * (ndim - 1) + (1,) if contiguous else None)


def specializations():
    """(name, kernel, parameters) for each specialization the two models launch."""
    out = []
    for n in (768, 1024, 1280, 1600, 2048):          # GPT-2 sizes, GLM encoder, GLM decoder
        rows, tile = norm.norm_config(n)
        for rms in (False, True):
            for res in (False, True):
                out.append((f"norm-{n}-rms{rms}-res{res}", norm.norm_kernel,
                            [arr(2), arr(2), arr(2), arr(1), arr(1), arr(2), F32, F32, rows, tile, rms, res]))
    for code in (act.GELU_TANH, act.GELU_ERF, act.SILU):
        for gated in (False, True):
            out.append((f"act-{code}-{gated}", act.activation_kernel,
                        [arr(1), arr(1), arr(1), act.ELEMENTWISE_TILE, code, gated]))
    for tiles in (linear.SMALL_M, linear.LARGE_M):
        for bias, code in ((False, 0), (True, 0), (True, act.GELU_TANH), (True, act.GELU_ERF)):
            out.append((f"linear-{tiles}-{bias}-{code}", linear.linear_kernel,
                        [arr(2), arr(2), arr(1), arr(2), I32, *tiles, bias, code, False]))
        out.append((f"linear-{tiles}-partial", linear.linear_kernel,
                    [arr(2), arr(2), arr(1), arr(3), I32, *tiles, False, 0, True]))
    for bias, code in ((False, 0), (True, 0), (True, act.GELU_TANH), (True, act.GELU_ERF)):
        out.append((f"splitk-{bias}-{code}", linear.splitk_reduce_kernel,
                    [arr(3), arr(1), arr(2), 256, bias, code]))
    out.append(("softmax", softmax.softmax_kernel, [arr(2), arr(2), softmax.MAX_TILE]))
    for d in (64, 128):
        tm, tn = attention.FLASH_TILES[d]
        for causal in (False, True):
            out.append((f"flash-{d}-{causal}", attention.flash_kernel,
                        [arr(4), arr(4, False), arr(4, False), arr(4), iarr(1), F32, I32, d, tm, tn, causal]))
        out.append((f"decode-{d}", attention.decode_split_kernel,
                    [arr(4), arr(4, False), arr(4, False), arr(5), arr(4), arr(4), iarr(1), iarr(1), F32, I32,
                     d, 16, attention.DECODE_TILE_N]))
        out.append((f"merge-{d}", attention.decode_merge_kernel, [arr(5), arr(4), arr(4), arr(4), I32, d]))
    for heads, d in ((20, 64), (16, 128), (4, 128)):   # GLM encoder q/k, decoder q, decoder k
        out.append((f"rope-{heads}-{d}", rope.rope_kernel,
                    [arr(4), arr(3), arr(3), arr(4), I32, next_pow2(heads), d]))
    out.append(("conv1d-gelu", conv1d.conv1d_kernel,
                [arr(3), arr(3, False), arr(1), arr(3), I32, I32, 3, True, act.GELU_ERF]))
    return out


SPECS = specializations()


@pytest.mark.parametrize("name,kernel,params", SPECS, ids=[s[0] for s in SPECS])
def test_kernel_compiles(name, kernel, params):
    sig = KernelSignature(params, CallingConvention.cutile_python_v1())
    for arch in ARCHS:
        buf = io.BytesIO()
        export_kernel(kernel, [sig], buf, gpu_code=arch, output_format="cubin")
        assert len(buf.getvalue()) > 1000, f"{name} {arch}: empty cubin"
