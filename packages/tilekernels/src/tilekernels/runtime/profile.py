"""Where a run's wall time went: named stages timed as they run (checkpoint read, weights,
upload, graphs, ...), the kernels built or loaded, and moments (the first result), printed by
the command lines' profile=true. Timing a stage costs two clock reads, so it is always on."""
from __future__ import annotations

import contextlib
import os
import sys
import time

_STAGES: dict[str, list[float]] = {}        # name -> [seconds, times entered]
_MARKS: dict[str, float] = {}               # name -> seconds since the process started


def process_age() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module's import)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


@contextlib.contextmanager
def stage(name: str):
    """Add the block's wall time to stage `name`."""
    began = time.perf_counter()
    try:
        yield
    finally:
        entry = _STAGES.setdefault(name, [0.0, 0])
        entry[0] += time.perf_counter() - began
        entry[1] += 1


def mark(name: str) -> None:
    """Note when `name` first happened (seconds since the process started)."""
    _MARKS.setdefault(name, process_age())


def stages() -> dict:
    """{stage: {seconds, count}}, the marks, and the kernels built and loaded (tilekernels.cubins)."""
    from ..cubins import STATS

    return {"stages": {k: {"seconds": round(s, 4), "count": n} for k, (s, n) in _STAGES.items()},
            "marks": {k: round(v, 4) for k, v in _MARKS.items()}, "kernels": dict(STATS),
            "process_s": round(process_age(), 4)}


def report(file=None) -> None:
    """Print stages() as a few lines (stderr by default)."""
    file = file or sys.stderr
    s = stages()
    k = s["kernels"]
    print(f"profile: {s['process_s']:.2f} s since the process started", file=file)
    for name, v in s["marks"].items():
        print(f"  {name:<28} at {v:8.2f} s", file=file)
    for name, v in s["stages"].items():
        print(f"  {name:<28} {v['seconds']:8.2f} s  ({v['count']}x)", file=file)
    print(f"  kernels: {k['built']} compiled here ({k['build_s']:.2f} s), {k['loaded']} from the cache, "
          f"{k['prebuilt']} missing when loading began, left to workers ({k['wait_s']:.2f} s waited for builds; "
          f"{k['start_s']:.2f} s checking the cache and starting them)",
          file=file)
