"""torch tensors, JAX arrays and other CUDA arrays in, the same kind out, without a copy.

Every public op is wrapped in `any_array`. numpy and CuPy arguments pass straight through (the
reference and the kernel). An op given a torch tensor, a JAX array or any array exporting DLPack
or __cuda_array_interface__ sees a CuPy view of the same memory (zero-copy), launches on the
caller's stream (torch's current stream; JAX's and DLPack producers' arrays are made ready for
it by the DLPack exchange) and returns its arrays as the first such argument's kind (torch or
JAX; CuPy for the rest). An array written in place (out=, caches, counters) is returned as
the caller's own object. torch and JAX are imported only when one of their arrays arrives:
tilekernels depends on neither.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import numpy as np

from .weights import BF16

__all__ = ["any_array", "kind_of"]

_CUDA = (2, 3, 13)      # DLPack device types: CUDA, CUDA host (pinned), CUDA managed
ARRAYS = ("torch", "jax", "dlpack", "cai")
# what each argument type is: an array kind above, "fields" (a dataclass: a norm, whose
# parameters may be foreign), "items" (a tuple or list: out=(...), embed=(...)), "dtype" (a torch
# dtype) or None (passed through as it is)
_KINDS: dict[type, str | None] = {np.ndarray: None, int: None, float: None, bool: None, str: None,
                                  type(None): None, tuple: "items", list: "items"}


def _classify(t: type) -> str | None:
    root = t.__module__.split(".")[0]
    if root == "cupy" or issubclass(t, np.ndarray):       # numpy's subclasses (memmap) are numpy
        kind = None
    elif root == "torch":
        kind = "dtype" if t.__name__ == "dtype" else "torch" if hasattr(t, "__dlpack__") else None
    elif root in ("jax", "jaxlib"):
        kind = "jax" if hasattr(t, "__dlpack__") else None
    elif hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__"):
        kind = "dlpack"
    elif hasattr(t, "__cuda_array_interface__"):
        kind = "cai"
    else:
        kind = "fields" if dataclasses.is_dataclass(t) else None
    _KINDS[t] = kind
    return kind


def _kind(a: Any) -> str | None:
    t = type(a)
    return _KINDS[t] if t in _KINDS else _classify(t)


def kind_of(a: Any) -> str | None:
    """'torch', 'jax', 'dlpack' or 'cai' for an array an op converts; None for numpy, CuPy and
    everything else."""
    kind = _kind(a)
    return kind if kind in ARRAYS else None


def _converts(a: Any) -> bool:
    """Whether an argument needs converting: a foreign array, a norm or tuple holding one, a torch
    dtype."""
    kind = _kind(a)
    if kind == "fields":
        return any(kind_of(getattr(a, f.name)) for f in dataclasses.fields(a))
    if kind == "items":
        return any(_converts(x) for x in a)
    return kind is not None


def any_array(op: Callable) -> Callable:
    """Wrap a public op so that torch, JAX and other CUDA arrays run its kernel (module doc)."""
    signature = inspect.signature(op)

    @functools.wraps(op)
    def call(*args, **kwargs):
        for a in args:
            if type(a) not in _KINDS or _KINDS[type(a)] is not None:
                if _converts(a):
                    return _call(op, signature, args, kwargs)
        for a in kwargs.values():
            if type(a) not in _KINDS or _KINDS[type(a)] is not None:
                if _converts(a):
                    return _call(op, signature, args, kwargs)
        return op(*args, **kwargs)

    return call


def _call(op: Callable, signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    import cupy

    bound = signature.bind(*args, **kwargs)
    first = None
    for name, a in bound.arguments.items():
        for x in _arrays([a]):
            _check_device(name, x)
            first = x if first is None else first
    given: dict[int, Any] = {}
    if first is None:           # only a torch dtype to translate
        _inward_all(bound, given)
        return op(*bound.args, **bound.kwargs)
    device, stream = _placement(first)
    with cupy.cuda.Device(device), _stream(cupy, stream, device):
        _inward_all(bound, given)
        return _outward(op(*bound.args, **bound.kwargs), kind_of(first), given)


def _inward_all(bound: inspect.BoundArguments, given: dict[int, Any]) -> None:
    for name, a in bound.arguments.items():
        bound.arguments[name] = _inward(a, given)


def _arrays(values):
    """The foreign arrays among an op's arguments (a norm's parameters and a tuple's items included)."""
    for a in values:
        if _kind(a) == "fields":
            yield from (getattr(a, f.name) for f in dataclasses.fields(a) if kind_of(getattr(a, f.name)))
        elif _kind(a) == "items":
            yield from _arrays(a)
        elif kind_of(a):
            yield a


def _check_device(name: str, a: Any) -> None:
    kind = kind_of(a)
    if kind == "torch":
        where = None if a.is_cuda else str(a.device)
    elif kind in ("jax", "dlpack"):
        dev_type, _ = a.__dlpack_device__()
        where = None if int(dev_type) in _CUDA else "the CPU" if int(dev_type) == 1 else f"DLPack device {dev_type}"
    else:
        where = None
    if where is not None:
        what = {"torch": "torch tensor", "jax": "JAX array"}.get(kind, f"{type(a).__name__} array")
        raise TypeError(f"{name}: a {what} on {where}; tilekernels runs CUDA arrays (torch, JAX, CuPy) on the GPU "
                        "and numpy arrays on the reference")


def _placement(a: Any) -> tuple[int, int | None]:
    """(device ordinal, stream pointer or None for CuPy's current stream) an op on `a` runs on."""
    import cupy

    kind = kind_of(a)
    if kind == "torch":
        import torch

        return a.device.index, torch.cuda.current_stream(a.device).cuda_stream
    if kind in ("jax", "dlpack"):
        return int(a.__dlpack_device__()[1]), None
    return cupy.cuda.Device().id, None


def _stream(cupy, ptr: int | None, device: int):
    if ptr is None:
        return cupy.cuda.get_current_stream(device)
    return cupy.cuda.Stream.null if ptr == 0 else cupy.cuda.ExternalStream(ptr, device)


def _inward(a: Any, given: dict[int, Any]) -> Any:
    """A CuPy view of a foreign array (remembered in `given`, to return it as itself)."""
    import cupy

    if _kind(a) == "fields":
        changes = {f.name: _inward(getattr(a, f.name), given) for f in dataclasses.fields(a)
                   if kind_of(getattr(a, f.name))}
        return dataclasses.replace(a, **changes) if changes else a
    if _kind(a) == "items":
        return type(a)(_inward(x, given) for x in a)
    kind = kind_of(a)
    if kind is None:
        return _numpy_dtype(a) if _kind(a) == "dtype" else a
    if kind == "torch":
        import torch

        a_ = a.detach()
        c = (cupy.from_dlpack(a_.view(torch.int16)).view(np.uint16).view(BF16) if a_.dtype == torch.bfloat16
             else cupy.from_dlpack(a_))
    elif kind == "jax":
        import jax
        import jax.numpy as jnp

        c = (cupy.from_dlpack(jax.lax.bitcast_convert_type(a, jnp.uint16)).view(BF16) if a.dtype == jnp.bfloat16
             else cupy.from_dlpack(a))
    elif kind == "dlpack":
        c = cupy.from_dlpack(a)
    else:
        c = cupy.asarray(a)
    given[id(c)] = (c, a)
    return c


def _outward(r: Any, kind: str | None, given: dict[int, Any]) -> Any:
    """Results as the caller's kind: an argument returned is the caller's object itself."""
    if isinstance(r, (tuple, list)):
        return type(r)(_outward(x, kind, given) for x in r)
    if type(r).__module__.split(".")[0] != "cupy":
        return r
    if id(r) in given and given[id(r)][0] is r:
        return given[id(r)][1]
    if kind == "torch":
        import torch

        return (torch.from_dlpack(r.view(np.int16)).view(torch.bfloat16) if r.dtype == BF16
                else torch.from_dlpack(r))
    if kind == "jax":
        import jax
        import jax.numpy as jnp

        return (jax.lax.bitcast_convert_type(jnp.from_dlpack(r.view(np.uint16)), jnp.bfloat16) if r.dtype == BF16
                else jnp.from_dlpack(r))
    return r


def _numpy_dtype(d: Any) -> np.dtype:
    """A torch dtype (out_dtype=torch.bfloat16) as the numpy dtype the ops take."""
    import torch

    if d == torch.bfloat16:
        return BF16
    return np.dtype(str(d).removeprefix("torch."))
