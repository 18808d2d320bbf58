"""Audio in, log-mel features out, exactly as transformers' WhisperFeatureExtractor
(feature_size=128) computes them for each 30 s window.

audio.py reads the samples; librosa provides the Slaney mel filters (shipped as computed by it:
importing librosa.filters took seconds of a first file); the STFT is an rfft over a
periodic Hann window, in float64 with numpy on the CPU (log_mels: the recipe) or with cupy on the
GPU (_log_mels_device: the same arithmetic in a few fused kernels, as a 30 s clip waits for it).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from .audio import SAMPLE_RATE, AudioError

N_FFT, HOP = 400, 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE          # 480000
FRAMES = WINDOW_SAMPLES // HOP                         # 3000


_FILTERS: np.ndarray | None = None


MEL_FILTERS = Path(__file__).resolve().parent / "data" / "mel_filters.npz"


def mel_filters() -> np.ndarray:
    """(128, 201) Slaney-scale, Slaney-normalised mel filters over 0-8000 Hz: librosa.filters.mel(
    sr=16000, n_fft=400, n_mels=128, fmin=0, fmax=8000, htk=False, norm="slaney"), as stored in
    MEL_FILTERS (tests/asr/test_features.py compares them)."""
    global _FILTERS
    if _FILTERS is None:
        with np.load(MEL_FILTERS) as f:
            _FILTERS = f["mel_128"].astype(np.float64)
    return _FILTERS


@functools.lru_cache(maxsize=None)
def _tables(xp, device: int) -> tuple:
    """The periodic Hann window and the mel filters as xp arrays (on GPU `device`), made once: on the
    GPU, each made per call cost a copy and several launches a batch of windows."""
    hann, filters = 0.5 - 0.5 * xp.cos(2 * np.pi * xp.arange(N_FFT) / N_FFT), xp.asarray(mel_filters())
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()      # ready for any stream that uses them
    return hann, filters


def log_mel(window, n_mels: int = 128, xp=np):
    """(n_mels, 3000) float32 features of one window of at most 480000 samples (zero padded),
    computed with xp (numpy, or cupy for features already on the GPU)."""
    return log_mels([window], n_mels, xp)[0]


def log_mels(windows: list, n_mels: int = 128, xp=np):
    """log_mel of several windows at once, (W, n_mels, 3000): one batched FFT and one product
    with the filters (on a GPU several windows take about as long as one)."""
    if n_mels != 128:
        raise ValueError(f"only 128 mel bins are supported, the checkpoint asks for {n_mels}")
    if xp is not np and all(w.dtype == np.float32 for w in windows):
        return _log_mels_device(windows, xp)
    x = xp.zeros((len(windows), WINDOW_SAMPLES), np.float64)
    for i, w in enumerate(windows):
        x[i, : len(w)] = xp.asarray(w)
    x = xp.ascontiguousarray(xp.pad(x, ((0, 0), (N_FFT // 2, N_FFT // 2)), mode="reflect"))
    frames = xp.lib.stride_tricks.as_strided(x, shape=(len(windows), FRAMES + 1, N_FFT),
                                             strides=(x.strides[0], HOP * 8, 8))                # (W, 3001, 400)
    hann, filters = _tables(xp, 0 if xp is np else xp.cuda.Device().id)
    power = xp.abs(xp.fft.rfft(frames * hann, axis=-1)) ** 2                         # (W, 3001, 201)
    mel = filters @ power.transpose(0, 2, 1)                                          # (W, 128, 3001)
    spec = xp.log10(xp.maximum(mel, 1e-10))[:, :, :-1]
    # each window's maximum in two reductions: cupy's one over (128, 3000) runs in a single block
    spec = xp.maximum(spec, spec.max(axis=2, keepdims=True).max(axis=1, keepdims=True) - 8.0)
    return ((spec + 4.0) / 4.0).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _device_kernels(cupy) -> tuple:
    """The fused steps of _log_mels_device: (frames, power, scale)."""
    frames = cupy.ElementwiseKernel(
        "raw float32 x, raw float64 hann", "float64 f", f"""
        const long long per = {(FRAMES + 1) * N_FFT}LL, n = i % {N_FFT}, t = (i % per) / {N_FFT};
        long long j = t * {HOP} + n - {N_FFT // 2};
        if (j < 0) j = -j;                                              // numpy's pad(mode='reflect')
        if (j >= {WINDOW_SAMPLES}) j = {2 * (WINDOW_SAMPLES - 1)} - j;
        f = (double)x[(i / per) * {WINDOW_SAMPLES} + j] * hann[n];""", "glm_asr_frames")
    power = cupy.ElementwiseKernel("complex128 z", "float64 p", "const double a = abs(z); p = a * a;",
                                   "glm_asr_power")
    scale = cupy.ElementwiseKernel(
        "raw float64 mel, raw float64 top", "float32 y", f"""
        const long long per = 128LL * {FRAMES}, w = i / per, m = (i % per) / {FRAMES}, t = i % {FRAMES};
        const double s = log10(fmax(mel[(w * {FRAMES + 1} + t) * 128 + m], 1e-10));
        y = (fmax(s, log10(fmax(top[w], 1e-10)) - 8.0) + 4.0) / 4.0;""", "glm_asr_scale")
    return frames, power, scale


def _log_mels_device(windows: list, cupy):
    """log_mels in eight launches, not some twenty cupy calls whose host time a 30 s clip waited
    for: the recipe's float64 operations in its order (the filter product's sums in cuBLAS's), the
    largest log taken as the log of the largest power (log10 is monotone)."""
    n = len(windows)
    x = cupy.empty((n, WINDOW_SAMPLES), np.float32)
    for i, w in enumerate(windows):
        if isinstance(w, np.ndarray):
            x[i, :len(w)].set(np.ascontiguousarray(w))
        else:
            x[i, :len(w)] = w
        if len(w) < WINDOW_SAMPLES:
            x[i, len(w):] = 0
    hann, filters = _tables(cupy, cupy.cuda.Device().id)
    frames, power, scale = _device_kernels(cupy)
    f = frames(x, hann, size=n * (FRAMES + 1) * N_FFT).reshape(n, FRAMES + 1, N_FFT)
    mel = power(cupy.fft.rfft(f, axis=-1)) @ filters.T                                # (W, 3001, 128)
    top = mel[:, :-1].max(axis=2).max(axis=1)
    return scale(mel, top, size=n * 128 * FRAMES).reshape(n, 128, FRAMES)


def valid_frames(n_samples: int) -> int:
    return math.ceil(n_samples / HOP)


def audio_tokens(frames: int) -> int:
    """Audio embeddings the encoder + projector yield for `frames` valid mel frames."""
    after_conv = (frames - 1) // 2 + 1
    return max(0, (after_conv - 4) // 4 + 1)


@dataclass
class Window:
    start_s: float
    end_s: float
    features: object            # (128, 3000) float32, numpy or cupy; or the window's samples (xp=None)
    tokens: int                 # audio embeddings that belong to real audio
    speech: float | None = None     # the VAD's mean speech probability over its speech (None: no VAD)


def stream_windows(blocks: Iterable[np.ndarray], n_mels: int = 128, xp=np, offset_s: float = 0.0) -> Iterator[Window]:
    """Non-overlapping 30 s windows with their features (computed with xp: cupy puts them on the
    GPU; None leaves the samples, for featurize later) from samples arriving in blocks of any
    size; times in the file's time (offset_s: that of the first sample). A too-short tail is
    dropped; audio with no window at all is an AudioError."""
    buf, start, made = np.zeros(0, np.float32), 0, False
    blocks = iter(blocks)
    while True:
        block = next(blocks, None)
        if block is not None:
            buf = np.concatenate([buf, block]) if len(buf) else block
        while len(buf) >= WINDOW_SAMPLES or (block is None and len(buf)):
            chunk, buf = buf[:WINDOW_SAMPLES], buf[WINDOW_SAMPLES:]
            tokens = audio_tokens(valid_frames(len(chunk)))
            if tokens >= 1:
                made = True
                yield Window(offset_s + start / SAMPLE_RATE, offset_s + (start + len(chunk)) / SAMPLE_RATE,
                             chunk if xp is None else log_mel(chunk, n_mels, xp), tokens)
            start += len(chunk)
        if block is None:
            break
    if not made:
        raise AudioError(f"audio too short to transcribe ({start / SAMPLE_RATE * 1000:.0f} ms; "
                         f"at least {6 * HOP / SAMPLE_RATE * 1000 + 1:.0f} ms needed)")


def featurize(ws: list[Window], n_mels: int, xp):
    """The windows' features (W, n_mels, 3000) with xp, computed together from their samples
    where stream_windows left them."""
    raw = [w.features for w in ws if w.features.ndim == 1]
    if len(raw) == len(ws):
        return log_mels(raw, n_mels, xp)
    made = iter(log_mels(raw, n_mels, xp)) if raw else iter(())
    return xp.stack([next(made) if w.features.ndim == 1 else xp.asarray(w.features) for w in ws])


def windows(samples: np.ndarray, n_mels: int = 128, xp=np) -> list[Window]:
    """stream_windows of samples held whole."""
    return list(stream_windows([samples], n_mels, xp))
