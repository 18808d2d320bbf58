"""Load test of the OpenAI-compatible servers: concurrent clients on loopback (GPU host).

    python tools/load_test.py [--out DIR] [--concurrency 1,8,32,64] [--kind gpt,asr] [--device gpu]

Starts each server (python -m gpt.serve, python -m glm_asr.serve) as a subprocess on a free port
of 127.0.0.1 over a full-size checkpoint of seeded random weights written to a temporary folder
(gpt2 124M in the HF layout with a tokenizer trained here; GLM-ASR-Nano as bench_glm_asr writes
it), then for each concurrency C runs C clients (threads, the standard library's HTTP), each sending requests back to back until 4 x C
(at least 8) have been answered:
- gpt: POST /v1/completions, 128-token prompts (token ids), 128 new tokens (eos cannot end them:
  `stop` empty, temperature 0 on random weights), streamed; tokens/s aggregate, time to first
  token p50/p99;
- asr: POST /v1/audio/transcriptions, 30 s of speech-like audio (benchlib.synthetic_speechlike)
  as FLAC, max_new_tokens 64 (the server's default, set at start); real-time factor aggregate
  (audio seconds / wall seconds), latency p50/p99.
Every round is run twice and the second reported: the first compiles and captures what that
concurrency needs (prefill graphs of its batch sizes), as in a server that has been running. A
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
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchlib import gpu_name, served_checkpoint, synthetic_speechlike, versions, write_result


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


def gpt_request(url: str, prompt: list[int], new: int) -> tuple[float | None, float, int]:
    """One streamed completion: (time to first text, latency, tokens)."""
    body = json.dumps({"model": "gpt2", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
                       "stop": [], "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    t0, first, tokens = time.perf_counter(), None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, tokens


def asr_request(url: str, flac: bytes) -> tuple[None, float, int]:
    """One transcription of the clip (multipart): (None, latency, 0)."""
    boundary = "loadtestboundary"
    parts = [f'--{boundary}\r\ncontent-disposition: form-data; name="model"\r\n\r\nglm-asr\r\n'.encode(),
             f'--{boundary}\r\ncontent-disposition: form-data; name="file"; filename="clip.flac"\r\n'
             f"content-type: audio/flac\r\n\r\n".encode() + flac + b"\r\n", f"--{boundary}--\r\n".encode()]
    req = urllib.request.Request(url + "/v1/audio/transcriptions", b"".join(parts),
                                 {"content-type": f"multipart/form-data; boundary={boundary}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return None, time.perf_counter() - t0, 0


def round_(kind: str, url: str, c: int, payload, new: int = 128) -> dict:
    """c clients (threads) sending requests back to back until max(8, 4c) are answered."""
    left = list(range(max(8, 4 * c)))
    out: list = []

    def client():
        while True:
            try:
                left.pop()
            except IndexError:
                return
            out.append(gpt_request(url, payload, new) if kind == "gpt" else asr_request(url, payload))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        for f in [pool.submit(client) for _ in range(c)]:
            f.result()
    wall = time.perf_counter() - t0
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--kind", default="gpt,asr")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--small", action="store_true", help="tiny checkpoints (a smoke run on any host)")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
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
            else:
                served_checkpoint("asr", ckpt, args.small)
                module, extra = "glm_asr.serve", ["served_model_name=glm-asr", "max_new_tokens=64", "vad=none"]
                import soundfile as sf

                buf = io.BytesIO()
                sf.write(buf, synthetic_speechlike(30.0), 16000, format="FLAC")
                payload = buf.getvalue()
            proc, url = start(module, [f"model.path={ckpt}", f"device={args.device}", *extra], tmp)
            try:
                new = 16 if args.small else 128
                for c in levels:
                    round_(kind, url, c, payload, new)      # warm: its prefill shapes captured, as a running server has
                    rows.append(round_(kind, url, c, payload, new))
                    print(rows[-1], flush=True)
                    if not args.small:      # after every round: a run cut short keeps what it measured
                        write_result("load-test", {"gpu": gpu_name(), "versions": versions(), "rows": rows}, args.out)
            finally:
                stop(proc)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
