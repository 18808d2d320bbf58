"""OpenAI's Realtime transcription over a WebSocket (/v1/realtime): the client sets up the session
(`transcription_session.update` or `session.update`: `input_audio_format` "pcm16", our
`input_sample_rate`, default OpenAI's 24000, `turn_detection` and, as OpenAI's, an
`input_audio_transcription.prompt`: our context; or the GA shape, `session.update` with `type`
"transcription" and `audio.input`'s `format` {"type": "audio/pcm", "rate"}, `turn_detection` and
`transcription.prompt`, answered in that shape) and appends base64 PCM16
(`input_audio_buffer.append`). Every server event has an `event_id`.

turn_detection null (push-to-talk): each `input_audio_buffer.commit` is transcribed through the
server's shared pipeline like an upload (the same VAD, guard and instruction).
turn_detection {"type": "server_vad"} (the default, as OpenAI's): Silero VAD runs on the stream as
it arrives, on the CPU (vad.live: the segments a file of the same 16 kHz audio gets, under the
server's vad_options, which OpenAI's threshold, silence_duration_ms and prefix_padding_ms and our
own option names override; a GPU server's file VAD, within 1e-4 of the CPU's, can move an edge by
a frame); `input_audio_buffer.speech_started` where speech begins, and for each segment once no
later audio can change it `speech_stopped`, `committed` (an item a segment) and its
transcription, decoded as a file's segment is. A commit ends the stream there (as a file ends).

Each item's text comes as `conversation.item.input_audio_transcription.delta` events as it is
decoded (a segment at a time with the loop guard on), then `.completed` with the transcript, the
tokens used (`usage`) and its segments' times (in the stream's time), or `.failed`. Bad events get
OpenAI's `error` event; the session goes on.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
import logging
import uuid
from collections import deque

import dataclasses
from typing import Callable

import numpy as np

from tilekernels.runtime.server import APIError, Job, submit

from .audio import SAMPLE_RATE
from .reading import Cut
from .subtitles import Deltas
from .vad import VadOptions
from .vad.live import Feeder, LiveVad, Speech

IN_FLIGHT = 8                   # a session's items in the server's queue at once; more wait in the session
WAITING = 32                    # items waiting so, in commit order; past that (or WAITING_BYTES) one fails
WAITING_BYTES = 64 << 20        # their audio at most (or the session's max_bytes, when larger)
ROOM_WAIT_S = 600               # how long an item waits for room in a full server before it fails
SEND_TIMEOUT_S = 30             # a client that takes no event for this long is let go (its items cancelled)
OPENAI_RATE = 24000             # OpenAI's pcm16 rate, the default input_sample_rate
MAX_APPEND_BYTES = 15 << 20     # an append event's audio at most (OpenAI's 15 MiB)
RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
log = logging.getLogger("glm_asr.realtime")
FEEDER = Feeder()                # every session's live VAD, fed together (one encoder chain a round)
OPENAI_VAD = {"threshold": "threshold", "silence_duration_ms": "min_silence_duration_ms",
              "prefix_padding_ms": "speech_pad_ms"}     # OpenAI's server_vad fields: ours
GA_PARAMS = {"session.input_sample_rate": "session.audio.input.format.rate",
             "session.input_audio_format": "session.audio.input.format",
             "session.turn_detection": "session.audio.input.turn_detection",
             "session.input_audio_transcription.prompt": "session.audio.input.transcription.prompt"}


class SessionError(Exception):
    """A bad client event: an error event is sent and the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def pcm16(audio) -> np.ndarray:
    """The int16 samples of base64 little-endian mono int16 (checked)."""
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
    return np.frombuffer(raw, "<i2")


def to_16k(x: np.ndarray, rate: int) -> np.ndarray:
    """float32 samples at 16 kHz of int16 ones at `rate` (resampled whole, as a file is read)."""
    x = x.astype(np.float32) / 32768
    if rate == SAMPLE_RATE or not len(x):
        return x
    import librosa

    return librosa.resample(x, orig_sr=rate, target_sr=SAMPLE_RATE).astype(np.float32)


class Session:
    """One WebSocket's state: its settings, the audio not yet committed (push-to-talk: pcm16 as
    sent, at most max_bytes; server_vad: the live VAD's, bounded the same way)
    and the items being transcribed. vad: the server's vad_options, server_vad's defaults."""

    def __init__(self, send, worker, make_job, max_bytes: int, vad: VadOptions | None = None,
                 check_context: Callable[[str], object] | None = None):
        self.send, self.worker, self.make_job, self.max_bytes = send, worker, make_job, max_bytes
        self.check_context = check_context      # raises for a context the server refuses (too long)
        self.vad_defaults = vad or VadOptions()
        self.rate: int | None = None        # set by the session update
        self.context: str | None = None     # input_audio_transcription.prompt: the instruction's context
        self.turns: VadOptions | None = self.vad_defaults      # server_vad's options; None: push-to-talk
        self.buffer: list[np.ndarray] = []
        self.live: LiveVad | None = None    # server_vad: the stream since the last commit
        self.resampler = None               # server_vad at another rate than 16 kHz: soxr's, one a stream
        self.offset = 0                     # samples (16 kHz) of the session's stream before self.live's
        self.open: str | None = None        # the item whose speech has started
        self.items = itertools.count()
        self.previous: str | None = None
        self.tasks: set[asyncio.Task] = set()
        self.jobs: set[Job] = set()
        self.room = asyncio.Condition()     # IN_FLIGHT and the waiting items: a client faster than the server
        self.in_flight, self.queued = 0, deque()      # waits; the waiting items' (ticket, bytes), in commit order
        self.tickets = itertools.count()

    def settings(self) -> dict:
        """The session as OpenAI's transcription_session events show it."""
        return {"input_audio_format": "pcm16", "input_sample_rate": self.rate or OPENAI_RATE,
                "turn_detection": self.turn_settings(), "input_audio_transcription": {"prompt": self.context or ""}}

    def ga_settings(self) -> dict:
        """The session in the shape of OpenAI's GA session events (a transcription session)."""
        return {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": self.rate or OPENAI_RATE}, "noise_reduction": None,
            "transcription": {"prompt": self.context or ""}, "turn_detection": self.turn_settings()}}}

    def turn_settings(self) -> dict | None:
        """server_vad's options under OpenAI's names (threshold, prefix_padding_ms,
        silence_duration_ms), then the rest of ours."""
        if self.turns is None:
            return None
        o = dataclasses.asdict(self.turns)
        return {"type": "server_vad", "threshold": o.pop("threshold"),
                "prefix_padding_ms": round(o.pop("speech_pad_ms")),
                "silence_duration_ms": round(o.pop("min_silence_duration_ms")), **o}

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
            x = pcm16(event.get("audio"))
            if self.turns is not None:
                await self.hear(self.resample(x.astype(np.float32) / 32768))
                return
            if 2 * (sum(len(b) for b in self.buffer) + len(x)) > self.max_bytes:
                raise SessionError("the buffer is full (max_upload_mb): commit or clear it", "buffer_full", "audio")
            self.buffer.append(x)
        elif kind == "input_audio_buffer.commit":
            if self.turns is not None:
                await self.end_stream()
            else:
                await self.commit()
        elif kind == "input_audio_buffer.clear":
            self.buffer, self.resampler = [], None
            if self.live is not None:
                live, self.live = self.live, None
                await self.passed(live.n)
            await self.send({"type": "input_audio_buffer.cleared"})
        else:
            raise SessionError(f"unknown event type {kind!r}", "unknown_event", "type")

    async def update(self, s: dict, kind: str) -> None:
        if not isinstance(s, dict):
            raise SessionError("session must be an object", param="session")
        if kind == "session.update" and ("type" in s or "audio" in s):
            try:
                await self.apply(ga_session(s))
            except SessionError as e:       # said with the GA shape's names
                raise SessionError(str(e), e.code, GA_PARAMS.get(e.param, e.param)) from None
            await self.send({"type": "session.updated", "session": self.ga_settings()})
            return
        await self.apply(s)
        await self.send({"type": kind.replace("update", "updated"), "session": self.settings()})

    async def apply(self, s: dict) -> None:
        """Take a session's settings (the beta shape), all or none."""
        fmt = s.get("input_audio_format", "pcm16")
        if fmt != "pcm16":
            raise SessionError(f"input_audio_format must be pcm16, got {fmt!r}", param="session.input_audio_format")
        rate = s.get("input_sample_rate", self.rate or OPENAI_RATE)
        if isinstance(rate, bool) or not isinstance(rate, int) or rate not in RATES:
            raise SessionError(f"input_sample_rate must be one of {', '.join(map(str, RATES))}, got {rate!r}",
                               param="session.input_sample_rate")
        turns = self.turn_detection(s["turn_detection"]) if "turn_detection" in s else self.turns
        asked = s.get("input_audio_transcription") or {}
        context = asked.get("prompt") if isinstance(asked, dict) else None
        if context is not None and not isinstance(context, str):
            raise SessionError("input_audio_transcription.prompt must be a string",
                               param="session.input_audio_transcription.prompt")
        if context is not None and self.check_context is not None:
            try:
                self.check_context(context)
            except Exception as e:  # noqa: BLE001 - refused now, not at each item's commit
                raise SessionError(str(e), param="session.input_audio_transcription.prompt") from None
        pending = self.buffer or (self.live is not None and self.live.n)
        if pending and (rate != self.rate or turns != self.turns):
            raise SessionError("commit or clear the audio before changing input_sample_rate or turn_detection",
                               param="session.input_sample_rate" if rate != self.rate else "session.turn_detection")
        self.rate, self.turns = rate, turns
        self.context = context if context is not None else self.context

    def turn_detection(self, t) -> VadOptions | None:
        """server_vad's options from a session's turn_detection (None: push-to-talk)."""
        if t is None:
            return None
        if not isinstance(t, dict) or t.get("type", "server_vad") != "server_vad":
            raise SessionError("turn_detection must be null or {\"type\": \"server_vad\", ...}", "unsupported",
                               "session.turn_detection")
        fields = {f.name for f in dataclasses.fields(VadOptions)}
        changes = {}
        for name, value in t.items():
            if name in ("type", "create_response", "interrupt_response", "idle_timeout_ms"):
                continue                            # OpenAI's, about responses and idle prompts: none here
            ours = OPENAI_VAD.get(name, name)
            if ours not in fields:
                raise SessionError(f"unknown turn_detection option {name!r}", param=f"session.turn_detection.{name}")
            changes[ours] = value
        try:
            return dataclasses.replace(self.vad_defaults, **changes)
        except (ValueError, TypeError) as e:
            raise SessionError(str(e).replace("vad_options.", "turn_detection."),
                               param="session.turn_detection") from None

    # ------------------------------------------------------------------ server_vad
    async def hear(self, x: np.ndarray) -> None:
        """Audio into the live VAD (FEEDER's thread, with the other sessions'), then what it found.
        A turn whose audio would pass max_bytes is ended there, as a commit would."""
        if self.live is None:
            self.live = LiveVad(self.turns)
        events = await asyncio.wrap_future(FEEDER.submit(self.live, x))
        await self.announce(events)
        if 2 * len(self.live.buf) > self.max_bytes:
            await self.end_stream()

    def resample(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        """A piece of the stream at 16 kHz, resampled as one stream (no seams between pieces)."""
        if self.rate == SAMPLE_RATE:
            return x
        if self.resampler is None:
            import soxr

            self.resampler = soxr.ResampleStream(self.rate, SAMPLE_RATE, 1, dtype="float32")
        y = self.resampler.resample_chunk(x, last=last)
        if last:
            self.resampler = None
        return y

    async def end_stream(self) -> None:
        """The stream ends here (a commit): what is left of its speech is final; a new one begins."""
        if self.resampler is not None and self.live is not None:
            tail = self.resample(np.zeros(0, np.float32), last=True)
            if len(tail):
                await self.hear(tail)
        if self.live is None or not self.live.n:
            return
        live, self.live = self.live, None
        try:
            await self.announce(await asyncio.wrap_future(FEEDER.submit(live, None)))
        finally:
            await self.passed(live.n)       # the next stream's times follow this one's, whatever happened

    async def passed(self, n: int) -> None:
        """The stream's n samples are behind the session (ended or cleared): a turn still open
        stops there, and the next stream's times count from there."""
        self.offset += n
        await self.stopped(self.offset)

    async def announce(self, events: list) -> None:
        for e in events:
            if isinstance(e, Speech):
                try:
                    await self.speech(e)
                except SessionError as err:             # this item refused: the stream's others go on
                    await self.send(error_event(str(err), err.code, err.param))
            elif e[0] == "started":
                await self.started(self.offset + e[1])
            else:                                       # dropped: too short to keep
                await self.stopped(self.offset + e[1])

    async def started(self, sample: int) -> None:
        self.open = self.open or f"item_{next(self.items):04d}"
        await self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": ms(sample),
                         "item_id": self.open})

    async def stopped(self, sample: int) -> None:
        if self.open is not None:
            await self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ms(sample),
                             "item_id": self.open})
            self.open = None

    async def speech(self, e: Speech) -> None:
        """A final segment: its item stopped and committed, its audio decoded as a file's segment."""
        seg = e.segment
        if self.open is None:
            await self.started(self.offset + seg.start)
        item = self.open
        await self.stopped(self.offset + seg.end)
        start = self.offset / SAMPLE_RATE
        await self.transcribe_item(item, Cut(e.audio, start + seg.start_s, start + seg.end_s, e.speech))

    # ------------------------------------------------------------------ push-to-talk and both
    async def commit(self) -> None:
        """Transcribe the buffer as one item (nothing appended since the last commit: nothing)."""
        if not self.buffer:
            return
        samples = await asyncio.to_thread(to_16k, np.concatenate(self.buffer), self.rate)   # off the event loop
        await self.transcribe_item(f"item_{next(self.items):04d}", samples)
        self.buffer = []

    async def transcribe_item(self, item: str, audio: np.ndarray | Cut) -> None:
        """Commit an item (16 kHz samples, or a Cut) and transcribe it in a task of its own."""
        try:
            job = self.make_job(item, audio, self.context)
        except Exception as e:  # noqa: BLE001 - the server refuses the settings (a context too long)
            raise SessionError(str(e), param="session.input_audio_transcription.prompt") from None
        previous, self.previous = self.previous, item
        await self.send({"type": "input_audio_buffer.committed", "item_id": item, "previous_item_id": previous})
        size = (audio.samples if isinstance(audio, Cut) else audio).nbytes
        if len(self.queued) >= WAITING or (
                self.queued and sum(n for _, n in self.queued) + size > max(self.max_bytes, WAITING_BYTES)):
            await self.send({"type": "conversation.item.input_audio_transcription.failed", "item_id": item,
                             "content_index": 0, "error": error_event(
                                 f"{WAITING} items (or {max(self.max_bytes, WAITING_BYTES) >> 20} MB of audio) of this "
                                 "session already wait for the server: send slower", "queue_full", None)["error"]})
            return
        ticket = next(self.tickets)
        self.queued.append((ticket, size))
        self.jobs.add(job)
        task = asyncio.ensure_future(self.transcribe(item, job, ticket))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def enter(self, job: Job) -> None:
        """Submit the job once the server's queue has room (tried every 0.1 s, up to ROOM_WAIT_S):
        the items of a client that sends faster than the server transcribes (a file at full
        speed) wait, within WAITING and WAITING_BYTES, rather than being refused."""
        deadline = asyncio.get_running_loop().time() + ROOM_WAIT_S
        while True:
            try:
                submit(self.worker(), job)
                return
            except APIError as e:
                if e.status != 503 or asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(0.1)

    async def transcribe(self, item: str, job: Job, ticket: int) -> None:
        """The item's transcription, its turn come (the session's waiting items go in commit order,
        IN_FLIGHT at most under way), its text sent as deltas as it is decoded (a segment at a
        time with the loop guard on), then .completed (or .failed)."""
        job.future.add_done_callback(lambda _: job.emit(None))
        deltas, under_way = Deltas(), False
        try:
            async with self.room:
                await self.room.wait_for(lambda: self.queued[0][0] == ticket and self.in_flight < IN_FLIGHT)
            await self.enter(job)
            async with self.room:
                self.queued.popleft()
                self.in_flight, under_way = self.in_flight + 1, True
                self.room.notify_all()
            while (part := await job.items.get()) is not None:
                if delta := deltas.add(part):   # they join to the transcript (Transcript.text's join)
                    await self.send({"type": "conversation.item.input_audio_transcription.delta", "item_id": item,
                                     "content_index": 0, "delta": delta})
            result = job.future.result()
            await self.send({"type": "conversation.item.input_audio_transcription.completed", "item_id": item,
                             "content_index": 0, "transcript": result.text,
                             "usage": deltas.usage(),
                             "segments": [{"start": s.start, "end": s.end, "text": s.text} for s in result.segments]})
        except Exception as e:  # noqa: BLE001 - the item failed (bad audio, a full queue): said, the session goes on
            await self.send({"type": "conversation.item.input_audio_transcription.failed", "item_id": item,
                             "content_index": 0, "error": error_event(str(e) or e.__class__.__name__,
                                                                      "transcription_failed", None)["error"]})
        finally:
            self.jobs.discard(job)
            async with self.room:
                if under_way:
                    self.in_flight -= 1
                else:
                    self.queued = deque(q for q in self.queued if q[0] != ticket)
                self.room.notify_all()

    def close(self) -> None:
        """The socket went away: its commits leave the pipeline."""
        for job in self.jobs:
            job.cancel()
        for task in self.tasks:
            task.cancel()


async def serve_socket(ws, api_key: str | None, make_session: Callable[[Callable], Session]) -> None:
    """A /v1/realtime connection (a Starlette WebSocket): the api_key checked at the handshake
    (Authorization: Bearer, or the openai-insecure-api-key.* subprotocol), then the client's
    events handed to its session (make_session(send)) until it goes; a bad event is an error event."""
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    if api_key and ws.headers.get("authorization") != f"Bearer {api_key}" \
            and f"openai-insecure-api-key.{api_key}" not in offered:
        await ws.close(code=1008)       # refused at the handshake (403)
        return
    await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
    lock, open_ = asyncio.Lock(), [True]

    async def send(message: dict) -> None:
        async with lock:
            if open_[0]:
                try:
                    await asyncio.wait_for(ws.send_text(json.dumps({"event_id": f"event_{uuid.uuid4().hex[:22]}",
                                                                    **message}, ensure_ascii=False)), SEND_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - gone, or reads nothing (timed out): its work ends
                    open_[0] = False
                    session.close()

    session = make_session(send)
    await send({"type": "transcription_session.created", "session": session.settings()})
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            try:
                if message.get("text") is None:
                    raise SessionError("events are JSON text frames", "invalid_event")
                await session.handle(message["text"])
            except SessionError as e:
                await send(error_event(str(e), e.code, e.param))
            except Exception as e:  # noqa: BLE001 - not the client's fault: said as a server error, logged
                log.exception("realtime event failed")
                await send(error_event(f"{type(e).__name__}: {e}", "internal_error", None, "server_error"))
            if not open_[0]:            # a send failed or timed out: the client is let go
                break
    finally:
        open_[0] = False
        session.close()


def ga_session(s: dict) -> dict:
    """A GA-shaped session (type "transcription", audio.input.{format, turn_detection,
    transcription}) as the beta shape's settings."""
    if s.get("type", "transcription") != "transcription":
        raise SessionError(f"this server transcribes: session.type must be 'transcription', got {s.get('type')!r}",
                           "unsupported", "session.type")
    audio = s.get("audio") or {}
    inp = audio.get("input") or {} if isinstance(audio, dict) else None
    if not isinstance(inp, dict):
        raise SessionError("audio.input must be an object", param="session.audio.input")
    flat = {}
    fmt = inp.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type", "audio/pcm") != "audio/pcm":
            raise SessionError("audio.input.format must be {\"type\": \"audio/pcm\", \"rate\": ...}", "unsupported",
                               "session.audio.input.format")
        if "rate" in fmt:
            flat["input_sample_rate"] = fmt["rate"]
    if "turn_detection" in inp:
        flat["turn_detection"] = inp["turn_detection"]
    if inp.get("transcription") is not None:
        flat["input_audio_transcription"] = inp["transcription"]
    return flat


def ms(sample: int) -> int:
    return int(sample * 1000 // SAMPLE_RATE)


def error_event(message: str, code: str, param: str | None, kind: str = "invalid_request_error") -> dict:
    return {"type": "error", "error": {"type": kind, "code": code, "message": message, "param": param}}
