"""What both OpenAI-compatible servers (python -m gpt.serve, python -m glm_asr.serve) share, free
of any model: OpenAI-shaped errors, the api_key check, Prometheus metrics, Job and EngineWorker
(one thread stepping the engine, every request's rows joining its running batch, admitted by the
rows it asks; glm_asr.serve has a worker of its own around its pipeline), the body limit checked
while the body streams in, the options both take, and running uvicorn with graceful SIGTERM and
read deadlines (connections.py).

Needs fastapi, uvicorn, python-multipart and prometheus-client (dependencies of gpt and glm_asr).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .cli import Float, Int, Str, options
from .device import freeze_heap

log = logging.getLogger("tilekernels.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",    # OpenAI's
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          429: "rate_limit_error", 499: "invalid_request_error", 503: "server_overloaded", 500: "server_error"}


class APIError(Exception):
    """A request refused with an OpenAI-shaped error body and this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


class QueueFull(Exception):
    pass


class ClientGone(Exception):
    pass


class Job:
    """One request's work for a worker thread: the worker sets future, may emit(item) to stream
    items to the request (thread-safe) and drops or stops the work once cancelled is set (its
    client went away). rows: what it weighs in the worker's queue."""
    rows = 1

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.future = concurrent.futures.Future()
        self.cancelled = threading.Event()
        self.loop = loop or asyncio.get_running_loop()
        self.items: asyncio.Queue = asyncio.Queue()

    def emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:        # the loop has closed (the server stopped): no one is reading
            pass

    def cancel(self) -> None:
        self.cancelled.set()


class EngineJob(Job):
    """One request's engine requests (runtime.Request, tagged by their row): the worker emits a
    list of (tag, text piece) an engine step (up to a replay's CHAIN tokens a row: one wake-up
    of the event loop for them, not one a token) and sets the result to their Completions, in
    order."""

    def __init__(self, requests: list, loop: asyncio.AbstractEventLoop | None = None):
        super().__init__(loop)
        self.requests = requests
        self.rows = len(requests)


class ThreadWorker:
    """A model's thread fed by an inbox of jobs, each finished by _done; stop() lets those in
    flight finish, then returns. Admission counts rows (Job.rows): a job joins while the rows in
    flight and its own fit in `capacity`, or alone (nothing in flight), QueueFull otherwise.
    Subclasses set their own state, then call this __init__ (which starts _run)."""

    def __init__(self, capacity: int, metrics: "Metrics", name: str):
        self.capacity, self.metrics = capacity, metrics
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._live = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._live and self._live + job.rows > self.capacity:
                raise QueueFull()
            self._live += job.rows
        self._inbox.put(job)
        return job

    def _done(self, job: Job, result=None, error: BaseException | None = None) -> None:
        with self._lock:                # first: a client woken by the result may submit again at once
            self._live -= job.rows
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)

    def _run(self) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 120.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)


class EngineFailed(RuntimeError):
    """An engine step failed for no one request's fault: every request in flight ends with it."""


class EngineWorker(ThreadWorker):
    """The engine behind one thread: each job's requests join the running batch at the next step
    and leave it as they finish (continuous batching), so concurrent requests share every decode
    step, and each gets the tokens it gets alone (the engine's do not depend on the batch). A job
    ends, and everything of it is let go (its rows, its bookkeeping), when its requests finish,
    when one of them fails (its error, that job alone) or when its client leaves. Capacity:
    the engine's rows plus max_queue rows waiting."""

    def __init__(self, engine, max_queue: int, metrics: "Metrics"):
        self.engine = engine
        self._active: list[EngineJob] = []
        self._owner: dict[int, EngineJob] = {}       # id(request) -> its job, while the job is active
        super().__init__(engine.max_batch + max_queue, metrics, "engine-worker")

    def _admit(self, job: EngineJob) -> None:
        if job.cancelled.is_set():
            return self._done(job, error=ClientGone())
        try:
            self.engine.add(*job.requests)
        except ValueError as e:
            return self._done(job, error=e)
        for r in job.requests:
            self._owner[id(r)] = job
        self._active.append(job)

    def _retire(self, job: EngineJob, error: BaseException | None = None) -> None:
        """End a job: its unfinished rows leave the engine, its bookkeeping goes, its future is set."""
        self._active.remove(job)
        for r in job.requests:
            self._owner.pop(id(r), None)
            if not r.finished:
                self.engine.cancel(r)
        failed = next((r.error for r in job.requests if r.error is not None), None)
        error = error or failed
        self._done(job, None if error is not None else [r.out for r in job.requests], error)

    def _run(self) -> None:
        while True:
            self._take()
            if not self.engine.busy:
                self.metrics.running.set(0)
                if self._stopping.is_set() and self._inbox.empty():
                    return
                continue
            self._step()

    def _take(self) -> None:
        """Admit the jobs in the inbox (waiting up to 0.1 s for one while the engine is idle) and
        retire those whose clients have left."""
        busy = self.engine.busy
        try:
            job = self._inbox.get(block=not busy, timeout=None if busy else 0.1)
            while job is not None:
                self._admit(job)
                job = self._inbox.get_nowait()
        except queue.Empty:
            pass
        for job in [j for j in self._active if j.cancelled.is_set()]:
            self._retire(job, ClientGone())
        self.metrics.queue_depth.set(self.engine.waiting)

    def _step(self) -> None:
        """One engine step: its text to each job's stream, then the jobs it ended retired."""
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - no one request's: all in flight end, the worker goes on
            log.exception("engine step failed")
            for job in list(self._active):
                self._retire(job, EngineFailed(f"the engine failed ({e.__class__.__name__}); retry"))
            return
        self.metrics.running.set(self.engine.running)
        pieces: dict[EngineJob, list] = {}
        ended: dict[EngineJob, None] = {}       # jobs a request of which finished or failed in this step
        for ev in events:
            job = self._owner.get(id(ev.request))
            if job is None:
                continue
            if ev.piece:
                pieces.setdefault(job, []).append((ev.request.tag, ev.piece))
            if ev.finished:
                ended[job] = None
        for job, items in pieces.items():
            job.emit(items)
        for job in ended:
            if all(r.finished for r in job.requests) or any(r.error is not None for r in job.requests):
                self._retire(job)


async def wait(request: Request, job: Job, poll_s: float = 0.25):
    """The job's result; a client that disconnects first cancels it (ClientGone)."""
    fut = asyncio.wrap_future(job.future)
    while True:
        done, _ = await asyncio.wait({fut}, timeout=poll_s)
        if done:
            return fut.result()
        if await request.is_disconnected():
            job.cancel()
            raise ClientGone()


class Metrics:
    """Prometheus metrics of one server (its own registry): requests by endpoint and status,
    queue depth, running batch size, latency, plus a model's own counters (add_counter)."""

    def __init__(self, prefix: str):
        self.prefix, self.registry = prefix, CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{prefix}_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.queue_depth = Gauge(f"{prefix}_queue_depth", "requests waiting for the model", registry=r)
        self.running = Gauge(f"{prefix}_running_batch_size", "requests the model is running now", registry=r)
        self.latency = Histogram(f"{prefix}_request_latency_seconds", "request latency (to the last byte for "
                                 "streams)", ["endpoint"], registry=r,
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))

    def add_counter(self, name: str, doc: str) -> Counter:
        return Counter(f"{self.prefix}_{name}", doc, registry=self.registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)


OPEN = ("/health", "/metrics")      # the paths an api_key does not guard (probes, scrapers)


class AuthAndMetrics:
    """The api_key check (every path but OPEN's) and each request's count and latency (a stream's ends with its
    last chunk), as a plain ASGI middleware: Starlette's BaseHTTPMiddleware (@app.middleware)
    passes every chunk of a stream through a memory stream of its own, a third of the event
    loop's time in a profile of gpt.serve under 64 streaming clients."""

    def __init__(self, app, metrics: "Metrics", api_key: str | None):
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        if self.api_key and scope["path"] not in OPEN:
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.api_key}":
                self.metrics.requests.labels("unauthorized", "401").inc()
                response = error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                          code="invalid_api_key")
                return await response(scope, receive, send)
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = getattr(scope.get("route"), "path", None) or "unmatched"     # the route matched
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


def make_app(title: str, model_id: str, metrics: Metrics, worker: Callable[[], Any], api_key: str | None = None,
             owned_by: str = "tilekernels") -> tuple[FastAPI, Callable]:
    """A FastAPI app with /health, /metrics, /v1/models, OpenAI-shaped errors for every failure
    (unknown routes included) and the api_key check on all but /health and /metrics; worker() (an EngineWorker, or the
    model's own: submit(job), stop(), max_queue) starts with the app and stops (after the requests
    in flight) when it shuts down. Returns (app, the worker)."""
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        state["worker"] = worker()
        try:
            yield
        finally:
            await asyncio.to_thread(state["worker"].stop)

    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(AuthAndMetrics, metrics=metrics, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}", code="not_found")
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(_request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query")]
        return error_response(400, f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid')}",
                              ".".join(loc) or None)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_request, _e):
        return error_response(499, "the client closed the connection")

    @app.exception_handler(Exception)
    async def _internal(_request, e: Exception):
        log.exception("internal error")
        return error_response(500, f"internal error: {e.__class__.__name__}")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(model_id, owned_by)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise APIError(404, f"model {name!r} not found (this server has {model_id!r})", "model",
                           "model_not_found")
        return model_card(model_id, owned_by)

    return app, lambda: state["worker"]


_CREATED = int(time.time())


def model_card(model_id: str, owned_by: str) -> dict:
    return {"id": model_id, "object": "model", "created": _CREATED, "owned_by": owned_by}


def check_model(name, model_id: str) -> None:
    """A request's model: absent, empty or this server's (else 404 model_not_found; 400 if not a
    string)."""
    if name is not None and not isinstance(name, str):
        raise APIError(400, f"model must be a string, got {name!r}", "model")
    if name not in (None, "", model_id):
        raise APIError(404, f"model {name!r} not found (this server has {model_id!r})", "model", "model_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def submit(worker, job: Job) -> Job:
    """The job on the worker; 503 when its queue is full."""
    try:
        return worker.submit(job)
    except QueueFull:
        raise APIError(503, "the server is busy: its queue is full (max_queue); retry later",
                       code="queue_full") from None


class UploadTooLarge(Exception):
    pass


def too_large(max_bytes: int, option: str, param: str | None = None) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {max_bytes / 2 ** 20:g} MB ({option})", param,
                    "request_too_large")


def limited(request: Request, max_bytes: int, option: str) -> Request:
    """The request with its body counted as it streams in: a Content-Length over max_bytes is a
    413 at once, and reading past max_bytes raises UploadTooLarge, before the rest is received."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise too_large(max_bytes, option)
    seen = 0
    receive = request.receive

    async def counting():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise UploadTooLarge()
        return message

    return Request(request.scope, counting)


async def read_body(request: Request, max_bytes: int, option: str) -> bytes:
    """The whole body, refused (413) as soon as it is known to pass max_bytes."""
    body = limited(request, max_bytes, option)
    try:
        return await body.body()
    except UploadTooLarge:
        raise too_large(max_bytes, option) from None


WS_MAX_BYTES = 24 << 20     # a WebSocket message at most: OpenAI's 15 MiB append, base64 (20 MiB), and its JSON


def serve(app: FastAPI, host: str, port: int, log_level: str = "info", timeout_keep_alive: float = 5,
          timeout_read: float = 15) -> None:
    """Run app on uvicorn until SIGINT/SIGTERM: it stops accepting, lets the running requests
    finish, then shuts the worker down (uvicorn re-raises the signal, which ends the process: the
    CLIs' own SIGTERM handler, exit_with_one_line_errors', is set back to the default first).
    A connection idle between requests closes after timeout_keep_alive seconds; one whose
    request head takes longer than timeout_read, or whose body pauses longer, too
    (connections.py)."""
    import uvicorn

    from .connections import timed_h11

    import signal

    freeze_heap()       # what loading and warm-up built: out of the collector's full passes
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)       # a service manager's clean stop: ended by the signal
    config = uvicorn.Config(app, host=host, port=int(port), log_level=log_level, timeout_graceful_shutdown=None,
                            http=timed_h11(timeout_read), timeout_keep_alive=timeout_keep_alive,
                            ws_max_size=WS_MAX_BYTES)
    uvicorn.Server(config).run()


SERVER_OPTIONS = {"host": Str, "port": Int(min=0, max=65535), "max_queue": Int(min=0),
                  "timeout_keep_alive": Float(gt=0), "timeout_read": Float(gt=0)}    # seconds


def server_options(cfg) -> dict:
    """The options both servers share (SERVER_OPTIONS, part of each server's own table), checked:
    host, port, max_queue, the connection timeouts."""
    return options(cfg, SERVER_OPTIONS)


def run_server(app: FastAPI, o: dict, log_level) -> None:
    """serve() with the shared options o (server_options)."""
    serve(app, o["host"], o["port"], str(log_level or "info"), o["timeout_keep_alive"], o["timeout_read"])


__all__ = ["APIError", "ClientGone", "EngineFailed", "EngineJob", "EngineWorker", "Job", "Metrics", "QueueFull",
           "ThreadWorker", "UploadTooLarge", "check_model", "error_body", "error_response", "limited", "make_app",
           "new_id", "read_body", "run_server", "serve", "server_options", "submit", "too_large", "wait",
           "PlainTextResponse"]
