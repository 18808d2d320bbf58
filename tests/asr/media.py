"""Audio and video files made at test time with PyAV (no binary fixtures)."""
from fractions import Fraction

import numpy as np


def encode(path, streams: list, rate: int = 16000, video: bool = False, audio_start: float = 0.0) -> None:
    """Write `path` with one audio stream per entry of `streams` ((codec, float32 mono samples at
    `rate`)), optionally a few frames of video first; audio_start delays the audio's first pts."""
    import av

    with av.open(str(path), "w") as c:
        vs = None
        if video:
            vs = c.add_stream("libvpx" if str(path).endswith(".webm") else "libx264", rate=10)
            vs.width, vs.height, vs.pix_fmt = 64, 48, "yuv420p"
        outs = []
        for codec, samples in streams:
            a = c.add_stream(codec, rate=48000 if "opus" in codec else rate)
            a.layout = "stereo" if "opus" in codec else "mono"
            outs.append((a, samples))
        for a, samples in outs:
            x = samples if a.rate == rate else _resample(samples, rate, a.rate)
            x = np.stack([x, x]) if a.layout.name == "stereo" else x[None]
            n, pts = a.codec_context.frame_size or 1024, int(audio_start * a.rate)
            for i in range(0, x.shape[1], n):
                f = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[:, i:i + n], np.float32), format="fltp",
                                               layout=a.layout.name)
                f.sample_rate, f.pts, f.time_base = a.rate, pts, Fraction(1, a.rate)
                pts += f.samples
                for p in a.encode(f):
                    c.mux(p)
            for p in a.encode(None):
                c.mux(p)
        if vs is not None:
            for i in range(20):
                frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 10, np.uint8), format="rgb24")
                for p in vs.encode(frame):
                    c.mux(p)
            for p in vs.encode(None):
                c.mux(p)


def _resample(x, rate, to):
    import soxr

    return soxr.resample(x, rate, to).astype(np.float32)


def voice(seconds: float = 3.0, seed: int = 0, f0: float = 140.0) -> np.ndarray:
    """Speech-like audio: a harmonic tone under a syllable-rate envelope, with a little noise."""
    t = np.arange(int(16000 * seconds)) / 16000
    x = sum(np.sin(2 * np.pi * k * f0 * t) / k for k in range(1, 6)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (0.2 * x + 0.01 * np.random.default_rng(seed).standard_normal(len(t))).astype(np.float32)
