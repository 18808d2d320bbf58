"""Audio in, log-mel features out, exactly as transformers' WhisperFeatureExtractor
(feature_size=128) computes them for each 30 s window.

audio.py reads the samples; librosa provides the Slaney mel filters; the STFT is an rfft over a
periodic Hann window, in float64 with numpy on the CPU or with cupy on the GPU (the same code: xp
is the array module).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from .audio import SAMPLE_RATE, AudioError

N_FFT, HOP = 400, 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE          # 480000
FRAMES = WINDOW_SAMPLES // HOP                         # 3000


_FILTERS: np.ndarray | None = None


def mel_filters() -> np.ndarray:
    """(128, 201) Slaney-scale, Slaney-normalised mel filters over 0-8000 Hz."""
    global _FILTERS
    if _FILTERS is None:
        import librosa

        _FILTERS = librosa.filters.mel(sr=SAMPLE_RATE, n_fft=N_FFT, n_mels=128, fmin=0.0, fmax=8000.0,
                                       htk=False, norm="slaney").astype(np.float64)
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
    with the filters (a GPU computes 8 windows in about the time of one)."""
    if n_mels != 128:
        raise ValueError(f"only 128 mel bins are supported, the checkpoint asks for {n_mels}")
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
    # each window's maximum in two reductions: cupy's one over (128, 3000) ran in one block, 0.24 ms
    spec = xp.maximum(spec, spec.max(axis=2, keepdims=True).max(axis=1, keepdims=True) - 8.0)
    return ((spec + 4.0) / 4.0).astype(np.float32)


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
    made = iter(log_mels(raw, n_mels, xp)) if raw else iter(())
    return xp.stack([next(made) if w.features.ndim == 1 else xp.asarray(w.features) for w in ws])


def windows(samples: np.ndarray, n_mels: int = 128, xp=np) -> list[Window]:
    """stream_windows of samples held whole."""
    return list(stream_windows([samples], n_mels, xp))
