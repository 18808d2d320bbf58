"""Speech segments from Silero's frame probabilities: the options (as faster-whisper's), the
regions (threshold hysteresis), and their merging and cutting into segments of at most one encoder
window (the package's docstring says how)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000
FRAME = 512                 # samples per probability (32 ms)
MAX_WINDOW_S = 30.0         # the encoder's window
CHAPTER_S = 120.0           # speech going on longer is closed at a pause near this length (chapters)
CHAPTER_FRAMES = int(CHAPTER_S * SAMPLE_RATE) // FRAME


MAX_MS = {"min_speech_duration_ms": 86_400_000, "min_silence_duration_ms": 600_000,    # a day; ten minutes
          "speech_pad_ms": 60_000}            # a minute (a pad is cut to the 30 s window anyway)


@dataclass
class VadOptions:
    """Named and defaulted as faster-whisper's VadOptions, except max_speech_duration_s: the 30 s
    encoder window (faster-whisper: inf), which is also its upper bound here.

    threshold: a frame whose speech probability is >= threshold starts speech.
    neg_threshold: speech ends at a frame below it (None: max(threshold - 0.15, 0.01)).
    min_speech_duration_ms: segments whose speech lasts no longer are dropped.
    max_speech_duration_s: the longest segment (speech bounds and padded audio alike).
    min_silence_duration_ms: a pause at least this long ends a segment; shorter ones are kept
        inside it.
    speech_pad_ms: audio given to the model before and after the speech (not in the times).
    """

    threshold: float = 0.5
    neg_threshold: float | None = None
    min_speech_duration_ms: int = 0
    max_speech_duration_s: float = MAX_WINDOW_S
    min_silence_duration_ms: int = 2000
    speech_pad_ms: int = 400

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"vad_options.{name} must be {want}, got {getattr(self, name)!r}")

        def number(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "a number")
            return v

        if not 0 < number("threshold") < 1:
            bad("threshold", "between 0 and 1")
        if self.neg_threshold is not None and not 0 < number("neg_threshold") <= self.threshold:
            bad("neg_threshold", f"in (0, threshold={self.threshold}]")
        for name, top in MAX_MS.items():
            if not 0 <= number(name) <= top:
                bad(name, f"from 0 to {top}")
        if not 1 <= number("max_speech_duration_s") <= MAX_WINDOW_S:
            bad("max_speech_duration_s", f"between 1 and {MAX_WINDOW_S:g} (the encoder's window)")

    @property
    def low(self) -> float:
        """The threshold below which speech ends."""
        return max(self.threshold - 0.15, 0.01) if self.neg_threshold is None else self.neg_threshold


@dataclass(frozen=True)
class Segment:
    """Samples in the file's time at 16 kHz: [start, end) holds the speech (the times written),
    [audio_start, audio_end) the audio given to the model (start/end padded)."""

    start: int
    end: int
    audio_start: int
    audio_end: int

    @property
    def start_s(self) -> float:
        return self.start / SAMPLE_RATE

    @property
    def end_s(self) -> float:
        return self.end / SAMPLE_RATE

    @property
    def audio_start_s(self) -> float:
        return self.audio_start / SAMPLE_RATE

    @property
    def audio_end_s(self) -> float:
        return self.audio_end / SAMPLE_RATE


def speech_regions(probs: np.ndarray, options: VadOptions | None = None,
                   inside: bool = False) -> list[tuple[int, int]]:
    """[start, end) frame ranges of speech: it starts at a frame >= threshold and ends at the
    next frame below neg_threshold (frames between the two keep the state they follow; inside:
    the probabilities start in speech, the rest of a region cut by chapters)."""
    o = options or VadOptions()
    p = np.asarray(probs, np.float32)
    if len(p) == 0:
        return []
    on, off = p >= o.threshold, p < o.low
    idx = np.arange(len(p))
    last = np.maximum.accumulate(np.where(on | off, idx, -1))          # the latest decisive frame
    speech = np.where(last >= 0, on[np.maximum(last, 0)], inside)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], speech.view(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def speech_groups(regions: list[tuple[int, int]], options: VadOptions) -> list[list[tuple[int, int]]]:
    """The regions in groups: a pause shorter than min_silence_duration_ms joins two regions."""
    min_silence = options.min_silence_duration_ms * SAMPLE_RATE / 1000
    groups: list[list[tuple[int, int]]] = []
    for r in regions:
        if groups and (r[0] - groups[-1][-1][1]) * FRAME < min_silence:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _hard_cuts(start: int, end: int, probs: np.ndarray, max_frames: int) -> list[tuple[int, int]]:
    """A region without a pause cut into parts of at most max_frames at its least speech-like
    frames (where both sides fit if they can, else after at least half a part)."""
    out = []
    while end - start > max_frames:
        if end - start <= 2 * max_frames:
            lo, hi = end - max_frames, start + max_frames            # both sides fit
        else:
            lo, hi = start + max_frames // 2, start + max_frames
        cut = lo + int(np.argmin(probs[lo:hi + 1]))
        out.append((start, cut))
        start = cut
    return out + [(start, end)]


def _split(regions: list[tuple[int, int]], probs: np.ndarray, max_frames: int) -> list[tuple[int, int]]:
    """Speech spans of at most max_frames covering a group of regions, cut in pauses between
    regions: the shortest pause cut in is as long as it can be, then the parts are as few as they
    can be, then the pauses cut in as long (then as little speech-like) as they can be. A region
    longer than max_frames is first cut at its least speech-like frames (pauses of length 0)."""
    regions = [r for a, b in regions for r in _hard_cuts(a, b, probs, max_frames)]
    starts = np.array([a for a, _ in regions])
    ends = np.array([b for _, b in regions])
    if ends[-1] - starts[0] <= max_frames:
        return [(int(starts[0]), int(ends[-1]))]
    n = len(regions)
    gap = starts[1:] - ends[:-1]                                     # the pause after region k
    cum = np.concatenate([[0.0], np.cumsum(probs, dtype=np.float64)])
    mean = (cum[starts[1:]] - cum[ends[:-1]]) / np.maximum(gap, 1)
    first = np.searchsorted(starts, ends - max_frames, side="left")   # a part ending at j starts >= first[j]

    def feasible(tau):                 # parts <= max_frames cut only in pauses >= tau (greedy)
        i = 0
        while ends[-1] - starts[i] > max_frames:
            j = int(np.searchsorted(ends, starts[i] + max_frames, side="right")) - 1   # last region that fits
            while j >= i and gap[j] < tau:
                j -= 1
            if j < i:
                return False
            i = j + 1
        return True

    taus = np.unique(gap)
    lo, hi = 0, len(taus) - 1                                        # taus[0] (the shortest) always works
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if feasible(taus[mid]) else (lo, mid - 1)
    tau = taus[lo]
    # the cost of a part ending with region j: one part, less its pause's length, plus its pause's
    # mean probability, weighted so that each criterion outranks the next (for pauses adding up
    # to less than 1e7 frames, 89 hours)
    cost = np.concatenate([1e10 - gap * 1e3 + mean, [1e10]])
    cost[:-1][gap < tau] = math.inf                                  # no cut in a shorter pause
    best = np.full(n, math.inf)                                      # covering regions 0..j, cut after j
    prev = np.full(n, math.inf)                                      # prev[i]: best[i - 1] (0 for i = 0)
    prev[0] = 0.0
    came = np.zeros(n, np.int64)
    for j in range(n):
        if cost[j] < math.inf:
            k = int(first[j]) + int(np.argmin(prev[first[j]: j + 1]))
            best[j], came[j] = prev[k] + cost[j], k
            if j + 1 < n:
                prev[j + 1] = best[j]
    out, j = [], n - 1
    while j >= 0:
        i = int(came[j])
        out.append((int(starts[i]), int(ends[j])))
        j = i - 1
    return out[::-1]


def chapters(regions: list[tuple[int, int]], probs: np.ndarray, max_frames: int) -> list[list[tuple[int, int]]]:
    """A group's regions in chapters, each cut into segments alone, so that speech with no long
    pause is final a chapter at a time, not at its end (a long file's first windows reach the
    encoder while its VAD goes on; a live monologue is transcribed as it goes). A chapter that
    would run past CHAPTER_S (its `limit`) ends at the longest pause (the latest of equals) after
    a region ending in its last max_frames before the limit; if none ends there, at the pause the
    limit falls in, or inside the region it falls in, at its least speech-like frame of those
    last max_frames (a region of speech with no pause at all, music scored as speech, is cut
    too: what is pending stays bounded). The two halves of a region cut so touch (no pause).
    Decided by the regions and probabilities up to the limit, or the start of the first region
    after it: on a prefix of the probabilities every chapter but the last is the whole
    stream's (vad.live)."""
    out, regions = [], list(regions)
    while regions[-1][1] > regions[0][0] + CHAPTER_FRAMES:
        limit = regions[0][0] + CHAPTER_FRAMES
        inside = [k for k in range(len(regions) - 1) if limit - max_frames <= regions[k][1] <= limit]
        if inside:
            k = max(inside, key=lambda k: (regions[k + 1][0] - regions[k][1], k))
            out.append(regions[:k + 1])
            regions = regions[k + 1:]
            continue
        k = next(k for k, r in enumerate(regions) if r[1] > limit)      # the region the limit falls in or before
        a, b = regions[k]
        if a >= limit:                                                  # in the pause before it
            out.append(regions[:k])
            regions = regions[k:]
            continue
        lo = max(a + 1, limit - max_frames)
        cut = lo + int(np.argmin(probs[lo:limit + 1]))
        out.append(regions[:k] + [(a, cut)])
        regions = [(cut, b)] + regions[k + 1:]
    return out + [regions]


def segments_from_probs(probs: np.ndarray, n_samples: int, options: VadOptions | None = None, *,
                        before: int | None = None, continued: bool = False, inside: bool = False) -> list[Segment]:
    """The segments of a file of n_samples whose frame probabilities are probs (see module doc).
    before: where the segment before these probabilities ended, in their time (<= 0), for the
    rest of a stream whose earlier segments were given out (vad.live); None: they start the file.
    continued: the probabilities start inside a group whose earlier chapters were given out;
    inside: inside a region, too (a chapter cut in it)."""
    o = options or VadOptions()
    probs = np.asarray(probs, np.float32)
    if probs.shape != (-(-n_samples // FRAME),):
        raise ValueError(f"{n_samples} samples have {-(-n_samples // FRAME)} frames, "
                         f"got probabilities of shape {probs.shape}")
    max_samples = int(o.max_speech_duration_s * SAMPLE_RATE)
    max_frames = max_samples // FRAME
    min_speech = o.min_speech_duration_ms * SAMPLE_RATE / 1000
    pad = int(o.speech_pad_ms * SAMPLE_RATE / 1000)

    spans = []
    for i, g in enumerate(speech_groups(speech_regions(probs, o, inside), o)):
        a, b = g[0][0] * FRAME, min(g[-1][1] * FRAME, n_samples)
        # a group longer than a chapter is kept whatever min_speech says: its first chapter is
        # given out before its length is known
        if b > a and (b - a > min(min_speech, CHAPTER_FRAMES * FRAME) or (continued and i == 0)):
            spans += [s for c in chapters(g, probs, max_frames) for s in _split(c, probs, max_frames)]
    bounds = [(a * FRAME, min(b * FRAME, n_samples)) for a, b in spans]
    bounds = [(a, b) for a, b in bounds if b > a]

    out = []
    for i, (a, b) in enumerate(bounds):
        prev = bounds[i - 1][1] if i else before
        left = 0 if prev is None else (prev + a) // 2                  # the middle of each pause
        right = (b + bounds[i + 1][0]) // 2 if i + 1 < len(bounds) else n_samples
        lp, rp = min(pad, a - max(left, 0)), min(pad, min(right, n_samples) - b)
        slack = max_samples - (b - a)
        if lp + rp > slack:                                            # share what 30 s leaves
            lp2 = min(lp, slack // 2)
            rp2 = min(rp, slack - lp2)
            lp2 = min(lp, slack - rp2)
            lp, rp = lp2, rp2
        out.append(Segment(a, b, a - lp, b + rp))
    return out


def mean_speech(probs: np.ndarray, seg: Segment) -> float | None:
    """The mean probability of a segment's speech frames (probs in the segment's time); None if
    it has none. A segment's no_speech_prob is 1 minus it."""
    p = probs[seg.start // FRAME: max(-(-seg.end // FRAME), seg.start // FRAME + 1)]
    return float(np.mean(p, dtype=np.float64)) if len(p) else None
