"""Audio in, log-mel features out, exactly as transformers' WhisperFeatureExtractor
(feature_size=128) computes them for each 30 s window.

soundfile reads the file, channels are averaged to mono, librosa resamples to 16 kHz and
provides the Slaney mel filters; the STFT is an rfft over a periodic Hann window, in float64
with numpy on the CPU or with cupy on the GPU (the same code: xp is the array module).
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
N_FFT, HOP = 400, 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE          # 480000
FRAMES = WINDOW_SAMPLES // HOP                         # 3000


class AudioError(Exception):
    """An audio file that cannot be transcribed; one line for the user."""


def read_audio(path: str | Path) -> np.ndarray:
    """Mono float32 samples at 16 kHz from any file libsndfile reads."""
    import soundfile

    p = Path(path)
    if not p.exists():
        raise AudioError(f"{path}: no such file")
    if p.is_dir():
        raise AudioError(f"{path}: is a directory")
    try:
        with soundfile.SoundFile(str(p)) as f:
            data, rate, log = f.read(dtype="float32", always_2d=True), f.samplerate, f.extra_info
    except Exception as e:  # soundfile raises LibsndfileError, RuntimeError, TypeError...
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AudioError(f"{path}: not a readable audio file ({msg})") from None
    short = re.search(r"data\s*:\s*(\d+) \(should be (\d+)\)", log)      # libsndfile's note on a cut-short file
    if short and int(short.group(2)) < int(short.group(1)):
        got = data.shape[0] / rate
        print(f"warning: {path}: truncated: its header claims {got * int(short.group(1)) / int(short.group(2)):.2f} s, "
              f"{got:.2f} s read", file=sys.stderr)
    if data.shape[0] == 0:
        raise AudioError(f"{path}: contains no samples")
    if not np.isfinite(data).all():
        raise AudioError(f"{path}: contains NaN or infinite samples")
    mono = data.mean(axis=1)
    if rate != SAMPLE_RATE:
        import librosa

        mono = librosa.resample(mono, orig_sr=rate, target_sr=SAMPLE_RATE)
    return np.ascontiguousarray(mono, dtype=np.float32)


_FILTERS: np.ndarray | None = None


def mel_filters() -> np.ndarray:
    """(128, 201) Slaney-scale, Slaney-normalised mel filters over 0-8000 Hz."""
    global _FILTERS
    if _FILTERS is None:
        import librosa

        _FILTERS = librosa.filters.mel(sr=SAMPLE_RATE, n_fft=N_FFT, n_mels=128, fmin=0.0, fmax=8000.0,
                                       htk=False, norm="slaney").astype(np.float64)
    return _FILTERS


def log_mel(window, n_mels: int = 128, xp=np):
    """(n_mels, 3000) float32 features of one window of at most 480000 samples (zero padded),
    computed with xp (numpy, or cupy for features already on the GPU)."""
    if n_mels != 128:
        raise ValueError(f"only 128 mel bins are supported, the checkpoint asks for {n_mels}")
    x = xp.zeros(WINDOW_SAMPLES, np.float64)
    x[: len(window)] = xp.asarray(window)
    x = xp.pad(x, N_FFT // 2, mode="reflect")
    frames = xp.lib.stride_tricks.as_strided(x, shape=(FRAMES + 1, N_FFT), strides=(HOP * 8, 8))   # (3001, 400)
    hann = 0.5 - 0.5 * xp.cos(2 * np.pi * xp.arange(N_FFT) / N_FFT)              # periodic
    power = xp.abs(xp.fft.rfft(frames * hann, axis=-1)) ** 2                         # (3001, 201)
    mel = xp.asarray(mel_filters()) @ power.T                                        # (128, 3001)
    spec = xp.log10(xp.maximum(mel, 1e-10))[:, :-1]
    spec = xp.maximum(spec, spec.max() - 8.0)
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
    features: object            # (128, 3000) float32, numpy or cupy
    tokens: int                 # audio embeddings that belong to real audio


def windows(samples: np.ndarray, n_mels: int = 128, xp=np) -> list[Window]:
    """Non-overlapping 30 s windows with their features (computed with xp: cupy puts them on
    the GPU); a too-short tail is dropped."""
    out = []
    for start in range(0, len(samples), WINDOW_SAMPLES):
        chunk = samples[start: start + WINDOW_SAMPLES]
        tokens = audio_tokens(valid_frames(len(chunk)))
        if tokens < 1:
            continue
        out.append(Window(start / SAMPLE_RATE, (start + len(chunk)) / SAMPLE_RATE, log_mel(chunk, n_mels, xp), tokens))
    if not out:
        raise AudioError(f"audio too short to transcribe ({len(samples) / SAMPLE_RATE * 1000:.0f} ms; "
                         f"at least {6 * HOP / SAMPLE_RATE * 1000 + 1:.0f} ms needed)")
    return out
