"""Servers as subprocesses on 127.0.0.1 for the tests: start one, talk to it, always stop it."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, module: str, args: list[str], tmp: Path):
        self.port = free_port()
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TMPDIR": str(tmp)}
        self.log = open(tmp.parent / f"{tmp.name}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args, "device=cpu", f"port={self.port}",
                                      "log_level=warning"], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{module} exited: {Path(self.log.name).read_text()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{module} did not come up: {Path(self.log.name).read_text()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def client(self, key: str = "x"):
        return openai.OpenAI(base_url=self.url("/v1"), api_key=key, max_retries=0, timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def start(request, module, args, tmp) -> Server:
    s = Server(module, args, tmp)
    request.addfinalizer(s.stop)
    return s


def post(url: str, body: bytes, headers: dict) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def error_of(e) -> dict:
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("error", body)


def concurrently(fn, n: int) -> None:
    """fn(0) ... fn(n - 1) at once, each in its own thread (bounded: 120 s each)."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

