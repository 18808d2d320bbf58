"""Speech segments of a live stream, each as soon as no later audio can change it: the segments a
file of the same samples gets (speech_probs in the same anchored blocks, computed frame by frame
as the samples arrive; segments_from_probs' rules), for server-side turn detection.

A group of speech regions (what pauses shorter than min_silence_duration_ms join) is final once
its last region is followed by max(min_silence_duration_ms, 2 * speech_pad_ms) without speech:
no later region can join it, and its right padding is settled. Its segments (at most
max_speech_duration_s each, cut as a file's) are then given out with their padded audio. A group
still going on gives out its chapters (segments.chapters) as each is final. Memory
is bounded by the audio since the last segment given out (and a VAD block), not by the stream.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from .model import CONTEXT, _gate_inputs, _one_blas_thread, block_frames, lstm_steps
from .segments import (FRAME, SAMPLE_RATE, Segment, VadOptions, chapters, mean_speech, segments_from_probs,
                       speech_groups, speech_regions)


SLACK = 1 << 18         # samples of room a LiveVad's store gets past what it holds (16 s)


@dataclass(frozen=True)
class Speech:
    """A final segment (samples in the stream's time), its padded audio (None where the LiveVad
    keeps none) and its speech's mean probability."""
    segment: Segment
    audio: np.ndarray
    speech: float | None


class LiveVad:
    """feed(16 kHz samples) -> what happened, in order: ("started", sample) where a group of speech
    begins, then, once the group is final, its Speech segments, or ("dropped", sample) where it
    ended if it was too short to keep (min_speech_duration_ms). finish() ends the stream (as a
    file ends: everything left is final). Samples count from the stream's start."""

    def __init__(self, options: VadOptions | None = None, keep_audio: bool = True):
        self.o, self.keep_audio = options or VadOptions(), keep_audio     # False: Speech.audio is None
        self.block, self.warm = block_frames()
        self._store, self._lo, self._hi = np.zeros(0, np.float32), 0, 0   # buf: _store[_lo:_hi]
        self.origin, self.n = 0, 0               # the stream sample buf starts at; samples fed
        self.probs, self.first = np.zeros(0, np.float32), 0            # probabilities from frame `first`
        self.row: tuple | None = None            # (block, next frame, h, c): the block being computed
        self.before: int | None = None           # stream sample where the last segment given out ended
        self.started = 0                         # frames before this one have had their "started"
        self.handled = 0                         # groups before this frame are final and handled
        self.continued = False                   # self.probs start inside a group (after a chapter)
        self.inside = False                      # ... and inside a region of it (a chapter cut in it)
        self.ended = False
        pad = self.o.speech_pad_ms * SAMPLE_RATE / 1000
        # frames without speech after a region that make it final (at least one: a region running to
        # the last frame known may go on)
        self.need = max(1, math.ceil(max(self.o.min_silence_duration_ms * SAMPLE_RATE / 1000, 2 * pad) / FRAME))

    @property
    def buf(self) -> np.ndarray:
        """The samples kept, from stream sample `origin`: a view of a store with room for as many
        again, at most SLACK more (a live stream's small appends copy only themselves until it
        fills)."""
        return self._store[self._lo:self._hi]

    def _keep(self, x: np.ndarray) -> None:
        n, m = self._hi - self._lo, len(x)
        if self._hi + m > len(self._store):
            store = np.empty(n + m + min(SLACK, max(m, n)), np.float32)     # small streams stay small
            store[:n] = self.buf
            self._store, self._lo, self._hi = store, 0, n
        self._store[self._hi:self._hi + m] = x
        self._hi += m

    @property
    def frames(self) -> int:
        """Frames whose probabilities are known."""
        return self.first + len(self.probs)

    def feed(self, samples: np.ndarray) -> list:
        return feed_all([(self, samples)])[0]

    def finish(self) -> list:
        """The stream's end: its last frame zero padded, every segment left final."""
        return feed_all([(self, None)])[0]

    def settle(self, samples: np.ndarray, probs: np.ndarray, last: bool = False) -> list:
        """feed() with the probabilities computed elsewhere (a file's, vad.chunk_probs on the
        GPU): samples and the probabilities of the frames they complete; last: the stream ends
        with them (probs then include its last, zero-padded frame). Without keep_audio only the
        probabilities of speech not yet final are held, however long it goes on."""
        frames = self._take(samples)
        if last:
            frames = self._take(None)
        if len(probs) != frames - self.frames:
            raise ValueError(f"{len(probs)} probabilities for {frames - self.frames} new frames")
        self.probs = np.concatenate([self.probs, np.asarray(probs, np.float32)])
        return self._events()

    # ------------------------------------------------------------------ probabilities
    def _take(self, samples: np.ndarray | None) -> int:
        """Keep the samples (None: the stream ends); the frames whose probabilities it can have."""
        if self.ended:
            if samples is None:
                return self.frames
            raise ValueError("the stream has ended")
        if samples is None:
            self.ended = True
            return -(-self.n // FRAME)
        x = np.asarray(samples, np.float32).reshape(-1)
        if self.keep_audio:
            self._keep(x)
        self.n += len(x)
        return self.n // FRAME

    def _pieces(self, frames: int) -> list[tuple[int, int, int]]:
        """(block, first frame, end) of each run of one block's row up to `frames`: a block's row
        starts from its warm-up before it, with a fresh state (speech_probs' blocks)."""
        out, f, row = [], self.frames, self.row
        while f < frames:
            k = f // self.block if self.block else 0
            nxt = row[1] if row is not None and row[0] == k else max(0, k * self.block - self.warm)
            end = min(frames, (k + 1) * self.block) if self.block else frames
            out.append((k, nxt, end))
            row, f = (k, end), end
        return out

    def _step(self, piece: tuple[int, int, int], gates: np.ndarray) -> None:
        """The LSTM and head over one piece's gate inputs, its new probabilities appended."""
        k, nxt, end = piece
        h, c = self.row[2:] if self.row is not None and self.row[0] == k else (None, None)
        p, h, c = lstm_steps(gates[:, None], h, c)
        self.row = (k, end, h, c)
        self.probs = np.concatenate([self.probs, p[self.frames - nxt:, 0]])

    def _frames(self, g0: int, g1: int) -> np.ndarray:
        """Frames g0 .. g1 - 1 with their context, (g1 - g0, CONTEXT + FRAME): zeros before the
        stream and past its end."""
        lo, hi = g0 * FRAME - CONTEXT, g1 * FRAME
        x = np.zeros(hi - lo, np.float32)
        a, b = max(lo, self.origin), min(hi, self.origin + len(self.buf))
        if b > a:
            x[a - lo:b - lo] = self.buf[a - self.origin:b - self.origin]
        return np.lib.stride_tricks.as_strided(x, (g1 - g0, CONTEXT + FRAME), (FRAME * 4, 4)).copy()

    # ------------------------------------------------------------------ segments
    def _events(self) -> list:
        """For each group of speech in turn: ("started", sample) once the groups before it are final,
        and once it is final its Speech segments, or ("dropped", sample) if too short to keep. A
        group still going on is final a chapter at a time (segments.chapters): each chapter
        but its last is given out as a group of its own."""
        events, regions = [], speech_regions(self.probs, self.o, self.inside)
        groups = speech_groups(regions, self.o)
        cut, continued, inside = self._cut(regions), False, False
        at = next((i for i, g in enumerate(groups) if cut is None or g[-1][1] > cut), None)
        if at is not None:                           # the first group not final: its chapters but the last are
            parts = chapters(groups[at], self.probs, int(self.o.max_speech_duration_s * SAMPLE_RATE) // FRAME)
            if len(parts) > 1:
                groups[at:at + 1] = parts
                cut, continued = parts[-2][-1][1], True
                inside = parts[-1][0][0] == cut       # cut in a region: what follows starts in speech
        base = self.first * FRAME
        segments = []
        if cut is not None:
            n = (self.n if self.ended else self.frames * FRAME) - base
            segments = segments_from_probs(self.probs, n, self.o, continued=self.continued, inside=self.inside,
                                           before=None if self.before is None else self.before - base)
        for g in groups:
            a, e = g[0][0], g[-1][1]
            if self.first + a < self.handled:          # given out (or dropped) already
                continue
            if self.first + a >= self.started:
                events.append(("started", base + a * FRAME))
                self.started = self.first + a + 1
            if cut is None or e > cut:      # not final, nor any after it: announced once this one is
                break
            mine = [s for s in segments if a * FRAME <= s.start < e * FRAME]
            for s in mine:
                seg = Segment(s.start + base, s.end + base, s.audio_start + base, s.audio_end + base)
                audio = (self.buf[seg.audio_start - self.origin: seg.audio_end - self.origin].copy()
                         if self.keep_audio else None)
                events.append(Speech(seg, audio, mean_speech(self.probs, s)))
                self.before = seg.end
            if not mine:
                events.append(("dropped", base + min(e * FRAME, self.n - base)))
        if cut is not None:
            self.handled, self.continued, self.inside = self.first + cut, continued, inside
        pending = next((g[0][0] for g in groups if cut is None or g[-1][1] > cut), None)
        self._forget(cut, pending)
        return events

    def _cut(self, regions: list) -> int | None:
        """The frame (in self.probs) up to which every group is final: the end of the last region
        followed by `need` frames without speech (all of them once the stream has ended)."""
        if self.ended:
            return len(self.probs)
        cut = None
        for i, (_, end) in enumerate(regions):
            following = regions[i + 1][0] if i + 1 < len(regions) else len(self.probs)
            if following - end >= self.need:
                cut = end
        return cut

    def _forget(self, cut: int | None, pending: int | None) -> None:
        """Drop what no later segment or VAD block needs. Probabilities: those before the cut, or
        with no speech pending (`pending`: the first frame of a group not final, in self.probs)
        all but the last padding's worth, so a long silence costs nothing. Later speech starts at
        least 2 * speech_pad_ms past either, so its padding and the hysteresis (off there) come
        out as the whole stream's. Samples: those before the padded start of speech still pending
        (or that can come) and before the next block's warm-up."""
        pad = int(self.o.speech_pad_ms * SAMPLE_RATE / 1000)
        speech = self.frames * FRAME if pending is None else (self.first + pending) * FRAME
        if not self.ended:
            start = self.frames - math.ceil(pad / FRAME) - 1 if pending is None else self.first + (cut or 0)
            if start > self.first:
                self.probs, self.first = self.probs[start - self.first:], start
        keep = min(speech - pad, (self.frames - self.warm) * FRAME - CONTEXT)
        keep = max(keep, self.origin)
        self._lo, self.origin = self._lo + keep - self.origin, keep


def feed_all(streams: list[tuple[LiveVad, np.ndarray | None]]) -> list[list]:
    """LiveVad.feed (samples) or finish (None) for many streams at once, each stream's events:
    the encoder of every stream's new frames in one chain of products (nearly all of the work),
    then each stream's LSTM steps."""
    if not all(v.keep_audio for v, _ in streams):     # its probabilities would come from zeros
        raise ValueError("a LiveVad that keeps no audio takes probabilities (settle), not samples to feed")
    plans = [(v, v._pieces(v._take(x))) for v, x in streams]
    chunks = [v._frames(nxt, end) for v, pieces in plans for _, nxt, end in pieces]
    if chunks:
        with _one_blas_thread():        # OpenBLAS's threads on these small products cost far more than they give
            gates, at = _gate_inputs(np.concatenate(chunks)), 0
            for v, pieces in plans:
                for piece in pieces:
                    m = piece[2] - piece[1]
                    v._step(piece, gates[at:at + m])
                    at += m
    return [v._events() for v, _ in streams]


class Feeder:
    """A thread feeding the LiveVads of many streams together (feed_all): what is submitted while
    it works goes into its next batch, so N sessions cost one encoder chain a round, not N. It
    exits after IDLE_S without work and starts again on the next submit."""
    IDLE_S = 5.0

    def __init__(self):
        self._wake = threading.Condition()
        self._pending: list[tuple[LiveVad, np.ndarray | None, Future]] = []
        self._thread: threading.Thread | None = None

    def submit(self, vad: LiveVad, samples: np.ndarray | None) -> Future:
        """feed(samples) (None: finish()) in the next batch; a Future of its events. One stream's
        submits must each be awaited before the next (a session's appends are)."""
        future: Future = Future()
        with self._wake:
            self._pending.append((vad, samples, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="glm_asr-live-vad", daemon=True)
                self._thread.start()
            self._wake.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._pending:
                    self._wake.wait(self.IDLE_S)
                if not self._pending:
                    self._thread = None
                    return
                batch, self._pending = self._pending, []
            ready = []
            for vad, x, future in batch:
                if vad.ended and x is not None:
                    future.set_exception(ValueError("the stream has ended"))
                else:
                    ready.append((vad, x, future))
            try:
                results = feed_all([(vad, x) for vad, x, _ in ready])
            except Exception as e:  # noqa: BLE001 - handed to every submitter of the batch
                for _, _, future in ready:
                    future.set_exception(e)
                continue
            for (_, _, future), events in zip(ready, results):
                future.set_result(events)
