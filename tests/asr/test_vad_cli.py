"""vad=silero (the default) end to end on the espeak-ng fixtures: segment times on the speech,
silence decoded as nothing (and still an output file), speech across the 30 s mark in one
segment, streaming probabilities like one pass, readable subtitles."""
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from asr_cli import cli

from glm_asr.reading import speech_windows
from glm_asr.vad import STREAM_CHUNK, VadOptions, segments_from_probs, speech_probs, stream_probs
from glm_asr.vad.segments import mean_speech

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PLACED = json.loads((FIXTURES / "fixtures.json").read_text())["files"]


def test_cli_segments_sit_on_the_speech_and_silence_gets_empty_outputs(tiny, tmp_path):
    out = tmp_path / "out"
    files = [FIXTURES / "pause3s.flac", FIXTURES / "noise.flac"]
    for fmt in ("json", "txt", "srt", "vtt"):
        r = cli(*files, f"model.path={tiny}", "max_new_tokens=3", "device=cpu", f"output_format={fmt}",
                f"output_dir={out}")
        assert r.returncode == 0, r.stderr
    doc = json.loads((out / "pause3s.json").read_text())
    want = [(s["start_s"], s["end_s"]) for s in PLACED["pause3s.flac"]["speech"]]
    got = [(s["start"], s["end"]) for s in doc["segments"]]
    assert len(got) == 2 and all(abs(a - b) <= 0.3 for g, w in zip(got, want) for a, b in zip(g, w)), got
    assert json.loads((out / "noise.json").read_text())["segments"] == []
    assert (out / "noise.txt").read_text() == "\n" and (out / "noise.srt").read_text() == ""    # an empty line
    assert (out / "noise.vtt").read_text().strip() == "WEBVTT"
    cues = (out / "pause3s.srt").read_text().strip().split("\n\n")
    for cue in cues:
        lines = cue.split("\n")
        assert len(lines[2:]) <= 2 and all(len(line) <= 42 for line in lines[2:]), cue


def test_speech_across_the_30s_mark_is_one_segment_in_file_time(tiny, tmp_path):
    clip, rate = sf.read(FIXTURES / "pause05.flac", dtype="float32")
    silence = np.zeros(28 * rate, np.float32)
    x = np.concatenate([silence, clip, silence[: 5 * rate]])
    sf.write(tmp_path / "long.wav", x, rate)
    r = cli(tmp_path / "long.wav", f"model.path={tiny}", "max_new_tokens=2", "device=cpu", "output_format=json")
    assert r.returncode == 0, r.stderr
    [seg] = json.loads(r.stdout)["segments"]
    speech = PLACED["pause05.flac"]["speech"]
    assert abs(seg["start"] - (28 + speech[0]["start_s"])) <= 0.3 and abs(seg["end"] - (28 + speech[-1]["end_s"])) <= 0.3
    assert seg["start"] < 30 < seg["end"]


def test_streamed_probabilities_are_the_whole_files(monkeypatch):
    """stream_probs over blocks (chunks of whole VAD blocks, each with the block before it) gives
    the whole file's probabilities (to the rounding of other products' shapes) and segments;
    speech_windows, one pass a chunk at a time, gives each segment with exactly its padded audio."""
    import glm_asr.vad as vad

    monkeypatch.setattr(vad.workers, "STREAM_CHUNK", 2 * vad.workers.BLOCK)      # 16 s chunks: several seams
    parts = [sf.read(FIXTURES / f, dtype="float32")[0] for f in ("pause3s.flac", "one.flac", "pause05.flac")] * 2
    x = np.concatenate(parts)
    blocks = [x[i: i + 7777] for i in range(0, len(x), 7777)]
    streamed, n = stream_probs(blocks)
    whole = speech_probs(x)
    assert n == len(x) and streamed.shape == whole.shape == (-(-len(x) // 512),)
    np.testing.assert_allclose(streamed, whole, atol=1e-5)
    segs = segments_from_probs(streamed, n)
    assert len(segs) >= 4 and segs == segments_from_probs(whole, len(x))
    windows = list(speech_windows(x, VadOptions(), xp=None))
    assert [(w.start_s, w.end_s) for w in windows] == [(s.start_s, s.end_s) for s in segs]
    for w, seg in zip(windows, segs):
        np.testing.assert_array_equal(w.features, x[seg.audio_start: seg.audio_end])
        assert abs(w.speech - mean_speech(whole, seg)) < 1e-4
    assert STREAM_CHUNK % vad.workers.BLOCK == 0 and vad.workers.BLOCK % 512 == 0


def test_a_files_windows_read_once_are_those_in_memory(monkeypatch, tmp_path):
    """From a file (read once, a chunk of its VAD at a time) the windows are those of the same
    samples in memory; with long silences between its speech, the first window goes out before
    the VAD has read the whole file."""
    import glm_asr.vad as vad
    from glm_asr.audio import Audio

    monkeypatch.setattr(vad.workers, "STREAM_CHUNK", 2 * vad.workers.BLOCK)
    parts = [sf.read(FIXTURES / f, dtype="float32")[0] for f in ("pause3s.flac", "one.flac", "pause05.flac")]
    gap = np.zeros(20 * 16000, np.float32)
    x = np.concatenate([parts[0], gap, parts[1], gap, parts[2], gap])
    sf.write(tmp_path / "long.flac", x, 16000)
    calls = []

    def probs(samples):
        calls.append(len(samples))
        return speech_probs(samples)

    with Audio(str(tmp_path / "long.flac")) as audio:
        windows = speech_windows(audio, VadOptions(), xp=None, probs=probs)
        first = next(windows)
        assert sum(calls) < len(x) * 0.8        # the rest of the file's VAD is still to come
        got = [first, *windows]
    want = list(speech_windows(sf.read(tmp_path / "long.flac", dtype="float32")[0], VadOptions(), xp=None))
    assert len(got) == len(want) >= 3
    for g, w in zip(got, want):
        assert (g.start_s, g.end_s, g.speech) == (w.start_s, w.end_s, w.speech)
        np.testing.assert_array_equal(g.features, w.features)
    with pytest.raises(ValueError, match="keeps no audio"):
        vad.LiveVad(keep_audio=False).feed(x[:16000])


def test_a_long_file_without_long_pauses_reaches_the_encoder_while_its_vad_goes_on(tmp_path):
    """45 minutes of speech whose pauses are all shorter than min_silence (one group of speech):
    its first windows go out after the first chunk of its VAD, not after the whole file's (the
    probabilities here are made up: speech with a short pause every 3 s)."""
    import glm_asr.vad as vad
    from glm_asr.audio import Audio

    n = 16000 * 2700
    sf.write(tmp_path / "talk.flac", np.zeros(n, np.float32), 16000)
    pattern = np.r_[np.full(80, 0.9), np.full(14, 0.1)].astype(np.float32)
    made = np.resize(pattern, -(-n // 512))
    calls = []

    def probs(samples):             # a chunk after the first comes with the VAD block before it
        start = sum(calls) - (vad.workers.BLOCK if calls else 0)
        calls.append(len(samples) - (vad.workers.BLOCK if calls else 0))
        return made[start // 512: start // 512 + -(-len(samples) // 512)]

    import tracemalloc

    tracemalloc.start()
    with Audio(str(tmp_path / "talk.flac")) as audio:
        windows = speech_windows(audio, VadOptions(), xp=None, probs=probs)
        first = next(windows)
        assert sum(calls) == STREAM_CHUNK < n // 8
        got = [first]
        for w in windows:
            got.append(w)
            w.features = None           # what the pipeline takes on
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 6 * STREAM_CHUNK * 4 < n * 4 / 1.5, peak     # a few chunks of samples, not the file
    want = segments_from_probs(made, n, VadOptions())
    assert [(w.start_s, w.end_s) for w in got] == [(s.start_s, s.end_s) for s in want] and len(want) > 20


def test_speech_windows_of_silence_decode_nothing():
    assert list(speech_windows(np.zeros(16000 * 40, np.float32), VadOptions())) == []


@pytest.mark.parametrize("arg,message", [("vad=webrtc", "vad must be one of silero, none"),
                                         ("vad_options.threshold=2", "vad_options.threshold must be between"),
                                         ("+vad_options.speed=3", "unknown option 'speed'"),
                                         ("vad_options=5", "vad_options must be a group of settings")])
def test_bad_vad_options_one_line(tiny, arg, message):
    r = cli(FIXTURES / "one.flac", f"model.path={tiny}", "device=cpu", arg)
    assert r.returncode == 1 and message in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr


def test_the_readers_queue_takes_the_files_in_turn():
    """A long file's reader that filled the queue does not hold back a second file: its first
    window may queue past the bound and comes out next; each file's items keep their order; VAD
    jobs come first."""
    import threading

    from glm_asr.reading import FairQueue

    q = FairQueue(4)
    assert all(q.put(0, ("long", i), 0) for i in range(4)) and not q.put(0, ("long", 4), 0)
    assert q.put(1, ("short", 0), 0) and not q.put(1, ("short", 1), 0)     # one past the bound, not two
    assert q.put(-1, ("vad", 0), 0)
    assert [q.get(0) for _ in range(4)] == [("vad", 0), ("long", 0), ("short", 0), ("long", 1)]
    late = threading.Thread(target=lambda: q.put(1, ("short", 1), 5))
    late.start()
    late.join(5)
    assert [q.get(0) for _ in range(4)] == [("long", 2), ("short", 1), ("long", 3), None] and q.empty()


class _Later:
    """A chunk's probabilities, computed only when asked for (a worker or the GPU loop not done)."""
    under_way: list = []

    def __init__(self, samples):
        self.samples = samples
        _Later.under_way.append(self)

    def done(self) -> bool:
        return False

    def result(self):
        _Later.under_way.remove(self)
        return speech_probs(self.samples)


def test_a_files_next_chunks_are_read_while_its_vad_runs(monkeypatch):
    """chunk_probs hands up to AHEAD chunks to a VAD that has not answered yet (a long file's
    VAD in several workers, or in one GPU batch, while the next chunks are read), never more, and
    its chunks and probabilities are those of one chunk at a time; a VAD that answers at once gets
    one chunk at a time."""
    import glm_asr.vad as vad

    monkeypatch.setattr(vad.workers, "STREAM_CHUNK", 2 * vad.workers.BLOCK)
    x = np.concatenate([sf.read(FIXTURES / f, dtype="float32")[0] for f in ("pause3s.flac", "one.flac")] * 4)
    blocks = [x[i: i + 7777] for i in range(0, len(x), 7777)]       # 100 s: 7 chunks of 16 s
    most, got = 0, []
    for chunk, p, last in vad.chunk_probs(blocks, _Later):
        most = max(most, len(_Later.under_way) + 1)
        got.append((chunk, p, last))
    assert most == vad.AHEAD > 1 and len(got) > vad.AHEAD and not _Later.under_way
    one_at_a_time = list(vad.chunk_probs(blocks, speech_probs, ahead=1))
    assert len(got) == len(one_at_a_time) and [g[2] for g in got] == [False] * (len(got) - 1) + [True]
    for (c, p, _), (c1, p1, _) in zip(got, one_at_a_time):
        np.testing.assert_array_equal(c, c1)
        np.testing.assert_array_equal(p, p1)
    assert sum(len(c) for c, _, _ in got) == len(x)


def test_the_gpu_loops_vad_gets_a_long_files_chunks_together(monkeypatch, tmp_path):
    """With the VAD on the GPU, a long file's reader queues its next chunks' VAD jobs before the
    loop has answered the first, so the loop runs them in one batch; the windows are the CPU VAD's.
    (Here the 'GPU' is speech_probs, run by this test as the pipeline's loop runs device_probs.)"""
    import time

    import glm_asr.vad as vad
    from glm_asr.features import Window
    from glm_asr.reading import Readers, VadJob

    monkeypatch.setattr(vad.workers, "STREAM_CHUNK", 2 * vad.workers.BLOCK)
    x = np.concatenate([sf.read(FIXTURES / f, dtype="float32")[0] for f in ("pause3s.flac", "one.flac")] * 4)
    sf.write(tmp_path / "long.flac", x, 16000)
    from glm_asr.audio import Audio

    readers = Readers(VadOptions(), True, 128, 64, lambda i: True)
    batches, items = [], []
    try:
        readers.submit(0, lambda: Audio(str(tmp_path / "long.flac")))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
            jobs = []
            while (item := readers.get(0)) is not None:
                if isinstance(item[2], VadJob):
                    jobs.append(item[2])
                else:
                    items.append(item)
            if jobs:
                batches.append(len(jobs))
                for j in jobs:
                    j.future.set_result(speech_probs(j.samples))
            if items and not isinstance(items[-1][2], Window):       # the file's end (or its error)
                break
    finally:
        readers.close()
    assert max(batches) == vad.AHEAD > 1, batches
    want = list(speech_windows(x, VadOptions(), xp=None))
    got = [w for _, _, w in items[:-1]]
    assert items[-1][1] == len(got) == len(want) >= 4
    for g, w in zip(got, want):
        assert (g.start_s, g.end_s) == (w.start_s, w.end_s)
        np.testing.assert_array_equal(g.features, w.features)


def test_the_loop_hands_over_queued_vad_batches_in_order_once_the_gpu_has_them():
    """The pipeline's loop queues the VAD on the GPU and goes on feeding the engine: _vad_answer
    hands a batch's probabilities to its jobs only once done() (in queue order, so a finished batch
    behind a running one waits), all of them with wait, and a batch that failed to its jobs."""
    from types import SimpleNamespace

    from glm_asr.pipeline import Transcriber
    from glm_asr.reading import VadJob

    class Queued:
        def __init__(self, probs, ready=False, error=None):
            self.probs, self.ready, self.error = probs, ready, error

        def done(self):
            return self.ready

        def result(self):
            if self.error is not None:
                raise self.error
            return self.probs

    jobs = [[VadJob(np.zeros(1, np.float32)) for _ in range(n)] for n in (2, 1, 1)]
    probs = [[np.full(3, i + 10 * b, np.float32) for i in range(len(js))] for b, js in enumerate(jobs)]
    queued = [Queued(probs[0]), Queued(probs[1], ready=True), Queued(None, error=RuntimeError("bad"))]
    loop = SimpleNamespace(_vad_queued=list(zip(jobs, queued)))
    Transcriber._vad_answer(loop)
    assert not any(j.done() for js in jobs for j in js) and len(loop._vad_queued) == 3
    queued[0].ready = True
    Transcriber._vad_answer(loop)
    assert [j.done() for js in jobs for j in js] == [True, True, True, False] and len(loop._vad_queued) == 1
    np.testing.assert_array_equal(jobs[0][1].result(), probs[0][1])
    np.testing.assert_array_equal(jobs[1][0].result(), probs[1][0])
    Transcriber._vad_answer(loop, wait=True)
    assert not loop._vad_queued and isinstance(jobs[2][0].future.exception(), RuntimeError)
