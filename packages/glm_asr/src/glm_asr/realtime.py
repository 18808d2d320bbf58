"""OpenAI's Realtime transcription over a WebSocket (/v1/realtime), push-to-talk: the client sets up
the session (`transcription_session.update` or `session.update`: `input_audio_format` "pcm16", our
`input_sample_rate`, default OpenAI's 24000, `turn_detection` null and, as OpenAI's, an
`input_audio_transcription.prompt`: our context), appends base64 PCM16
(`input_audio_buffer.append`) and commits (`input_audio_buffer.commit`); each commit is transcribed
through the server's shared pipeline like an upload (the same VAD, guard and instruction), its
segments sent as `conversation.item.input_audio_transcription.delta` as they are decoded, then
`.completed` with the whole transcript. Server-side turn detection (`server_vad`) is refused for
now with an error event. Bad events get OpenAI's `error` event; the session goes on.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json

import numpy as np

from tilekernels.runtime.server import Job, submit

from .audio import SAMPLE_RATE
from .subtitles import join_text

OPENAI_RATE = 24000             # OpenAI's pcm16 rate, the default input_sample_rate
MAX_APPEND_BYTES = 15 << 20     # an append event's audio at most (OpenAI's 15 MiB)
RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)


class SessionError(Exception):
    """A bad client event: an error event is sent and the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def pcm16(audio, rate: int) -> np.ndarray:
    """float32 samples at 16 kHz of base64 little-endian mono int16 at `rate` (whole-buffer
    resampling, as a file of the same samples is read)."""
    if not isinstance(audio, str):
        raise SessionError("audio must be a base64 string", param="audio")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise SessionError("audio is not valid base64", param="audio") from None
    if len(raw) > MAX_APPEND_BYTES:
        raise SessionError(f"an append carries at most {MAX_APPEND_BYTES >> 20} MiB of audio", param="audio")
    if len(raw) % 2:
        raise SessionError("pcm16 audio has an even number of bytes", param="audio")
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768


def to_16k(x: np.ndarray, rate: int) -> np.ndarray:
    if rate == SAMPLE_RATE or not len(x):
        return x
    import librosa

    return librosa.resample(x, orig_sr=rate, target_sr=SAMPLE_RATE).astype(np.float32)


class Session:
    """One WebSocket's state: its settings, the audio appended since the last commit (float32 at
    the input rate; at most max_bytes of pcm16) and the commits being transcribed."""

    def __init__(self, send, worker, make_job, max_bytes: int):
        self.send, self.worker, self.make_job, self.max_bytes = send, worker, make_job, max_bytes
        self.rate: int | None = None        # set by the session update
        self.context: str | None = None     # input_audio_transcription.prompt: the instruction's context
        self.buffer: list[np.ndarray] = []
        self.items = itertools.count()
        self.previous: str | None = None
        self.tasks: set[asyncio.Task] = set()
        self.jobs: set[Job] = set()

    async def handle(self, raw: str) -> None:
        try:
            event = json.loads(raw)
        except (ValueError, RecursionError):
            raise SessionError("an event must be a JSON object") from None
        if not isinstance(event, dict):
            raise SessionError("an event must be a JSON object")
        kind = event.get("type")
        if kind in ("transcription_session.update", "session.update"):
            await self.update(event.get("session") or {}, kind)
        elif kind == "input_audio_buffer.append":
            if self.rate is None:
                raise SessionError("send transcription_session.update before audio", "session_not_set_up")
            x = pcm16(event.get("audio"), self.rate)
            if 2 * (sum(len(b) for b in self.buffer) + len(x)) > self.max_bytes:
                raise SessionError("the buffer is full (max_upload_mb): commit or clear it", "buffer_full", "audio")
            self.buffer.append(x)
        elif kind == "input_audio_buffer.commit":
            self.commit()
        elif kind == "input_audio_buffer.clear":
            self.buffer = []
            await self.send({"type": "input_audio_buffer.cleared"})
        else:
            raise SessionError(f"unknown event type {kind!r}", "unknown_event", "type")

    async def update(self, s: dict, kind: str) -> None:
        if not isinstance(s, dict):
            raise SessionError("session must be an object", param="session")
        fmt = s.get("input_audio_format", "pcm16")
        if fmt != "pcm16":
            raise SessionError(f"input_audio_format must be pcm16, got {fmt!r}", param="session.input_audio_format")
        rate = s.get("input_sample_rate", self.rate or OPENAI_RATE)
        if rate not in RATES:
            raise SessionError(f"input_sample_rate must be one of {', '.join(map(str, RATES))}, got {rate!r}",
                               param="session.input_sample_rate")
        if s.get("turn_detection") is not None:
            raise SessionError("turn_detection must be null: commit each turn (input_audio_buffer.commit); server "
                               "turn detection is not supported yet", "unsupported", "session.turn_detection")
        asked = s.get("input_audio_transcription") or {}
        context = asked.get("prompt") if isinstance(asked, dict) else None
        if context is not None and not isinstance(context, str):
            raise SessionError("input_audio_transcription.prompt must be a string",
                               param="session.input_audio_transcription.prompt")
        if self.buffer and rate != self.rate:
            raise SessionError("commit or clear the audio before changing input_sample_rate",
                               param="session.input_sample_rate")
        self.rate, self.context = rate, context if context is not None else self.context
        await self.send({"type": kind.replace("update", "updated"),
                         "session": {"input_audio_format": "pcm16", "input_sample_rate": rate, "turn_detection": None}})

    def commit(self) -> None:
        """Transcribe the buffer as one item (nothing appended since the last commit: nothing)."""
        if not self.buffer:
            return
        samples = to_16k(np.concatenate(self.buffer), self.rate)
        item = f"item_{next(self.items):04d}"
        try:
            job = self.make_job(item, samples, self.context)
        except Exception as e:  # noqa: BLE001 - the server refuses the settings (a context too long)
            raise SessionError(str(e), param="session.input_audio_transcription.prompt") from None
        self.buffer, previous, self.previous = [], self.previous, item
        self.jobs.add(job)
        task = asyncio.ensure_future(self.transcribe(item, previous, job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def transcribe(self, item: str, previous: str | None, job: Job) -> None:
        await self.send({"type": "input_audio_buffer.committed", "item_id": item, "previous_item_id": previous})
        job.future.add_done_callback(lambda _: job.emit(None))
        segments, text = [], ""
        try:
            submit(self.worker(), job)
            while (part := await job.items.get()) is not None:
                segments.append(part[0])
                now = join_text(segments)       # the deltas join to the transcript (Transcript.text's join)
                if len(now) > len(text):
                    await self.send({"type": "conversation.item.input_audio_transcription.delta", "item_id": item,
                                     "content_index": 0, "delta": now[len(text):]})
                    text = now
            result = job.future.result()
            await self.send({"type": "conversation.item.input_audio_transcription.completed", "item_id": item,
                             "content_index": 0, "transcript": result.text,
                             "segments": [{"start": s.start, "end": s.end, "text": s.text} for s in result.segments]})
        except Exception as e:  # noqa: BLE001 - the item failed (bad audio, a full queue): said, the session goes on
            await self.send(error_event(str(e) or e.__class__.__name__, "transcription_failed", None))
        finally:
            self.jobs.discard(job)

    def close(self) -> None:
        """The socket went away: its commits leave the pipeline."""
        for job in self.jobs:
            job.cancel()
        for task in self.tasks:
            task.cancel()


def error_event(message: str, code: str, param: str | None) -> dict:
    return {"type": "error", "error": {"type": "invalid_request_error", "code": code, "message": message,
                                       "param": param}}
