"""The install's warm-up (glm_asr.warmup, run by tilekernels.prebuild) and the synthetic checkpoints
it transcribes with (glm_asr.synthetic)."""
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from glm_asr import synthetic, warmup
from tilekernels import prebuild
from tilekernels.runtime.device import gpu_problem

TINY = dict(enc=64, enc_heads=4, dec=64, dec_heads=4, kv_heads=2, dec_inner=128)


def test_a_bfloat16_checkpoint_holds_the_float32_ones_values(tmp_path):
    """Stored as the hub stores it (bfloat16), the tests' float32 form's seeded values rounded (the
    matrices' exactly: they are bfloat16 values in both)."""
    from tilekernels.weights import BF16

    a = load_file(synthetic.write_checkpoint(tmp_path / "a") / "model.safetensors")
    b = load_file(synthetic.write_checkpoint(tmp_path / "b", dtype="bfloat16") / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 20
    for k in a:
        assert b[k].dtype == BF16, (k, b[k].dtype)
        assert np.array_equal(a[k].astype(BF16), b[k]), k
        assert a[k].ndim == 1 or np.array_equal(a[k], b[k].astype(np.float32)), k


def test_the_warm_up_transcribes_with_a_two_layer_model(monkeypatch):
    """What the install runs on the GPU, here on the CPU at tiny sizes: a two-layer bfloat16
    checkpoint, both VAD modes, and a text from each."""
    import glm_asr

    seen = []
    real = glm_asr.SpeechRecognizer.transcribe

    def transcribe(self, audio, **kw):
        seen.append((self.transcriber.model.config.decoder.num_layers, kw["vad"]))
        return real(self, audio, **kw)

    monkeypatch.setattr(glm_asr.SpeechRecognizer, "transcribe", transcribe)
    texts = warmup.warm("cpu", **TINY)
    assert seen == [(2, "silero"), (2, "none")]      # two decoder layers: a cache of several
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


@pytest.mark.skipif(gpu_problem() is None, reason="a GPU works here (test_asr_gpu.py runs the warm-up)")
def test_the_warm_up_without_a_gpu_is_one_line_and_exit_1():
    r = subprocess.run([sys.executable, "-m", "glm_asr.warmup"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error: glm_asr.warmup: ") and r.stderr.count("\n") == 1, r.stderr


def test_prebuild_runs_the_warm_ups_the_packages_ship(tmp_path, monkeypatch):
    """prebuild finds PACKAGE.warmup for package targets only and runs each in a process of its own;
    its exit status is 1 when one fails."""
    assert prebuild.warmups(["glm_asr", "gpt", "glm_asr", str(tmp_path / "k.txt")]) == ["glm_asr.warmup"]
    for name, body in (("good", "open('ran-good', 'w').close()"), ("bad", "raise SystemExit(3)")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "warmup.py").write_text(body + "\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert prebuild.warm_up(["good"]) == 0 and (tmp_path / "ran-good").exists()
    (tmp_path / "ran-good").unlink()
    assert prebuild.warm_up(["bad", "good"]) == 1 and (tmp_path / "ran-good").exists()     # the rest still run


def test_prebuild_warms_up_only_for_this_machines_gpu(monkeypatch, capsys):
    """With --arch (a build for another machine, maybe without a GPU) no warm-up runs; without it
    the warm-ups run after the kernels and their failure is prebuild's exit status."""
    ran = []
    monkeypatch.setattr(prebuild, "missing", lambda lines, arch: [])
    monkeypatch.setattr(prebuild, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(prebuild, "warm_up", lambda targets: ran.append(targets) or 1)
    assert prebuild.main(["glm_asr", "--arch", "sm_90"]) == 0 and ran == []
    assert prebuild.main(["glm_asr", "gpt"]) == 1 and ran == [["glm_asr", "gpt"]]


def test_the_synthetic_checkpoint_command_fails_in_one_line(tmp_path):
    """python -m glm_asr.synthetic DIR: a folder it cannot make is one line and exit 1."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    r = subprocess.run([sys.executable, "-m", "glm_asr.synthetic", str(blocked / "ckpt")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr
