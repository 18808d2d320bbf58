"""The pipeline's first stages, on the CPU: files read, decoded, resampled and (with VAD) cut into
speech segments, then into windows, by reader threads a block at a time, into one bounded queue
toward the pipeline's loop (memory is bounded by the queue, not by file length or count), which
hands out the files' items in turn (FairQueue): one long file does not hold back a short one.

What a reader puts is (file index, window number, item): a Window; the file's end (item: its
duration, number: its window count); an exception (the file failed); or, index -1, a VadJob whose
speech probabilities the loop computes on the GPU with the other readers' (on the CPU the VAD runs
in worker processes, vad.PendingProbs).
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .audio import SAMPLE_RATE, Audio
from .features import Window, audio_tokens, log_mel, stream_windows, valid_frames
from .vad import LiveVad, PendingProbs, Speech, VadOptions, chunk_probs

READERS = 8                # files read at once (CPU threads): as many as the VAD's worker processes on a
                           # 16-core host (vad.PendingProbs, the CPU's VAD); 4 left half of them idle


@dataclass(frozen=True)
class Cut:
    """Speech another VAD has cut (a live stream's, vad.live): its padded audio and its speech's
    times, decoded as one window, as a file's segment is."""
    samples: np.ndarray
    start_s: float
    end_s: float
    speech: float | None = None

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


@dataclass
class VadJob:
    """A reader's samples whose speech probabilities the pipeline's loop computes on the GPU
    (future); result() waits for them, giving up once `stop` is set (the loop has ended)."""
    samples: np.ndarray
    future: Future = field(default_factory=Future)
    stop: threading.Event | None = None

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> np.ndarray:
        while True:
            try:
                return self.future.result(timeout=0.1)
            except FutureTimeout:
                if self.stop is not None and self.stop.is_set():
                    raise RuntimeError("stopped") from None


class FairQueue:
    """Items of many files (keyed by file index), taken a file at a time in turn, each file's in
    order, VAD jobs (key -1: a reader waits on each) first and never held back: one file's many
    windows do not hold back another's. put waits while `size` items are held, unless its file
    holds none (each file may always queue one, so memory stays bounded by size plus the readers)."""

    def __init__(self, size: int):
        self.size, self.count = size, 0
        self.files: dict[int, deque] = {}       # non-empty only; insertion order is the turn
        self.changed = threading.Condition()

    def put(self, key: int, item, timeout: float) -> bool:
        """Queue item, waiting up to timeout seconds for room; whether it was queued."""
        with self.changed:
            if not self.changed.wait_for(lambda: key == -1 or self.count < self.size or key not in self.files,
                                         timeout):
                return False
            self.files.setdefault(key, deque()).append(item)
            self.count += 1
            self.changed.notify_all()
            return True

    def get(self, timeout: float):
        """The next item (waiting up to timeout seconds; 0: not at all), or None."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.count > 0, timeout):
                return None
            key = -1 if -1 in self.files else next(iter(self.files))
            items = self.files.pop(key)
            item = items.popleft()
            if items:
                self.files[key] = items             # back in line, after the other files
            self.count -= 1
            self.changed.notify_all()
            return item

    def empty(self) -> bool:
        with self.changed:
            return self.count == 0


class Readers:
    """READERS threads, each reading one file at a time into the queue. wanted(index): whether
    the loop still takes what a file's reader puts (not dropped, not failed); once closed, every
    reader gives up within 0.1 s."""

    def __init__(self, vad: VadOptions | None, gpu_vad: bool, n_mels: int, size: int,
                 wanted: Callable[[int], bool]):
        self.vad, self.gpu_vad, self.n_mels, self._wanted = vad, gpu_vad, n_mels, wanted
        self.queue = FairQueue(size)
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(READERS, thread_name_prefix="glm_asr-read")

    def submit(self, index: int, opener: Callable) -> None:
        self.pool.submit(self.read, index, opener)

    def get(self, wait: float) -> tuple | None:
        """The next item, waiting up to `wait` seconds for one (0: not at all); None if none."""
        return self.queue.get(wait)

    def empty(self) -> bool:
        return self.queue.empty()

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=True, cancel_futures=True)

    def wanted(self, index: int) -> bool:
        return not self.stop.is_set() and (index < 0 or self._wanted(index))

    def put(self, item: tuple) -> bool:
        while self.wanted(item[0]):
            if self.queue.put(item[0], item, 0.1):
                return True
        return False

    def gpu_probs(self, samples: np.ndarray) -> VadJob:
        """A reader's VAD, handed to the loop (run on the GPU, with other files' VAD): its pending
        result."""
        job = VadJob(samples, stop=self.stop)
        if not self.put((-1, -1, job)):
            raise RuntimeError("stopped")
        return job

    def read(self, index: int, opener: Callable) -> None:
        audio = None
        try:
            audio = opener()
            if isinstance(audio, Cut):
                wins = [w for w in [speech_window(audio.samples, audio.start_s, audio.end_s, audio.speech)] if w]
            elif self.vad is not None:
                wins = speech_windows(audio, self.vad, self.n_mels, None,
                                      self.gpu_probs if self.gpu_vad else PendingProbs)
            else:
                blocks, offset = ([audio], 0.0) if isinstance(audio, np.ndarray) else (audio, audio.offset_s)
                wins = stream_windows(blocks, self.n_mels, None, offset)
            n, end = 0, 0.0
            for w in wins:
                if not self.put((index, n, w)):
                    return
                n, end = n + 1, w.end_s
            seconds = len(audio) / SAMPLE_RATE if isinstance(audio, np.ndarray) else audio.seconds
            self.put((index, n, seconds or end))
        except Exception as e:      # noqa: BLE001 - handed to the caller as this file's result
            self.put((index, -1, e))
        finally:
            if isinstance(audio, Audio):
                audio.close()       # now, not at the next garbage collection (a server's upload)


def speech_windows(audio: Audio | np.ndarray, options: VadOptions, n_mels: int = 128, xp=np,
                   probs: Callable = PendingProbs) -> Iterator[Window]:
    """A window for each segment of speech Silero VAD finds: its padded audio as the features
    (computed with xp; None leaves the samples), its unpadded speech bounds as the times (in the
    file's time). The probabilities come a chunk at a time (vad.chunk_probs; probs(samples)
    computes a chunk's or starts to, the next chunks read meanwhile), and a segment goes out as
    soon as no later audio can change it (vad.LiveVad, whose segments are the whole file's): a
    long file's first windows reach the encoder while its VAD goes on. A file is read once: memory
    holds a few chunks (vad.AHEAD) and the samples and probabilities of speech not yet final (at
    most a chapter of it, vad.segments.chapters).
    Each window carries its speech's mean probability (a segment's no_speech_prob is 1 minus
    it)."""
    whole = isinstance(audio, np.ndarray)
    blocks, offset = ([audio], 0.0) if whole else (audio, audio.offset_s)
    vad = LiveVad(options, keep_audio=not whole)
    for chunk, p, last in chunk_probs(blocks, probs):
        for e in vad.settle(chunk, p, last):
            if isinstance(e, Speech):
                s = e.segment
                x = audio[s.audio_start:s.audio_end].copy() if whole else e.audio
                w = speech_window(x, offset + s.start_s, offset + s.end_s, e.speech, n_mels, xp)
                if w is not None:
                    yield w


def speech_window(x: np.ndarray, start_s: float, end_s: float, speech: float | None, n_mels: int = 128,
                  xp=None) -> Window | None:
    """The window of a segment's padded audio x and its speech's times (features computed with
    xp; None leaves the samples), or None if it is too short to give the encoder a token."""
    tokens = audio_tokens(valid_frames(len(x)))
    if tokens < 1:
        return None
    return Window(start_s, end_s, x if xp is None else log_mel(x, n_mels, xp), tokens, speech)
