"""Silero VAD's network against tilekernels' ops: speech_probs (one file, the CPU's blocks in a
thread pool) and device_probs (many files at once on the GPU); the package's docstring says how
blocks and their warm-up work."""
from __future__ import annotations

import contextlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tilekernels import array_module, is_device, linear, lstm, matmul_precision

from .segments import FRAME, SAMPLE_RATE, Segment, VadOptions, segments_from_probs

CONTEXT = 64                # samples of the previous frame prefixed to each frame (Silero v5/v6)
STATE = 128
WARMUP_S = 1.0              # the overlap of a block with the one before it
BLOCK_S = 8.0               # blocks of this length, anchored at its multiples in the file's time
BATCH = 32                  # blocks stepped together (rows of one LSTM step)
DEVICE_FRAMES = 16384       # frames encoded at once on the GPU (~15 KB each of temporaries)
CHUNK = 256                 # frames of each block encoded at once (fewer were slower)
SHAPE_CLASS = 16            # cuTile specializes a kernel on its dims' divisibility by 16 (_rows_class)
MODEL_PATH = Path(__file__).resolve().parents[1] / "data" / "silero_vad_16k.safetensors"  # tools/convert_silero.py


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
    view = xp.lib.stride_tricks.as_strided(buf[FRAME - CONTEXT:], (len(buf) // FRAME - 1, CONTEXT + FRAME),
                                           (FRAME * 4, 4))
    return view, bases


def _run_rows(view, rows, steps: int, chunk: int):
    """(steps, len(rows)) probabilities (an array of the view's module): row j from a fresh state
    through the frames view[rows[j]], view[rows[j] + 1], ..., what `steps` calls of Silero's
    streaming model give; `chunk` steps at a time: their encoder at once, then the LSTM."""
    xp = array_module(view)
    b = len(rows)
    rows = xp.asarray(rows, dtype=xp.int64)
    out = xp.empty((steps, b), xp.float32)
    h = c = None
    for t0 in range(0, steps, chunk):
        m = min(chunk, steps - t0)
        idx = (rows[None, :] + xp.arange(t0, t0 + m, dtype=xp.int64)[:, None]).reshape(-1)
        out[t0:t0 + m], h, c = model_steps(view[idx], b, h, c)
    return out


def model_steps(frames, rows: int, h=None, c=None):
    """(probabilities (steps, rows), h, c): Silero's streaming model over frames (steps * rows,
    CONTEXT + FRAME), step-major, from the LSTM state (h, c) (None: a fresh one)."""
    return lstm_steps(_gate_inputs(frames).reshape(len(frames) // rows, rows, 4 * STATE), h, c)


def lstm_steps(gates, h=None, c=None):
    """model_steps' second half: the LSTM and the head over gate inputs (steps, rows, 4 * STATE)."""
    xp = array_module(gates)
    w = weights(xp)
    m, rows = gates.shape[:2]
    hs, h, c = lstm(gates, w["lstm.weight_hh"], h, c)
    p = _product(xp.maximum(hs, 0).reshape(m * rows, STATE), w["head.row"], w["head.bias"], "sigmoid")
    return p.reshape(m, rows), h, c


def _layout(n: int, block: int, warm: int) -> tuple[list[int], int, int]:
    """(first frames, frames kept a block, steps a block) of n frames cut into blocks of `block`
    frames at its multiples (0: one block), whatever n: a frame's probability depends on the
    samples from its block's start (less the warm-up) up to it, never on the file's length, so a
    live stream (vad.live) and any chunking at multiples of a block compute the same. Block 0 runs
    from frame 0 (the sequential pass's); block k from k*block - warm, keeping its last `block`."""
    if not block or n <= block:
        return [0], n, n
    return [0] + [k * block - warm for k in range(1, -(-n // block))], block, warm + block


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
    per-step products cost far more than they give; the blocks run in threads of their own
    instead."""
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
                 block_s: float = BLOCK_S, warmup_s: float = WARMUP_S) -> np.ndarray:
    """The speech probability (float32) of each 512-sample frame of 16 kHz mono samples,
    ceil(len / 512) of them (the last frame zero padded); samples on the GPU (cupy) run there
    (device_probs).

    The frames are cut into blocks of block_s at its multiples; each block after the first also
    runs the warmup_s before it, from a fresh state, and keeps only its own frames. threads
    (default: the CPUs this process may use) run groups of up to `batch` blocks, each group one
    LSTM step a frame. One block (block_s=inf) is the plain sequential pass."""
    if samples16k.ndim != 1:
        raise ValueError(f"samples must be one-dimensional (mono), got shape {samples16k.shape}")
    if is_device(samples16k):
        return device_probs([samples16k], block_s=block_s, warmup_s=warmup_s)[0]
    x = np.ascontiguousarray(samples16k, dtype=np.float32)
    if len(x) == 0:
        return np.zeros(0, np.float32)
    with _one_blas_thread():
        return _probs(x, threads, batch, block_s, warmup_s)


def block_frames(block_s: float = BLOCK_S, warmup_s: float = WARMUP_S) -> tuple[int, int]:
    """(block, warm) in frames; block 0 for an infinite block_s (one block), else at least warm."""
    warm = math.ceil(warmup_s * SAMPLE_RATE / FRAME)
    return (max(1, warm, round(block_s * SAMPLE_RATE / FRAME)) if math.isfinite(block_s) else 0), warm


def _probs(x: np.ndarray, threads: int | None, batch: int, block_s: float, warmup_s: float) -> np.ndarray:
    n = -(-len(x) // FRAME)
    threads = max(1, threads or _cpus())
    batch = max(1, int(batch))
    block, warm = block_frames(block_s, warmup_s)
    starts, length, steps = _layout(n, block, warm)
    view, (base,) = _frame_view([x], steps)
    k = len(starts)
    groups = [list(g) for g in np.array_split(np.arange(k), max(min(threads, k), -(-k // batch)))]  # <= batch each
    p = np.empty((steps, len(starts)), np.float32)

    def work(group):
        p[:, group] = _run_rows(view, [base + starts[k] for k in group], steps, CHUNK)

    if len(groups) == 1:
        work(groups[0])
    else:
        with ThreadPoolExecutor(min(threads, len(groups))) as pool:
            list(pool.map(work, groups))
    return _assemble(p, n, length, warm)


def device_probs(samples: list, *, block_s: float = BLOCK_S, warmup_s: float = WARMUP_S) -> list[np.ndarray]:
    """speech_probs of several files at once on the GPU (cupy arrays of 16 kHz samples), as numpy
    arrays. Each file is cut into blocks of block_s at its multiples, as speech_probs (so its
    probabilities do not depend on the other files), and all blocks of all files are the rows of
    one LSTM (tilekernels.lstm, its time loop in one kernel), its products at 'highest' precision
    (3xTF32: within 1e-4 of the numpy model's; plain TF32 would compound in the recurrence). It
    runs on the current stream and changes the matmul precision while it runs: call it from the
    thread that launches the model's kernels."""
    return queue_probs(samples, block_s=block_s, warmup_s=warmup_s).result()


class QueuedProbs:
    """device_probs queued on a stream: done() once the GPU has them, result() (waiting for them)
    as device_probs returns them. The loop that feeds the engine queues the VAD's batches and goes
    on (a batch waited for held the engine's next steps back as long as the GPU took to get to it)."""

    def __init__(self, probs, finish):
        import cupy
        import cupyx

        self._probs, self._finish, self._host, self._event = probs, finish, None, None
        if probs is not None:                   # None: no samples, nothing to wait for
            self._host = cupyx.empty_pinned(probs.shape, probs.dtype)
            probs.get(out=self._host, blocking=False)           # on the current stream, after the VAD
            self._event = cupy.cuda.get_current_stream().record()

    def done(self) -> bool:
        return self._event is None or self._event.done

    def result(self) -> list[np.ndarray]:
        if self._event is not None:
            self._event.synchronize()
        self._probs = None
        return self._finish(self._host)


def queue_probs(samples: list, *, block_s: float = BLOCK_S, warmup_s: float = WARMUP_S) -> QueuedProbs:
    """device_probs queued on the current stream (QueuedProbs); bad input raises here."""
    import cupy

    block, warm = block_frames(block_s, warmup_s)
    xs = [cupy.ascontiguousarray(cupy.asarray(x, dtype=cupy.float32)) for x in samples]
    for x in xs:
        if x.ndim != 1:
            raise ValueError(f"samples must be one-dimensional (mono), got shape {x.shape}")
    ns = [-(-len(x) // FRAME) for x in xs]
    live = [i for i, n in enumerate(ns) if n]
    layouts = {i: _layout(ns[i], block, warm) for i in live}

    def finish(p: np.ndarray) -> list[np.ndarray]:
        out, col = [np.zeros(0, np.float32) for _ in xs], 0
        for i in live:
            starts, length, _ = layouts[i]
            out[i] = _assemble(p[:, col:col + len(starts)], ns[i], length, warm)
            col += len(starts)
        return out

    if not live:
        return QueuedProbs(None, finish)
    n_rows = _rows_class(sum(len(layouts[i][0]) for i in live))
    chunk = max(SHAPE_CLASS, DEVICE_FRAMES // n_rows)
    steps = _ceil(max(layouts[i][2] for i in live), chunk)
    view, bases = _frame_view([xs[i] for i in live], steps)
    rows = [base + f for i, base in zip(live, bases) for f in layouts[i][0]]
    rows += [rows[-1]] * (n_rows - len(rows))                   # repeats, whose columns go unread
    with matmul_precision("highest"):
        return QueuedProbs(_run_rows(view, rows, steps, chunk), finish)


def _ceil(n: int, k: int) -> int:
    return -(-n // k) * k


def _rows_class(n: int) -> int:
    """The rows the GPU runs for n blocks: a power of two from SHAPE_CLASS up to DEVICE_FRAMES /
    SHAPE_CLASS, multiples of that above. Chunks of DEVICE_FRAMES / rows steps (steps padded to
    whole chunks) then give every product of the VAD the same rows, DEVICE_FRAMES times its
    frames' share (or more, in multiples of 16 past it): the same kernels and tiles (linear_plan)
    for any number and length of files, built once, never mid-run."""
    top = DEVICE_FRAMES // SHAPE_CLASS
    return _ceil(n, top) if n > top else max(SHAPE_CLASS, 1 << (n - 1).bit_length())


def speech_segments(samples: np.ndarray, options: VadOptions | None = None, *,
                    probs: np.ndarray | None = None, **prob_kwargs) -> list[Segment]:
    """The speech segments of 16 kHz mono samples (silence only: []); probs: speech_probs of
    them when already computed; prob_kwargs go to speech_probs."""
    if probs is None:
        probs = speech_probs(samples, **prob_kwargs)
    return segments_from_probs(probs, len(samples), options)
