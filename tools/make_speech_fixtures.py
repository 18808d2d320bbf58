"""Write the speech fixtures of tests/asr/fixtures/: short 16 kHz mono FLAC files with English
sentences synthesised by espeak-ng placed at known offsets between stretches of low noise, and
fixtures.json, the speech interval of each placement (in samples and seconds).

Run by hand (never in CI), needs espeak-ng (Debian: apt-get install espeak-ng):
    uv run python tools/make_speech_fixtures.py [--out tests/asr/fixtures]

Each sentence is synthesised at espeak-ng's 22,050 Hz, resampled to 16 kHz (librosa), trimmed to
the stretch whose 10 ms RMS is within 40 dB of its loudest (espeak-ng pads its output with
silence), scaled to a 0.35 peak and added onto the noise at its offset: the interval written is
exactly where the trimmed clip was placed. Longer cases (speech across 30 s, a region over 30 s)
are assembled by the tests from these clips and generated silence, to keep the files small.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

RATE = 16000
NOISE_RMS = 2e-4                 # -74 dBFS white noise under everything
SEED = 24
VOICE, SPEED = "en-us", 160      # espeak-ng voice and words per minute

SENTENCES = {
    "fox": "The quick brown fox jumps over the dog.",
    "clean": "Clean audio works best.",
    "call": "Please call me back tomorrow.",
    "rain": "It rained all afternoon.",
}

# file -> its layout: seconds of noise and sentence names, alternating, starting with noise
FILES = {
    "noise.flac": [2.0],
    "one.flac": [1.0, "call", 1.2],
    "pause3s.flac": [0.8, "fox", 3.0, "clean", 1.0],
    "pause05.flac": [1.0, "rain", 0.5, "clean", 1.0],
}


def synthesise(text: str) -> np.ndarray:
    """The sentence spoken by espeak-ng, 16 kHz, trimmed to its sound, peak 0.35."""
    import librosa

    with tempfile.TemporaryDirectory() as d:
        wav = Path(d) / "s.wav"
        subprocess.run(["espeak-ng", "-v", VOICE, "-s", str(SPEED), "-w", str(wav), text], check=True)
        x, rate = sf.read(wav, dtype="float32", always_2d=True)
    x = librosa.resample(x.mean(axis=1), orig_sr=rate, target_sr=RATE)
    hop = RATE // 100
    rms = np.sqrt(np.convolve(x.astype(np.float64) ** 2, np.ones(hop) / hop, mode="same"))
    loud = np.flatnonzero(rms > rms.max() * 10 ** (-40 / 20))
    x = x[loud[0]: loud[-1] + 1]
    return (0.35 * x / np.abs(x).max()).astype(np.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/asr/fixtures")
    args = ap.parse_args(argv)
    if shutil.which("espeak-ng") is None:
        print("error: espeak-ng not found (Debian: apt-get install espeak-ng)", file=sys.stderr)
        return 1
    version = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout.strip()
    clips = {name: synthesise(text) for name, text in SENTENCES.items()}
    rng = np.random.default_rng(SEED)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {"sample_rate": RATE, "noise_rms": NOISE_RMS, "synthesis": f"{version}, voice {VOICE}, {SPEED} wpm",
                "sentences": SENTENCES, "files": {}}
    for fname, layout in FILES.items():
        parts, speech, at = [], [], 0
        for item in layout:
            if isinstance(item, str):
                clip = clips[item]
                speech.append({"sentence": item, "start": at, "end": at + len(clip),
                               "start_s": at / RATE, "end_s": (at + len(clip)) / RATE})
            else:
                clip = np.zeros(round(item * RATE), np.float32)
            parts.append(clip)
            at += len(clip)
        x = np.concatenate(parts) + (NOISE_RMS * rng.standard_normal(at)).astype(np.float32)
        sf.write(args.out / fname, x, RATE, subtype="PCM_16", format="FLAC", compression_level=1.0)
        manifest["files"][fname] = {"samples": at, "duration_s": at / RATE, "speech": speech}
        print(f"{fname}: {at / RATE:.2f} s, {(args.out / fname).stat().st_size:,} bytes, speech "
              + ", ".join(f"{s['start_s']:.3f}-{s['end_s']:.3f}" for s in speech))
    (args.out / "fixtures.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
