"""Inputs users have: m4a, mp4 and webm made with PyAV at test time, a video without audio, a
file with two audio streams, standard input, folders and glob patterns."""
import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
from asr_cli import cli
from media import encode, voice

from glm_asr.audio import Audio, AudioError, expand_inputs, read_audio
from glm_asr.features import windows

CODEC_LOSS = 0.06        # relative error of the log-mel features after the codec (measured 0.030-0.036)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    x = voice()
    sf.write(d / "talk.wav", x, 16000)
    encode(d / "memo.m4a", [("aac", x)])
    encode(d / "meeting.mp4", [("aac", x)], video=True)
    encode(d / "clip.webm", [("libopus", x)], video=True)
    noise = (0.3 * np.random.default_rng(5).standard_normal(len(x))).astype(np.float32)
    encode(d / "two.mkv", [("aac", noise), ("aac", x)])
    encode(d / "late.mp4", [("aac", x)], video=True, audio_start=1.0)
    encode(d / "silent-film.mp4", [], video=True)
    return d


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("name", ["memo.m4a", "meeting.mp4", "clip.webm"])
def test_codec_files_give_the_wav_features_within_the_codec_loss(media, name):
    ref = windows(read_audio(media / "talk.wav"))[0]
    got = windows(read_audio(media / name))[0]
    assert got.tokens == ref.tokens
    assert rel(got.features, ref.features) < CODEC_LOSS


def test_audio_stream_picks_a_stream(media):
    ref = windows(read_audio(media / "talk.wav"))[0].features
    first, second = (windows(read_audio(media / "two.mkv", k))[0].features for k in (None, 1))
    assert rel(second, ref) < CODEC_LOSS < rel(first, ref)
    with pytest.raises(AudioError, match="audio_stream=2, but the file has 2 audio stream"):
        Audio(str(media / "two.mkv"), 2)


def test_no_audio_stream_and_undecodable_files_are_one_line_errors(media, tmp_path):
    with pytest.raises(AudioError, match="silent-film.mp4: no audio stream"):
        Audio(str(media / "silent-film.mp4"))
    bad = tmp_path / "bad.m4a"
    bad.write_bytes(b"\x00\x00\x00\x18ftypM4A " + bytes(200))
    with pytest.raises(AudioError, match="bad.m4a: not a readable audio or video file"):
        list(Audio(str(bad)))


def test_timestamps_in_the_file_time_of_a_late_audio_stream(media):
    """The audio stream starts 1 s into the container (FFmpeg's timeline, where AAC's 1,024
    priming samples sit just before it): segment times follow."""
    a = Audio(str(media / "late.mp4"))
    assert abs(a.offset_s - (1.0 - 1024 / 16000)) < 1e-6


def test_blocks_are_bounded_and_rejoin_to_the_whole(tmp_path, monkeypatch):
    """Samples come in blocks of about BLOCK_SECONDS (memory does not grow with the file), for
    both decoders, resampled in a stream exactly as librosa resamples the whole file."""
    import librosa

    import glm_asr.audio as audio

    monkeypatch.setattr(audio, "BLOCK_SECONDS", 1)
    x = np.random.default_rng(0).standard_normal(44100 * 5).astype(np.float32) * 0.1
    sf.write(tmp_path / "a.wav", x, 44100, subtype="FLOAT")
    encode(tmp_path / "a.m4a", [("aac", voice(5.0))])
    for f in ("a.wav", "a.m4a"):
        blocks = list(Audio(str(tmp_path / f)))
        assert len(blocks) >= 4 and max(map(len, blocks)) < 2.2 * 16000
    whole = np.concatenate(list(Audio(str(tmp_path / "a.wav"))))
    np.testing.assert_array_equal(whole, librosa.resample(x, orig_sr=44100, target_sr=16000))


def test_a_file_sampled_too_slowly_is_refused(tmp_path):
    """A 4 KB WAV whose header says 1 Hz would resample to over an hour: refused, by both
    decoders, before any work."""
    sf.write(tmp_path / "slow.wav", np.zeros(4000, np.float32), 1)
    encode(tmp_path / "slow.mkv", [("pcm_s16le", np.zeros(4000, np.float32))], rate=1000)
    for f in ("slow.wav", "slow.mkv"):
        with pytest.raises(AudioError, match="Hz is needed"):
            Audio(str(tmp_path / f))


@pytest.mark.parametrize("rate,n", [(44100, 1), (48000, 144013), (22050, 3 * 22050 + 13), (8000, 7)])
def test_resampled_as_many_samples_as_librosa_gives(tmp_path, monkeypatch, rate, n):
    """Lengths that 16 kHz does not divide: librosa rounds the length up (zero padded), and so do
    both decoders (a one-sample file is one sample, not an empty file)."""
    import librosa

    import glm_asr.audio as audio

    monkeypatch.setattr(audio, "BLOCK_SECONDS", 1)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 0.1
    sf.write(tmp_path / "a.wav", x, rate, subtype="FLOAT")
    encode(tmp_path / "a.mkv", [("pcm_f32le", x)], rate=rate)
    want = librosa.resample(x, orig_sr=rate, target_sr=16000)
    for f in ("a.wav", "a.mkv"):
        np.testing.assert_array_equal(np.concatenate(list(Audio(str(tmp_path / f)))), want)


def test_expand_inputs_folders_globs_and_extensions(tmp_path):
    (tmp_path / "b" / "c").mkdir(parents=True)
    for f in ("z.wav", "b/a.M4A", "b/c/y.mp4", "b/notes.txt"):
        (tmp_path / f).write_bytes(b"x")
    files, errors = expand_inputs([str(tmp_path)])
    assert [f[len(str(tmp_path)) + 1:] for f in files] == ["b/a.M4A", "b/c/y.mp4", "z.wav"] and not errors
    files, _ = expand_inputs([str(tmp_path)], ["mp4"])
    assert [f.endswith("y.mp4") for f in files] == [True]
    files, errors = expand_inputs([str(tmp_path / "**" / "*.mp4"), str(tmp_path / "*.ogg"), "-", "missing.wav"])
    assert files[0].endswith("y.mp4") and files[1:] == ["-"]
    assert errors == [f"{tmp_path / '*.ogg'}: no files match", "missing.wav: no such file"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert expand_inputs([str(empty)])[1][0].startswith(f"{empty}: no audio or video files")


def test_cli_codecs_stdin_folder_glob_and_a_video_without_audio(media, tiny, tmp_path):
    """Every container transcribes to the wav's text; '-' reads standard input; the video with no
    audio stream is one error line and the others go on (exit 1)."""
    args = [f"model.path={tiny}", "vad=none", "max_new_tokens=2", "device=cpu", "output_format=json"]
    r = cli(media / "talk.wav", media / "memo.m4a", media / "meeting.mp4", media / "clip.webm",
            media / "silent-film.mp4", *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {media / 'silent-film.mp4'}: no audio stream"]
    docs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [d["file"][len(str(media)) + 1:] for d in docs] == ["talk.wav", "memo.m4a", "meeting.mp4", "clip.webm"]
    assert len({d["text"] for d in docs}) == 1, [d["text"] for d in docs]

    out = tmp_path / "out"
    with open(media / "memo.m4a", "rb") as stdin:
        r = subprocess.run([sys.executable, "-m", "glm_asr.transcribe", "-", *args, f"output_dir={out}"],
                           stdin=stdin, capture_output=True, text=True, timeout=600,
                           env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "stdin.json").read_text())
    assert doc["file"] == "-" and doc["text"] == docs[1]["text"]

    r = cli(str(media), f"{media}/**/*.m4a", f"{media}/*.flac", "extensions=[mp4]", *args,
            f"output_dir={tmp_path / 'dir'}")
    assert r.returncode == 1 and r.stderr.count("error:") == 2, r.stderr       # *.flac, silent-film.mp4
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["late.json", "meeting.json", "memo.json"]
    late = json.loads((tmp_path / "dir" / "late.json").read_text())
    assert abs(late["segments"][0]["start"] - 0.936) < 1e-3
