"""Load test of the OpenAI-compatible servers: concurrent clients on loopback (GPU host).

    python tools/load_test.py [--out DIR] [--concurrency 1,8,32,64] [--kind gpt,asr,live,stream] [--device gpu]

Starts each server (python -m gpt.serve, python -m glm_asr.serve) as a subprocess on a free port
of 127.0.0.1 over a full-size checkpoint of seeded random weights written to a temporary folder
(gpt2 124M in the HF layout with a tokenizer trained here; GLM-ASR-Nano as bench_glm_asr writes
it), then for each concurrency C runs C clients (asyncio and aiohttp, in up to 8 processes so
that the clients' own Python is not what is measured), each sending requests back to back until
4 x C (at least 8) have been answered:
- gpt: POST /v1/completions, 128-token prompts (token ids), 128 new tokens (eos cannot end them:
  `stop` empty, temperature 0 on random weights), streamed; tokens/s aggregate, time to first
  token p50/p99;
- asr: POST /v1/audio/transcriptions, 30 s of speech-like audio (glm_asr.synthetic.speechlike)
  as FLAC, max_new_tokens 64 (the server's default, set at start); real-time factor aggregate
  (audio seconds / wall seconds), latency p50/p99;
- stream: one upload of --stream-minutes (10) of speech with pauses (as live's) as FLAC with
  `stream=true` (the server's default VAD) and temperature 1 (random weights decode greedily to
  no text: sampled, a segment decodes its whole max_new_tokens): seconds from the request's last
  byte to the first transcript.text.delta and to transcript.text.done (a warm run, the median of 3);
- live: C sessions of /v1/realtime (server_vad) at once, each streaming --live-seconds of speech
  with pauses (the tests' espeak fixtures, looped, from a random point of the loop: turns end at
  independent times) as pcm16 at 1x real time in 100 ms appends,
  then committing: for each utterance the time from its speech_stopped event (the VAD closing
  the turn) to its transcript's completed event, p50/p99, each utterance decoding
  --live-tokens (16) tokens: random weights never end a transcript, and the fixtures'
  sentences are at most 9 words (10 GPT-2 tokens) and the end token, and how late any append was sent
  (a session fallen behind real time shows there); holds_1x_p99_1s says whether that level held
  real time with p99 <= 1 s (what a GPU holds live: the largest such level). One warm
  round, then one measured a level.
Every round is run four times: the first compiles and captures what that concurrency needs
(prefill graphs of its batch sizes), as in a server that has been running; the median of the
other three is reported, with all three in the order run (`rounds`): the rounds of 64 gpt
clients differ by up to a third. A
time to first token is only measured from text: greedy tokens of random weights that decode to
no text (partial UTF-8) leave it null. Every server is stopped at the end, whatever happens.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchlib import gpu_name, served_checkpoint, versions, write_result
from glm_asr.synthetic import speechlike


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(module: str, args: list[str], env_dir: Path):
    """The server subprocess and its base URL, once /health answers (10 minutes at most: the first
    start compiles nothing, but loading a full-size checkpoint takes a while)."""
    port = free_port()
    with open(env_dir / f"{module}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, f"port={port}", *args], cwd=env_dir,
                                stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (env_dir / f"{module}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{module} exited with {proc.returncode}; the end of its log:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{module} did not start")


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


CLIENT_PROCESSES = 8      # the clients' processes at most: one Python process of 64 clients (threads) was
                          # itself the limit, its GIL delaying each wave of new requests by ~70 ms
BOUNDARY = "loadtestboundary"
ROUNDS = 3                # measured rounds a concurrency (after a warm one): the median is reported
FIGURE = {"gpt": "tokens_per_s", "asr": "realtime_factor"}
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "asr" / "fixtures"
PIECE = 1600              # samples (100 ms at 16 kHz) a live append carries
LATE_S = 0.25             # an append later than this past its real-time schedule: the session fell behind
ROUTES = {"gpt": ("/v1/completions", "application/json"),
          "asr": ("/v1/audio/transcriptions", f"multipart/form-data; boundary={BOUNDARY}")}


def gpt_body(prompt: list[int], new: int) -> bytes:
    return json.dumps({"model": "gpt2", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
                       "stop": [], "stream_options": {"include_usage": True}}).encode()


def asr_body(flac: bytes) -> bytes:
    parts = [f'--{BOUNDARY}\r\ncontent-disposition: form-data; name="model"\r\n\r\nglm-asr\r\n'.encode(),
             f'--{BOUNDARY}\r\ncontent-disposition: form-data; name="file"; filename="clip.flac"\r\n'
             f"content-type: audio/flac\r\n\r\n".encode() + flac + b"\r\n", f"--{BOUNDARY}--\r\n".encode()]
    return b"".join(parts)


async def request(http, kind: str, url: str, body: bytes) -> tuple[float | None, float, int]:
    """One request: (time to first text or None, latency, tokens). A gpt completion is streamed
    (server-sent events, its token count from the usage chunk); a transcription is one reply."""
    route, ctype = ROUTES[kind]
    t0, first, tokens = time.perf_counter(), None, 0
    async with http.post(url + route, data=body, headers={"content-type": ctype}) as r:
        if r.status != 200:
            raise RuntimeError(f"{kind}: HTTP {r.status}: {(await r.read())[:300]!r}")
        if kind == "asr":
            await r.read()
        else:
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, tokens


def clients(kind: str, url: str, body: bytes, c: int, left, start, results) -> None:
    """One process's c clients (asyncio, aiohttp), each sending requests back to back while the
    shared count `left` lasts, once every process is ready (start, a barrier); its (first,
    latency, tokens) and its (began, ended) (time.monotonic, the same clock in every process)
    go to results."""
    import asyncio

    import aiohttp

    def take() -> bool:
        with left.get_lock():
            if left.value <= 0:
                return False
            left.value -= 1
            return True

    async def run():
        out = []
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
            async def client():
                while take():
                    out.append(await request(http, kind, url, body))
            start.wait()
            began = time.monotonic()
            await asyncio.gather(*[client() for _ in range(c)])
        return out, (began, time.monotonic())

    try:
        results.put(asyncio.run(run()))
    except Exception as e:          # noqa: BLE001 - handed to the parent, which raises it
        start.abort()               # the others (and the parent) stop waiting to start
        results.put(e)


def in_processes(ctx, c: int, job, timeout: float) -> list:
    """c clients over up to CLIENT_PROCESSES processes, each started as job(its share, start,
    results) -> (target, args), waiting at the barrier `start` until all are ready; what each
    puts in `results`. A failed process's error is raised (the first cause, not the others'
    broken barrier)."""
    n_procs = min(c, CLIENT_PROCESSES)
    start, results = ctx.Barrier(n_procs + 1), ctx.Queue()
    procs = []
    for i in range(n_procs):
        target, args = job(c // n_procs + (i < c % n_procs), start, results)
        procs.append(ctx.Process(target=target, args=args))
    for p in procs:
        p.start()
    try:
        try:
            start.wait(timeout=120)
        except threading.BrokenBarrierError:
            pass                    # a client process failed: its error comes with the results
        got = [results.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    errors = [g for g in got if isinstance(g, Exception)]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return got


def round_(kind: str, url: str, c: int, payload, new: int = 128) -> dict:
    """c clients sending requests back to back until max(8, 4c) are answered, spread over up to
    CLIENT_PROCESSES processes started (and waiting at a barrier) before the clock starts."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    body = gpt_body(payload, new) if kind == "gpt" else asr_body(payload)
    left = ctx.Value("i", max(8, 4 * c))
    got = in_processes(ctx, c, lambda k, start, results: (clients, (kind, url, body, k, left, start, results)), 900)
    out = [o for g in got for o in g[0]]
    wall = max(g[1][1] for g in got) - min(g[1][0] for g in got)
    lat = [o[1] for o in out]
    row = {"kind": kind, "concurrency": c, "requests": len(out), "wall_s": round(wall, 3),
           "latency_p50_s": round(percentile(lat, 50), 4), "latency_p99_s": round(percentile(lat, 99), 4)}
    if kind == "gpt":
        ttft = [o[0] for o in out if o[0] is not None]
        row |= {"new_tokens": new, "tokens_per_s": round(sum(o[2] for o in out) / wall, 1),
                "ttft_p50_s": round(percentile(ttft, 50), 4) if ttft else None,
                "ttft_p99_s": round(percentile(ttft, 99), 4) if ttft else None}
    else:
        row["realtime_factor"] = round(30.0 * len(out) / wall, 1)
    return row


def speech_stream(seconds: float) -> bytes:
    """pcm16 at 16 kHz: the espeak fixtures with their pauses, 2.5 s of silence after each (a
    turn ends), looped to `seconds`."""
    import soundfile as sf

    clips = [sf.read(FIXTURES / f, dtype="int16")[0] for f in ("pause3s.flac", "one.flac", "pause05.flac")]
    parts, n = [], 0
    while n < seconds * 16000:
        for c in clips:
            parts += [c, np.zeros(40000, np.int16)]
            n += len(c) + 40000
    return np.concatenate(parts)[: int(seconds * 16000)].astype("<i2").tobytes()


async def live_session(http, url: str, pcm: bytes) -> tuple[list[float], float]:
    """One session: (each utterance's seconds from speech_stopped to completed, the latest an
    append went out past its real-time schedule). Each session starts at its own random point of
    the stream (rotated), so that turns end at independent times, as different speakers' do,
    rather than all in the same 100 ms."""
    import asyncio
    import base64
    import random

    cut = random.randrange(len(pcm) // (2 * PIECE)) * 2 * PIECE
    pcm = pcm[cut:] + pcm[:cut]

    ws = await http.ws_connect(url.replace("http", "ws") + "/v1/realtime", max_msg_size=0)
    await ws.receive_json()
    await ws.send_json({"type": "transcription_session.update", "session": {"input_sample_rate": 16000}})
    await ws.receive_json()
    stopped, waits, done = {}, [], asyncio.Event()

    async def listen():
        committed, finished, ended = set(), set(), False
        while not (ended and committed <= finished):
            e = await ws.receive_json()
            now = time.perf_counter()
            if e["type"] == "input_audio_buffer.speech_stopped":
                stopped[e["item_id"]] = now
            elif e["type"] == "input_audio_buffer.committed":
                committed.add(e["item_id"])
            elif e["type"] == "conversation.item.input_audio_transcription.completed":
                finished.add(e["item_id"])
                if e["item_id"] in stopped:     # not the last commit's, which may cut an utterance
                    waits.append(now - stopped[e["item_id"]])
            elif e["type"] == "input_audio_buffer.cleared":
                ended = True
            elif e["type"] in ("error", "conversation.item.input_audio_transcription.failed"):
                raise RuntimeError(f"live: {e['error']['message']}")
        done.set()

    listener = asyncio.ensure_future(listen())
    t0, lag = time.perf_counter(), 0.0
    for i in range(0, len(pcm), 2 * PIECE):
        due = t0 + i / 2 / 16000
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        lag = max(lag, time.perf_counter() - due)
        piece = base64.b64encode(pcm[i:i + 2 * PIECE]).decode()
        await ws.send_json({"type": "input_audio_buffer.append", "audio": piece})
    await ws.send_json({"type": "input_audio_buffer.commit"})
    await ws.send_json({"type": "input_audio_buffer.clear"})
    await listener
    await ws.close()
    return waits, lag


def live_clients(url: str, pcm: bytes, c: int, start, results) -> None:
    """One process's c live sessions, started together once every process is ready."""
    import asyncio

    import aiohttp

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
            start.wait()
            return await asyncio.gather(*[live_session(http, url, pcm) for _ in range(c)])

    try:
        results.put(asyncio.run(run()))
    except Exception as e:          # noqa: BLE001 - handed to the parent, which raises it
        start.abort()
        results.put(e)


def live_round(url: str, c: int, seconds: float, tokens: int) -> dict:
    """c live sessions at once, over up to CLIENT_PROCESSES processes (the server decoding `tokens`
    an utterance)."""
    import multiprocessing

    pcm = speech_stream(seconds)
    ctx = multiprocessing.get_context("spawn")
    got = in_processes(ctx, c, lambda k, start, results: (live_clients, (url, pcm, k, start, results)), 1800)
    sessions = [s for g in got for s in g]
    waits = [w for s in sessions for w in s[0]]
    p99, late = percentile(waits, 99), max(s[1] for s in sessions)
    return {"kind": "live", "concurrency": c, "audio_s_each": seconds, "tokens_each": tokens,
            "starts": "random points of the loop", "utterances": len(waits),
            "completed_after_turn_p50_s": round(percentile(waits, 50), 4),
            "completed_after_turn_p99_s": round(p99, 4), "append_late_max_s": round(late, 4),
            "holds_1x_p99_1s": bool(p99 <= 1.0 and late <= LATE_S)}


def stream_round(url: str, minutes: float, runs: int = 3) -> dict:
    """One upload of `minutes` of speech with pauses as FLAC, `stream=true`: the time from the
    request's last byte sent to the first transcript.text.delta event, and to the done event
    (a warm run first, then the median of `runs`); whether every run's deltas joined to its text."""
    import http.client
    import urllib.parse

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.frombuffer(speech_stream(60 * minutes), "<i2"), 16000, format="FLAC")
    body = asr_body(buf.getvalue()).replace(
        f"--{BOUNDARY}--".encode(),
        ("".join(f'--{BOUNDARY}\r\ncontent-disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
                 for k, v in (("stream", "true"), ("temperature", "1"))) + f"--{BOUNDARY}--").encode())
    where = urllib.parse.urlsplit(url)

    def once() -> tuple[float, float, bool]:
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
        conn.request("POST", "/v1/audio/transcriptions", body, {"content-type": ROUTES["asr"][1]})
        sent, first, deltas, text = time.perf_counter(), None, [], None     # request() returns once the body is written
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"stream: HTTP {r.status}: {r.read()[:300]!r}")
        for line in r:
            if b'"transcript.text.delta"' in line:
                first = time.perf_counter() - sent if first is None else first
                deltas.append(json.loads(line.removeprefix(b"data:"))["delta"])
            if b'"transcript.text.done"' in line:
                text = json.loads(line.removeprefix(b"data:"))["text"]
                break
        done = time.perf_counter() - sent
        conn.close()
        return first, done, "".join(deltas) == text

    once()
    got = [once() for _ in range(runs)]
    firsts = [g[0] for g in got if g[0] is not None]     # random weights may decode to no text at all
    return {"kind": "stream", "audio_s": 60 * minutes, "upload_bytes": len(body),
            "first_delta_after_upload_s": round(statistics.median(firsts), 4) if firsts else None,
            "done_after_upload_s": round(statistics.median(g[1] for g in got), 4),
            "deltas_join_to_text": all(g[2] for g in got),
            "runs": [[None if a is None else round(a, 4), round(b, 4)] for a, b, _ in got]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--kind", default="gpt,asr")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--small", action="store_true", help="tiny checkpoints (a smoke run on any host)")
    ap.add_argument("--live-seconds", type=float, default=60.0, help="audio each live session streams")
    ap.add_argument("--asr-model", help="a GLM-ASR checkpoint directory to serve (default: random weights)")
    ap.add_argument("--live-tokens", type=int, default=16, help="tokens a live utterance decodes (its text's)")
    ap.add_argument("--stream-minutes", type=float, default=10.0, help="the streamed upload's length")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    unknown = set(args.kind.split(",")) - {"gpt", "asr", "live", "stream"}
    if unknown:
        ap.error(f"--kind: unknown {', '.join(sorted(unknown))} (gpt, asr, live, stream)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for kind in args.kind.split(","):
            ckpt = tmp / kind
            if kind == "gpt":
                served_checkpoint("gpt", ckpt, args.small)
                module, extra = "gpt.serve", ["served_model_name=gpt2", f"max_batch={max(levels)}", "stop=[]"]
                rng = np.random.default_rng(0)
                payload = rng.integers(0, 300 if args.small else 50257, 32 if args.small else 128).tolist()
            elif args.asr_model:
                ckpt = Path(args.asr_model)
            else:
                served_checkpoint("asr", ckpt, args.small)
            if kind in ("live", "stream"):
                # each session's utterance in flight holds a request slot: room for every level's
                tokens = args.live_tokens if kind == "live" else 64
                module, extra = "glm_asr.serve", ["served_model_name=glm-asr", f"max_new_tokens={tokens}",
                                                  f"max_queue={max(64, max(levels))}"]
            elif kind == "asr":
                module, extra = "glm_asr.serve", ["served_model_name=glm-asr", "max_new_tokens=64", "vad=none"]
                import soundfile as sf

                buf = io.BytesIO()
                sf.write(buf, speechlike(30.0), 16000, format="FLAC")
                payload = buf.getvalue()
            proc, url = start(module, [f"model.path={ckpt}", f"device={args.device}", *extra], tmp)
            try:
                new = 16 if args.small else 128
                if kind == "stream":
                    rows.append(stream_round(url, args.stream_minutes))
                    print(rows[-1], flush=True)
                    if not args.small:
                        write_result("load-test", {"gpu": gpu_name(), "versions": versions(), "rows": rows}, args.out)
                    continue
                if kind == "live":
                    live_round(url, max(levels), 10.0, args.live_tokens)      # warm: the VAD's and decoder's shapes
                for c in levels:
                    if kind == "live":
                        rows.append(live_round(url, c, args.live_seconds, args.live_tokens))
                        print(rows[-1], flush=True)
                        if not args.small:
                            write_result("load-test", {"gpu": gpu_name(), "versions": versions(), "rows": rows},
                                         args.out)
                        continue
                    round_(kind, url, c, payload, new)      # warm: its prefill shapes captured, as a running server has
                    runs = [round_(kind, url, c, payload, new) for _ in range(ROUNDS)]
                    median = sorted(runs, key=lambda r: r[FIGURE[kind]])[len(runs) // 2]
                    rows.append(median | {"rounds": [r[FIGURE[kind]] for r in runs]})     # in the order run
                    print(rows[-1], flush=True)
                    if not args.small:      # after every round: a run cut short keeps what it measured
                        write_result("load-test", {"gpu": gpu_name(), "versions": versions(), "rows": rows}, args.out)
            finally:
                stop(proc)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
