"""Log-mel features against a float64 re-derivation, token counts, windows, prompt."""
import math

import numpy as np
import pytest

from glm_asr.features import FRAMES, audio_tokens, log_mel, mel_filters, valid_frames, windows


def slow_log_mel(x: np.ndarray) -> np.ndarray:
    """Whisper's recipe written out frame by frame (full complex FFT, explicit window)."""
    buf = np.zeros(480000)
    buf[: len(x)] = x
    buf = np.concatenate([buf[200:0:-1], buf, buf[-2:-202:-1]])            # reflect padding
    n = np.arange(400)
    hann = np.sin(np.pi * n / 400) ** 2                                    # periodic Hann
    spec = np.empty((201, 3000))
    for f in range(3000):
        seg = buf[f * 160: f * 160 + 400] * hann
        spec[:, f] = np.abs(np.fft.fft(seg)[:201]) ** 2
    mel = np.log10(np.maximum(mel_filters() @ spec, 1e-10))
    mel = np.maximum(mel, mel.max() - 8)
    return (mel + 4) / 4


def test_log_mel_matches_float64_recipe(rng):
    x = (rng.standard_normal(16000 * 7) * 0.1).astype(np.float32)
    got = log_mel(x)
    assert got.shape == (128, FRAMES) and got.dtype == np.float32
    np.testing.assert_allclose(got, slow_log_mel(x.astype(np.float64)), atol=1e-5)


def test_mel_filters_are_librosas():
    """The shipped table is librosa's Slaney filters, to the bit (regenerate it with the call
    below and np.savez_compressed(MEL_FILTERS, mel_128=...) if librosa's ever change)."""
    import librosa

    f = mel_filters()
    want = librosa.filters.mel(sr=16000, n_fft=400, n_mels=128, fmin=0.0, fmax=8000.0, htk=False, norm="slaney")
    assert f.shape == (128, 201) and f.dtype == np.float64
    np.testing.assert_array_equal(f, want.astype(np.float64))
    assert (f >= 0).all() and (f.sum(1) > 0).all()


def test_features_need_no_librosa_import():
    """A first file's features import neither librosa nor scipy (seconds of a fresh process)."""
    import subprocess
    import sys

    code = ("import sys, numpy as np; from glm_asr.features import log_mel; log_mel(np.zeros(16000, np.float32)); "
            "print(sorted(m for m in ('librosa', 'scipy', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("frames,tokens", [(3000, 375), (7, 1), (6, 0), (1, 0), (1001, 125), (2999, 375)])
def test_token_count_formula(frames, tokens):
    l2 = math.ceil(frames / 2)
    assert audio_tokens(frames) == tokens == max(0, (l2 - 4) // 4 + 1)


def test_windows_of_long_audio(rng):
    x = (rng.standard_normal(16000 * 65) * 0.1).astype(np.float32)
    ws = windows(x)
    assert [(w.start_s, w.end_s) for w in ws] == [(0, 30), (30, 60), (60, 65)]
    assert [w.tokens for w in ws] == [375, 375, audio_tokens(valid_frames(5 * 16000))]
