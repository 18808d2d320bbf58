"""Voice activity detection with Silero VAD (MIT, github.com/snakers4/silero-vad; its license is
data/LICENSE.silero-vad), its network written here against tilekernels' ops (linear, lstm: numpy
on the CPU, cuTile on the GPU; the weights converted from its ONNX file by
tools/convert_silero.py; probabilities within 5e-6 of onnxruntime's on the CPU, 1e-4 on the GPU),
and the speech segments (at most one 30 s encoder window each) that the recogniser decodes
instead of fixed windows.

speech_probs: one speech probability per 32 ms frame (512 samples at 16 kHz); device_probs: those
of many files at once on the GPU. The model is a streaming one: each step takes a frame prefixed
by the last 64 samples of the one before (its context) and the LSTM state the step before left.
Everything before the LSTM sees that frame only, so the frames are encoded many at once; only the
LSTM steps, its rows (blocks) together. A long file is cut into blocks run side by side (rows of
one step, on the CPU such groups in a thread pool: numpy's products release the GIL); every block
but the first starts WARMUP_S earlier with a fresh state and its first WARMUP_S of probabilities
are dropped. The reset is not forgotten that soon (measured: Silero's state moves probabilities
at speech edges by up to ~0.5 for tens of seconds and by 1e-4 for minutes), but the speech found
is the same: regions within a frame or two, segments within 0.1 s of one sequential pass
(tests/asr/test_vad.py).

speech_segments: the speech regions (threshold hysteresis as Silero's get_speech_timestamps)
that pauses shorter than min_silence_duration_ms separate are merged into segments of at most
max_speech_duration_s. A longer group is cut in pauses: the shortest pause cut in is as long as
it can be, then the segments are as few as can be, then the pauses cut in are as long as can be
(a group that fits in two segments with a cut in its longest pause is cut there alone). A region
with no pause longer than max_speech_duration_s is cut at its least speech-like frames. Segment
start/end are the speech bounds (what is written); the audio range given to the model adds
speech_pad_ms each side, never past the middle of the pause to the next segment, the file's
ends or max_speech_duration_s in all.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
from tilekernels import array_module, is_device, linear, lstm, matmul_precision

SAMPLE_RATE = 16000
FRAME = 512                 # samples per probability (32 ms)
CONTEXT = 64                # samples of the previous frame prefixed to each frame (Silero v5/v6)
STATE = 128
WARMUP_S = 1.0              # the overlap of a block with the one before it
MIN_BLOCK_S = 8.0           # blocks are no shorter (a block's warm-up is wasted work)
BATCH = 32                  # blocks stepped together (rows of one LSTM step)
DEVICE_FRAMES = 16384       # frames encoded at once on the GPU (~15 KB each of temporaries)
CHUNK = 256                 # frames of each block encoded at once (fewer were slower)
MAX_WINDOW_S = 30.0         # the encoder's window
MODEL_PATH = Path(__file__).resolve().parent / "data" / "silero_vad_16k.safetensors"  # tools/convert_silero.py


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
        for name in ("min_speech_duration_ms", "min_silence_duration_ms", "speech_pad_ms"):
            if number(name) < 0:
                bad(name, ">= 0")
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


# --- the model -----------------------------------------------------------------------------

_LOCK = threading.Lock()
_WEIGHTS: dict[str, dict] = {}      # by array module: numpy's, cupy's


def weights(xp=np) -> dict:
    """Silero's 16 kHz weights (loaded once an array module), with the STFT's basis: a periodic
    Hann window times the DFT, 129 real rows then 129 imaginary ones, as the ONNX graph stores it
    (within 1e-7); the convs' weights as the (C_out, 3 * C_in) of a product by their taps."""
    with _LOCK:
        if "numpy" not in _WEIGHTS:
            from safetensors.numpy import load_file

            w = load_file(str(MODEL_PATH))
            n, f = np.arange(256), np.arange(129)[:, None]
            window, angle = 0.5 - 0.5 * np.cos(2 * np.pi * n / 256), 2 * np.pi * f * n / 256
            w["stft"] = np.concatenate([window * np.cos(angle), -window * np.sin(angle)]).astype(np.float32)
            for k in range(4):
                conv = w[f"encoder.{k}.weight"]
                w[f"encoder.{k}.taps"] = np.ascontiguousarray(conv.transpose(0, 2, 1)).reshape(len(conv), -1)
            w["lstm.bias"] = w["lstm.bias_ih"] + w["lstm.bias_hh"]
            w["head.row"] = w["head.weight"][None, :]
            _WEIGHTS["numpy"] = w
        if xp.__name__ not in _WEIGHTS:
            _WEIGHTS[xp.__name__] = {k: xp.asarray(v) for k, v in _WEIGHTS["numpy"].items()}
        return _WEIGHTS[xp.__name__]


def _product(x, weight, bias=None, activation: str | None = None):
    """linear(x, ...) of a 2-D x as a sequence's product (on the GPU the tiles kernel, without
    split-K), whose arithmetic for a row is the same whatever rows share it (a single row is
    doubled for it): a file's probabilities are the same alone and in a batch of files."""
    xp = array_module(x)
    one = len(x) == 1
    y = linear((xp.concatenate([x, x]) if one else x)[None], weight, bias, activation)[0]
    return y[:1] if one else y


def _conv_relu(x, taps, bias, stride: int):
    """ReLU(conv1d(x)) with 3 taps and padding 1, x (N, T, Cin) channels last -> (N, T', Cout),
    as one product of the taps side by side."""
    xp = array_module(x)
    t = (x.shape[1] - 1) // stride + 1
    xp_ = xp.pad(x, ((0, 0), (1, 1), (0, 0)))
    cols = xp.concatenate([xp_[:, k:k + stride * (t - 1) + 1:stride] for k in range(3)], axis=2)
    return _product(cols.reshape(-1, cols.shape[2]), taps, bias, "relu").reshape(len(x), t, -1)


def _gate_inputs(frames):
    """(N, CONTEXT + FRAME) frames -> (N, 4 * STATE): the LSTM's input half of its gates. Each row
    depends on its own frame only (the STFT and the encoder), so all frames go at once."""
    xp = array_module(frames)
    w = weights(xp)
    x = xp.concatenate([frames, frames[:, -2:-CONTEXT - 2:-1]], axis=1)              # reflect pad 64, right
    win = xp.lib.stride_tricks.as_strided(x, (len(x), 4, 256), (x.strides[0], 128 * 4, 4))
    spec = _product(xp.ascontiguousarray(win).reshape(-1, 256), w["stft"]).reshape(len(x), 4, 258)
    h = xp.sqrt(spec[..., :129] ** 2 + spec[..., 129:] ** 2)                        # (N, 4, 129)
    for k, stride in enumerate((1, 2, 2, 1)):
        h = _conv_relu(h, w[f"encoder.{k}.taps"], w[f"encoder.{k}.bias"], stride)    # (N, 4|2|1|1, C)
    return _product(h[:, 0], w["lstm.weight_ih"], w["lstm.bias"])


def _frame_view(xs: list, steps: int):
    """(view, bases): the files xs (1-D arrays of one module) in one zero-padded buffer, as a view
    (K, CONTEXT + FRAME) whose row bases[i] + f is frame f of file i with its context (zeros
    before the file, and for `steps` frames past its end)."""
    xp = array_module(xs[0])
    sizes = [FRAME * (1 + -(-len(x) // FRAME) + steps) for x in xs]
    buf = xp.zeros(sum(sizes), xp.float32)
    bases, pos = [], 0
    for x, size in zip(xs, sizes):
        buf[pos + FRAME: pos + FRAME + len(x)] = x
        bases.append(pos // FRAME)
        pos += size
    view = xp.lib.stride_tricks.as_strided(buf[FRAME - CONTEXT:], (len(buf) // FRAME - 1, CONTEXT + FRAME), (FRAME * 4, 4))
    return view, bases


def _run_rows(view, rows, steps: int, chunk: int):
    """(steps, len(rows)) probabilities (an array of the view's module): row j from a fresh state
    through the frames view[rows[j]], view[rows[j] + 1], ..., what `steps` calls of Silero's
    streaming model give; `chunk` steps at a time: their encoder at once, then the LSTM."""
    xp = array_module(view)
    w = weights(xp)
    b = len(rows)
    rows = xp.asarray(rows, dtype=xp.int64)
    out = xp.empty((steps, b), xp.float32)
    h = c = None
    for t0 in range(0, steps, chunk):
        m = min(chunk, steps - t0)
        idx = (rows[None, :] + xp.arange(t0, t0 + m, dtype=xp.int64)[:, None]).reshape(-1)
        gates = _gate_inputs(view[idx]).reshape(m, b, 4 * STATE)
        hs, h, c = lstm(gates, w["lstm.weight_hh"], h, c)
        p = _product(xp.maximum(hs, 0).reshape(m * b, STATE), w["head.row"], w["head.bias"], "sigmoid")
        out[t0:t0 + m] = p.reshape(m, b)
    return out


def _layout(n: int, blocks: int, min_block: int, warm: int) -> tuple[list[int], int, int]:
    """(first frames, frames kept a block, steps a block) of n frames cut into at most `blocks`
    blocks of at least min_block frames (0: one block). Block 0 runs from frame 0 (its first
    `length` frames are the sequential pass's); block k from k*length - warm, keeping its last
    `length`."""
    blocks = max(1, min(blocks, n // min_block)) if min_block else 1
    length = -(-n // blocks)                       # frames kept per block
    blocks = -(-n // length)
    if blocks == 1:
        return [0], n, n
    return [0] + [k * length - warm for k in range(1, blocks)], length, warm + length


def _assemble(p: np.ndarray, n: int, length: int, warm: int) -> np.ndarray:
    """A file's n probabilities from its blocks' columns of p (_layout's)."""
    if p.shape[1] == 1:
        return p[:n, 0]
    return np.concatenate([p[:length, 0]] + [p[warm:warm + length, k] for k in range(1, p.shape[1])])[:n]


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_BLAS: list = [0, None]     # (speech_probs calls running, the BLAS limits they set)


@contextlib.contextmanager
def _one_blas_thread():
    """One BLAS thread while any speech_probs runs: OpenBLAS's threads on the LSTM's small
    per-step products cost far more than they give (907 steps of 64 rows: 0.1 s on one thread,
    14 s on two, a busy 2-core machine); the blocks run in threads of their own instead."""
    with _LOCK:
        if _BLAS[0] == 0:
            try:
                from threadpoolctl import threadpool_limits

                _BLAS[1] = threadpool_limits(1, user_api="blas")
            except ImportError:
                _BLAS[1] = None
        _BLAS[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _BLAS[0] -= 1
            if _BLAS[0] == 0 and _BLAS[1] is not None:
                _BLAS[1].restore_original_limits()


def speech_probs(samples16k, *, threads: int | None = None, batch: int = BATCH,
                 min_block_s: float = MIN_BLOCK_S, warmup_s: float = WARMUP_S) -> np.ndarray:
    """The speech probability (float32) of each 512-sample frame of 16 kHz mono samples,
    ceil(len / 512) of them (the last frame zero padded); samples on the GPU (cupy) run there
    (device_probs).

    The frames are cut into up to threads * batch blocks of at least min_block_s; each block
    after the first also runs the warmup_s before it, from a fresh state, and keeps only its own
    frames. threads (default: the CPUs this process may use) run groups of `batch` blocks, each
    group one LSTM step a frame. threads=1, batch=1 with one block (min_block_s=inf) is the
    plain sequential pass."""
    if samples16k.ndim != 1:
        raise ValueError(f"samples must be one-dimensional (mono), got shape {samples16k.shape}")
    if is_device(samples16k):
        return device_probs([samples16k], min_block_s=min_block_s, warmup_s=warmup_s)[0]
    x = np.ascontiguousarray(samples16k, dtype=np.float32)
    if len(x) == 0:
        return np.zeros(0, np.float32)
    with _one_blas_thread():
        return _probs(x, threads, batch, min_block_s, warmup_s)


def _frames(min_block_s: float, warmup_s: float) -> tuple[int, int]:
    """(min_block, warm) in frames; min_block 0 for an infinite min_block_s (one block)."""
    warm = math.ceil(warmup_s * SAMPLE_RATE / FRAME)
    return (max(1, warm, round(min_block_s * SAMPLE_RATE / FRAME)) if math.isfinite(min_block_s) else 0), warm


def _probs(x: np.ndarray, threads: int | None, batch: int, min_block_s: float, warmup_s: float) -> np.ndarray:
    n = -(-len(x) // FRAME)
    threads = max(1, threads or _cpus())
    batch = max(1, int(batch))
    min_block, warm = _frames(min_block_s, warmup_s)
    starts, length, steps = _layout(n, threads * batch, min_block, warm)
    view, (base,) = _frame_view([x], steps)
    groups = [list(g) for g in np.array_split(np.arange(len(starts)), min(threads, len(starts)))]   # <= batch each
    p = np.empty((steps, len(starts)), np.float32)

    def work(group):
        p[:, group] = _run_rows(view, [base + starts[k] for k in group], steps, CHUNK)

    if len(groups) == 1:
        work(groups[0])
    else:
        with ThreadPoolExecutor(min(threads, len(groups))) as pool:
            list(pool.map(work, groups))
    return _assemble(p, n, length, warm)


def device_probs(samples: list, *, min_block_s: float = MIN_BLOCK_S, warmup_s: float = WARMUP_S) -> list[np.ndarray]:
    """speech_probs of several files at once on the GPU (cupy arrays of 16 kHz samples), as numpy
    arrays. Each file is cut into blocks of at least min_block_s by its own length alone (so its
    probabilities do not depend on the other files), and all blocks of all files are the rows of
    one LSTM (tilekernels.lstm, its time loop in one kernel), its products at 'highest' precision
    (3xTF32: within 1e-4 of the numpy model's; plain TF32 would compound in the recurrence). It
    runs on the current stream and changes the matmul precision while it runs: call it from the
    thread that launches the model's kernels."""
    import cupy

    min_block, warm = _frames(min_block_s, warmup_s)
    xs = [cupy.ascontiguousarray(cupy.asarray(x, dtype=cupy.float32)) for x in samples]
    for x in xs:
        if x.ndim != 1:
            raise ValueError(f"samples must be one-dimensional (mono), got shape {x.shape}")
    ns = [-(-len(x) // FRAME) for x in xs]
    live = [i for i, n in enumerate(ns) if n]
    layouts = {i: _layout(ns[i], 1 << 30, min_block, warm) for i in live}
    out = [np.zeros(0, np.float32) for _ in xs]
    if not live:
        return out
    steps = max(layouts[i][2] for i in live)
    view, bases = _frame_view([xs[i] for i in live], steps)
    rows = [base + f for i, base in zip(live, bases) for f in layouts[i][0]]
    with matmul_precision("highest"):
        p = _run_rows(view, rows, steps, max(1, DEVICE_FRAMES // len(rows))).get()
    col = 0
    for i in live:
        starts, length, _ = layouts[i]
        out[i] = _assemble(p[:, col:col + len(starts)], ns[i], length, warm)
        col += len(starts)
    return out


# --- segments ------------------------------------------------------------------------------

def speech_regions(probs: np.ndarray, options: VadOptions | None = None) -> list[tuple[int, int]]:
    """[start, end) frame ranges of speech: it starts at a frame >= threshold and ends at the
    next frame below neg_threshold (frames between the two keep the state they follow)."""
    o = options or VadOptions()
    p = np.asarray(probs, np.float32)
    if len(p) == 0:
        return []
    on, off = p >= o.threshold, p < o.low
    idx = np.arange(len(p))
    last = np.maximum.accumulate(np.where(on | off, idx, -1))          # the latest decisive frame
    speech = (last >= 0) & on[np.maximum(last, 0)]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], speech.view(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


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


def segments_from_probs(probs: np.ndarray, n_samples: int, options: VadOptions | None = None) -> list[Segment]:
    """The segments of a file of n_samples whose frame probabilities are probs (see module doc)."""
    o = options or VadOptions()
    probs = np.asarray(probs, np.float32)
    if probs.shape != (-(-n_samples // FRAME),):
        raise ValueError(f"{n_samples} samples have {-(-n_samples // FRAME)} frames, got probabilities of shape {probs.shape}")
    max_samples = int(o.max_speech_duration_s * SAMPLE_RATE)
    max_frames = max_samples // FRAME
    min_silence = o.min_silence_duration_ms * SAMPLE_RATE / 1000
    min_speech = o.min_speech_duration_ms * SAMPLE_RATE / 1000
    pad = int(o.speech_pad_ms * SAMPLE_RATE / 1000)

    groups: list[list[tuple[int, int]]] = []
    for r in speech_regions(probs, o):
        if groups and (r[0] - groups[-1][-1][1]) * FRAME < min_silence:
            groups[-1].append(r)
        else:
            groups.append([r])
    spans = []
    for g in groups:
        a, b = g[0][0] * FRAME, min(g[-1][1] * FRAME, n_samples)
        if b > a and b - a > min_speech:
            spans += _split(g, probs, max_frames)
    bounds = [(a * FRAME, min(b * FRAME, n_samples)) for a, b in spans]
    bounds = [(a, b) for a, b in bounds if b > a]

    out = []
    for i, (a, b) in enumerate(bounds):
        left = (bounds[i - 1][1] + a) // 2 if i else 0                 # the middle of each pause
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


def speech_segments(samples: np.ndarray, options: VadOptions | None = None, *,
                    probs: np.ndarray | None = None, **prob_kwargs) -> list[Segment]:
    """The speech segments of 16 kHz mono samples (silence only: []); probs: speech_probs of
    them when already computed; prob_kwargs go to speech_probs."""
    if probs is None:
        probs = speech_probs(samples, **prob_kwargs)
    return segments_from_probs(probs, len(samples), options)


STREAM_CHUNK = 9375 * FRAME     # 300 s of samples a speech_probs call when streaming (whole frames)
_POOL: tuple[int, object, int] | None = None        # (pid, ProcessPoolExecutor or None, threads a process)
PROCESSES = 8               # the VAD's worker processes at most (half the CPUs: readers and the GPU loop need some)


def _pool() -> tuple[int, object, int]:
    import multiprocessing

    global _POOL
    with _LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            pool, n = None, max(1, min(PROCESSES, _cpus() // 2))
            if not multiprocessing.current_process().daemon:
                from concurrent.futures import ProcessPoolExecutor

                from tilekernels.runtime.parent import watch_parent

                # each worker exits with this process, however it ends (SIGKILL too)
                pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                                           initializer=watch_parent, initargs=(os.getpid(),))
                for _ in range(n):      # spawned one a submit: start them all now, each loading the weights
                    pool.submit(speech_probs, np.zeros(FRAME, np.float32))
            _POOL = (os.getpid(), pool, max(1, _cpus() // n))
        return _POOL


def start_workers() -> None:
    """Start the VAD's worker processes (pooled_probs) now, in the background: while a model
    loads, rather than inside the first files' time (a spawned process imports numpy and loads
    the weights: about a second)."""
    _pool()


def stop_workers() -> None:
    """Stop the VAD's worker processes (a server's shutdown: a server killed by a signal it
    re-raises runs no atexit hooks) and wait for them to exit; pooled_probs starts them again.
    A normal interpreter exit stops them too (concurrent.futures' own exit hook)."""
    global _POOL
    with _LOCK:
        pool, _POOL = (_POOL[1] if _POOL is not None and _POOL[0] == os.getpid() else None), None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def pooled_probs(samples: np.ndarray) -> np.ndarray:
    """speech_probs in one of a few worker processes. Silero's LSTM steps in Python a frame; in the
    process of a busy pipeline (the GPU loop's Python) those steps wait on the GIL (VAD took 10x
    the bulk benchmark's GPU time).
    A daemonic process (a Dask worker) may not start children, and a script without a __main__
    guard cannot spawn them: there it runs here."""
    global _POOL
    _, pool, threads = _pool()
    if pool is not None:
        from concurrent.futures.process import BrokenProcessPool

        try:
            return pool.submit(speech_probs, samples, threads=threads).result()
        except BrokenProcessPool as e:  # e.g. a script without a __main__ guard: no child can start
            warnings.warn(f"VAD worker processes failed ({e}); VAD runs in this process from now on (slower)")
            with _LOCK:
                _POOL = (os.getpid(), None, threads)
    return speech_probs(samples)


def stream_probs(blocks: Iterable[np.ndarray], probs: Callable = pooled_probs) -> tuple[np.ndarray, int]:
    """(speech_probs, sample count) of samples arriving in blocks, STREAM_CHUNK at a time (each
    through probs(samples)), each chunk after the first warmed up on the WARMUP_S before it (as
    speech_probs' own blocks): memory bounded by a chunk, not by the file."""
    warm = int(round(WARMUP_S * SAMPLE_RATE / FRAME)) * FRAME
    out, buf, tail, n = [], np.zeros(0, np.float32), np.zeros(0, np.float32), 0

    def run(chunk):
        p = probs(np.concatenate([tail, chunk]) if len(tail) else chunk)
        return p[len(tail) // FRAME:]

    for block in blocks:
        n += len(block)
        buf = np.concatenate([buf, block]) if len(buf) else block
        while len(buf) >= STREAM_CHUNK:
            chunk, buf = buf[:STREAM_CHUNK], buf[STREAM_CHUNK:]
            out.append(run(chunk))
            tail = chunk[-warm:]
    if len(buf):
        out.append(run(buf))
    return (np.concatenate(out) if out else np.zeros(0, np.float32)), n


def segment_audio(blocks: Iterable[np.ndarray], segments: list[Segment]) -> Iterator[tuple[Segment, np.ndarray]]:
    """(segment, its padded audio) for each segment (in time order) from samples arriving in
    blocks; only the audio of the segment being cut is held."""
    segments, pos, buf = list(segments), 0, []
    i = 0
    for block in blocks:
        end = pos + len(block)
        while i < len(segments):
            seg = segments[i]
            a, b = max(seg.audio_start, pos), min(seg.audio_end, end)
            if b > a:
                buf.append(block[a - pos: b - pos])
            if seg.audio_end > end:
                break
            yield seg, (np.concatenate(buf) if buf else np.zeros(0, np.float32))
            buf, i = [], i + 1
        pos = end
    for seg in segments[i:]:                # a file shorter than its header said
        yield seg, (np.concatenate(buf) if buf else np.zeros(0, np.float32))
        buf = []
