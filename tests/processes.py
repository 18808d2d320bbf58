"""Processes seen through /proc (Linux), for the tests: a process's descendants, whether they are
still alive (a pid taken again by another process is not), their memory and open files."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of a live process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """{pid: start time} of every process below pid (children, theirs, ...)."""
    procs = {p: s for p, s in ((int(d.name), stat(int(d.name))) for d in Path("/proc").iterdir() if d.name.isdigit())
             if s is not None}
    out, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for p, (ppid, _, start) in procs.items():
            if ppid == parent and p not in out:
                out[p] = start
                todo.append(p)
    return out


def alive(procs: dict[int, int]) -> dict[int, int]:
    """Those of procs (pid: start time) still running (a zombie has ended; a reused pid is another)."""
    return {p: start for p, start in procs.items() if (s := stat(p)) is not None and s[1] != "Z" and s[2] == start}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def gone_within(procs: dict[int, int], seconds: float) -> dict[int, int]:
    """procs still alive after waiting up to `seconds` for them to end."""
    deadline = time.monotonic() + seconds
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_all(procs: dict[int, int]) -> None:
    for p in alive(procs):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def open_files(pid: int) -> list[str]:
    """What pid's file descriptors point at (paths, 'socket:[...]', 'pipe:[...]', ...)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out
