"""Installed from wheels, away from the repository: a fresh venv gets tilekernels, gpt and
glm_asr built from packages/, and both command lines run from another directory with the
configs and the Shakespeare model shipped inside the wheels."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[2]
UV = os.environ.get("UV") or shutil.which("uv")
pytestmark = pytest.mark.skipif(not UV, reason="uv not found (neither $UV nor on PATH)")


def clean_env() -> dict:
    """No trace of the workspace: no PYTHONPATH, no active venv; the hub offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME="/tmp/empty-hf-home")
    return env


def run(cmd, cwd, timeout=300):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with the three packages installed from their directories as wheels.
    --no-sources: the packages' published metadata, as pip would see it (with the workspace's
    sources uv would install the tilekernels dependency editable, pointing into the repo)."""
    d = tmp_path_factory.mktemp("install") / "venv"
    r = run([UV, "venv", d, "--python", sys.executable], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    python = d / "bin" / "python"
    r = run([UV, "pip", "install", "--no-sources", "--python", python, "./packages/tilekernels", "./packages/gpt",
             "./packages/glm_asr"], cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return python


def test_imports_and_configs_come_from_the_venv(venv, tmp_path):
    r = run([venv, "-c", "import gpt, glm_asr, tilekernels, tilekernels.runtime\n"
                         "from tilekernels.runtime.cli import config_dir\n"
                         "for f in (gpt.__file__, glm_asr.__file__, tilekernels.__file__, tilekernels.runtime.__file__,"
                         " config_dir('gpt'), config_dir('glm_asr')): print(f)"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    paths = [Path(p).resolve() for p in r.stdout.split()]
    prefix = venv.parent.parent.resolve()
    assert len(paths) == 6
    for p in paths:
        assert p.is_relative_to(prefix) and not p.is_relative_to(ROOT), p
    assert (paths[4] / "generate.yaml").is_file() and (paths[5] / "transcribe.yaml").is_file()


def test_installed_gpt_generate_runs_the_shipped_model(venv, tmp_path):
    r = run([venv, "-m", "gpt.generate", "max_new_tokens=5", "seed=1", "device=cpu", "prompt=ROMEO:"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout) > len("ROMEO:\n"), r.stdout
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []          # Hydra writes nothing in the cwd


def test_installed_transcribe_runs(venv, tmp_path):
    ckpt = tmp_path / "tiny"
    r = run([sys.executable, "-m", "glm_asr.synthetic", ckpt], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    t = np.arange(24000) / 16000
    sf.write(tmp_path / "a.wav", (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000)
    r = run([venv, "-m", "glm_asr.transcribe", "a.wav", f"model.path={ckpt}", "max_new_tokens=2", "device=cpu",
             "output_format=json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert '"file": "a.wav"' in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("package,module,config", [("gpt", "gpt", "generate.yaml"),
                                                   ("glm-asr", "glm_asr", "transcribe.yaml")])
def test_sdist_builds_a_wheel_with_the_configs(package, module, config, tmp_path):
    """`uv build` (as `python -m build`) makes the sdist, then the wheel from the unpacked sdist:
    the configs (a link to the top-level configs/) must be in the sdist as files, so in the wheel,
    and so must the kernel lists."""
    r = run([UV, "build", "--package", package, "-o", tmp_path], cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    wheels = list(tmp_path.glob("*.whl"))
    assert len(wheels) == 1
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert f"{module}/configs/{config}" in names
    # the kernel lists a GPU load builds ahead (tilekernels.cubins)
    shipped = {p.name for p in (ROOT / "packages" / module / "src" / module / "kernels").glob("*.txt")}
    assert shipped and {n.rsplit("/", 1)[1] for n in names if n.startswith(f"{module}/kernels/")} == shipped
