"""The CPU's VAD in worker processes (pooled_probs: Silero's LSTM steps in Python, which wait on the
GIL in a busy pipeline's process), long inputs streamed through it a chunk at a time, a few
chunks under way at once (chunk_probs, stream_probs)."""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import warnings
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from .model import _cpus, block_frames, speech_probs
from .segments import FRAME

_LOCK = threading.Lock()
BLOCK = block_frames()[0] * FRAME     # a VAD block's samples (vad.model.BLOCK_S)
STREAM_CHUNK = 36 * BLOCK       # 288 s of samples a speech_probs call when streaming (whole blocks)
AHEAD = 3                   # chunks of one input under way at once (chunk_probs): 55 MB of samples at most
_POOL: tuple[int, object, int] | None = None        # (pid, ProcessPoolExecutor or None, threads a process)
PROCESSES = 8               # the VAD's worker processes at most (half the CPUs: readers and the GPU loop need some)


def _pool() -> tuple[int, object, int]:
    import multiprocessing

    global _POOL
    with _LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            pool, n = None, max(1, min(PROCESSES, _cpus() // 2))
            if not multiprocessing.current_process().daemon and spawn_runs_no_program():
                from concurrent.futures import ProcessPoolExecutor

                # each worker exits with this process, however it ends (SIGKILL too); it starts with
                # Ctrl-C blocked (a terminal sends it to the whole process group, a worker still
                # importing too: the parent stops its workers)
                pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                                           initializer=_worker_start, initargs=(os.getpid(),))
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                try:
                    for _ in range(n):      # spawned one a submit: start them all now, each loading the weights
                        pool.submit(speech_probs, np.zeros(FRAME, np.float32))
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                atexit.register(stop_workers)   # before the interpreter tears down what the pool's threads use
            _POOL = (os.getpid(), pool, max(1, _cpus() // n))
        return _POOL


def _worker_start(parent: int) -> None:
    """A VAD worker ignores Ctrl-C (see _pool) and exits with its parent, however that ends."""
    from tilekernels.runtime.parent import watch_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(parent)


def spawn_runs_no_program() -> bool:
    """Whether a spawned worker can start without running the program that started it again: a
    spawned process imports the __main__ module (a script by its path, a -m module by its name)
    and so runs its top-level statements; a user's script without `if __name__ == "__main__":`
    would run twice. Safe: our command lines (python -m glm_asr.transcribe, ...), a package's
    __main__, an interactive session or -c, and a main module whose top level only imports and
    defines; elsewhere the VAD runs in this process."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and (spec.name.split(".")[0] in ("glm_asr", "gpt", "tilekernels")
                             or spec.name.endswith("__main__")):
        return True
    path = getattr(spec, "origin", None) if spec is not None else getattr(main, "__file__", None)
    return path is None or _defines_only(path)


def _defines_only(path: str) -> bool:
    """Whether a module's top level only imports, defines (functions, classes, constants) and
    runs the rest under `if __name__ == "__main__":`."""
    import ast

    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False

    def quiet(node) -> bool:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return True
        if isinstance(node, (ast.Expr, ast.Assign, ast.AnnAssign)):
            return node.value is None or isinstance(node.value, ast.Constant)
        return (isinstance(node, ast.If) and not node.orelse     # an else: would run in every worker
                and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"')

    return all(quiet(node) for node in tree.body)


def start_workers() -> None:
    """Start the VAD's worker processes (pooled_probs) now, in the background: while a model
    loads, rather than inside the first files' time (a spawned process imports numpy and loads
    the weights)."""
    _pool()


def stop_workers() -> None:
    """Stop the VAD's worker processes (a server's shutdown: a server killed by a signal it
    re-raises runs no atexit hooks) and wait for them to exit; pooled_probs starts them again.
    A normal interpreter exit stops them too (an atexit hook, before the interpreter tears down)."""
    global _POOL
    with _LOCK:
        pool, _POOL = (_POOL[1] if _POOL is not None and _POOL[0] == os.getpid() else None), None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


class PendingProbs:
    """pooled_probs of samples on their way: a worker process's result, or (no worker can run)
    computed here when asked for. Silero's LSTM steps in Python a frame; in the process of a busy
    pipeline (the GPU loop's Python) those steps wait on the GIL, and the VAD, not the GPU, sets
    the pace. A daemonic process (a Dask worker) may not start children, and a script without a
    __main__ guard cannot spawn them: there it runs here."""

    def __init__(self, samples: np.ndarray):
        self.samples, self.future = samples, None
        _, pool, threads = _pool()
        if pool is not None:
            from concurrent.futures.process import BrokenProcessPool

            try:
                self.future = pool.submit(speech_probs, samples, threads=threads)
            except BrokenProcessPool as e:
                _broken(e)

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def cancel(self) -> None:
        """No longer wanted (its input dropped): a worker that has not begun it skips it."""
        if self.future is not None:
            self.future.cancel()

    def result(self) -> np.ndarray:
        if self.future is not None:
            from concurrent.futures.process import BrokenProcessPool

            try:
                return self.future.result()
            except BrokenProcessPool as e:  # e.g. a script without a __main__ guard: no child can start
                _broken(e)
        return speech_probs(self.samples)


def _broken(e: Exception) -> None:
    global _POOL
    warnings.warn(f"VAD worker processes failed ({e}); VAD runs in this process from now on (slower)")
    with _LOCK:
        _POOL = (os.getpid(), None, _POOL[2] if _POOL is not None else 1)


def pooled_probs(samples: np.ndarray) -> np.ndarray:
    """speech_probs in one of a few worker processes (PendingProbs), waited for."""
    return PendingProbs(samples).result()


def chunk_probs(blocks: Iterable[np.ndarray], probs: Callable = PendingProbs,
                ahead: int = AHEAD) -> Iterator[tuple]:
    """(samples, their speech_probs, last) of samples arriving in blocks, STREAM_CHUNK at a time
    (each through probs(samples): the probabilities, or a pending result with done() and
    result()): memory bounded by `ahead` chunks, not by the file. While a chunk's VAD runs the
    next ones are read and handed to probs too, up to `ahead` under way (a long file's VAD in
    several workers at once, or in one GPU batch); each goes out once it and those before it are
    done. Each chunk after the first goes with the VAD block before it, whose probabilities are
    dropped: the chunk's first block then warms up on the samples the whole file's would, and
    every probability is the whole file's (the blocks are anchored at multiples of BLOCK). The
    last chunk's probabilities include its last, zero-padded frame; an empty input gives one
    empty last chunk."""
    pending: deque = deque()        # (chunk, its probabilities or their pending result, frames to drop, last)
    buf, tail = np.zeros(0, np.float32), np.zeros(0, np.float32)

    def submit(chunk: np.ndarray, last: bool) -> None:
        nonlocal tail
        if not len(chunk):
            pending.append((chunk, np.zeros(0, np.float32), 0, last))
            return
        joined = np.concatenate([tail, chunk]) if len(tail) else chunk
        pending.append((joined[len(tail):], probs(joined), len(tail) // FRAME, last))
        tail = joined[-BLOCK:].copy()

    def ready() -> Iterator[tuple]:
        while pending and (len(pending) >= ahead or pending[-1][3] or _done(pending[0][1])):
            chunk, p, drop, last = pending.popleft()
            yield chunk, (p.result() if hasattr(p, "result") else p)[drop:], last

    try:
        for block in blocks:
            buf = np.concatenate([buf, block]) if len(buf) else block
            while len(buf) > STREAM_CHUNK:      # what ends the input goes out as the last chunk
                submit(buf[:STREAM_CHUNK], False)
                buf = buf[STREAM_CHUNK:]
                yield from ready()
        submit(buf, True)
        yield from ready()
    finally:                                # stopped early (a dropped file): what is not begun is not done
        for _, p, _, _ in pending:
            getattr(p, "cancel", lambda: None)()


def _done(p) -> bool:
    return not hasattr(p, "done") or p.done()


def stream_probs(blocks: Iterable[np.ndarray], probs: Callable = PendingProbs) -> tuple[np.ndarray, int]:
    """(speech_probs, sample count) of samples arriving in blocks (chunk_probs' chunks, joined)."""
    out, n = [], 0
    for chunk, p, _ in chunk_probs(blocks, probs):
        out.append(p)
        n += len(chunk)
    return np.concatenate(out), n
