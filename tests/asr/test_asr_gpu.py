"""The tiny GLM-ASR on the GPU (cuTile kernels) against the same model on the CPU."""
import cupy
import numpy as np
import pytest

import tilekernels as tk
from glm_asr.features import log_mels, windows
from glm_asr.model import GlmAsr
from glm_asr.pipeline import decode
from tilekernels.runtime import Engine, device_stream, graphed

pytestmark = pytest.mark.gpu


def test_gpu_matches_cpu(tiny, poisoned, rng):
    cpu, gpu = GlmAsr.load(tiny, "cpu"), GlmAsr.load(tiny, "gpu")
    # the checkpoint holds bfloat16 values: the text decoder's matrices stay bfloat16 on the GPU
    layer = gpu.w["decoder"][0]
    dtypes = {a[0].dtype for a in (layer.qkv, layer.o, layer.fc1, layer.fc2)} | {gpu.w["lm_head"].dtype}
    assert dtypes == {tk.weights.BF16}
    assert gpu.w["encoder"][0].fc1[0].dtype == np.float32
    w = windows((rng.standard_normal(16000 * 4) * 0.1).astype(np.float32))[0]
    a = cpu.encode(w.features[None])
    b = gpu.encode(cupy.asarray(w.features[None]))
    assert np.linalg.norm(b.get() - a) / np.linalg.norm(a) < 5e-3
    ids = [100, 101] + [cpu.config.audio_token_id] * w.tokens + [102, 103]
    ours = decode(Engine(gpu, 1), ids, b[0, : w.tokens], 12, ignore_eos=True)
    assert decode(Engine(cpu, 1), ids, a[0, : w.tokens], 12, ignore_eos=True) == ours and len(ours) == 12


def test_a_bfloat16_checkpoint_uploads_as_stored(rounded_tiny):
    """Read as bfloat16 and uploaded so, the GPU model holds what the same values in float32 give:
    the text decoder's matrices bfloat16, its norms and the encoder float32, bit for bit."""
    a, b = (GlmAsr.load(rounded_tiny[k], "gpu") for k in (np.float32, tk.weights.BF16))
    for m in (a, b):
        layer = m.w["decoder"][0]
        assert layer.qkv[0].dtype == tk.weights.BF16 and layer.norm1.weight.dtype == np.float32
    for x, y in zip(*((m.w["decoder"][0].qkv[0], m.w["decoder"][0].norm1.weight, m.w["encoder"][0].fc1[0],
                       m.w["lm_head"]) for m in (a, b))):
        assert x.dtype == y.dtype and bool((x.view(cupy.uint8) == y.view(cupy.uint8)).all())


def test_weights_prepared_on_the_gpu_are_those_the_cpu_prepares(rounded_tiny):
    """load_tensors(device='gpu') uploads the checkpoint as stored and the model stacks, widens
    and folds it there: the same tensors as the CPU's preparation (the folded encoder's to float32
    rounding of the same float64 sums)."""
    from tilekernels.runtime import load_tensors

    path = rounded_tiny[tk.weights.BF16]
    cpu, gpu = load_tensors(path, widen=False), load_tensors(path, widen=False, device="gpu")
    assert cpu.keys() == gpu.keys()
    for k in cpu:
        assert isinstance(gpu[k], cupy.ndarray) and gpu[k].dtype == cpu[k].dtype
        assert np.array_equal(gpu[k].view(cupy.uint16).get(), cpu[k].view(np.uint16))
    config = GlmAsr.load(path).config
    a, b = GlmAsr._read(path, config, "cpu"), GlmAsr._read(path, config, "gpu")
    assert isinstance(b.w["decoder"][0].qkv[0], cupy.ndarray)
    for x, y in zip(*((m.w["decoder"][0].qkv[0], m.w["decoder"][1].fc1[0], *m.w["encoder"][0].qkv,
                       m.w["encoder"][1].fc2[1], m.w["lm_head"]) for m in (a, b))):
        x, y = tk.widen(x), tk.widen(y).get()
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7)


def test_features_on_the_gpu_match_the_cpu(rng):
    """The same log-mel code on cupy (float64 FFT on the device) as on numpy."""
    audio = (rng.standard_normal(16000 * 37) * 0.1).astype(np.float32)     # a full window and a tail
    cpu, gpu = windows(audio), windows(audio, xp=cupy)
    assert [(w.start_s, w.tokens) for w in cpu] == [(w.start_s, w.tokens) for w in gpu]
    for a, b in zip(cpu, gpu):
        assert isinstance(b.features, cupy.ndarray) and b.features.dtype == np.float32
        np.testing.assert_allclose(b.features.get(), a.features, atol=1e-6)
    clips = [audio[i * 16000: (i + 9) * 16000] for i in range(3)]      # three windows in one pass
    np.testing.assert_allclose(log_mels(clips, xp=cupy).get(), log_mels(clips), atol=1e-6)


def test_graph_replays_match_eager_calls(tiny, poisoned, rng):
    """The encoder and the prefill replayed from their captured graphs give what the eager calls
    give, for fresh inputs on every replay and for a second window count and prompt length."""
    gpu = GlmAsr.load(tiny, "gpu")
    cfg = gpu.config
    for n_windows in (1, 2, 1):
        feats = cupy.asarray(rng.standard_normal((n_windows, cfg.encoder.num_mel_bins, 3000)).astype(np.float32))
        np.testing.assert_array_equal(gpu.audio_tower(feats).get(), gpu.audio_tower_eager(feats).get())
        # the encoder and the projector in one graph, as the pipeline encodes
        np.testing.assert_array_equal(gpu.encode(feats).get(), gpu.project(gpu.audio_tower_eager(feats)).get())
    cache = gpu.new_cache(1, 16)
    prefill = graphed(cupy, lambda x: gpu.step(x, cache), "prefill")        # as the runner replays a prompt
    for n_audio in (5, 9, 5):
        ids = [100, 101] + [cfg.audio_token_id] * n_audio + [102]
        audio = cupy.asarray(rng.standard_normal((n_audio, cfg.decoder.hidden_size)).astype(np.float32))
        x = gpu.prompt_embeds(ids, audio)[None]
        with device_stream(cupy):
            cache.length = 0
            cache.begin(len(ids))
            replayed = prefill(x).get()
        eager = gpu.forward(x, gpu.new_cache(1, len(ids)))
        np.testing.assert_array_equal(replayed, eager.get())


def test_vad_on_the_gpu_finds_the_cpus_segments(tiny):
    """The pipeline with the model on the GPU runs its VAD there (the loop batches the readers'
    files): the same segments as on the CPU (worker processes), within a frame or two, and a
    file that cannot be read fails alone."""
    from test_vad import MANIFEST, load

    from glm_asr.pipeline import Transcriber
    from glm_asr.vad import VadOptions

    names = sorted(MANIFEST["files"])
    sources = [(n, (lambda n=n: load(n))) for n in names] + [("bad", lambda: np.zeros((2, 3), np.float32))]
    out = {}
    for device in ("cpu", "gpu"):
        t = Transcriber.load(tiny, device)
        out[device] = {name: r for name, r, _ in t.transcribe_many(sources, "x", 2, vad=VadOptions())}
    assert isinstance(out["gpu"]["bad"], Exception) and isinstance(out["cpu"]["bad"], Exception)
    assert sum(len(out["gpu"][n]) for n in names) >= 3
    for n in names:
        a, b = out["cpu"][n], out["gpu"][n]
        assert len(a) == len(b), (n, a, b)
        assert all(abs(x["start"] - y["start"]) <= 0.07 and abs(x["end"] - y["end"]) <= 0.07 for x, y in zip(a, b))


def test_the_install_warm_up_runs_on_the_gpu(capfd):
    """python -m tilekernels.prebuild glm_asr's last step: a two-layer model of the real sizes transcribes
    on the GPU (its kernels from the kernel list) and says how long it took."""
    from glm_asr import warmup

    assert warmup.main() == 0
    assert capfd.readouterr().out.startswith("glm_asr.warmup: ")
