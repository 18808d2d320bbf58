"""Compiled kernels kept on disk, built once per machine, and built ahead in parallel.

cuda.tile's own disk cache is keyed by the kernel's TileIR bytecode, so a process must run the
cuTile front end on every specialization to find its cubin (a fraction of a second each, seconds
a model), and the bytecode carries the source file's path, so every checkout rebuilds. `kernel`
here (a ct.kernel) keys its cubins on what decides them without building anything: the tilekernels
sources' digest, the specialization's mangled name (cuda.tile's name mangling encodes the
whole signature and round-trips it), the compiler options, the cuda.tile and tileiras releases
and the GPU architecture. A cache hit costs one file read.

A model ships the list of the specializations it launches, in the order a first run launches
them (a manifest, written by `launched` on a GPU run): `prebuild` compiles the ones missing from
the cache in worker processes, one a core, from the model's load on, in that order. Whoever builds
a cubin first claims it (a marker file naming its process, `<cubin>.building`), so workers,
launches and other processes on the machine share the work: a launch whose cubin another holds
waits for it, one nobody holds is compiled by the launching process. A run therefore waits only
for the kernels it launches; the workers finish the rest of the list in the background, also
after the run has exited, so that the next run finds them.

The cache lives in $TILEKERNELS_CACHE_DIR, else $XDG_CACHE_HOME/tilekernels, else
~/.cache/tilekernels ('off' turns it off); deleting the folder clears it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterable

import cuda.tile as ct
from cuda.tile.compilation import demangle_kernel_name, export_kernel, mangle_kernel_name

_LOCK = threading.Lock()
_LAUNCHED: dict[str, None] = {}         # "module:name symbol" of every specialization this process loaded, in order
_BUILT: list[str] = []                  # those it compiled itself, in order
STATS = {"loaded": 0, "built": 0, "build_s": 0.0, "prebuilt": 0, "wait_s": 0.0, "start_s": 0.0}
STALE_S = 600.0         # a claim this old is a dead builder's (its pid may have been reused)


def cache_dir() -> Path | None:
    """Where cubins are kept (None: the cache is off)."""
    env = os.environ.get("TILEKERNELS_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "none") else Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tilekernels"


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 of the kernel modules' sources (tilekernels/*.py; the runtime compiles nothing)."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _toolchain() -> str:
    from .compiler import version

    tileiras = version()
    return f"cuda.tile {ct.__version__} tileiras {'.'.join(map(str, tileiras)) if tileiras else 'unknown'}"


def cubin_path(module: str, name: str, symbol: str, options: str, arch: str) -> Path | None:
    """The cache file of one specialization (None when the cache is off)."""
    root = cache_dir()
    if root is None:
        return None
    key = hashlib.sha256("\n".join((source_digest(), _toolchain(), arch, module, name, options, symbol))
                         .encode()).hexdigest()
    return root / "cubins" / arch / key[:2] / f"{key}.cubin"


def _store(path: Path, cubin: bytes) -> None:
    """Write a cubin atomically (a reader never sees half of one; concurrent writers agree); a
    cache that cannot be written (a read-only home) is skipped: the kernel still runs."""
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _read(path: Path | None) -> bytes | None:
    try:
        return path.read_bytes() if path is not None else None
    except OSError:         # not built yet, or unreadable: compiled again
        return None


def _marker(path: Path) -> Path:
    return path.with_suffix(".building")


def _holder_alive(mark: Path) -> bool:
    """Whether the process named in a claim marker still runs (a marker just made, its pid not
    yet written, counts as alive; one older than STALE_S as dead)."""
    try:
        if time.time() - mark.stat().st_mtime > STALE_S:
            return False
        text = mark.read_text().strip()
    except OSError:
        return False        # gone: released
    if not text:
        return True
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def claim(path: Path) -> bool:
    """Take the building of `path` (False: another live process holds it); a dead holder's claim
    is taken over. A cache that cannot be written is ours to build (and not stored)."""
    mark = _marker(path)
    for _ in range(2):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _holder_alive(mark):
                return False
            with contextlib.suppress(OSError):
                mark.unlink()
            continue
        except OSError:
            return True
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def release(path: Path) -> None:
    with contextlib.suppress(OSError):
        _marker(path).unlink()


def await_cubin(path: Path) -> bytes | None:
    """The cached cubin, waiting while another process builds it; None once it is ours to build
    (claimed: release it after storing)."""
    began = None
    while True:
        cubin = _read(path)
        if cubin is not None or claim(path):
            break
        began = began or time.perf_counter()
        mark = _marker(path)
        while not path.exists() and _holder_alive(mark):
            time.sleep(0.005)
    if began is not None:
        STATS["wait_s"] += time.perf_counter() - began
    return cubin


def device_arch() -> str:
    """sm_XY of the current GPU."""
    import cupy

    return f"sm_{cupy.cuda.Device().compute_capability}"


class kernel(ct.kernel):
    """ct.kernel whose cubins come from (and go to) the on-disk cache above."""

    def __new__(cls, function=None, /, **options):
        if function is None:            # @kernel(occupancy=2)
            return lambda f: cls(f, **options)
        return super().__new__(cls, function, **options)

    def _compile(self, signature, context, compute_capability=None):
        arch = f"sm_{compute_capability[0]}{compute_capability[1]}" if compute_capability else device_arch()
        symbol = signature.symbol or mangle_kernel_name(self._pyfunc.__name__, signature)
        module, name = self.reference()
        path = self.cache_file(symbol, arch)
        with _LOCK:
            _LAUNCHED.setdefault(f"{module}:{name} {symbol}")
        cubin = await_cubin(path) if path is not None else None     # a failed build: compiled here, reported
        if cubin is not None:
            STATS["loaded"] += 1
            return cubin, symbol, None, ()
        began = time.perf_counter()
        try:
            cubin, symbol, extra, providers = super()._compile(signature, context, compute_capability)
            if path is not None and not providers:
                _store(path, cubin)
        finally:
            if path is not None:
                release(path)
        STATS["built"] += 1
        STATS["build_s"] += time.perf_counter() - began
        _BUILT.append(f"{module}:{name} {symbol}")
        return cubin, symbol, extra, providers

    def replace_hints(self, **hints) -> "kernel":
        return kernel(self._pyfunc, **dataclasses.asdict(dataclasses.replace(self._compiler_options, **hints)))

    def options(self) -> str:
        return repr(self._compiler_options)

    def cache_file(self, symbol: str, arch: str) -> Path | None:
        """cubin_path of this kernel's specialization `symbol` for `arch`."""
        return cubin_path(*self.reference(), symbol, self.options(), arch)

    def reference(self) -> tuple[str, str]:
        """(module, attribute) naming this kernel, which a worker process imports."""
        ref = self.__dict__.get("_reference")
        if ref is None:
            module = self._pyfunc.__module__
            names = [k for k, v in vars(sys.modules[module]).items() if v is self]
            ref = self.__dict__["_reference"] = (module, names[0] if names else self._pyfunc.__name__)
        return ref


def launched() -> list[str]:
    """Every specialization this process has loaded, as manifest lines ("module:name symbol"), in
    the order of their first launch."""
    with _LOCK:
        return list(_LAUNCHED)


def built() -> list[str]:
    """The specializations this process compiled itself (not found in the cache), in order."""
    return list(_BUILT)


def read_manifest(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _resolve(line: str) -> tuple[kernel, str]:
    import importlib

    ref, symbol = line.split(" ", 1)
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name), symbol


def missing(lines: Iterable[str], arch: str) -> list[tuple[str, Path]]:
    """The manifest lines whose cubins are not in the cache yet, each with its cache file (a line
    naming no kernel of this tilekernels is skipped: its launch, if any, compiles as ever)."""
    out = []
    for line in lines:
        try:
            k, symbol = _resolve(line)
        except (ImportError, AttributeError, ValueError):
            continue
        path = k.cache_file(symbol, arch)
        if path is not None and not path.exists():
            out.append((line, path))
    return out


def build(line: str, arch: str) -> None:
    """Compile one manifest line for `arch` into the cache unless it is there or another process
    holds its claim (a worker's job)."""
    k, symbol = _resolve(line)
    path = k.cache_file(symbol, arch)
    if path is None or path.exists() or not claim(path):
        return
    try:
        _, signature = demangle_kernel_name(symbol)
        buf = io.BytesIO()
        export_kernel(k, [signature], buf, gpu_code=arch, output_format="cubin")
        _store(path, buf.getvalue())
    finally:
        release(path)


class Prebuild:
    """The missing cubins of a manifest, compiling in worker processes (at most `workers`, by
    default one a core but the caller's). Every worker walks the whole list in order and builds
    what nobody has built or claimed, so the first lines finish first and no worker idles while
    another has a queue. Each worker is a fresh interpreter running build() on the lines it reads
    from stdin: never the caller's main module, which multiprocessing's spawn would import again
    in every worker (a script loading a model at top level would load it once a worker). The
    workers outlive the caller if it exits first: what they finish, the next run loads."""

    def __init__(self, todo: list[tuple[str, Path]], arch: str, workers: int | None = None):
        import subprocess

        workers = max(1, min(workers or (os.cpu_count() or 2) - 1, len(todo)))
        lines = "\n".join(line for line, _ in todo).encode()
        self.procs = []
        for _ in range(workers):
            proc = subprocess.Popen([sys.executable, "-c", "from tilekernels.cubins import work; work()", arch],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            proc.stdin.write(lines)
            proc.stdin.close()
            self.procs.append(proc)
        STATS["prebuilt"] += len(todo)

    def join(self) -> None:
        """Wait for every build (a failed one is compiled again, and reported, when launched)."""
        for p in self.procs:
            p.wait()

    def cancel(self) -> None:
        """Stop the builds (the load they ran beside failed); their claims die with them."""
        for p in self.procs:
            p.kill()
            p.wait()


def work() -> None:
    """A prebuild worker: build() each manifest line read from stdin for the architecture argv[1];
    one that fails is skipped (its launch compiles it and reports why)."""
    arch = sys.argv[1]
    for line in sys.stdin.read().splitlines():
        try:
            build(line, arch)
        except Exception as e:  # noqa: BLE001
            print(f"{line.split(' ')[0]}: {type(e).__name__}: {e}", file=sys.stderr)


def prebuild(lines: Iterable[str], arch: str | None = None, workers: int | None = None) -> Prebuild | None:
    """Start compiling the manifest lines whose cubins are not cached (None: all are)."""
    arch = arch or device_arch()
    todo = missing(lines, arch)
    return Prebuild(todo, arch, workers) if todo else None


@contextlib.contextmanager
def built_ahead(manifest: Path | None):
    """Start compiling the manifest's missing cubins in worker processes as the block (a model
    loading) begins; launches after it wait only for their own kernels. A block that fails stops
    the workers. No manifest (a CPU load, a model size none was recorded for): nothing to do."""
    began = time.perf_counter()
    building = prebuild(read_manifest(manifest)) if manifest is not None and manifest.exists() else None
    STATS["start_s"] += time.perf_counter() - began
    try:
        yield
    except BaseException:
        if building is not None:
            building.cancel()
        raise
