"""Array-type dispatch and argument validation shared by every op.

Each public op takes numpy arrays (runs the float32 numpy reference) or cupy arrays
(runs the cuTile kernel). Mixing the two, or passing anything else, is an error that
names the argument.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import cuda.tile as ct
import numpy as np

__all__ = ["array_module", "is_device", "backend", "check", "next_pow2", "launch", "sm_count", "inputs_ready",
           "release_dependents", "wait_for_inputs", "last_block_counters", "last_in_group", "reset_count",
           "full_wait_next", "dependent_launch", "set_dependent_launch"]

# Programmatic dependent launch (Hopper and later): each kernel may be scheduled while the one
# before it still runs, and waits in inputs_ready() for that one's writes. Hides the launch
# gap and lets weight loads start early. TILEKERNELS_DEPENDENT_LAUNCH=0 turns it off;
# set_dependent_launch / dependent_launch switch it from code (to measure what it saves).
_DEPENDENT_LAUNCH = os.environ.get("TILEKERNELS_DEPENDENT_LAUNCH", "1") != "0"


def set_dependent_launch(enabled: bool) -> bool:
    """Launch kernels as programmatic dependents (Hopper and later) or plainly from now on;
    returns the previous setting."""
    global _DEPENDENT_LAUNCH
    before, _DEPENDENT_LAUNCH = _DEPENDENT_LAUNCH, bool(enabled)
    return before


@contextlib.contextmanager
def dependent_launch(enabled: bool):
    """set_dependent_launch(enabled) for the kernels launched (or captured) inside the block."""
    before = set_dependent_launch(enabled)
    try:
        yield
    finally:
        set_dependent_launch(before)


def is_device(a: Any) -> bool:
    """True for a cupy array (checked without importing cupy)."""
    return type(a).__module__.split(".")[0] == "cupy"


def array_module(a: Any):
    """numpy or cupy, matching the array `a`."""
    if is_device(a):
        import cupy

        return cupy
    return np


def backend(**arrays: Any) -> str:
    """'numpy' or 'cupy' for the given named arrays (None entries are skipped)."""
    kinds = {}
    for name, a in arrays.items():
        if a is None:
            continue
        if isinstance(a, np.ndarray):
            kinds[name] = "numpy"
        elif is_device(a) and type(a).__name__ == "ndarray":
            kinds[name] = "cupy"
        else:
            raise TypeError(f"{name}: expected a numpy or cupy array, got {type(a).__name__}")
    found = set(kinds.values())
    if len(found) > 1:
        detail = ", ".join(f"{n}={k}" for n, k in kinds.items())
        raise TypeError(f"arrays must all be numpy or all be cupy, got {detail}")
    return found.pop() if found else "numpy"


def check(
    name: str,
    a: Any,
    *,
    ndim: int | tuple[int, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    dtype: Any = np.float32,
    contiguous: bool = True,
    inner_contiguous: bool = False,
) -> None:
    """Validate one array argument; the error says what was expected and what came.
    dtype: one dtype or a tuple of the accepted ones."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if a.dtype not in dtypes:
        want = " or ".join(np.dtype(d).name for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {a.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if a.ndim not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(f"{name}: expected {want} dimensions, got shape {tuple(a.shape)}")
    if shape is not None:
        if len(shape) != a.ndim or any(s is not None and s != d for s, d in zip(shape, a.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {tuple(a.shape)}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {a.strides}")
    if inner_contiguous and a.ndim and a.strides[-1] != a.itemsize and a.shape[-1] > 1:
        raise ValueError(f"{name}: expected unit stride on the last axis, got strides {a.strides}")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (cuTile tile dimensions must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """Multiprocessors of the current GPU (grid sizing for split-K and split-KV)."""
    import cupy

    return cupy.cuda.Device().attributes["MultiProcessorCount"]


class _DeviceArg:
    """A cupy array described by a version-2 __cuda_array_interface__ (no stream field).

    cupy's own interface names its stream, which makes the consumer synchronise on it at
    every launch; the kernels run on that same stream, so the plain description is
    equivalent and spares every launch that synchronisation.
    """
    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, a: Any):
        if a.dtype.kind == "V":     # bfloat16 has no type code here: its bits go as uint16 (weights.f32)
            a = a.view(a.dtype.str.replace("V", "u"))
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str, "strides": a.strides,
                                         "data": (a.data.ptr, False), "version": 2}


_COUNTERS: dict = {}
_FULL_WAIT_NEXT = False


def full_wait_next() -> None:
    """Launch the next kernel plainly: none of it runs before every kernel queued before it has
    finished, so neither do the dependent launches after it. Kernels read constants (weights)
    and earlier steps' cached keys before their dependency wait: in a CUDA graph of several
    decode steps, each step starts this way."""
    global _FULL_WAIT_NEXT
    _FULL_WAIT_NEXT = True


def last_block_counters(n: int):
    """n zeroed int32 counters for kernels whose last block to finish a group of blocks
    finishes the group's work (split-KV merge, argmax pick): each block adds one with an
    acquire-release atomic after its stores, the block that sees the group's count is last,
    and it sets the counter back to zero. So every launch leaves them zero, and one array per
    device and stream serves them all, graph replays included. Allocated outside any memory
    pool and never freed (a captured graph keeps the address): the first call on a stream
    must not be inside a graph capture."""
    import cupy

    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    have = _COUNTERS.setdefault(key, [])
    if not have or have[-1].size < n:
        with cupy.cuda.using_allocator(None):
            have.append(cupy.zeros(max(n, 256), cupy.int32))
    return have[-1]


def last_in_group(C, group, blocks):
    """Tile helper for last_block_counters, after the block's plain (non-TMA: the release does
    not order the async proxy) stores: count the block into C[group] and tell whether it is the
    last of the group's `blocks` blocks; then its loads see the group's stores."""
    return ct.atomic_add(C, group, 1) == blocks - 1


def reset_count(C, group) -> None:
    """Tile helper: the group's last block sets C[group] back to zero, a plain store (visible to
    the next kernel; an atomic exchange held the block's next loads back a round trip: SASS)."""
    ct.store(C, index=(group,), tile=ct.full((), 0, dtype=C.dtype))


@functools.lru_cache(maxsize=None)
def _hopper_or_later() -> bool:
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= 90


@functools.lru_cache(maxsize=None)
def _compiler_checked() -> bool:
    from . import compiler

    compiler.check(compiler.version())
    return True


def launch(grid: tuple[int, ...], kernel: Any, args: tuple) -> None:
    """Launch a cuTile kernel on cupy's current stream (as a programmatic dependent launch
    on Hopper and later: every kernel here calls inputs_ready before touching activations).
    The first launch checks the compiler's release (tilekernels.compiler)."""
    import cupy

    global _FULL_WAIT_NEXT
    _compiler_checked()
    dependent = _DEPENDENT_LAUNCH and not _FULL_WAIT_NEXT and _hopper_or_later()
    _FULL_WAIT_NEXT = False
    args = tuple(_DeviceArg(a) if is_device(a) else a for a in args)
    ct.launch(cupy.cuda.get_current_stream().ptr, grid, kernel, args, programmatic_dependent_launch=dependent)


def inputs_ready() -> None:
    """Tile helper, in every kernel before it reads activations or writes anything (constant
    weights may be loaded before it): let the next kernel start launching, then wait until the
    kernels before this one have finished and their writes are visible. Releasing the next
    kernel before the wait rather than after lets its blocks start their weight loads a kernel
    earlier (the next kernel still waits for this one to finish), which shortens every kernel of
    a dependent chain."""
    release_dependents()
    wait_for_inputs()


def release_dependents() -> None:
    """Tile helper, inputs_ready's first half: the next kernel may start launching (a kernel
    that loads something before its wait releases first, so the next launch does not wait
    for those loads)."""
    ct.grid_dependency_control_launch_dependents()


def wait_for_inputs() -> None:
    """Tile helper, inputs_ready's second half: the kernels before this one have finished and
    their writes are visible."""
    ct.grid_dependency_control_wait()
