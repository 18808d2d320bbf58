"""python -m glm_asr.live audio.wav [key=value ...]: live transcription from a glm_asr.serve

Streams a file, or raw audio on standard input ('-': mono 16-bit little-endian PCM at
input_sample_rate), to a server's /v1/realtime at real time (speed=2: twice as fast, 0: as fast as
the socket takes it) and prints each utterance's text as soon as it is transcribed, one line an
utterance; the server's VAD finds the utterances (server_vad).

    python -m glm_asr.live talk.flac url=ws://gpu-box:8000/v1/realtime
    ffmpeg -i rtsp://camera/stream -f s16le -ar 16000 -ac 1 - | python -m glm_asr.live -
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import sys
import threading
import time
from typing import AsyncIterator

import hydra
import numpy as np
from omegaconf import DictConfig

from tilekernels.runtime.cli import (Bool, Float, Int, OptInt, OptStr, Str, config_dir, exit_with_one_line_errors,
                                     options, run_hydra, split_args)

from .audio import SAMPLE_RATE, Audio, AudioError

_FILES: list[str] = []
LIVE_OPTIONS = {"url": Str, "api_key": OptStr, "speed": Float(min=0), "input_sample_rate": Int(min=1),
                "context": OptStr, "timestamps": Bool, "silence_duration_ms": OptInt(min=0),
                "audio_stream": OptInt(min=0)}
PIECE_S = 0.1               # audio an append event carries


def clock(seconds: float) -> str:
    m, s = divmod(max(seconds, 0.0), 60)
    return f"{int(m) // 60:02d}:{int(m) % 60:02d}:{s:06.3f}"


async def pieces(audio: Audio | None, rate: int) -> AsyncIterator[bytes]:
    """pcm16 bytes of PIECE_S each: an opened file's samples (read at 16 kHz; the caller closes
    it), or (None) standard input's."""
    if audio is None:
        size, odd = 2 * max(1, round(rate * PIECE_S)), b""
        while data := await stdin_read(size):
            data = odd + data
            cut = len(data) - len(data) % 2          # a sample split over two reads stays whole
            data, odd = data[:cut], data[cut:]
            if data:
                yield data
        return
    step = round(SAMPLE_RATE * PIECE_S)
    rest = np.zeros(0, np.float32)
    for block in audio:
        rest = np.concatenate([rest, block])
        while len(rest) >= step:
            yield pcm16(rest[:step])
            rest = rest[step:]
    if len(rest):
        yield pcm16(rest)


def stdin_read(size: int) -> asyncio.Future:
    """Up to `size` bytes of standard input (b"" at its end), read in a daemon thread from its
    file descriptor: a read that waits on a quiet pipe holds up neither the exit (asyncio.to_thread's
    would, on SIGTERM) nor, holding the buffered stream's lock, the interpreter's shutdown."""
    loop = asyncio.get_running_loop()
    got = loop.create_future()

    def read() -> None:
        try:
            if sys.stdin is None:
                raise OSError("standard input is closed")
            data = os.read(sys.stdin.fileno(), size)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            failed = e
            hand = lambda: got.done() or got.set_exception(failed)     # noqa: E731
        else:
            hand = lambda: got.done() or got.set_result(data)          # noqa: E731
        with contextlib.suppress(RuntimeError):     # the loop closed meanwhile (the client ended): no one waits
            loop.call_soon_threadsafe(hand)

    threading.Thread(target=read, daemon=True).start()
    return got


def pcm16(x: np.ndarray) -> bytes:
    return np.clip(np.round(x * 32768), -32768, 32767).astype("<i2").tobytes()


async def stream(o: dict, path: str, out=sys.stdout) -> int:
    """Send the audio, print the utterances; the exit status (1 if the server reported errors)."""
    from websockets.asyncio.client import connect

    rate = SAMPLE_RATE if path != "-" else o["input_sample_rate"]
    headers = {"Authorization": f"Bearer {o['api_key']}"} if o["api_key"] else {}
    turn = {"type": "server_vad"}
    if o["silence_duration_ms"] is not None:
        turn["silence_duration_ms"] = o["silence_duration_ms"]
    session = {"input_audio_format": "pcm16", "input_sample_rate": rate, "turn_detection": turn}
    if o["context"]:
        session["input_audio_transcription"] = {"prompt": o["context"]}
    from websockets.exceptions import ConnectionClosed

    audio = None if path == "-" else Audio(path, o["audio_stream"])     # a bad file fails here, before connecting
    with audio or contextlib.nullcontext():                            # closed however it ends
        try:
            ws = await connect(o["url"], additional_headers=headers, max_size=None, open_timeout=30)
        except Exception as e:  # noqa: BLE001 - refused, unreachable, not a WebSocket: one line
            raise OSError(f"cannot connect to {o['url']}: {e}") from None
        try:
            async with ws:
                return await session_run(ws, audio, rate, session, out, o)
        except ConnectionClosed as e:
            raise OSError(f"the server closed the connection ({e})") from None


async def session_run(ws, audio: Audio | None, rate: int, session: dict, out, o: dict) -> int:
    """Set the session up, send the audio at its pace while the printer shows what comes back
    (stopped, and waited for, if the sending fails: its error is the one said)."""
    await ws.recv()                                         # transcription_session.created
    await ws.send(json.dumps({"type": "transcription_session.update", "session": session}))
    reply = json.loads(await ws.recv())
    if reply["type"] == "error":
        raise ValueError(reply["error"]["message"])
    printer = asyncio.ensure_future(show(ws, o["timestamps"], out))
    try:
        start, sent = time.monotonic(), 0
        async for data in pieces(audio, rate):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()}))
            sent += len(data) // 2
            if o["speed"] > 0:
                await asyncio.sleep(max(0.0, start + sent / rate / o["speed"] - time.monotonic()))
        if not sent:
            raise ValueError("no audio to send: standard input was empty")
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))     # the end: the last speech is final
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))      # its reply follows every commit
    except BaseException:
        printer.cancel()
        await asyncio.gather(printer, return_exceptions=True)
        raise
    return await printer


async def show(ws, timestamps: bool, out) -> int:
    """Print the items' transcripts in the order they were committed (the stream's), each as soon
    as it and those before it are complete, until every item committed before the final
    `cleared` is; server errors go to stderr. Returns 1 if there were any."""
    order: list[str] = []
    done: dict[str, str | None] = {}
    ended, errors = False, 0
    while not ended or order:
        e = json.loads(await ws.recv())
        kind = e["type"]
        if kind == "input_audio_buffer.committed":
            order.append(e["item_id"])
        elif kind == "conversation.item.input_audio_transcription.completed":
            segments, text = e.get("segments") or [], e["transcript"].strip()
            when = f"[{clock(segments[0]['start'])} --> {clock(segments[-1]['end'])}] " if timestamps and segments \
                else ""
            done[e["item_id"]] = when + text if text else None
        elif kind == "input_audio_buffer.cleared":
            ended = True
        elif kind in ("error", "conversation.item.input_audio_transcription.failed"):
            errors += 1
            if e.get("item_id") is not None:
                done[e["item_id"]] = None
            print(f"error: {e['error']['message']}", file=sys.stderr, flush=True)
        while order and order[0] in done:
            line = done.pop(order.pop(0))
            if line is not None:
                print(line, file=out, flush=True)
    return 1 if errors else 0


def run(cfg: DictConfig, files: list[str]) -> int:
    o = options(cfg, LIVE_OPTIONS)
    if len(files) != 1:
        raise ValueError(f"give one audio file, or '-' for standard input (got {len(files)})")
    try:
        return asyncio.run(stream(o, files[0]))
    except AudioError as e:
        raise ValueError(str(e)) from None


@hydra.main(version_base=None, config_path=config_dir("glm_asr"), config_name="live")
def _hydra_main(cfg: DictConfig) -> None:
    exit_with_one_line_errors(lambda: run(cfg, _FILES))


def main() -> None:
    _FILES[:], rest = split_args(sys.argv[1:])
    sys.argv = [sys.argv[0]] + rest
    run_hydra(_hydra_main)


if __name__ == "__main__":
    main()
