"""The client side's bookkeeping: the files (Item), the tally and its summary, and the progress
line or bar."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

ERRORS = "errors.jsonl"


@dataclass(frozen=True)
class Item:
    source: str         # the path as given (the transcript's "file")
    path: str           # absolute, for the workers
    name: str           # output file name
    duration: float = 0.0


def _fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


@dataclass
class Tally:
    start: float
    files: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    seconds: float = 0.0
    ready: float | None = None          # when the workers were up and the model loaded

    def summary(self, out_dir: Path, interrupted: bool = False) -> str:
        wall = time.perf_counter() - self.start
        left = self.files - self.skipped - self.done - self.failed
        parts = [f"{self.done} transcribed", f"{self.skipped} skipped (output exists)",
                 f"{self.failed} failed" + (f" (see {out_dir / ERRORS})" if self.failed else "")]
        if left:
            parts.append(f"{left} not done")
        speed = ""
        if self.seconds > 0:
            speed = f": {self.seconds / wall:.1f}x real time (real-time factor {wall / self.seconds:.4f})"
            if self.ready is not None:
                speed += f", {self.seconds / (time.perf_counter() - self.ready):.1f}x after it"
        setup = f", {self.ready - self.start:.1f} s of it reading headers, starting workers and loading the model" \
            if self.ready is not None else ""
        head = "stopped" if interrupted else "done"
        return (f"{head}: {', '.join(parts)}; {self.seconds / 3600:.3f} h of audio in {wall:.1f} s wall"
                f"{setup}{speed}")


class Progress:
    """Audio seconds done: a tqdm bar on a terminal, else a line every `every` seconds (logs)."""

    def __init__(self, total_s: float, files: int, every: float = 60.0):
        from tqdm import tqdm

        self.tty = sys.stderr.isatty()
        self.total, self.files, self.every = total_s, files, every
        self.n, self.nfiles, self.t0, self.last = 0.0, 0, time.perf_counter(), time.perf_counter()
        self.bar = tqdm(total=round(total_s, 1), unit="s", desc="audio", file=sys.stderr,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}, "
                                   "{rate_fmt}]") if self.tty else None

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def update(self, seconds: float, files: int) -> None:
        self.n += seconds
        self.nfiles += files
        if self.n > self.total:             # files of unknown length add to the total as they finish
            self.total = self.n
            if self.bar is not None:
                self.bar.total = round(self.total, 1)
        if self.bar is not None:
            self.bar.update(seconds)
            return
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            rate = self.n / (now - self.t0)
            eta = f", about {_fmt_seconds((self.total - self.n) / rate)} left" if rate > 0 else ""
            pct = 100 * self.n / self.total if self.total else 100.0
            print(f"progress: {self.nfiles}/{self.files} files, {_fmt_seconds(self.n)} of {_fmt_seconds(self.total)} "
                  f"audio ({pct:.0f}%), {rate:.1f}x real time{eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
