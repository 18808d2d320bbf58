"""What runs on a bulk worker: the model, loaded once a process (kept here, keyed by model, device
and precision), and the tasks' files fed through one batched pipeline (_Feed) shared by the tasks
running at once, each transcript written as soon as it is done."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import threading
from collections import deque
from concurrent.futures import Future
from pathlib import Path

from ..formats import render, write_atomic

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

    from ..api import load

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


def output_exists(path: Path) -> bool:
    """Whether an output exists (a name the file system refuses, too long: no; writing it is then
    that file's error, not the task's)."""
    try:
        return path.exists()
    except OSError:
        return False


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
        feed = _feed(asr, {k: job[k] for k in ("prompt", "max_new_tokens", "audio_stream", "vad", "vad_options",
                                               "temperature", "compression_ratio_threshold",
                                               "logprob_threshold")})
    out_dir = Path(job["output_dir"])
    results = [{"name": name, "seconds": 0.0, "error": None, "warnings": [], "exists": output_exists(out_dir / name)}
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
    try:
        write_atomic(out_dir / name, render(job["output_format"], source, t.to_dict()["segments"], **job["layout"]))
    except OSError as e:
        r["error"] = _reason(e, path, source)


def _noop(x):
    return x
