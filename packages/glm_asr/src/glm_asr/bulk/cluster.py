"""A bulk run's cluster: local workers (one a GPU, each a process of its own started with its
environment), and the loop that keeps at most WINDOW tasks in flight."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import deque

from .worker import TASK_THREADS, _noop

WINDOW = 2048           # tasks in flight at once: the scheduler's memory stays flat for any manifest size


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
            self.scheduler, self.name, self.env, self.scratch = scheduler, name, env, None
            super().__init__()

        async def _start(self) -> None:
            spec = {"cls": "distributed.Nanny", "opts": {"name": self.name, "nthreads": TASK_THREADS,
                                                         "memory_limit": 0, "host": "127.0.0.1", "death_timeout": 60}}
            env = {**os.environ, "DASK_LOGGING__DISTRIBUTED": "critical",     # bulk says what failed
                   # the statistical profiler (the dashboard's) samples every thread's stack 100 times a second
                   "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False", **self.env}
            if not env.get("CUDA_TILE_TEMP_DIR"):
                # cuda.tile's scratch folder, which it removes at exit, here where close() removes it
                # too: a worker stopped mid-task (Ctrl-C) ends without its exit handlers
                self.scratch = env["CUDA_TILE_TEMP_DIR"] = tempfile.mkdtemp(prefix="glm_asr-bulk-worker.")
            # a session of its own: a terminal's Ctrl-C reaches the bulk command alone, which closes
            # its workers (close) as at the end of a run
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "glm_asr.dask_worker", str(os.getpid()), self.scheduler,
                "--spec", json.dumps(spec), env=env, start_new_session=True)

        async def close(self) -> None:
            """SIGTERM first: `dask spec` closes its Nanny and worker, whose connections then end
            cleanly (killed outright, a closing scheduler logged a broken connection's traceback
            now and then); what is left after 10 s is killed."""
            if self.process is not None and self.process.returncode is None:
                self.process.terminate()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.process.wait(), 10)
            await super().close()
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)

    return WorkerProcess


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
