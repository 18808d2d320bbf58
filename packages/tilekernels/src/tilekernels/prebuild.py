"""python -m tilekernels.prebuild PACKAGE|LIST ... [--arch sm_XY]: a model's kernels built into the
cubin cache (tilekernels.cubins) ahead of its first run: an install step, or a container image's
build on a machine without a GPU (--arch names the one it will run on). On this machine's GPU (no
--arch), a package that ships a `<package>.warmup` module then has it run, in a process of its own:
the rest of a first run's one-time work (CuPy's kernels, bytecode) done now too."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .cubins import Prebuild, build, cache_dir, device_arch, missing, read_manifest


def manifests(target: str) -> list[Path]:
    """A manifest file, or every manifest an installed package ships (<package>/kernels/*.txt),
    found without importing the package."""
    import importlib.util

    path = Path(target)
    if path.suffix == ".txt" and path.is_file():
        return [path]
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{target}: neither a kernel list (.txt) nor an installed package")
    found = sorted(f for loc in spec.submodule_search_locations for f in Path(loc, "kernels").glob("*.txt"))
    if not found:
        raise ValueError(f"{target}: ships no kernel list (kernels/*.txt)")
    return found


def main(argv: list[str] | None = None) -> int:
    """Build the listed kernels into the cache now, so that a model's first run loads them instead of
    compiling them (with --arch no GPU is needed); without --arch each package's warm-up runs
    after (PACKAGE.warmup). The exit status is 1 if a kernel or a warm-up failed."""
    import argparse
    import re

    ap = argparse.ArgumentParser(prog="python -m tilekernels.prebuild", description=main.__doc__)
    ap.add_argument("targets", nargs="+", metavar="PACKAGE|LIST", help="a model package (gpt, glm_asr) or a .txt list")
    ap.add_argument("--arch", help="the GPU architecture, sm_XY (default: this machine's GPU's)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="compilers at once (default: a core each)")
    args = ap.parse_args(argv)
    try:
        lines = list(dict.fromkeys(line for t in args.targets for m in manifests(t) for line in read_manifest(m)))
        if args.arch is not None and not re.fullmatch(r"sm_\d+", args.arch):
            raise ValueError(f"--arch {args.arch}: expected sm_XY, e.g. sm_90")
        if args.workers < 1:
            raise ValueError(f"--workers {args.workers}: at least 1")
        if cache_dir() is None:
            raise ValueError("the kernel cache is off (TILEKERNELS_CACHE_DIR): nothing to build into")
        try:
            arch = args.arch or device_arch()
        except Exception as e:
            raise ValueError(f"no GPU to build for ({type(e).__name__}): name one with --arch sm_XY") from None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    todo = missing(lines, arch)
    if todo:
        Prebuild(todo, arch, args.workers).join()
    failed = missing(lines, arch)
    print(f"{len(todo) - len(failed)} kernels built for {arch} in {time.perf_counter() - began:.1f} s, "
          f"{len(lines) - len(todo)} were cached ({cache_dir()})")
    if failed:
        try:
            build(failed[0][0], arch)       # again here, for the reason
            reason = "built on a second try"
        except Exception as e:  # noqa: BLE001
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"error: {len(failed)} kernels failed to build, first {failed[0][0].split(' ')[0]} ({reason})",
              file=sys.stderr)
        return 1
    return 0 if args.arch is not None else warm_up(args.targets)


def warmups(targets: list[str]) -> list[str]:
    """The `<package>.warmup` modules of the targets that are packages and ship one."""
    import importlib.util

    out = []
    for t in dict.fromkeys(targets):
        try:
            if not t.endswith(".txt") and importlib.util.find_spec(f"{t}.warmup") is not None:
                out.append(f"{t}.warmup")
        except (ImportError, ValueError):
            pass
    return out


def warm_up(targets: list[str], timeout: float = 900.0) -> int:
    """Run each warm-up module (python -m PACKAGE.warmup), its lines passed on; 1 if any failed or
    ran past timeout seconds."""
    import subprocess

    status = 0
    for module in warmups(targets):
        try:
            status |= subprocess.run([sys.executable, "-m", module], timeout=timeout).returncode != 0
        except subprocess.TimeoutExpired:
            print(f"error: {module} ran past {timeout:.0f} s", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
