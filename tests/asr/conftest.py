import numpy as np
import pytest
import soundfile as sf


@pytest.fixture(scope="session")
def audio_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("audio")
    rng = np.random.default_rng(0)

    def tone(rate, seconds, channels=1):
        t = np.arange(int(rate * seconds)) / rate
        x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))
        return np.repeat(x[:, None], channels, 1).astype(np.float32)

    sf.write(d / "speech16k.wav", tone(16000, 2.5), 16000)
    sf.write(d / "long.flac", tone(16000, 65), 16000)
    sf.write(d / "low8k.wav", tone(8000, 1.5), 8000)
    sf.write(d / "six48k.wav", tone(48000, 1.0, 6), 48000)
    sf.write(d / "quiet.ogg", np.zeros((16000, 1), np.float32), 16000)
    sf.write(d / "short.wav", tone(16000, 0.03), 16000)
    sf.write(d / "empty.wav", np.zeros((0, 1), np.float32), 16000)
    nan = tone(16000, 1.0)
    nan[100] = np.nan
    sf.write(d / "nan.wav", nan, 16000, subtype="FLOAT")
    (d / "notaudio.wav").write_text("this is not audio")
    return d


@pytest.fixture(scope="session")
def rounded_tiny(tiny, tmp_path_factory):
    """The tiny checkpoint's values rounded to bfloat16, saved twice: {np.float32: dir, BF16: dir}
    (the second as the hub checkpoint is stored)."""
    from safetensors.numpy import load_file, save_file

    from tilekernels.weights import BF16

    dirs = {dtype: tmp_path_factory.mktemp(f"tiny-{np.dtype(dtype).name}") for dtype in (np.float32, BF16)}
    for dtype, d in dirs.items():
        for f in tiny.iterdir():        # a sharded checkpoint: each shard rounded
            if f.suffix == ".safetensors":
                save_file({k: v.astype(BF16).astype(dtype) for k, v in load_file(f).items()}, d / f.name)
            else:
                (d / f.name).write_bytes(f.read_bytes())
    return dirs
