"""Reading long recordings: peak memory and speed of decoding m4a (AAC, through PyAV) and wav
(libsndfile) files of 10 and 60 minutes into 30 s windows of log-mel features, each in a fresh
process (CPU; any host); --vad: Silero VAD's probabilities and segments over 60 minutes of the
espeak-ng fixtures between pauses and noise, on all of this host's cores and on its GPU.

    python tools/bench_audio.py [--minutes 10,60] [--out DIR]
    python tools/bench_audio.py --vad [--out DIR]

Memory must not grow with the file's length: samples arrive in blocks and windows are made as
they are consumed (glm_asr.audio.Audio, glm_asr.features.stream_windows).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make(path: Path, minutes: int) -> None:
    """minutes of speech-like audio at 16 kHz: wav with soundfile, m4a (AAC) with PyAV."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests" / "asr"))
    from media import encode, voice

    x = np.tile(voice(60.0), minutes)
    if path.suffix == ".wav":
        import soundfile as sf

        sf.write(path, x, 16000)
    else:
        encode(path, [("aac", x)])


def measure(path: str) -> dict:
    """In this (fresh) process: read the file into windows of features; seconds and peak RSS."""
    from glm_asr.audio import Audio
    from glm_asr.features import stream_windows

    before = peak_rss_mb()
    t = time.perf_counter()
    audio = Audio(path)
    n = sum(1 for _ in stream_windows(audio, offset_s=audio.offset_s))
    seconds = time.perf_counter() - t
    return {"windows": n, "wall_s": round(seconds, 2), "peak_rss_mb": peak_rss_mb(), "rss_before_mb": before}


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def bench_vad(out_dir: str) -> None:
    """Silero's probabilities over 60 minutes (first call warms up; median of the next 3), then the
    segmentation: speech_probs on all of this host's CPUs, and device_probs on the GPU where there
    is one (from host samples: the upload and the probabilities' download included); written to
    vad-60min.json."""
    import os
    import statistics

    import numpy as np
    import soundfile as sf

    from glm_asr.vad import speech_probs, speech_segments

    fixtures = ROOT / "tests" / "asr" / "fixtures"
    clips = [sf.read(fixtures / f, dtype="float32")[0] for f in ("one.flac", "pause3s.flac", "pause05.flac", "noise.flac")]
    rng = np.random.default_rng(0)
    parts, n = [], 0
    while n < 3600 * 16000:
        gap = (rng.standard_normal(int(rng.uniform(0.2, 4) * 16000)) * 2e-4).astype(np.float32)
        parts += [clips[rng.integers(len(clips))], gap]
        n += len(parts[-2]) + len(gap)
    x = np.concatenate(parts)[: 3600 * 16000]
    runs = {"cpu": speech_probs}
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import cupy

        from glm_asr.vad import device_probs

        cupy.cuda.runtime.getDeviceCount()
        runs["gpu"] = lambda a: device_probs([cupy.asarray(a)])[0]
        versions["cupy"] = cupy.__version__
        gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:       # noqa: BLE001 - no GPU here: the CPU row only
        gpu = None
    rows, found = [], {}
    for device, run in runs.items():
        times = []
        for _ in range(4):
            t = time.perf_counter()
            probs = run(x)
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        found[device] = speech_segments(x, probs=probs)
        rows.append({"device": device, "audio_s": 3600, "cpus": os.cpu_count(), "gpu": gpu if device == "gpu" else None,
                     "speech_probs_s": [round(v, 4) for v in times],
                     "speech_probs_median_s": round(statistics.median(times[1:]), 4), "segments": len(found[device]),
                     "segmentation_s": round(time.perf_counter() - t, 3)})
        print(rows[-1])
    if "gpu" in found:          # the two runs cut blocks differently (their resets move edge frames)
        a, b = found["cpu"], found["gpu"]
        rows[-1]["segments_within_0.1s_of_cpu"] = len(a) == len(b) and all(
            abs(p.start - q.start) <= 1600 and abs(p.end - q.end) <= 1600 for p, q in zip(a, b))
    out = Path(out_dir) / "vad-60min.json"
    out.write_text(json.dumps({"host": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "gpu": gpu,
                               "versions": versions,
                               "what": "Silero VAD 16 kHz over 60 minutes of speech fixtures, pauses and noise: "
                                       "glm_asr.vad.speech_probs (numpy, blocks in threads on all CPUs) and "
                                       "device_probs (tilekernels on the GPU, from host samples)",
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", default="10,60")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--measure", help=argparse.SUPPRESS)     # the child process's entry
    ap.add_argument("--vad", action="store_true", help="time Silero VAD over 60 minutes instead")
    args = ap.parse_args()
    if args.vad:
        bench_vad(args.out)
        return
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for minutes in (int(m) for m in args.minutes.split(",")):
            for ext in ("m4a", "wav"):
                path = Path(d) / f"{minutes}min.{ext}"
                make(path, minutes)
                r = subprocess.run([sys.executable, __file__, "--measure", str(path)], capture_output=True, text=True,
                                   check=True)
                row = {"format": ext, "minutes": minutes, "file_mb": round(path.stat().st_size / 2**20, 1),
                       **json.loads(r.stdout)}
                row["times_real_time"] = round(minutes * 60 / row["wall_s"], 1)
                rows.append(row)
                print(row)
                path.unlink()
    import av
    import numpy

    out = Path(args.out) / "audio-read-cpu.json"
    out.write_text(json.dumps({"host": platform.processor() or platform.machine(), "cpus": __import__("os").cpu_count(),
                               "versions": {"python": platform.python_version(), "numpy": numpy.__version__,
                                            "av": av.__version__},
                               "what": "Audio + stream_windows (CPU log-mel) of speech-like audio, one fresh process "
                                       "per file; peak_rss_mb: its VmHWM (rss_before_mb: after imports)",
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
