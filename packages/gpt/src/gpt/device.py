"""Choosing where a model runs: 'gpu' (cupy + cuTile), 'cpu' (numpy), or 'auto'."""
from __future__ import annotations

import sys


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
