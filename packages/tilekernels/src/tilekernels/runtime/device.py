"""Where a model runs: 'gpu' (cupy + cuTile), 'cpu' (numpy), or 'auto'; moving its weights there;
the stream GPU work is queued on; the heap kept out of the collector's way."""
from __future__ import annotations

import contextlib
import gc
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from .profile import stage


def gpu_problem() -> str | None:
    """Why the GPU path cannot run here, or None when it can."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        import cuda.tile  # noqa: F401
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip(": ")
    return None


def pick_device(choice: str) -> str:
    """Resolve 'auto' (GPU if one works, else CPU with a one-line notice)."""
    if choice not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, got {choice!r}")
    if choice == "cpu":
        return "cpu"
    problem = gpu_problem()
    if problem is None:
        return "gpu"
    if choice == "gpu":
        raise ValueError(f"device=gpu but the GPU is not usable ({problem})")
    print(f"note: no usable GPU ({problem}); running on the CPU", file=sys.stderr)
    return "cpu"


def kernel_manifest(folder: Path, device: str, *dims) -> Path | None:
    """The list of kernel specializations a model of these dimensions launches on the GPU at the
    current precision (tilekernels.cubins builds them ahead), recorded by tools/first_result.py;
    None on the CPU."""
    from .precision import precision

    return folder / ("-".join(map(str, (*dims, precision()))) + ".txt") if device == "gpu" else None


def load_model(read: Callable, device: str, kernels: Path, *dims):
    """read(device) (a model from its checkpoint, its tensors uploaded as stored and prepared
    where they will run) moved to `device`, timed as the stages 'model load' and 'weights
    prepared'; on the GPU the kernels listed for a model of these dimensions (kernel_manifest)
    build meanwhile in worker processes (tilekernels.cubins)."""
    from ..cubins import built_ahead

    with stage("model load"), built_ahead(kernel_manifest(kernels, device, *dims)):
        with stage("weights prepared"):
            model = read(device)
        return model.to(device)


def move_weights(tree, device: str, compact: bool = False, rounded: bool = False):
    """A copy of a weight tree (arrays inside tuples, lists, dicts and dataclasses) on
    'cpu' (numpy, float32) or 'gpu' (cupy); an array referenced twice (tied weights) stays
    shared. compact: on the GPU a matrix of bfloat16 values (a bfloat16 checkpoint, read as
    such or widened) is stored as bfloat16, which is exact (tk.compact); other bfloat16 arrays
    are widened to float32 there. rounded: on the GPU every matrix is
    stored as bfloat16, rounded to nearest (a float32 checkpoint at precision bf16, as
    transformers' bfloat16 model holds its weights)."""
    import dataclasses

    import tilekernels as tk

    if device == "gpu":
        import cupy

        def move(a):
            if a.dtype == tk.weights.BF16:          # a bfloat16 checkpoint's, read as it is stored
                a = cupy.asarray(a.view(np.uint16)).view(tk.weights.BF16)
                return a if a.ndim == 2 and (compact or rounded) else tk.widen(a)
            a = cupy.asarray(a)
            if a.ndim == 2 and rounded:
                return tk.weights.to_bf16(a)
            return tk.compact(a) if compact and a.ndim == 2 else a
    elif device == "cpu":
        def move(a):
            return tk.widen(a.get() if type(a).__module__.split(".")[0] == "cupy" else a)
    else:
        raise ValueError(f"device: expected 'cpu' or 'gpu', got {device!r}")
    seen: dict[int, object] = {}

    def m(x):
        if x is None or isinstance(x, (int, float, str)):
            return x
        if isinstance(x, tuple):
            return tuple(m(a) for a in x)
        if isinstance(x, list):
            return [m(a) for a in x]
        if isinstance(x, dict):
            return {k: m(a) for k, a in x.items()}
        if dataclasses.is_dataclass(x):
            return type(x)(*(m(getattr(x, f.name)) for f in dataclasses.fields(x)))
        if id(x) not in seen:
            seen[id(x)] = move(x)
        return seen[id(x)]

    with stage("weights to the device" if device == "gpu" else "weights to float32"):
        return m(tree)


def device_stream(xp):
    """A non-default stream for GPU runs (CUDA graphs cannot capture the default one),
    ordered after everything already queued on the current stream."""
    if xp is np:
        return contextlib.nullcontext()
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    return stream


def copy_to_host(host: np.ndarray, a, stream) -> np.ndarray:
    """Queue a copy of contiguous device array a into pinned host array host on stream (a
    captured graph's last nodes, a prefill's first tokens); host is valid once the stream
    gets there."""
    import cupy

    cupy.cuda.runtime.memcpyAsync(host.ctypes.data, a.data.ptr, a.nbytes, cupy.cuda.runtime.memcpyDeviceToHost,
                                  stream.ptr)
    return host


def to_host(a, stream) -> np.ndarray:
    """copy_to_host into a new pinned array."""
    import cupy
    import cupyx

    a = cupy.ascontiguousarray(a)
    return copy_to_host(cupyx.empty_pinned(a.shape, a.dtype), a, stream)


def freeze_heap() -> None:
    """Collect, then take every object alive (a loaded model, compiled kernels, captured graphs,
    configs) out of the garbage collector's full passes (gc.freeze). Each full pass scanned them
    all with the GIL held, every few seconds under load, stalling the engine's token loop and
    every request beside it (docs/performance.md). The
    collection first keeps unreachable cycles (a dropped engine and its KV cache) from being
    frozen for good; once the heap is frozen it scans only what is new. Called once
    the long-lived state is built: after warm-up, before serving, as a pipeline run starts."""
    gc.collect()
    gc.freeze()
