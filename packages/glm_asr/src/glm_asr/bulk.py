"""python -m glm_asr.bulk manifest=FILE|DIR output_dir=DIR [key=value ...]

Bulk transcription on Dask distributed: a manifest of audio files, one transcript per file in
output_dir (the names `python -m glm_asr.transcribe ... output_dir=DIR` gives), written by the
workers as each file is done, so a re-run skips what exists and a crash costs only what was missing.

    python -m glm_asr.bulk manifest=files.txt output_dir=out                # a worker per local GPU
    python -m glm_asr.bulk manifest=/archive glob='**/*.flac' output_dir=out output_format=srt
    python -m glm_asr.bulk manifest=files.txt output_dir=out scheduler=tcp://head:8786
    python -m glm_asr.bulk --overhead 10000     # the scheduler's cost per task (docs/scaling.md)

Each worker process loads the model once (kept in this module, keyed by model and device) and
runs the files of the tasks it is given through one batched pipeline: a local worker runs two
tasks at once (a `dask worker` started with --nthreads 2 does too), so the next task's files are
read and encoded while the last one's still decode. Tasks are one file, or short ones making about
task_seconds of audio (a batch's worth by default), submitted longest first with falling
priority, at most WINDOW in flight: a fast worker takes more of them (Dask's queuing and work
stealing). A task returns, for each file, its output name, audio seconds and error (None when
written). A worker that dies takes its tasks with it and Dask runs them again elsewhere; outputs
are written atomically under fixed names, so no transcript is lost, duplicated or half written. Unreadable files go to
output_dir/errors.jsonl ({"path", "reason"} per line) and the run goes on (exit code 1).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from tilekernels.runtime.cli import Float, Int, OptInt, OptStr, Str, config_dir, exit_with_one_line_errors, \
    options, split_args

from .audio import EXTENSIONS
from .formats import FORMATS, output_names, render, write_atomic
from .transcribe import extensions as parse_extensions, vad_options

ERRORS = "errors.jsonl"
WINDOW = 2048           # tasks in flight at once: the scheduler's memory stays flat for any manifest size
MAX_GROUP = 100         # files in one task at most
CRASH_ENV = "GLM_ASR_BULK_TEST_CRASH_DIR"   # tests: a worker exits when <dir>/<output name> exists (once)


# ------------------------------------------------------------------ the manifest
def read_manifest(manifest: str | Path, glob: str = "**/*", extensions=EXTENSIONS) -> list[str]:
    """The audio paths a manifest names, in order. A text file: one path a line, blank lines and
    lines starting with # skipped, relative paths taken relative to the file's folder. A directory:
    the files under it that glob matches whose suffix is one of extensions (any case; empty: any
    suffix), hidden files (.name) left out, sorted."""
    m = Path(manifest)
    if not m.exists():
        raise ValueError(f"manifest {manifest}: no such file or directory")
    if m.is_dir():
        exts = {e.lower().lstrip(".") for e in (extensions or ())}
        try:
            found = [p for p in m.glob(glob) if p.is_file() and not p.name.startswith(".")
                     and (not exts or p.suffix.lower().lstrip(".") in exts)]
        except (ValueError, NotImplementedError) as e:
            raise ValueError(f"glob {glob!r}: {e}") from None
        return sorted(str(p) for p in found)
    try:
        text = m.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"manifest {manifest}: not a UTF-8 text file of paths") from None
    paths = []
    for line in text.splitlines():
        entry = line.strip()
        if entry and not entry.startswith("#"):
            p = Path(entry).expanduser()
            paths.append(str(p if p.is_absolute() else m.parent / p))
    return paths


def probe_duration(path: str) -> float:
    """Seconds of audio in a file from its header (libsndfile, else the container's via PyAV);
    0.0 when unknown (a missing or unreadable file: the worker reports it)."""
    try:
        import soundfile

        return float(soundfile.info(path).duration)
    except Exception:
        pass
    try:
        import av

        with av.open(path) as c:
            return max(0.0, float(c.duration or 0) / 1e6)
    except Exception:
        return 0.0


def plan_tasks(durations: list[float], task_seconds: float) -> list[list[int]]:
    """Tasks (lists of indices into durations), longest first. A file of task_seconds or more is a
    task of its own; shorter ones are grouped, in falling length, until a group holds task_seconds
    of audio (or MAX_GROUP files); files of unknown length (0) come last, one a task."""
    order = sorted(range(len(durations)), key=lambda i: -durations[i])      # stable: ties in manifest order
    tasks, group, acc = [], [], 0.0
    for i in (i for i in order if durations[i] > 0):
        if durations[i] >= task_seconds:
            tasks.append([i])
            continue
        group.append(i)
        acc += durations[i]
        if acc >= task_seconds or len(group) >= MAX_GROUP:
            tasks.append(group)
            group, acc = [], 0.0
    if group:
        tasks.append(group)
    return tasks + [[i] for i in order if durations[i] <= 0]


# ------------------------------------------------------------------ on the workers
_MODEL_LOCK = threading.Lock()      # one thread at a time loads the model (a `dask worker` of several threads)
_ENGINE_LOCK = threading.Lock()     # one thread at a time runs it (a feed's, or a file done alone)
_FEEDS: dict = {}                   # options -> _Feed of the model in _CACHE
TASK_THREADS = 2                    # tasks a local worker runs at once, through one feed
_CACHE: dict = {}                   # (model, device) -> (Transcriber, device used): one model per worker


def _model_key(job: dict) -> tuple:
    return tuple(sorted(job["model"].items())), job["device"], job["precision"]


def worker_transcriber(job: dict):
    """This worker process's model for job's model and device, loaded on first use as the command
    line loads it (a different model replaces it), with job's options checked against it. Returns
    (glm_asr.SpeechRecognizer, 'cpu' | 'gpu'). Call with _MODEL_LOCK held."""
    from tilekernels.runtime import from_model_config

    from .api import load

    _quiet_pool_closing()
    key = _model_key(job)
    if key not in _CACHE:
        if _CACHE:
            with _ENGINE_LOCK:          # once the feed of the model before has finished
                _CACHE.clear()
                _FEEDS.clear()
                _free_gpu_memory()
        asr = load(str(from_model_config(job["model"])), job["device"], max_batch=job["max_batch"],
                   encoder_batch=job["encoder_batch"], precision=job["precision"])
        _CACHE[key] = (asr, asr.device)
    asr, device = _CACHE[key]
    asr.transcriber.check(job["prompt"], job["max_new_tokens"])
    return asr, device


class _PoolClosing(logging.Filter):
    """Drops the traceback a worker logs when the run ends with a heartbeat in flight: its own
    connection pool, closing, cancels the heartbeat, or the closing scheduler closes its stream
    (each seen now and then on a loaded machine)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage().startswith("Failed to communicate with scheduler during heartbeat")
                    and ("ConnectionPool closing" in str(exc) or str(exc).endswith("Stream is closed")))


def _quiet_pool_closing() -> None:
    """Install _PoolClosing on this worker's logger (once)."""
    log = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _PoolClosing) for f in log.filters):
        log.addFilter(_PoolClosing())


def _free_gpu_memory() -> None:
    import gc

    gc.collect()
    if "cupy" in sys.modules:
        sys.modules["cupy"].get_default_memory_pool().free_all_blocks()


def prepare(job: dict) -> str:
    """Load (or find) the model on this worker and check the options against it; the device it
    runs on: 'cpu', or 'gpu <PCI bus id>'."""
    with _MODEL_LOCK:
        device = worker_transcriber(job)[1]
    if device == "gpu":
        import cupy

        device += f" {cupy.cuda.Device().pci_bus_id}"
    return device


def _reason(e: Exception, path: str, source: str) -> str:
    """A failure's message without the file's name in front, the path as the manifest gives it."""
    msg = str(e) or type(e).__name__
    msg = msg[len(path) + 2:] if msg.startswith(f"{path}: ") else msg
    return msg.replace(path, source)


def _crash_for_test(name: str) -> None:
    d = os.environ.get(CRASH_ENV)
    if d:
        try:
            os.unlink(os.path.join(d, name))      # only the first worker to get here dies, once
        except FileNotFoundError:
            return
        os._exit(17)


def transcribe_files(files: list[tuple[str, str, str]], job: dict) -> list[dict]:
    """A task: transcribe each (source, absolute path, output name) into job's output_dir as the
    command line does (formats.render with the file as the manifest gives it), skipping outputs
    that exist, each written as soon as it is done. The files join this worker's pipeline (_Feed),
    which the other task running here feeds too. Per file: {name, seconds (of audio), error (None:
    written), warnings, exists}. A file's failure is its error; should the pipeline itself fail,
    its files are done one by one, so that failure stays theirs; the model failing to load fails
    the task."""
    with _MODEL_LOCK:
        asr, _ = worker_transcriber(job)
        feed = _feed(asr, {k: job[k] for k in ("prompt", "max_new_tokens", "audio_stream", "vad", "vad_options")})
    out_dir = Path(job["output_dir"])
    results = [{"name": name, "seconds": 0.0, "error": None, "warnings": [], "exists": (out_dir / name).exists()}
               for _, _, name in files]
    todo = [(f, r) for f, r in zip(files, results) if not r["exists"]]
    for ((source, path, name), r), pending in zip(todo, feed.submit([path for (_, path, _), _ in todo])):
        t = None
        try:
            t, warnings = pending.result()
        except Exception:   # noqa: BLE001 - the pipeline failed: this file alone, so its failure stays its own
            err = io.StringIO()
            with _ENGINE_LOCK, contextlib.redirect_stderr(err):
                try:
                    t = asr.transcribe(path, **feed.opts)
                except (ValueError, OSError) as e:          # glm_asr.ASRError is a ValueError
                    r["error"] = _reason(e, path, source)
                except Exception as e:  # one bad file must not end a run of thousands: recorded, the run goes on
                    r["error"] = f"{type(e).__name__}: {_reason(e, path, source)}"
            warnings = [w for w in err.getvalue().splitlines() if w.strip()]
        r["warnings"] = [w.replace(path, source) for w in warnings]      # the file as the manifest names it
        if t is None:
            continue
        r["seconds"] = t.seconds
        if t.error is not None:
            r["error"] = _reason(ValueError(t.error), path, source)
        else:
            _write(job, out_dir, source, path, name, r, t)
    return results


class _Feed:
    """This worker's pipeline (SpeechRecognizer.transcribe_many over a live source), shared by the
    tasks running here at once (TASK_THREADS): a task's files join it while the windows of the
    task before are still decoding, so the engine does not drain between tasks. Its thread runs
    while it has files, holding _ENGINE_LOCK; each file's (Transcript, warnings) comes back through
    a Future, in submission order. A pipeline failure fails every file in it and ends the thread."""

    def __init__(self, asr, opts: dict):
        self.asr, self.opts = asr, opts
        self.lock = threading.Lock()
        self.waiting: deque = deque()       # (path, Future), not yet in the pipeline
        self.taken: deque = deque()         # (path, Future), in the pipeline, in order
        self.running = False
        self.err = io.StringIO()            # the pipeline's stderr: warnings naming a file are that file's

    def submit(self, paths: list[str]) -> list[Future]:
        futures = [Future() for _ in paths]
        with self.lock:
            self.waiting.extend(zip(paths, futures))
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="glm_asr-bulk-feed", daemon=True).start()
        return futures

    def _source(self):
        while True:
            with self.lock:
                if not self.waiting and not self.taken:
                    self.running = False        # the next submit starts another thread
                    return
                item = self.waiting.popleft() if self.waiting else None
                if item is not None:
                    self.taken.append(item)
            yield None if item is None else item[0]

    def _warnings(self, path: str) -> list[str]:
        """The lines so far that name path, or that name no file still in the pipeline."""
        with self.lock:
            lines = [w for w in self.err.getvalue().splitlines() if w.strip()]
            others = [p for p, _ in self.taken if p != path]
            mine = [w for w in lines if path in w or not any(p in w for p in others)]
            self.err = io.StringIO()
            self.err.writelines(w + "\n" for w in lines if w not in mine)
        return mine

    def _run(self) -> None:
        error: BaseException = RuntimeError("the pipeline ended before this file")
        with _ENGINE_LOCK:
            try:
                with contextlib.redirect_stderr(self):
                    for t in self.asr.transcribe_many(self._source(), **self.opts):
                        with self.lock:
                            path, pending = self.taken.popleft()
                        pending.set_result((t, self._warnings(path)))
            except BaseException as e:  # noqa: BLE001 - every file in the pipeline fails with it
                error = e
            finally:
                with self.lock:
                    failed = list(self.taken) + list(self.waiting)
                    self.taken.clear()
                    self.waiting.clear()
                    self.running = False
                for _, pending in failed:
                    pending.set_exception(error)

    def write(self, text: str) -> int:         # the pipeline's stderr (its readers' threads too)
        with self.lock:
            return self.err.write(text)

    def flush(self) -> None:
        pass


def _feed(asr, opts: dict) -> _Feed:
    """This worker's feed for opts on its model asr (made on first use; a new model drops the
    feeds, worker_transcriber). Call with _MODEL_LOCK held."""
    key = json.dumps(opts, sort_keys=True, default=str)
    if key not in _FEEDS:
        _FEEDS[key] = _Feed(asr, opts)
    return _FEEDS[key]


def _write(job: dict, out_dir: Path, source: str, path: str, name: str, r: dict, t) -> None:
    """Write a transcript as the command line renders it (its error in r if that fails)."""
    _crash_for_test(name)
    try:
        write_atomic(out_dir / name, render(job["output_format"], source, t.to_dict()["segments"],
                                            readable=job["vad"] == "silero"))
    except OSError as e:
        r["error"] = _reason(e, path, source)


def _noop(x):
    return x


# ------------------------------------------------------------------ the cluster
def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (or their indices)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [d.strip() for d in env.split(",") if d.strip()]
        out = []
        for d in ids:               # CUDA stops at the first invalid entry (-1 hides all)
            if d.startswith("-"):
                break
            out.append(d)
        return out
    try:
        import cupy

        return [str(i) for i in range(cupy.cuda.runtime.getDeviceCount())]
    except Exception:
        return []


def worker_plan(device: str, gpus: int | None, workers: int | None, visible: list[str]) -> tuple[str, list[dict]]:
    """(the workers' device, each local worker's extra environment): one worker per GPU pinned with
    CUDA_VISIBLE_DEVICES, or `workers` CPU processes."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, got {device!r}")
    if gpus is not None and gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if device == "cpu" and gpus:
        raise ValueError(f"gpus={gpus} with device=cpu: set device=gpu (or auto), or gpus=0")
    if gpus is not None and gpus > len(visible):
        raise ValueError(f"gpus={gpus} but {len(visible)} GPU{'s' * (len(visible) != 1)} visible")
    if device == "gpu" and gpus == 0:
        raise ValueError("gpus=0 with device=gpu: give gpus=N or device=cpu")
    n_gpu = 0 if device == "cpu" else (len(visible) if gpus is None else gpus)
    if n_gpu:
        if workers is not None and workers != n_gpu:
            raise ValueError(f"workers={workers} with {n_gpu} GPU workers: a GPU worker per GPU (set gpus=N)")
        return device, [{"CUDA_VISIBLE_DEVICES": d} for d in visible[:n_gpu]]
    if device == "gpu":
        raise ValueError("device=gpu but no GPU is visible")
    n = workers if workers is not None else min(4, os.cpu_count() or 1)
    return "cpu", [{"CUDA_VISIBLE_DEVICES": ""} for _ in range(n)]


def local_cluster(envs: list[dict], dashboard: str | None = None):
    """A LocalCluster on 127.0.0.1 of one worker per entry of envs, each a Nanny (which restarts
    its worker if it dies) in a process of its own started with that environment; no memory limit
    (the model is the memory)."""
    import logging

    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=0, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=dashboard, silence_logs=logging.ERROR, memory_limit=0,
                           # the scheduler's HTTP server (health, metrics) runs even without a dashboard: any free port
                           scheduler_kwargs=None if dashboard else {"dashboard_address": "127.0.0.1:0"})
    try:
        for i, env in enumerate(envs):
            cluster.worker_spec[f"worker-{i}"] = {"cls": _worker_process(), "options": {"env": dict(env)}}
        cluster.scale(len(envs))
        return cluster
    except BaseException:
        cluster.close()
        raise


def _worker_process():
    """The class of a local worker: a `dask spec` process running a Nanny (glm_asr.dask_worker: it
    exits with this process, however this one ends), env in its environment
    from its first instruction, as CUDA_VISIBLE_DEVICES must be before anything starts CUDA
    (Nanny(env=...) sets it in the worker process once that has imported the command's modules).
    With the Nannies inside the client process instead, two GPUs ran slower than one
    (docs/scaling.md)."""
    import asyncio

    from distributed.deploy.subprocess import Subprocess

    class WorkerProcess(Subprocess):
        def __init__(self, scheduler: str, name: str, env: dict):
            self.scheduler, self.name, self.env = scheduler, name, env
            super().__init__()

        async def _start(self) -> None:
            spec = {"cls": "distributed.Nanny", "opts": {"name": self.name, "nthreads": TASK_THREADS,
                                                         "memory_limit": 0, "host": "127.0.0.1", "death_timeout": 60}}
            env = {**os.environ, "DASK_LOGGING__DISTRIBUTED": "error",
                   # the statistical profiler (the dashboard's) samples every thread's stack 100 times a second
                   "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False", **self.env}
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "glm_asr.dask_worker", str(os.getpid()), self.scheduler,
                "--spec", json.dumps(spec), env=env)

        async def close(self) -> None:
            """SIGTERM first: `dask spec` closes its Nanny and worker, whose connections then end
            cleanly (killed outright, a closing scheduler logged a broken connection's traceback
            now and then); what is left after 10 s is killed."""
            if self.process is not None and self.process.returncode is None:
                self.process.terminate()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.process.wait(), 10)
            await super().close()

    return WorkerProcess


# ------------------------------------------------------------------ driving the tasks
def drive(client, tasks, submit, on_result, window: int = WINDOW) -> None:
    """Submit tasks in order, at most `window` in flight; on_result(task, future) for each as it
    finishes (in any order) may return tasks to submit next."""
    from distributed import as_completed

    pending, running, ac = deque(tasks), {}, as_completed()

    def top_up():
        while pending and len(running) < window:
            t = pending.popleft()
            f = submit(t)
            running[f.key] = (t, f)
            ac.add(f)

    top_up()
    try:
        for f in ac:
            t, _ = running.pop(f.key)
            pending.extendleft(reversed(on_result(t, f) or []))
            f.release()
            top_up()
    except BaseException:
        if running:
            client.cancel([f for _, f in running.values()], force=True)
        raise


def task_overhead(n: int = 10_000, workers: int = 2, client=None) -> dict:
    """The scheduler's cost per task: n no-op tasks through drive (bulk's own submission loop, one
    task per submit, priorities, at most WINDOW in flight) on a LocalCluster of `workers` single-
    threaded processes (or client's cluster), after a warm-up task. Also the same n through one
    client.map, the least a task costs."""
    from distributed import Client

    def measure(c):
        c.submit(_noop, -1, pure=False).result()
        tag = uuid.uuid4().hex[:8]
        t0 = time.perf_counter()
        drive(c, range(n), lambda i: c.submit(_noop, i, key=f"noop-{tag}-{i}", priority=n - i),
              lambda i, f: None)
        looped = time.perf_counter() - t0
        t0 = time.perf_counter()
        futures = c.map(_noop, range(n), key=[f"map-{tag}-{i}" for i in range(n)])
        c.gather(futures)
        mapped = time.perf_counter() - t0
        del futures
        return {"tasks": n, "workers": len(c.scheduler_info()["workers"]), "bulk_loop_s": looped,
                "bulk_loop_us_per_task": looped / n * 1e6, "map_s": mapped, "map_us_per_task": mapped / n * 1e6}

    if client is not None:
        return measure(client)
    with local_cluster([{} for _ in range(workers)]) as cluster, Client(cluster) as c:
        c.wait_for_workers(workers, timeout=120)
        return measure(c)


# ------------------------------------------------------------------ the client side
@dataclass(frozen=True)
class Item:
    source: str         # the path as given (the transcript's "file")
    path: str           # absolute, for the workers
    name: str           # output file name
    duration: float = 0.0


def _fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


@dataclass
class Tally:
    start: float
    files: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    seconds: float = 0.0
    ready: float | None = None          # when the workers were up and the model loaded

    def summary(self, out_dir: Path, interrupted: bool = False) -> str:
        wall = time.perf_counter() - self.start
        left = self.files - self.skipped - self.done - self.failed
        parts = [f"{self.done} transcribed", f"{self.skipped} skipped (output exists)",
                 f"{self.failed} failed" + (f" (see {out_dir / ERRORS})" if self.failed else "")]
        if left:
            parts.append(f"{left} not done")
        speed = ""
        if self.seconds > 0:
            speed = f": {self.seconds / wall:.1f}x real time (real-time factor {wall / self.seconds:.4f})"
            if self.ready is not None:
                speed += f", {self.seconds / (time.perf_counter() - self.ready):.1f}x after it"
        setup = f", {self.ready - self.start:.1f} s of it reading headers, starting workers and loading the model" \
            if self.ready is not None else ""
        head = "stopped" if interrupted else "done"
        return (f"{head}: {', '.join(parts)}; {self.seconds / 3600:.3f} h of audio in {wall:.1f} s wall"
                f"{setup}{speed}")


class Progress:
    """Audio seconds done: a tqdm bar on a terminal, else a line every `every` seconds (logs)."""

    def __init__(self, total_s: float, files: int, every: float = 60.0):
        from tqdm import tqdm

        self.tty = sys.stderr.isatty()
        self.total, self.files, self.every = total_s, files, every
        self.n, self.nfiles, self.t0, self.last = 0.0, 0, time.perf_counter(), time.perf_counter()
        self.bar = tqdm(total=round(total_s, 1), unit="s", desc="audio", file=sys.stderr,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}, "
                                   "{rate_fmt}]") if self.tty else None

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def update(self, seconds: float, files: int) -> None:
        self.n += seconds
        self.nfiles += files
        if self.n > self.total:             # files of unknown length add to the total as they finish
            self.total = self.n
            if self.bar is not None:
                self.bar.total = round(self.total, 1)
        if self.bar is not None:
            self.bar.update(seconds)
            return
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            rate = self.n / (now - self.t0)
            eta = f", about {_fmt_seconds((self.total - self.n) / rate)} left" if rate > 0 else ""
            pct = 100 * self.n / self.total if self.total else 100.0
            print(f"progress: {self.nfiles}/{self.files} files, {_fmt_seconds(self.n)} of {_fmt_seconds(self.total)} "
                  f"audio ({pct:.0f}%), {rate:.1f}x real time{eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_KINDS = {"output_format": Str, "output_dir": OptStr, "max_new_tokens": Int, "prompt": Str, "device": Str,
          "manifest": OptStr, "glob": Str, "gpus": OptInt, "workers": OptInt, "audio_stream": OptInt, "vad": Str,
          "scheduler": OptStr, "task_seconds": Float, "dashboard": OptStr, "max_batch": Int, "encoder_batch": Int,
          "precision": Str}


def check_options(cfg, inputs: list[str]) -> dict:
    o = options(cfg, _KINDS)
    if inputs and o["manifest"] is None and len(inputs) == 1:
        o["manifest"] = inputs[0]
    elif inputs:
        raise ValueError(f"unexpected argument{'s' * (len(inputs) > 1)} {' '.join(inputs)}: give manifest=FILE|DIR "
                         f"(a text file of paths or a directory) and key=value options")
    if not o["manifest"]:
        raise ValueError("no manifest given: python -m glm_asr.bulk manifest=FILE|DIR output_dir=DIR")
    if not o["output_dir"]:
        raise ValueError("no output_dir given: bulk writes one transcript per file there (output_dir=DIR)")
    if o["output_format"] not in FORMATS:
        raise ValueError(f"output_format must be one of {', '.join(FORMATS)}, got {o['output_format']!r}")
    for name in ("max_new_tokens", "max_batch", "encoder_batch"):
        if o[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {o[name]}")
    if o["audio_stream"] is not None and o["audio_stream"] < 0:
        raise ValueError(f"audio_stream must be >= 0, got {o['audio_stream']}")
    if o["task_seconds"] < 0 or not math.isfinite(o["task_seconds"]):
        raise ValueError(f"task_seconds must be >= 0, got {o['task_seconds']}")
    if o["scheduler"] and (o["gpus"] is not None or o["workers"] is not None):
        raise ValueError("scheduler=ADDRESS uses that cluster's workers: gpus and workers are for a local cluster")
    if Path(o["output_dir"]).exists() and not Path(o["output_dir"]).is_dir():
        raise ValueError(f"output_dir {o['output_dir']}: exists and is not a directory")
    o["extensions"] = parse_extensions(cfg.get("extensions"))
    o["model"] = {k: cfg.model.get(k) for k in cfg.model}
    return o


def _probe_all(items: list[Item], tty: bool) -> list[Item]:
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    with ThreadPoolExecutor(16) as pool:
        durations = list(tqdm(pool.map(probe_duration, [it.path for it in items]), total=len(items),
                              desc="reading headers", unit="file", file=sys.stderr, leave=False,
                              disable=not tty or len(items) < 1000))
    return [Item(it.source, it.path, it.name, d) for it, d in zip(items, durations)]


def _remove_stale_temporaries(out_dir: Path, names: set[str]) -> None:
    """write_atomic's temporaries (.<name>.<random>) of this manifest's outputs that a killed
    worker left behind (the run is over: nothing of it is writing)."""
    with os.scandir(out_dir) as it:
        for e in it:
            if e.name.startswith(".") and e.name[1:].rsplit(".", 1)[0] in names and e.is_file():
                with contextlib.suppress(OSError):
                    os.unlink(e.path)


def run(cfg, inputs: list[str] = ()) -> int:
    from distributed import Client, KilledWorker

    start = time.perf_counter()
    o = check_options(cfg, list(inputs))
    fmt, out_dir = o["output_format"], Path(o["output_dir"]).absolute()
    sources = read_manifest(o["manifest"], o["glob"], o["extensions"])
    if not sources:
        what = "lists no files" if not Path(o["manifest"]).is_dir() else \
            f"has no files matching glob={o['glob']!r} with extension {', '.join(o['extensions'])}"
        raise ValueError(f"manifest {o['manifest']}: {what}")
    repeated = len(sources) - len({os.path.abspath(s) for s in sources})
    names = output_names(sources, fmt)
    out_dir.mkdir(parents=True, exist_ok=True)
    existing = set(os.listdir(out_dir))
    tty = sys.stderr.isatty()
    tally = Tally(start, files=len(sources))
    todo = [Item(s, os.path.abspath(s), n) for s, n in zip(sources, names) if n not in existing]
    tally.skipped = len(sources) - len(todo)
    if repeated:
        print(f"warning: {repeated} path{'s' * (repeated > 1)} appear more than once in the manifest; each is "
              f"transcribed again under its own name", file=sys.stderr)
    errors_path = out_dir / ERRORS
    if not todo:
        errors_path.unlink(missing_ok=True)
        print(tally.summary(out_dir), file=sys.stderr)
        return 0
    job = {"model": o["model"], "output_dir": str(out_dir), "output_format": fmt, "prompt": o["prompt"],
           "max_new_tokens": o["max_new_tokens"], "audio_stream": o["audio_stream"], "device": o["device"],
           "vad": o["vad"], "vad_options": vad_options(cfg.get("vad_options")), "max_batch": o["max_batch"],
           "encoder_batch": o["encoder_batch"], "precision": o["precision"]}
    if not o["scheduler"]:
        job["device"], envs = worker_plan(o["device"], o["gpus"], o["workers"], visible_gpus())

    cluster = None
    try:
        if o["scheduler"]:
            client = Client(o["scheduler"])
        else:
            cluster = local_cluster(envs, o["dashboard"])
            client = Client(cluster)
            client.wait_for_workers(len(envs), timeout=300)
        with client:
            # every worker there loads the model while the headers are read, before any file is given
            # out: a bad checkpoint or option is one error line, not one per file (a worker joining
            # later loads it at its first task)
            def load_everywhere():
                return [client.submit(prepare, job, pure=False, workers=[w], allow_other_workers=True, priority=1)
                        for w in client.scheduler_info()["workers"]]

            loading = load_everywhere()
            items = _probe_all(todo, tty)
            durations = [it.duration for it in items]
            tasks = plan_tasks(durations, o["task_seconds"])
            if not loading:
                print(f"note: waiting for workers to join {o['scheduler']}", file=sys.stderr)
                client.wait_for_workers(1)
                loading = load_everywhere()
            try:
                devices = client.gather(loading)
            except KilledWorker as e:      # e.g. out of memory: one line, not a traceback
                raise ValueError(f"a worker process died while loading the model ({e})") from None
            gpus = [d for d in devices if d != "cpu"]
            if not o["scheduler"] and len(set(gpus)) < len(gpus):
                raise ValueError(f"the local workers do not each have a GPU of their own: {', '.join(devices)}")
            device = "/".join(sorted({d.split()[0] for d in devices}))
            nworkers = len(loading)
            tally.ready = time.perf_counter()
            unknown = sum(d <= 0 for d in durations)
            print(f"bulk: {len(sources)} files: {tally.skipped} skipped (output exists), {len(items)} to transcribe "
                  f"({_fmt_seconds(sum(durations))} of audio" + (f", {unknown} of unknown length" if unknown else "")
                  + f") in {len(tasks)} tasks on {nworkers} {device} worker{'s' * (nworkers > 1)}"
                  + (f" at {o['scheduler']}" if o["scheduler"] else ""), file=sys.stderr)
            _transcribe_all(client, items, tasks, job, tally, errors_path, KilledWorker)
    except BaseException:
        if tally.ready is not None:         # what was done survives: the summary, then the error
            print(tally.summary(out_dir, interrupted=True), file=sys.stderr)
        raise
    finally:
        if cluster is not None:
            cluster.close()
    with contextlib.suppress(OSError):
        _remove_stale_temporaries(out_dir, set(names))
    print(tally.summary(out_dir), file=sys.stderr)
    return 1 if tally.failed else 0


def _transcribe_all(client, items: list[Item], tasks: list[list[int]], job: dict, tally: Tally, errors_path: Path,
                    KilledWorker) -> None:
    run_id = uuid.uuid4().hex[:8]
    count = iter(range(10 ** 12))
    progress = Progress(sum(it.duration for it in items), len(items))
    errors = None           # errors.jsonl: this run's failures (a file that failed before is tried again)

    def fail(item: Item, reason: str) -> None:
        nonlocal errors
        tally.failed += 1
        if errors is None:
            errors = open(errors_path, "w", encoding="utf-8")
        errors.write(json.dumps({"path": item.source, "reason": reason}, ensure_ascii=False) + "\n")
        errors.flush()
        progress.write(f"error: {item.source}: {reason}")

    def submit(task: list[int]):
        files = [(items[i].source, items[i].path, items[i].name) for i in task]
        n = next(count)             # submitted longest first: each task a lower priority than the one before
        return client.submit(transcribe_files, files, job, pure=False, key=f"transcribe-{run_id}-{n}", priority=-n)

    def on_result(task: list[int], future):
        if future.status == "error":
            exc = future.exception()
            if isinstance(exc, KilledWorker):
                if len(task) > 1:           # find the file that kills workers: its group's files one by one
                    return [[i] for i in task]
                it = items[task[0]]
                if (Path(job["output_dir"]) / it.name).exists():
                    tally.done += 1
                    return None
                fail(it, "the worker died while transcribing it, each of the times Dask tried "
                         "(distributed.scheduler.allowed-failures)")
                progress.update(it.duration, 1)
                return None
            raise exc
        seconds = 0.0
        for i, r in zip(task, future.result()):
            it, s = items[i], r["seconds"] or items[i].duration     # a file written before (exists): its header's
            for w in r["warnings"]:
                progress.write(w)
            if r["error"] is not None:
                fail(it, r["error"])
            else:
                tally.done += 1
                tally.seconds += s
            seconds += s
        progress.update(seconds, len(task))
        return None

    try:
        drive(client, tasks, submit, on_result)
    finally:
        progress.close()
        if errors is not None:
            errors.close()
        if not tally.failed:
            errors_path.unlink(missing_ok=True)


# ------------------------------------------------------------------ the command line
def _overhead_main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 10_000
    workers = int(argv[1]) if len(argv) > 1 else 2
    r = task_overhead(n, workers)
    print(f"{r['tasks']} no-op tasks on a LocalCluster of {r['workers']} worker processes (1 thread each), "
          f"{os.cpu_count()} cores:\n"
          f"  bulk's submission loop: {r['bulk_loop_s']:.2f} s, {r['bulk_loop_us_per_task']:.0f} us a task, "
          f"{r['tasks'] / r['bulk_loop_s']:.0f} tasks/s\n"
          f"  one client.map:         {r['map_s']:.2f} s, {r['map_us_per_task']:.0f} us a task, "
          f"{r['tasks'] / r['map_s']:.0f} tasks/s")


def main() -> None:
    if sys.argv[1:2] == ["--overhead"]:
        _overhead_main(sys.argv[2:])
        return
    import hydra

    import signal

    def stop(signum, frame):        # a batch system's SIGTERM: stop as on Ctrl-C (summary, cluster closed)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    inputs, rest = split_args(sys.argv[1:])
    sys.argv = [sys.argv[0]] + rest

    @hydra.main(version_base=None, config_path=config_dir("glm_asr"), config_name="bulk")
    def _hydra_main(cfg) -> None:
        exit_with_one_line_errors(lambda: run(cfg, inputs))

    _hydra_main()


if __name__ == "__main__":
    # run from the imported module, not __main__, so the task functions pickle by reference
    from glm_asr.bulk import main as _main

    _main()
