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
