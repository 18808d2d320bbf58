"""LiveVad: a stream fed in ragged pieces gets the segments, padded audio and speech
probabilities of the same samples read as a file, each segment as soon as no later audio can
change it, in bounded memory."""
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from glm_asr.vad import (FRAME, LiveVad, Speech, VadOptions, block_frames, segments_from_probs, speech_probs,
                         speech_regions)
from glm_asr.vad.segments import speech_groups

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def stream():
    """~43 s: sentences with 0.5 s and 3 s pauses, a noise clip, twice, and 3 s of silence."""
    parts = [sf.read(FIXTURES / f, dtype="float32")[0] for f in ("pause3s.flac", "one.flac", "pause05.flac",
                                                                  "noise.flac")] * 2
    return np.concatenate(parts + [np.zeros(48000, np.float32)])


def feed(v: LiveVad, x: np.ndarray, sizes) -> list:
    events, i, k = [], 0, 0
    while i < len(x):
        n = sizes[k % len(sizes)]
        events += [(i + n, e) for e in v.feed(x[i:i + n])]
        i, k = i + n, k + 1
    return events + [(len(x), e) for e in v.finish()]


@pytest.mark.parametrize("options", [VadOptions(), VadOptions(min_silence_duration_ms=300, speech_pad_ms=200),
                                     VadOptions(min_silence_duration_ms=100, speech_pad_ms=600, threshold=0.6),
                                     VadOptions(min_speech_duration_ms=2500), VadOptions(max_speech_duration_s=4),
                                     VadOptions(min_silence_duration_ms=0, speech_pad_ms=0)])
def test_the_files_segments_as_each_turns_final(stream, options):
    x = stream
    whole = segments_from_probs(speech_probs(x), len(x), options)
    v = LiveVad(options)
    events = feed(v, x, [1777, 1, 16000, 513, 4096])
    speech = [(at, e) for at, e in events if isinstance(e, Speech)]
    assert [e.segment for _, e in speech] == whole and len(whole) >= 3
    pad = options.speech_pad_ms * 16
    wait = max(options.min_silence_duration_ms * 16, 2 * pad) + 2 * FRAME + 16000   # + a piece fed at once
    # a group's padded audio reaches to the next group's when they are closer than 2 x pad: the
    # segment is final once the last group of such a run of groups has ended
    groups = [(g[0][0] * FRAME, g[-1][1] * FRAME) for g in speech_groups(speech_regions(speech_probs(x), options),
                                                                         options)]
    run_ends = [e for (_, e), nxt in zip(groups, groups[1:] + [(np.inf, 0)]) if nxt[0] - e >= 2 * pad]
    for at, e in speech:
        np.testing.assert_array_equal(e.audio, x[e.segment.audio_start:e.segment.audio_end])
        end = min(g for g in run_ends if g >= e.segment.end - pad - FRAME)
        assert at <= end + wait or (at == len(x) and end + wait > len(x))     # final soon after its run ends
    assert sum(at < len(x) for at, _ in speech) >= len(speech) - 2           # not all held for the end
    # each segment follows its group's "started"; a dropped group's start is followed by "dropped"
    open_, last = None, -1
    for _, e in events:
        if isinstance(e, Speech):
            assert open_ is not None and open_ <= e.segment.start and e.segment.start > last
            last = e.segment.start
        elif e[0] == "started":
            open_ = e[1]
        else:
            assert e[0] == "dropped" and open_ is not None and e[1] > open_
    assert len(v.buf) < 2 * 16000 * 8 + 48000          # bounded: pending speech and a block, not the stream


def test_a_dropped_group_and_a_stream_ending_in_speech():
    """Short speech under min_speech_duration_ms is announced and then dropped; speech still going
    when the stream ends is final at finish(), as a file's last segment."""
    clip = sf.read(FIXTURES / "one.flac", dtype="float32")[0]
    x = np.concatenate([np.zeros(8000, np.float32), clip[16000:26000], np.zeros(56000, np.float32), clip])
    o = VadOptions(min_speech_duration_ms=1000)
    events = feed(LiveVad(o), x, [3200])
    kinds = [e if isinstance(e, tuple) else "speech" for _, e in events]
    assert [k[0] if isinstance(k, tuple) else k for k in kinds] == ["started", "dropped", "started", "speech"]
    assert [e.segment for _, e in events if isinstance(e, Speech)] == segments_from_probs(speech_probs(x), len(x), o)
    assert events[-1][0] == len(x)                                   # the last one at finish()
    v = LiveVad()
    v.finish()
    with pytest.raises(ValueError, match="ended"):
        v.feed(np.zeros(10, np.float32))


def test_probabilities_are_the_files(stream):
    """Frame by frame, block by block (each warmed up on the second before it), to the rounding
    of the products' other shapes."""
    x, v, got = stream[:16000 * 20], LiveVad(), []
    for i in range(0, len(x), 3000):
        known = v.frames
        v.feed(x[i:i + 3000])
        got.append(v.probs[known - v.first:])             # each feed's new ones (older ones are forgotten)
    assert v.first > 0 and block_frames()[0] < len(x) // FRAME      # some forgotten; more than one block
    np.testing.assert_allclose(np.concatenate(got), speech_probs(x)[:len(x) // FRAME], atol=1e-5)


def test_a_session_resamples_its_stream_as_one():
    """server_vad at 24 kHz: the pieces resampled as one stream (soxr's), not each on its own."""
    import soxr

    from glm_asr.realtime import Session

    s = Session(None, None, None, 1 << 20)
    s.rate = 24000
    x = np.random.default_rng(0).standard_normal(24000 * 3).astype(np.float32) * 0.1
    got = [s.resample(x[i:i + 2400]) for i in range(0, len(x), 2400)] + [s.resample(np.zeros(0, np.float32), True)]
    np.testing.assert_allclose(np.concatenate(got), soxr.resample(x, 24000, 16000), atol=1e-6)
    assert s.resampler is None


def test_a_feeder_batches_streams_and_gives_each_its_own(stream):
    """Streams fed together through a Feeder get what each fed alone gets; a feed after the end
    fails alone; the thread goes once idle."""
    from glm_asr.vad.live import Feeder

    f, x = Feeder(), stream[:16000 * 20]
    f.IDLE_S = 0.2
    alone = [LiveVad(), LiveVad(VadOptions(min_silence_duration_ms=300))]
    together = [LiveVad(), LiveVad(VadOptions(min_silence_duration_ms=300))]
    want, got = [[], []], [[], []]
    for i in range(0, len(x), 4000):
        futures = [f.submit(v, x[i:i + 4000]) for v in together]
        for k in range(2):
            want[k] += alone[k].feed(x[i:i + 4000])
            got[k] += futures[k].result(30)
    ended = LiveVad()
    ended.finish()
    bad, fine = f.submit(ended, x[:100]), f.submit(together[0], None)
    with pytest.raises(ValueError, match="ended"):
        bad.result(30)
    got[0] += fine.result(30)
    want[0] += alone[0].finish()
    seg = lambda events: [e.segment if isinstance(e, Speech) else e for e in events]     # noqa: E731
    assert seg(got[0]) == seg(want[0]) and seg(got[1]) == seg(want[1]) and len(seg(want[1])) > 2
    import time

    time.sleep(0.6)
    assert f._thread is None


def test_a_long_silence_costs_nothing_and_changes_nothing():
    """Two minutes of silence between speech: what is kept stays small (probabilities and
    samples), and the segments are still the file's."""
    clip = sf.read(FIXTURES / "pause05.flac", dtype="float32")[0]
    x = np.concatenate([clip, np.zeros(16000 * 120, np.float32), clip])
    v, events, kept = LiveVad(), [], (0, 0)
    for i in range(0, len(x), 16000):
        events += v.feed(x[i:i + 16000])
        if 16000 * 30 < i < 16000 * 110:
            kept = max(kept[0], len(v.probs)), max(kept[1], len(v.buf))
    events += v.finish()
    assert [e.segment for e in events if isinstance(e, Speech)] == segments_from_probs(speech_probs(x), len(x))
    assert kept[0] < 100 and kept[1] < 16000 * 3, kept      # frames, samples: ~2.5 s, not 80


def random_probs(rng, seconds: float) -> np.ndarray:
    """Probabilities of speech in runs of 0.2-40 s between pauses of 0.05-4 s (most shorter than
    the 2 s that ends a group: minutes of speech with no long pause), values on both sides of the
    thresholds and between them."""
    out, t = [], 0
    while t < seconds * 16000 // FRAME:
        speech = int(rng.uniform(0.2, 40 if rng.random() < 0.1 else 6) * 16000 / FRAME)
        pause = int(rng.uniform(0.05, 4 if rng.random() < 0.02 else 1.2) * 16000 / FRAME)
        out += [rng.uniform(0.4, 1.0, speech), rng.uniform(0.0, 0.45, pause)]
        t += speech + pause
    return np.concatenate(out).astype(np.float32)


def settle(v: LiveVad, probs: np.ndarray, n: int, sizes) -> list:
    """A file of n samples whose probabilities are probs, settled in pieces of `sizes` samples."""
    events, i, k = [], 0, 0
    while i < n:
        j = min(n, i + sizes[k % len(sizes)])
        last = j == n
        new = probs[i // FRAME: (-(-j // FRAME) if last else j // FRAME)]
        events += [(j, e) for e in v.settle(np.zeros(j - i, np.float32), new, last)]
        i, k = j, k + 1
    return events


@pytest.mark.parametrize("seed", range(6))
def test_speech_without_long_pauses_is_final_a_chapter_at_a_time(seed):
    """Minutes of speech whose pauses are all shorter than min_silence are one group; settled in
    ragged pieces it gets the whole file's segments, each within a chapter and a window of its end
    (not at the group's end), and no segment spans a chapter's cut."""
    from glm_asr.vad.segments import CHAPTER_S, chapters, speech_groups

    rng = np.random.default_rng(seed)
    probs = random_probs(rng, 600)
    n = len(probs) * FRAME - int(rng.integers(0, FRAME))
    options = [VadOptions(), VadOptions(min_silence_duration_ms=3000, speech_pad_ms=700),
               VadOptions(max_speech_duration_s=7, min_speech_duration_ms=500),
               VadOptions(min_speech_duration_ms=200_000)][seed % 4]
    whole = segments_from_probs(probs, n, options)
    events = settle(LiveVad(options, keep_audio=False), probs, n, [int(rng.integers(1, 200_000)) for _ in range(7)])
    got = [(at, e.segment) for at, e in events if isinstance(e, Speech)]
    assert [s for _, s in got] == whole and len(whole) > 10
    wait = (CHAPTER_S + 2 * options.max_speech_duration_s + 4) * 16000 + 200_000
    assert all(at <= s.end + wait or at == n for at, s in got)
    assert sum(at < n for at, _ in got) > len(got) // 2        # most of them before the end
    # the rule itself: chapters end near CHAPTER_S at a pause, and every segment lies in one
    groups = speech_groups(speech_regions(probs, options), options)
    longest, cut = max(e - s for g in groups for s, e in g), 0
    for g in groups:
        parts = chapters(g, probs, int(options.max_speech_duration_s * 16000) // FRAME)
        assert joined([r for p in parts for r in p]) == g
        cut += len(parts) - 1
        for p in parts[:-1]:
            assert p[-1][1] - p[0][0] <= CHAPTER_S * 16000 / FRAME + longest
            assert not any(s.start < p[-1][1] * FRAME < s.end for s in whole)
    assert cut >= 2


def joined(regions: list) -> list:
    """Regions with the two halves of each region a chapter cut in (touching) joined again."""
    out = []
    for a, b in regions:
        out[-1:] = [(out[-1][0], b)] if out and out[-1][1] == a else out[-1:] + [(a, b)]
    return out


def test_a_group_longer_than_a_chapter_is_kept_whatever_min_speech_says():
    """min_speech_duration_ms drops short groups; a group longer than a chapter, whose first
    chapter a stream gives out before its length is known, is kept in a file too."""
    from glm_asr.vad.segments import CHAPTER_S

    spoken = int((CHAPTER_S + 20) * 16000 / FRAME)
    probs = np.concatenate([np.zeros(50), np.tile(np.r_[np.full(60, 0.9), np.full(10, 0.1)], spoken // 70),
                            np.zeros(100)]).astype(np.float32)
    n = len(probs) * FRAME
    o = VadOptions(min_speech_duration_ms=int(1000 * (CHAPTER_S + 60)))
    whole = segments_from_probs(probs, n, o)
    assert whole and whole[-1].end - whole[0].start > CHAPTER_S * 16000
    got = [e.segment for _, e in settle(LiveVad(o, keep_audio=False), probs, n, [30_000]) if isinstance(e, Speech)]
    assert got == whole


@pytest.mark.parametrize("level", [0.9, 0.42])
def test_speech_without_any_pause_is_cut_into_chapters_in_bounded_memory(level):
    """Twenty minutes of one region of speech (music scored as speech; 0.42: one frame over the
    threshold, then values between the two thresholds) is given out a chapter at a time, as the
    file's segments, holding a chapter's samples and probabilities at most, not the stream's."""
    from glm_asr.vad.segments import CHAPTER_S

    frames = int(1200 * 16000 / FRAME)
    probs = np.full(frames, level, np.float32)
    probs[:20], probs[20], probs[-50:] = 0.0, 0.9, 0.0
    n = frames * FRAME
    whole = segments_from_probs(probs, n, VadOptions())
    v, got, held = LiveVad(keep_audio=True), [], (0, 0)
    for i in range(0, n, 30 * 16000):
        j = min(n, i + 30 * 16000)
        new = probs[i // FRAME: -(-j // FRAME) if j == n else j // FRAME]
        got += [(j, e.segment) for e in v.settle(np.zeros(j - i, np.float32), new, j == n) if isinstance(e, Speech)]
        held = max(held[0], len(v.probs)), max(held[1], len(v.buf))
    assert [s for _, s in got] == whole and len(whole) >= 40
    assert sum(at < n for at, _ in got) > len(got) * 3 // 4          # most of them long before the end
    bound = (CHAPTER_S + 31) * 16000
    assert held[0] < bound / FRAME and held[1] < bound, held
