"""The transcribe command line's outputs and refusals on the tiny checkpoint (CPU): JSON Lines
for several files, subtitle formats needing output_dir, clashing names, odd file names,
option checking, truncated audio and unwritable outputs."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf


def cli(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": "/tmp/empty-hf-home"}
    return subprocess.run([sys.executable, "-m", "glm_asr.transcribe", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=600)


def one_error_line(r, *needles):
    """Bad input: exit 1, exactly one stderr line, 'error: ...', no traceback, nothing on stdout."""
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_json_lines_for_several_files_with_odd_names(tiny, audio_dir, tmp_path):
    """Two files to stdout as JSON: one JSON object per line. The files are named like a Hydra
    override and like a flag, given relative to the working directory: both are inputs."""
    shutil.copy(audio_dir / "speech16k.wav", tmp_path / "name=with_equals.wav")
    shutil.copy(audio_dir / "low8k.wav", tmp_path / "-dash.wav")
    r = cli("name=with_equals.wav", "-dash.wav", f"model.path={tiny}", "vad=none", "max_new_tokens=2", "device=cpu",
            "output_format=json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and r.stdout.endswith("\n"), r.stdout
    docs = [json.loads(line) for line in lines]
    assert all(isinstance(d, dict) for d in docs)
    assert [d["file"] for d in docs] == ["name=with_equals.wav", "-dash.wav"]
    assert all(isinstance(d["text"], str) and len(d["segments"]) == 1 for d in docs)


def test_json_for_one_file_is_one_document(tiny, audio_dir):
    wav = audio_dir / "speech16k.wav"
    r = cli(wav, f"model.path={tiny}", "vad=none", "max_new_tokens=2", "device=cpu", "output_format=json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().count("\n") > 1          # pretty printed, not a JSON line
    doc = json.loads(r.stdout)
    assert doc["file"] == str(wav) and doc["segments"][0]["start"] == 0 and doc["segments"][0]["end"] == 2.5


def test_json_segments_carry_tokens_compression_and_no_speech(tiny):
    """Each JSON segment holds its decoded token ids (which decode to its text), its text's zlib
    compression ratio, and with the VAD no_speech_prob = 1 - the mean speech probability of its
    frames (a probability; null with vad none)."""
    import zlib

    from glm_asr.vad import FRAME, VadOptions, segments_from_probs, speech_probs
    from tilekernels.runtime import load_tokenizer

    tok = load_tokenizer(tiny)
    fixture = Path(__file__).parent / "fixtures" / "pause05.flac"
    for vad in ("silero", "none"):
        r = cli(fixture, f"model.path={tiny}", f"vad={vad}", "max_new_tokens=6", "device=cpu", "output_format=json")
        assert r.returncode == 0, r.stderr
        segments = json.loads(r.stdout)["segments"]
        assert segments
        for seg in segments:
            assert seg["tokens"] and all(isinstance(t, int) for t in seg["tokens"])
            assert tok.decode(seg["tokens"], skip_special_tokens=True).strip() == seg["text"]
            raw = seg["text"].encode()
            assert seg["compression_ratio"] == (round(len(raw) / len(zlib.compress(raw)), 3) if raw else 0.0)
            assert -50 < seg["avg_logprob"] < 0         # the tokens' mean log-probability
        if vad == "none":
            assert all(seg["no_speech_prob"] is None for seg in segments)
            continue
        audio, _ = sf.read(fixture, dtype="float32")
        p = speech_probs(audio)
        spans = segments_from_probs(p, len(audio), VadOptions())
        assert len(spans) == len(segments)
        for seg, span in zip(segments, spans):
            mean = float(np.mean(p[span.start // FRAME: -(-span.end // FRAME)], dtype=np.float64))
            assert abs(seg["no_speech_prob"] - (1 - mean)) <= 1e-4 and 0 <= seg["no_speech_prob"] <= 1


def test_compression_ratio_sees_a_loop():
    """A decode that loops compresses far better than speech's text: above the 2.4 that
    Whisper-family engines take for a failed segment."""
    from glm_asr.pipeline import compression_ratio

    assert compression_ratio("the the the the the the the the the the the the the the the the") > 2.4
    assert compression_ratio("A quick brown fox jumps over the lazy dog near the riverbank.") < 2.4
    assert compression_ratio("") == 0.0


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitles_for_several_files_need_output_dir(tiny, audio_dir, fmt):
    r = cli(audio_dir / "speech16k.wav", audio_dir / "low8k.wav", f"model.path={tiny}", "vad=none", "max_new_tokens=2",
            "device=cpu", f"output_format={fmt}")
    one_error_line(r, "output_dir", fmt)


def test_subtitle_lines_take_their_width_and_count(tiny, tmp_path):
    """max_line_width and max_line_count (WhisperX's names) shape every srt cue; a bad one is one
    error line before any work."""
    clip = Path(__file__).resolve().parent / "fixtures" / "pause05.flac"
    r = cli(clip, f"model.path={tiny}", "max_new_tokens=60", "device=cpu", "output_format=srt", "max_line_width=16",
            "max_line_count=1", "temperature=0")
    assert r.returncode == 0, r.stderr
    cues = [c.split("\n") for c in r.stdout.strip().split("\n\n")]
    assert len(cues) > 1 and all(len(c) == 3 and len(c[2]) <= 16 for c in cues), r.stdout
    one_error_line(cli(clip, f"model.path={tiny}", "device=cpu", "max_line_width=0"), "max_line_width")


def test_same_stem_from_two_folders(tiny, audio_dir, tmp_path):
    for d, src in (("s1", "speech16k.wav"), ("s2", "low8k.wav")):
        (tmp_path / d).mkdir()
        shutil.copy(audio_dir / src, tmp_path / d / "x.wav")
    out = tmp_path / "out"
    r = cli(tmp_path / "s1/x.wav", tmp_path / "s2/x.wav", f"model.path={tiny}", "vad=none", "max_new_tokens=2",
            "device=cpu", "output_format=json", f"output_dir={out}")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert sorted(p.name for p in out.iterdir()) == ["x-1.json", "x-2.json"]
    assert json.loads((out / "x-1.json").read_text())["file"] == str(tmp_path / "s1/x.wav")
    assert json.loads((out / "x-2.json").read_text())["file"] == str(tmp_path / "s2/x.wav")
    assert json.loads((out / "x-2.json").read_text())["segments"][0]["end"] == 1.5       # low8k: 1.5 s


@pytest.mark.parametrize("value,message", [
    ("abc", "max_new_tokens must be an integer"),
    ("2.7", "max_new_tokens must be an integer"),
    ("100000000", "exceeds the model's"),          # the tiny decoder's max_position_embeddings
    ("1000", "exceeds the engine's 1024 positions a slot"),     # pipeline.SLOT_POSITIONS
])
def test_bad_max_new_tokens_one_line(tiny, audio_dir, value, message):
    r = cli(audio_dir / "speech16k.wav", f"model.path={tiny}", "vad=none", f"max_new_tokens={value}", "device=cpu")
    one_error_line(r, message)


def test_truncated_wav_warns_and_transcribes(tiny, tmp_path):
    wav = tmp_path / "cut.wav"
    t = np.arange(16000) / 16000
    sf.write(wav, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000)
    data = wav.read_bytes()
    wav.write_bytes(data[: len(data) // 2])
    r = cli(wav, f"model.path={tiny}", "vad=none", "max_new_tokens=2", "device=cpu")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(wav) in warnings[0] and "truncated" in warnings[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout.count("\n") == 1
    import struct

    pcm = (np.sin(2 * np.pi * 440 * t) * 9000).astype("<i2").tobytes()        # a WAV as ffmpeg streams it to a
    streamed = (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, 16000,
                32000, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF) + pcm)       # pipe: sizes 2**32 - 1, unknown
    r = subprocess.run([sys.executable, "-m", "glm_asr.transcribe", "-", f"model.path={tiny}", "vad=none",
                        "max_new_tokens=2", "device=cpu"], input=streamed, capture_output=True, timeout=300)
    assert r.returncode == 0 and r.stderr.decode().startswith("1 file transcribed"), r.stderr


def test_a_wav_cut_after_its_header_is_one_error_and_the_others_go_on(tiny, audio_dir, tmp_path):
    """A WAV cut right after its 44-byte header (libsndfile: 'should be 0' bytes of data) is that
    file's error line; the files around it are transcribed."""
    head = tmp_path / "head.wav"
    head.write_bytes((audio_dir / "speech16k.wav").read_bytes()[:44])
    ok = audio_dir / "speech16k.wav"
    r = cli(ok, head, ok, f"model.path={tiny}", "vad=none", "max_new_tokens=2", "device=cpu")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(head) in errors[0], r.stderr
    assert r.stdout.count("\n") == 2


def test_an_output_name_near_the_file_systems_limit_is_written(tmp_path):
    """A 250-byte output name fits (255); its temporary, named after it, must fit too."""
    from glm_asr.formats import write_atomic

    path = tmp_path / ("x" * 246 + ".txt")
    write_atomic(path, "text\n")
    assert path.read_text() == "text\n" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_unwritable_output_names_the_output_and_keeps_the_others(tiny, audio_dir, tmp_path):
    """An output that cannot be written (its name taken by a directory: fails as root too) gets one
    error line naming the output path (not the hidden temporary file); the other input's output is
    written; exit 1; no temporary file is left behind."""
    out = tmp_path / "out"
    (out / "speech16k.txt").mkdir(parents=True)
    r = cli(audio_dir / "speech16k.wav", audio_dir / "low8k.wav", f"model.path={tiny}", "vad=none", "max_new_tokens=2",
            "device=cpu", f"output_dir={out}")
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error:") and str(out / "speech16k.txt") in lines[0], r.stderr
    assert lines[1].startswith("1 file transcribed, ") and lines[1].endswith("; 1 failed"), r.stderr
    assert ".speech16k.txt." not in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["low8k.txt", "speech16k.txt"]
    assert (out / "low8k.txt").read_text().endswith("\n")


def test_output_dir_that_is_a_file_is_refused_before_any_work(tiny, audio_dir, tmp_path):
    blocker = tmp_path / "outdir"
    blocker.write_text("a file, not a directory")
    r = cli(audio_dir / "speech16k.wav", f"model.path={tiny}", "vad=none", "device=cpu", f"output_dir={blocker}")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "output_dir" in r.stderr, r.stderr
    assert blocker.read_text() == "a file, not a directory"
    r = cli(audio_dir / "speech16k.wav", f"model.path={tiny}", "vad=none", "device=cpu",
            f"output_dir={blocker / 'sub'}")       # cannot be made: said before the model loads, not after the work
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "is not a directory" in r.stderr, r.stderr
    assert "model loaded" not in r.stderr
