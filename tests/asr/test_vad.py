"""Silero VAD (numpy, CPU) on espeak-ng speech placed at known offsets (tests/asr/fixtures,
made by tools/make_speech_fixtures.py; longer cases assembled here from its clips), and the
segmentation rules on probabilities written by hand."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from glm_asr import vad
from glm_asr.vad import model as vad_model, workers as vad_workers
from glm_asr.vad import FRAME, SAMPLE_RATE as SR, Segment, VadOptions, segments_from_probs, speech_probs, speech_segments

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MANIFEST = json.loads((FIXTURES / "fixtures.json").read_text())
TOL = 0.3                    # seconds: VAD bounds vs the placed speech


def load(name: str) -> np.ndarray:
    x, rate = sf.read(FIXTURES / name, dtype="float32")
    assert rate == SR and x.ndim == 1
    return x


def clips() -> list[np.ndarray]:
    """Every placed sentence of the fixtures, cut out at its known bounds."""
    out = []
    for name, info in MANIFEST["files"].items():
        x = load(name)
        out += [x[s["start"]:s["end"]] for s in info["speech"]]
    return out


def noise(seconds: float, rng) -> np.ndarray:
    return (MANIFEST["noise_rms"] * rng.standard_normal(round(seconds * SR))).astype(np.float32)


def assemble(layout, rng):
    """Audio from a layout of seconds of noise (floats) and clips (arrays), and the clips'
    [start, end) in seconds."""
    parts, speech, at = [], [], 0
    for item in layout:
        part = noise(item, rng) if isinstance(item, (int, float)) else item + noise(len(item) / SR, rng)
        if not isinstance(item, (int, float)):
            speech.append((at / SR, (at + len(part)) / SR))
        parts.append(part)
        at += len(part)
    return np.concatenate(parts), speech


def bounds(segs):
    return [(s.start_s, s.end_s) for s in segs]


def assert_near(got, want, tol=TOL):
    assert len(got) == len(want), (got, want)
    for (a, b), (c, d) in zip(got, want):
        assert abs(a - c) <= tol and abs(b - d) <= tol, (got, want)


# --- the model and its package data --------------------------------------------------------

def test_model_and_license_are_package_data():
    assert vad.MODEL_PATH.is_file() and 900_000 < vad.MODEL_PATH.stat().st_size < 1_100_000
    assert "MIT License" in (vad.MODEL_PATH.parent / "LICENSE.silero-vad").read_text()
    assert vad.weights() is vad.weights()


def test_options_are_faster_whispers_with_a_30s_window():
    o = VadOptions()
    assert (o.threshold, o.neg_threshold, o.min_speech_duration_ms, o.max_speech_duration_s,
            o.min_silence_duration_ms, o.speech_pad_ms) == (0.5, None, 0, 30.0, 2000, 400)
    assert o.low == pytest.approx(0.35) and VadOptions(threshold=0.1).low == pytest.approx(0.01)
    assert VadOptions(neg_threshold=0.2).low == 0.2


@pytest.mark.parametrize("kwargs", [dict(threshold=0), dict(threshold=1.2), dict(threshold="x"),
                                    dict(neg_threshold=0.7), dict(max_speech_duration_s=31),
                                    dict(max_speech_duration_s=math.inf), dict(min_silence_duration_ms=-1),
                                    dict(speech_pad_ms=float("nan")), dict(speech_pad_ms=1e305),
                                    dict(min_silence_duration_ms=600_001), dict(min_speech_duration_ms=1e20)])
def test_bad_options_are_refused_with_their_name(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        VadOptions(**kwargs)


def test_speech_probs_one_per_frame():
    assert speech_probs(np.zeros(0, np.float32)).shape == (0,)
    for n in (1, 511, 512, 513, 16000):
        p = speech_probs(np.zeros(n, np.float32))
        assert p.shape == (-(-n // FRAME),) and p.dtype == np.float32 and ((p >= 0) & (p <= 1)).all()
    with pytest.raises(ValueError, match="one-dimensional"):
        speech_probs(np.zeros((2, 1000), np.float32))


def test_probabilities_are_silero_onnx_models():
    """Against the ONNX model's own probabilities (onnxruntime, written by tools/convert_silero.py:
    frame by frame as silero-vad's OnnxWrapper feeds it, each 512-sample frame after the last 64
    samples of the one before, the state carried, the file zero padded to whole frames): the
    sequential pass, and a short file's default (one block)."""
    ref = np.load(FIXTURES / "silero_onnx_probs.npz")
    for name in ("pause05", "noise"):
        x = load(f"{name}.flac")
        np.testing.assert_allclose(speech_probs(x, threads=1, batch=1, block_s=math.inf), ref[name], atol=1e-5)
        np.testing.assert_allclose(speech_probs(x), ref[name], atol=1e-5)


def test_rows_of_one_step_are_independent():
    """Blocks stepped together as rows give each block's own sequential probabilities."""
    x = load("pause05.flac")
    view, (base,) = vad_model._frame_view([x], 40 + 90)

    def blocks(starts):
        return vad_model._run_rows(view, [base + f for f in starts], 40, vad.CHUNK)

    alone = [blocks([f]) for f in (0, 37, 90)]
    together = blocks([0, 37, 90])
    np.testing.assert_allclose(together, np.concatenate(alone, axis=1), atol=1e-6)


# --- fixtures: boundaries on speech ------------------------------------------------------

def test_fixture_boundaries_within_tolerance():
    for name in ("one.flac", "pause3s.flac"):
        want = [(s["start_s"], s["end_s"]) for s in MANIFEST["files"][name]["speech"]]
        assert_near(bounds(speech_segments(load(name))), want)


def test_silence_only_gives_no_segments():
    assert speech_segments(load("noise.flac")) == []
    assert speech_segments(np.zeros(5 * SR, np.float32)) == []
    assert speech_segments(np.zeros(0, np.float32)) == []


def test_pause_shorter_than_min_silence_joins_longer_splits():
    short = MANIFEST["files"]["pause05.flac"]["speech"]
    assert_near(bounds(speech_segments(load("pause05.flac"))), [(short[0]["start_s"], short[-1]["end_s"])])
    long = MANIFEST["files"]["pause3s.flac"]["speech"]
    assert len(speech_segments(load("pause3s.flac"))) == 2 == len(long)
    # and a min_silence below the 0.5 s pause separates the two utterances
    got = speech_segments(load("pause05.flac"), VadOptions(min_silence_duration_ms=200))
    assert_near(bounds(got), [(s["start_s"], s["end_s"]) for s in short])


def test_speech_across_the_30s_mark_is_one_segment_in_file_time():
    rng = np.random.default_rng(1)
    c = clips()
    x, speech = assemble([28.8, c[0], 0.4, c[1], 0.3, c[2], 3.0], rng)
    assert speech[0][0] < 30 < speech[-1][1]
    segs = speech_segments(x)
    assert_near(bounds(segs), [(speech[0][0], speech[-1][1])])
    s = segs[0]
    assert s.audio_start == s.start - 400 * SR // 1000 and s.audio_end == s.end + 400 * SR // 1000


def test_speech_longer_than_30s_is_cut_at_its_longest_pause():
    rng = np.random.default_rng(2)
    c = clips()
    layout, longest_after = [1.0], 10
    for i in range(22):                            # ~45 s of clips 0.3 s apart, one pause of 1.2 s
        layout += [c[i % len(c)], 1.2 if i == longest_after else 0.3]
    layout[-1] = 2.5
    x, speech = assemble(layout, rng)
    assert speech[-1][1] - speech[0][0] > 40 and speech[longest_after][1] - speech[0][0] < 30
    segs = speech_segments(x)
    assert_near(bounds(segs), [(speech[0][0], speech[longest_after][1]), (speech[longest_after + 1][0], speech[-1][1])])
    assert all(s.end - s.start <= 30 * SR and s.audio_end - s.audio_start <= 30 * SR for s in segs)
    assert segs[0].audio_end <= segs[1].audio_start                  # no audio given to the model twice


def test_long_speech_with_short_pauses_only_is_cut_at_pauses():
    rng = np.random.default_rng(4)
    c = clips()
    layout = [0.5]
    for i in range(30):                            # ~60 s, pauses 0.25-0.6 s
        layout += [c[int(rng.integers(len(c)))], float(rng.uniform(0.25, 0.6))]
    x, speech = assemble(layout, rng)
    segs = speech_segments(x)
    assert 3 <= len(segs) <= 4 and all(s.end - s.start <= 30 * SR for s in segs)
    assert abs(segs[0].start_s - speech[0][0]) <= TOL and abs(segs[-1].end_s - speech[-1][1]) <= TOL
    for a, b in zip(segs, segs[1:]):               # every cut in a pause between clips, never inside one
        assert any(abs(a.end_s - e) <= TOL for _, e in speech) and any(abs(b.start_s - s) <= TOL for s, _ in speech)
        assert a.audio_end <= b.audio_start


def test_padding_widens_the_audio_only():
    x = load("pause3s.flac")
    p = speech_probs(x)
    plain = segments_from_probs(p, len(x), VadOptions(speech_pad_ms=0))
    padded = segments_from_probs(p, len(x), VadOptions(speech_pad_ms=400))
    assert [(s.start, s.end) for s in plain] == [(s.start, s.end) for s in padded]
    assert all((s.audio_start, s.audio_end) == (s.start, s.end) for s in plain)
    for s in padded:
        assert s.audio_start == max(0, s.start - 6400) and s.audio_end == min(len(x), s.end + 6400)
    # clipped to the file
    big = segments_from_probs(p, len(x), VadOptions(speech_pad_ms=5000))
    assert big[0].audio_start == 0 and big[-1].audio_end == len(x)
    assert big[0].audio_end == big[1].audio_start == (big[0].end + big[1].start) // 2   # the pause's middle


# --- the segmentation rules on probabilities written by hand ----------------------------------

def frames(seconds: float) -> int:
    return round(seconds * SR / FRAME)


def probs_of(*runs) -> np.ndarray:
    """Probabilities from (seconds, value) runs; a run ending t seconds in ends at frames(t)."""
    out, t = [], 0.0
    for s, v in runs:
        out.append(np.full(frames(t + s) - frames(t), v, np.float32))
        t += s
    return np.concatenate(out)


def test_hysteresis_as_silero():
    # 0.4 (between 0.35 and 0.5) neither starts speech nor ends it
    p = probs_of((1, 0.0), (1, 0.4), (1, 0.9), (1, 0.4), (1, 0.9), (1, 0.2), (1, 0.4), (1, 0.0))
    assert vad.speech_regions(p) == [(frames(2), frames(5))]


def test_a_pause_free_region_longer_than_30s_is_cut_at_its_least_speechlike_frame():
    p = probs_of((1, 0.0), (70, 0.9), (1, 0.0))
    p[frames(1 + 25)] = 0.45                      # dips that do not end speech (> neg_threshold)
    p[frames(1 + 52)] = 0.40
    segs = segments_from_probs(p, len(p) * FRAME, VadOptions(speech_pad_ms=400))
    assert [(s.start, s.end) for s in segs] == [(frames(1) * FRAME, frames(26) * FRAME),
                                                (frames(26) * FRAME, frames(53) * FRAME),
                                                (frames(53) * FRAME, frames(71) * FRAME)]
    assert segs[0].audio_end == segs[1].audio_start == segs[0].end           # no pad across a hard cut
    assert all(s.audio_end - s.audio_start <= 30 * SR for s in segs)


def regions_with_pauses(speech_s, pauses_s):
    """Probabilities of speech runs of speech_s seconds with pauses_s between them, 1 s of
    silence each side."""
    runs = [(1, 0.0)]
    for sp, pa in zip(speech_s, list(pauses_s) + [1]):
        runs += [(sp, 0.95), (pa, 0.05)]
    return probs_of(*runs)


def test_a_group_that_fits_two_segments_is_cut_at_its_longest_pause_alone():
    pauses = [0.3] * 19
    pauses[11] = 1.0
    p = regions_with_pauses([2.0] * 20, pauses)            # ~46 s, the 1 s pause after ~24 s
    segs = segments_from_probs(p, len(p) * FRAME)
    assert len(segs) == 2
    assert segs[0].end == frames(1 + 12 * 2.0 + 11 * 0.3) * FRAME
    assert segs[1].start == frames(1 + 12 * 2.0 + 11 * 0.3 + 1.0) * FRAME


def test_the_shortest_pause_cut_in_is_as_long_as_can_be_then_fewest_segments():
    # a 1.5 s pause 5 s in, 0.2 s pauses, one of 0.6 s 20 s in (of 40 s): cutting at the 1.5 s pause
    # needs a second cut, at best the 0.6 s one: the 0.6 s one alone gives the same shortest cut
    # pause with fewer segments
    speech = [1.0] * 4 + [1.0] * 12 + [1.0] * 16
    pauses = [0.2] * 3 + [1.5] + [0.2] * 11 + [0.6] + [0.2] * 15
    p = regions_with_pauses(speech, pauses)
    segs = segments_from_probs(p, len(p) * FRAME)
    at = 1 + 16 * 1.0 + sum(pauses[:15])
    assert len(segs) == 2 and segs[0].end == frames(at) * FRAME and segs[1].start == frames(at + 0.6) * FRAME
    # pauses growing along the group: as few segments as 30 s allows, not one cut per pause
    speech, pauses = [1.5] * 200, [0.1 + i * 0.004 for i in range(199)]
    p = regions_with_pauses(speech, pauses)
    segs = segments_from_probs(p, len(p) * FRAME)
    span = (segs[-1].end - segs[0].start) / SR
    assert len(segs) == math.ceil(span / 30) and all(s.end - s.start <= 30 * SR for s in segs)


def test_padding_is_clipped_to_30s():
    p = probs_of((3, 0.0), (29.9, 0.9), (3, 0.0))
    (s,) = segments_from_probs(p, len(p) * FRAME)
    assert s.end - s.start <= 30 * SR and s.audio_end - s.audio_start == 30 * SR
    assert s.start - s.audio_start == pytest.approx(s.audio_end - s.end, abs=1)


def test_min_speech_duration_drops_short_segments():
    p = probs_of((1, 0.0), (0.1, 0.9), (3, 0.0), (1, 0.9), (1, 0.0))
    assert len(segments_from_probs(p, len(p) * FRAME)) == 2
    segs = segments_from_probs(p, len(p) * FRAME, VadOptions(min_speech_duration_ms=250))
    assert [s.start for s in segs] == [frames(4.1) * FRAME]


def test_segment_times():
    s = Segment(16000, 48000, 9600, 54400)
    assert (s.start_s, s.end_s, s.audio_start_s, s.audio_end_s) == (1.0, 3.0, 0.6, 3.4)


# --- blocks in parallel ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_minutes():
    """~2 minutes of clips between pauses of 0.3-0.7 s or 3-4 s, far from the 2 s that decides
    whether two regions join."""
    rng = np.random.default_rng(3)
    c, layout = clips(), [1.0]
    while sum(len(i) / SR if isinstance(i, np.ndarray) else i for i in layout) < 120:
        layout += [c[int(rng.integers(len(c)))], float(rng.uniform(3, 4) if rng.random() < 0.3 else rng.uniform(0.3, 0.7))]
    x, speech = assemble(layout, rng)
    return x, speech, speech_probs(x, threads=1, batch=1, block_s=math.inf)


def test_batched_and_threaded_blocks_are_the_same_computation(two_minutes):
    x, _, _ = two_minutes
    a = speech_probs(x, threads=1, batch=32, block_s=4)       # 30 blocks of 4 s in one batch
    b = speech_probs(x, threads=8, batch=1, block_s=4)        # the same blocks, one a row, in 8 threads
    c = speech_probs(x, threads=2, batch=7, block_s=4)
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(a, c, atol=1e-5)


def test_blocks_match_one_sequential_pass(two_minutes):
    """The first block is the sequential pass. Later blocks start from a reset state: Silero's
    LSTM remembers for minutes (a reset still moves probabilities by 1e-2 after 2 minutes, and by
    up to ~0.9 at speech edges in the first seconds; 16-bit rounding of the input moves them by
    ~1e-2 too), so block probabilities differ from the sequential pass near speech edges, and
    what is compared is the speech found: nearly the same speech frames, the same segments within
    3 frames (96 ms), and both within the tolerance of the placed speech."""
    x, placed, seq = two_minutes
    par = speech_probs(x, threads=4, batch=4, block_s=7.5)      # 16 blocks of 7.5 s
    first = vad.block_frames(7.5)[0]
    np.testing.assert_allclose(par[:first], seq[:first], atol=1e-6)
    def speech(p):
        out = np.zeros(len(p), bool)
        for a, b in vad.speech_regions(p):
            out[a:b] = True
        return out
    assert (speech(seq) != speech(par)).mean() < 0.02      # a few frames at edges and in-word dips
    sa, sb = speech_segments(x, probs=seq), speech_segments(x, probs=par)
    assert len(sa) == len(sb)
    assert all(abs(a.start - b.start) <= 3 * FRAME and abs(a.end - b.end) <= 3 * FRAME for a, b in zip(sa, sb))
    groups, cur = [], [placed[0]]                   # the placed speech, joined across short pauses
    for s in placed[1:]:
        if s[0] - cur[-1][1] < 2.0:
            cur.append(s)
        else:
            groups.append((cur[0][0], cur[-1][1]))
            cur = [s]
    groups.append((cur[0][0], cur[-1][1]))
    assert all(b - a <= 30 for a, b in groups)
    assert_near(bounds(sa), groups)
    assert_near(bounds(sb), groups)


def test_a_bad_input_fails_alone_in_the_worker_processes():
    """An error inside a VAD worker process reaches its caller; the processes stay in use for
    the next file (before, any error moved all later VAD into the calling process, ~10x slower
    beside a busy pipeline)."""
    with pytest.raises(ValueError, match="one-dimensional"):
        vad.pooled_probs(np.zeros((2, FRAME), np.float32))
    assert vad_workers._POOL[1] is not None
    x = np.random.default_rng(0).standard_normal(3 * FRAME).astype(np.float32) * 0.1
    np.testing.assert_allclose(vad.pooled_probs(x), speech_probs(x), rtol=1e-5, atol=1e-6)


def test_gpu_vad_products_fall_in_one_shape_class():
    """Whatever the number of blocks (files and their lengths), the GPU's rows are padded and its
    chunks of steps sized so that every product of the VAD gets the same tile plan and shapes
    divisible by 16: one set of kernels, built ahead, never a compile mid-run."""
    from glm_asr.vad import model
    from tilekernels.tiling import linear_plan

    w = model.weights()
    products = [(4, w["stft"].shape)] + [(share, w[f"encoder.{k}.taps"].shape) for k, share in enumerate((4, 2, 1, 1))]
    products += [(1, w["lstm.weight_ih"].shape), (1, w["head.row"].shape)]
    plans = set()
    for blocks in (1, 3, 16, 17, 100, 769, 1024, 1025, 5000):
        rows = model._rows_class(blocks)
        chunk = max(model.SHAPE_CLASS, model.DEVICE_FRAMES // rows)
        assert rows >= blocks and rows % 16 == 0 and chunk % 16 == 0
        for share, (n, k) in products:
            plans.add((n, k, str(linear_plan(chunk * rows * share, n, k, sequence=True))))
    assert len(plans) == len(products)


# --- on the GPU ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_probabilities_are_the_numpy_models(poisoned, two_minutes):
    """device_probs (tilekernels' linear and lstm at 'highest') against the numpy model in the
    same blocks (each file's by its length alone), and against the ONNX model's own on the short
    fixtures (one block: the sequential pass), within 1e-4; a file's probabilities alone and in a
    batch of others are the same; empty and one-sample files; files of any length and number after
    the first launch no other kernel specialization (rows and steps in shape classes)."""
    import cupy

    from tilekernels import cubins

    ref = np.load(FIXTURES / "silero_onnx_probs.npz")
    rng = np.random.default_rng(5)
    files = [load("pause05.flac"), load("noise.flac"), two_minutes[0], np.zeros(0, np.float32),
             rng.standard_normal(1).astype(np.float32), noise(31.3, rng)]
    got = vad.device_probs([cupy.asarray(x) for x in files])
    kinds = set(cubins.launched())
    for x, p in zip(files, got):
        assert isinstance(p, np.ndarray) and p.shape == (-(-len(x) // FRAME),)
        np.testing.assert_allclose(p, speech_probs(x, threads=1, batch=1 << 20), atol=1e-4)
    for i, name in enumerate(("pause05", "noise")):
        np.testing.assert_allclose(got[i], ref[name], atol=1e-4)
    for x, p in zip(files, got):
        assert np.array_equal(vad.device_probs([cupy.asarray(x)])[0], p)
    assert np.array_equal(speech_probs(cupy.asarray(files[2])), got[2])
    vad.device_probs([cupy.asarray(x) for x in files[2:4] + [noise(7.7, rng)] * 5])
    assert set(cubins.launched()) == kinds
