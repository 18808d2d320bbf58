"""The cuTile compiler (tileiras) that builds this process's kernels, checked before the first launch.

tileiras 13.4.92 miscompiled some of these kernels on sm_90: the split-K decode products with
128-wide K chunks and decode attention over a float32 cache gave wrong results that differed from
call to call (docs/performance.md, "The compiler"). 13.5.37 builds them exact, so that is the
oldest release the kernels run with.
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

OLDEST = (13, 5, 37)


class CompilerError(RuntimeError):
    """The installed tileiras cannot build these kernels right."""


def parse_version(text: str) -> tuple[int, ...] | None:
    """(major, minor, patch) from `tileiras --version` output ("... release 13.5, V13.5.37")."""
    found = re.search(r"\bV(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(g) for g in found.groups()) if found else None


def executable() -> str | None:
    """The tileiras cuda.tile runs: the nvidia-cuda-tileiras wheel's, else the one on PATH."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for d in (spec.submodule_search_locations or []) if spec else []:
        exe = shutil.which("tileiras", path=str(Path(d) / "cu13" / "bin"))
        if exe:
            return exe
    return shutil.which("tileiras")


@functools.lru_cache(maxsize=None)
def version() -> tuple[int, ...] | None:
    """The compiler's release, or None where it cannot be found or read (cuda.tile reports those)."""
    exe = executable()
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_version(out)


def check(found: tuple[int, ...] | None) -> None:
    """Raise for a compiler older than OLDEST (its kernels may come out wrong)."""
    if found is not None and found < OLDEST:
        have, want = ".".join(map(str, found)), ".".join(map(str, OLDEST))
        raise CompilerError(f"tileiras {have} miscompiles some tilekernels kernels (wrong, nondeterministic "
                           f"results); install nvidia-cuda-tileiras>={want} (pip) or a CUDA {want} toolkit")
