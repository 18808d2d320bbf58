"""Reading long recordings: peak memory and speed of decoding m4a (AAC, through PyAV) and wav
(libsndfile) files of 10 and 60 minutes into 30 s windows of log-mel features, each in a fresh
process (CPU; any host).

    python tools/bench_audio.py [--minutes 10,60] [--out DIR]

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", default="10,60")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--measure", help=argparse.SUPPRESS)     # the child process's entry
    args = ap.parse_args()
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
