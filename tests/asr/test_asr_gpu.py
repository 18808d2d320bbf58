"""The tiny GLM-ASR on the GPU (cuTile kernels) against the same model on the CPU."""
import cupy
import numpy as np
import pytest

from glm_asr.features import windows
from glm_asr.model import GlmAsr

pytestmark = pytest.mark.gpu


def test_gpu_matches_cpu(tiny, poisoned, rng):
    cpu, gpu = GlmAsr.load(tiny, "cpu"), GlmAsr.load(tiny, "gpu")
    w = windows((rng.standard_normal(16000 * 4) * 0.1).astype(np.float32))[0]
    a = cpu.encode(w.features[None])
    b = gpu.encode(cupy.asarray(w.features[None]))
    assert np.linalg.norm(b.get() - a) / np.linalg.norm(a) < 5e-3
    ids = [100, 101] + [cpu.config.audio_token_id] * w.tokens + [102, 103]
    assert cpu.greedy(ids, a[0, : w.tokens], 12, eos=()) == gpu.greedy(ids, b[0, : w.tokens], 12, eos=())


def test_features_on_the_gpu_match_the_cpu(rng):
    """The same log-mel code on cupy (float64 FFT on the device) as on numpy."""
    audio = (rng.standard_normal(16000 * 37) * 0.1).astype(np.float32)     # a full window and a tail
    cpu, gpu = windows(audio), windows(audio, xp=cupy)
    assert [(w.start_s, w.tokens) for w in cpu] == [(w.start_s, w.tokens) for w in gpu]
    for a, b in zip(cpu, gpu):
        assert isinstance(b.features, cupy.ndarray) and b.features.dtype == np.float32
        np.testing.assert_allclose(b.features.get(), a.features, atol=1e-6)
