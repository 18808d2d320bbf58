"""python -m glm_asr.serve [key=value ...]: an OpenAI-compatible transcription server (FastAPI on uvicorn).

    python -m glm_asr.serve port=8000 device=gpu
    curl localhost:8000/v1/audio/transcriptions -F file=@talk.flac -F response_format=srt

POST /v1/audio/transcriptions (multipart: file, model, response_format json | text | srt | vtt |
verbose_json, temperature (0: the server's loop guard, its `temperature` list and thresholds, greedy
by default; above 0: that temperature alone, seeded per segment), timestamp_granularities[] (only
segment), stream (true: server-sent transcript.text.delta events as the text is decoded, then
transcript.text.done; json and text), language (accepted, unused) and prompt (OpenAI's style or
context hint: our `context`, read after the instruction, the server's `prompt` option)), the
/v1/realtime WebSocket (OpenAI's Realtime transcription events, server VAD or push-to-talk:
glm_asr.realtime), GET /v1/models, /health, /metrics. Every option of python -m glm_asr.transcribe
is the default of each request (max_new_tokens, vad, vad_options, audio_stream, the instruction);
the text equals the CLI's for the same file and options. Every upload goes through one
long-running pipeline (SharedPipeline: Transcriber.transcribe_many over the uploads as they
come), so the windows of all requests in flight are encoded and decoded together on the engine.
Uploads stream to a temporary file (limit max_upload_mb, checked as they come), deleted when the
request ends.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import hydra
import numpy as np
from fastapi import Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from omegaconf import DictConfig

from tilekernels.runtime import from_model_config
from tilekernels.runtime.sampler import MAX_TEMPERATURE
from tilekernels.runtime.cli import Float, Str, config_dir, exit_with_one_line_errors, options, run_hydra
from tilekernels.runtime.server import (SERVER_OPTIONS, APIError, ClientGone, Job, Metrics, ThreadWorker,
                                        UploadTooLarge, check_model, error_response, limited, make_app, run_server,
                                        submit, too_large, wait)

from .api import ASRError, Segment, SpeechRecognizer, Transcript, fallback_settings, load, vad_settings
from .audio import SAMPLE_RATE, Audio, AudioError
from .formats import render
from .subtitles import Deltas, join_text
from .pipeline import Dropped, with_context
from .reading import Cut
from .realtime import Session, serve_socket
from .transcribe import MODEL_OPTIONS, loop_guard, vad_options
from .vad import stop_workers

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
CONTENT_TYPES = {"text": "text/plain; charset=utf-8", "srt": "application/x-subrip; charset=utf-8",
                 "vtt": "text/vtt; charset=utf-8"}


class SharedPipeline(ThreadWorker):
    """One Transcriber.transcribe_many over every upload as it arrives (a live source), results
    handed back as each file completes: the windows of all requests in flight share the encoder
    batches and the engine's decode steps, and each file's text is the CLI's (the engine's tokens
    do not depend on the batch). A request whose client has gone is dropped: before its file is
    read, or from the pipeline (its windows leave the engine)."""

    def __init__(self, asr: SpeechRecognizer, o: dict, metrics: Metrics):
        self.asr, self.o = asr, o
        self._jobs: dict[str, Job] = {}
        self._ids = itertools.count()
        super().__init__(1 + o["max_queue"], metrics, "asr-pipeline")

    def submit(self, job: Job) -> Job:
        """job.source: (name, opener) of its upload."""
        super().submit(job)
        self.metrics.queue_depth.set(self._inbox.qsize())
        return job

    def _done(self, job: Job, result=None, error: BaseException | None = None) -> None:
        super()._done(job, result, error)
        self.metrics.running.set(len(self._jobs))

    def stop(self, timeout: float = 120.0) -> None:
        super().stop(timeout)
        stop_workers()          # the VAD's worker processes end with the server, not after it

    def _sources(self):
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                if self._stopping.is_set():
                    return
                yield None
                continue
            self.metrics.queue_depth.set(self._inbox.qsize())
            if job.cancelled.is_set():
                self._done(job, error=ClientGone())
                continue
            key = str(next(self._ids))
            self._jobs[key] = job
            self.metrics.running.set(len(self._jobs))
            yield key, job.source[1], job.stream, job.guard, job.instruction

    def _partial(self, key: str, segment: dict, prompt_tokens: int, new_tokens: int) -> None:
        """A segment of a streamed upload as soon as it is decoded."""
        self._jobs[key].emit((segment, prompt_tokens, new_tokens))

    def _preview(self, key: str, text: str) -> None:
        """The text so far of a streamed upload's next segment, as its tokens come."""
        self._jobs[key].emit(text)

    def _run(self) -> None:
        o = self.o
        vad = vad_settings(o["vad"], o["vad_options"])
        results = self.asr.transcriber.transcribe_many(self._sources(), o["prompt"], o["max_new_tokens"], vad=vad,
                                                       in_order=False, partial=self._partial, preview=self._preview,
                                                       dropped=lambda key: self._jobs[key].cancelled.is_set())
        for key, result, seconds in results:
            job = self._jobs.pop(key)
            if isinstance(result, Dropped):
                self._done(job, error=ClientGone())
            elif isinstance(result, BaseException):
                self._done(job, error=ASRError(str(result)))
            else:
                self._done(job, Transcript(job.source[0], [Segment(**s) for s in result], seconds=seconds))


def _server_settings(cfg: DictConfig) -> dict:
    """The server's options, declared here once (the servers' and transcribe's shared ones, the
    upload limit, the default response_format) and checked (ValueError naming the option);
    output_format as a response_format (txt: text)."""
    o = options(cfg, {**SERVER_OPTIONS, **MODEL_OPTIONS, "max_upload_mb": Float(gt=0),
                      "output_format": Str(choices=(*RESPONSE_FORMATS, "txt"))})
    o["output_format"] = {"txt": "text"}.get(o["output_format"], o["output_format"])
    o["vad_options"] = vad_options(cfg.get("vad_options"))       # each checked (VadOptions)
    return o


def _request_settings(form, model_id: str, default_format: str) -> tuple:
    """(upload, text fields, response_format, stream) of a transcription request's form, each
    field checked (APIError naming it)."""
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise APIError(400, "file is required (multipart field 'file')", "file")
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    check_model(fields.get("model"), model_id)
    fmt = fields.get("response_format") or default_format
    if fmt not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {fmt!r}",
                       "response_format")
    granularities = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
    if any(g != "segment" for g in granularities):
        raise APIError(400, "only segment timestamps are supported (timestamp_granularities: segment); "
                       "word timestamps are not", "timestamp_granularities", "unsupported_parameter")
    stream = fields.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise APIError(400, f"stream must be true or false, got {fields['stream']!r}", "stream")
    if stream == "true" and fmt not in ("json", "text"):
        raise APIError(400, f"stream=true takes response_format json or text, got {fmt!r}", "response_format")
    temperature = fields.get("temperature")
    if temperature not in (None, ""):
        try:
            t = float(temperature)
        except ValueError:
            raise APIError(400, f"temperature must be a number, got {temperature!r}", "temperature") from None
        if not 0 <= t <= MAX_TEMPERATURE:
            raise APIError(400, f"temperature must be from 0 to {MAX_TEMPERATURE:g}, got {temperature!r}",
                           "temperature")
        fields["temperature"] = t
    return upload, fields, fmt, stream == "true"


async def _save_upload(upload, scratch: str) -> tuple[str, str]:
    """(the upload's name, its path in scratch), its bytes written there a MiB at a time."""
    name = upload.filename or "audio"
    suffix = re.sub(r"[^A-Za-z0-9]", "", Path(name).suffix)[:10]
    path = os.path.join(scratch, "upload" + (f".{suffix}" if suffix else ""))
    with open(path, "wb") as f:
        await upload.seek(0)
        while chunk := await upload.read(1 << 20):
            f.write(chunk)
    return name, path


@dataclass
class Served:
    """What the routes of a running server share: its options, recognizer, model id, loop guard,
    pipeline and counters."""
    o: dict
    asr: SpeechRecognizer
    model_id: str
    guard: object
    worker: Callable
    audio_seconds: object
    max_bytes: int

    def instruction(self, fields: dict) -> str:
        """A request's instruction: the server's, with the request's prompt as its context (else
        the server's context option); 400 if a window's prompt could not fit it."""
        text = with_context(self.o["prompt"], fields.get("prompt") or self.o["context"])
        try:
            self.asr.transcriber.check(text, self.o["max_new_tokens"])
        except ValueError as e:
            raise APIError(400, f"prompt too long: {e}", "prompt") from None
        return text

    def counted(self, job: Job, seconds: float) -> Job:
        """The job, its audio counted in audio_seconds once it succeeds."""
        if seconds:
            job.future.add_done_callback(lambda f: f.exception() or self.audio_seconds.inc(seconds))
        return job


def build_app(cfg: DictConfig, asr: SpeechRecognizer | None = None):
    o = _server_settings(cfg)
    source = from_model_config(cfg.model)
    model_id = str(cfg.get("served_model_name") or (source.name if cfg.model.get("path") else cfg.model.get("id")))
    asr = asr or load(str(source), o["device"], max_batch=o["max_batch"], precision=o["precision"])
    asr.transcriber.check(with_context(o["prompt"], o["context"]), o["max_new_tokens"])
    guard = fallback_settings(**loop_guard(cfg, o))     # a request's temperature 0; above 0 its own
    if asr.transcriber.model.xp is not np:     # compiles and captures; on the CPU there are none
        asr.transcriber.warm_up(o["prompt"])
    metrics = Metrics("glm_asr")
    audio_seconds = metrics.add_counter("audio_seconds", "seconds of audio transcribed")
    app, worker = make_app("glm_asr", model_id, metrics, lambda: SharedPipeline(asr, o, metrics),
                           cfg.get("api_key") or None)
    served = Served(o, asr, model_id, guard, worker, audio_seconds, int(o["max_upload_mb"] * 1024 * 1024))
    add_transcriptions(app, served)
    add_realtime(app, served, cfg.get("api_key") or None)
    return app, o


def add_transcriptions(app, s: Served) -> None:
    """POST /v1/audio/transcriptions: an upload through the shared pipeline, answered whole or
    streamed (server-sent events)."""
    o = s.o

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        scratch, response = tempfile.mkdtemp(prefix="glm_asr.serve."), None
        try:
            response = await _handle(request, scratch)
            return response
        finally:        # a stream's upload goes once the pipeline is done with it (its job's end)
            if not isinstance(response, StreamingResponse):
                shutil.rmtree(scratch, ignore_errors=True)

    async def _handle(request: Request, scratch: str):
        if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            raise APIError(400, "send multipart/form-data with a file field", "file")
        body = limited(request, s.max_bytes, "max_upload_mb")
        try:
            form = await body.form(max_files=1, max_fields=64)
        except UploadTooLarge:
            raise too_large(s.max_bytes, "max_upload_mb", "file") from None
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed multipart body
            raise APIError(400, f"cannot read the form: {e}") from None
        try:
            upload, fields, fmt, stream = _request_settings(form, s.model_id, o["output_format"])
            prompt = s.instruction(fields)
            name, path = await _save_upload(upload, scratch)
        finally:
            await form.close()
        try:
            with Audio(path, o["audio_stream"], name=name) as audio:
                seconds = audio.seconds
        except AudioError as e:
            raise APIError(400, f"cannot decode the audio: {e}", "file", "invalid_audio") from None     # OpenAI's

        job = Job()
        job.source, job.stream = (name, lambda: Audio(path, o["audio_stream"], name=name)), stream
        t = fields.get("temperature") or 0.0
        job.guard = s.guard if t == 0 else replace(s.guard, temperatures=(t,))
        job.instruction = prompt
        job = s.counted(submit(s.worker(), job), seconds)
        if stream:
            job.future.add_done_callback(lambda _: shutil.rmtree(scratch, ignore_errors=True))
            return StreamingResponse(transcript_events(request, job),
                                     media_type="text/event-stream", headers={"cache-control": "no-cache"})
        try:
            r = await wait(request, job)
        except ClientGone:
            return error_response(499, "the client went away")
        except ASRError as e:
            raise APIError(400, str(e), "file", "invalid_audio") from None
        return respond(r, fmt, seconds, fields.get("language"), o["vad"] == "none")


def add_realtime(app, s: Served, api_key: str | None) -> None:
    """The /v1/realtime WebSocket (glm_asr.realtime): each item a job of the shared pipeline."""
    vad = vad_settings("silero", s.o["vad_options"])

    def make_job(item: str, audio, context: str | None) -> Job:
        """An item's job: 16 kHz samples (through the server's VAD) or a live VAD's Cut."""
        job = Job()
        job.source, job.stream = (item, lambda: audio), True
        job.guard, job.instruction = s.guard, s.instruction({"prompt": context})
        return s.counted(job, audio.seconds if isinstance(audio, Cut) else len(audio) / SAMPLE_RATE)

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        await serve_socket(ws, api_key, lambda send: Session(send, s.worker, make_job, s.max_bytes, vad,
                                                             lambda c: s.instruction({"prompt": c})))


async def transcript_events(request: Request, job: Job):
    """OpenAI's transcription stream (server-sent events): transcript.text.delta events as a
    segment's tokens come (once those before it are decoded; with the loop guard on, a segment
    at a time, as a retry may change it), then transcript.text.done with the whole text (the
    deltas joined) and the tokens used; a failure ends it with an error event. A client that
    goes away cancels the job."""
    def event(payload: dict) -> str:
        return "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n"

    job.future.add_done_callback(lambda _: job.emit(None))     # after the last segment: the end
    deltas = Deltas()
    try:
        while (item := await _next(request, job)) is not None:
            if delta := deltas.add(item):
                yield event({"type": "transcript.text.delta", "delta": delta})
        try:
            final = join_text([asdict(s) for s in job.future.result().segments])
        except Exception as e:  # noqa: BLE001 - the headers are gone: said in the stream
            yield event({"error": {"message": str(e), "type": "invalid_request_error", "param": "file",
                                   "code": "invalid_audio"}})
            return
        if final != deltas.text and final.startswith(deltas.text):
            yield event({"type": "transcript.text.delta", "delta": final[len(deltas.text):]})
        yield event({"type": "transcript.text.done", "text": final, "usage": deltas.usage()})
    except ClientGone:
        return
    finally:
        if not job.future.done():
            job.cancel()


async def _next(request: Request, job: Job):
    """The job's next streamed item (None at its end); ClientGone once the client has left."""
    while True:
        try:
            return await asyncio.wait_for(job.items.get(), 0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone() from None


def _verbose_segment(i: int, s: dict) -> dict:
    """A segment in OpenAI's verbose_json shape; no_speech_prob 1 minus the VAD's mean speech
    probability over it (vad none: 0, no evidence of its absence; the field is required there)."""
    out = {"id": i, "seek": 0, "start": s["start"], "end": s["end"], "text": s["text"], "tokens": s["tokens"],
           "temperature": s["temperature"], "avg_logprob": s["avg_logprob"],
           "compression_ratio": s["compression_ratio"], "no_speech_prob": s["no_speech_prob"] or 0.0}
    return out


def respond(r: Transcript, fmt: str, seconds: float | None, language: str | None, windows: bool):
    """The response in an OpenAI response_format; text, srt and vtt as the CLI's files."""
    segments = [asdict(s) for s in r.segments]
    text = r.text
    if fmt == "json":
        return JSONResponse({"text": text})
    if fmt == "verbose_json":
        end = segments[-1]["end"] if segments else 0.0
        return JSONResponse({"task": "transcribe", "language": language or "unknown",
                             "duration": float(seconds if seconds is not None else end), "text": text,
                             "segments": [_verbose_segment(i, s) for i, s in enumerate(segments)]})
    body = render("txt" if fmt == "text" else fmt, r.source, segments, windows=windows)
    return PlainTextResponse(body, media_type=CONTENT_TYPES[fmt])


def run(cfg: DictConfig) -> None:
    app, o = build_app(cfg)
    run_server(app, o, cfg.get("log_level"))


@hydra.main(version_base=None, config_path=config_dir("glm_asr"), config_name="serve")
def _hydra_main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg))


def main() -> None:
    run_hydra(_hydra_main)


if __name__ == "__main__":
    main()
