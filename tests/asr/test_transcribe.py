"""The tiny checkpoint end to end: loader, prompt, every output format, many files, bad input."""
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from asr_cli import cli

import glm_asr
from glm_asr.model import GlmAsr
from glm_asr.pipeline import Transcriber
from tilekernels.runtime import CheckpointError, load_tensors

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_prompt_construction(tiny):
    asr = Transcriber.load(tiny, "cpu")
    ids = asr.prompt_ids(5, "Please transcribe this audio into text")
    assert ids.count(asr.model.config.audio_token_id) == 5
    assert asr.tok.decode(ids, skip_special_tokens=False) == (
        "<|user|>\n<|begin_of_audio|>" + "<|pad|>" * 5 + "<|end_of_audio|><|user|>\n"
        "Please transcribe this audio into text<|assistant|>\n")


def test_tied_head_follows_config(tiny, tmp_path, capsys):
    d = tmp_path / "tied"
    d.mkdir()
    for f in tiny.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    m = GlmAsr.load(d)
    assert m.w["lm_head"] is m.w["embed"]       # the head is the embedding: one array, shared on the GPU too
    assert "ignoring the different language_model.lm_head.weight" in capsys.readouterr().err


def test_untied_head_and_decoder_cache(tiny):
    m = GlmAsr.load(tiny)
    t = load_tensors(tiny)
    np.testing.assert_array_equal(m.w["lm_head"], t["language_model.lm_head.weight"])
    np.testing.assert_array_equal(m.w["norm"].weight, t["language_model.model.norm.weight"])
    x = m.w["embed"][np.array([[3, 9, 27, 81]])]
    full = m.forward(x, m.new_cache(1, 8))
    cache = m.new_cache(1, 8)
    m.forward(x[:, :2], cache)
    m.forward(x[:, 2:3], cache)
    np.testing.assert_allclose(m.forward(x[:, 3:], cache), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["txt", "json", "srt", "vtt"])
def test_every_output_format(tiny, audio_dir, tmp_path, fmt):
    r = cli(audio_dir / "long.flac", audio_dir / "speech16k.wav", f"model.path={tiny}", "vad=none", "max_new_tokens=3",
            "device=cpu", f"output_format={fmt}", f"output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    long, short = (tmp_path / f"long.{fmt}").read_text(), (tmp_path / f"speech16k.{fmt}").read_text()
    if fmt == "json":
        doc = json.loads(long)
        assert [(s["start"], s["end"]) for s in doc["segments"]] == [(0, 30), (30, 60), (60, 65)]
    elif fmt == "srt":
        assert "00:00:30,000 --> 00:01:00,000" in long and long.startswith("1\n00:00:00,000 --> ")
    elif fmt == "vtt":
        assert long.startswith("WEBVTT") and "00:01:00.000 --> 00:01:05.000" in long
    assert short


def test_stdout_and_resampled_multichannel(tiny, audio_dir):
    r = cli(audio_dir / "low8k.wav", audio_dir / "six48k.wav", audio_dir / "quiet.ogg", f"model.path={tiny}", "vad=none",
            "max_new_tokens=2", "device=cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 3


@pytest.mark.parametrize("name,message", [
    ("missing.wav", "no such file"), ("nothing*.wav", "no files match"), ("notaudio.wav", "not a readable audio"),
    ("empty.wav", "contains no samples"), ("nan.wav", "NaN or infinite"), ("short.wav", "audio too short"),
])
def test_bad_audio_one_line(tiny, audio_dir, name, message):
    r = cli(audio_dir / name, f"model.path={tiny}", "vad=none", "device=cpu")
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


def test_no_half_written_output(tiny, audio_dir, tmp_path):
    r = cli(audio_dir / "nan.wav", f"model.path={tiny}", "vad=none", "device=cpu", f"output_dir={tmp_path}")
    assert r.returncode == 1 and list(tmp_path.iterdir()) == []


def test_model_errors_one_line(tiny, audio_dir, tmp_path):
    r = cli(audio_dir / "speech16k.wav", "device=cpu")                     # default hub id, offline
    assert r.returncode == 1 and "not in the local cache and the hub is unreachable" in r.stderr
    r = cli(audio_dir / "speech16k.wav", "model.id=null", "device=cpu")
    assert r.returncode == 1 and r.stderr.strip() == "error: no model given: set model=NAME or model.path=DIR"
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    r = cli(audio_dir / "speech16k.wav", f"model.path={bad}", "device=cpu")
    assert r.returncode == 1 and "language_model.model.layers.0.mlp.gate_proj.weight: expected shape (96, 64)" in r.stderr
    assert r.stderr.strip().count("\n") == 0
    (bad / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match="is not GLM-ASR"):
        GlmAsr.load(bad)


def test_transcripts_do_not_depend_on_the_batch(tiny, audio_dir, tmp_path):
    """Windows of several files decode together (continuous batching): max_batch=1 and max_batch=8
    (with encoder groups that split files) write the same transcripts, and a closing line counts
    the files and the audio."""
    files = [audio_dir / n for n in ("long.flac", "speech16k.wav", "low8k.wav", "six48k.wav")]
    out = {}
    for batch, enc in ((1, 8), (8, 3)):
        d = tmp_path / f"b{batch}"
        r = cli(*files, f"model.path={tiny}", "vad=none", "max_new_tokens=12", "device=cpu", "output_format=json",
                f"output_dir={d}", f"max_batch={batch}", f"encoder_batch={enc}")
        assert r.returncode == 0, r.stderr
        assert r.stderr.strip().startswith("4 files transcribed, 70.0 s of audio in "), r.stderr
        out[batch] = {p.name: json.loads(p.read_text()) for p in d.iterdir()}
    assert out[1] == out[8] and len(out[1]) == 4
    assert sum(len(s["text"]) for doc in out[1].values() for s in doc["segments"]) > 0


def test_warm_up_leaves_the_transcriber_as_new(tiny, audio_dir):
    """A server's warm-up (encoder groups of 1..encoder_batch windows, every decode bucket) leaves
    the engine idle with its slots free, and transcripts as a fresh transcriber's."""
    from glm_asr.audio import read_audio

    def run(asr):
        src = [(p.name, lambda p=p: read_audio(p)) for p in (audio_dir / "long.flac", audio_dir / "speech16k.wav")]
        return [(n, s) for n, s, _ in asr.transcribe_many(src, "Please transcribe this audio into text", 12)]

    warm = Transcriber.load(tiny, "cpu", max_batch=4, encoder_batch=3)
    groups, encode = [], warm._encode
    warm._encode = lambda group, *rest: (groups.append(len(group)), encode(group, *rest))[1]
    warm.warm_up("Please transcribe this audio into text")
    assert groups == [1, 2, 3]
    assert {rows for rows, _ in warm.engine.runner.decoders} == {1, 2, 4}
    assert not warm.engine.busy and sorted(warm.engine.runner.slots.free) == list(range(4))
    got = run(warm)
    assert got == run(Transcriber.load(tiny, "cpu", max_batch=4, encoder_batch=3))
    assert len(got) == 2 and all(isinstance(s, list) and s for _, s in got)


def test_windows_read_while_the_gpu_encodes_join_one_prefill(tiny):
    """While the GPU still runs an encoder pass (Transcriber._encoding; simulated on the CPU: busy
    for a second after each pass returns, as a queued GPU pass would be), a part group waits and
    the engine is stepped only once every input is read, so the windows join one prefill; the
    transcripts are a plain run's."""
    import time

    rng = np.random.default_rng(3)
    audio = [(0.1 * rng.standard_normal(32000)).astype(np.float32) for _ in range(6)]

    def run(asr):
        src = [(f"f{i}", lambda a=a: a) for i, a in enumerate(audio)]
        return [(n, s) for n, s, _ in asr.transcribe_many(src, "Please transcribe this audio into text", 3)]

    asr = Transcriber.load(tiny, "cpu", max_batch=16, encoder_batch=4)
    last, prefills, stepped_busy = [-1e9], [], []
    encode, prefill, step = asr._encode, asr.engine.runner.prefill, asr.engine.step

    def busy():
        return time.monotonic() - last[0] < 1.0
    asr._encoding = busy
    asr._encode = lambda *args: (encode(*args), last.__setitem__(0, time.monotonic()))[0]
    asr.engine.runner.prefill = lambda reqs: (prefills.append(len(reqs)), prefill(reqs))[1]
    asr.engine.step = lambda: (stepped_busy.append(busy()), step())[1]
    got = run(asr)
    assert prefills == [6] and stepped_busy
    assert got == run(Transcriber.load(tiny, "cpu", max_batch=16, encoder_batch=4))


def test_the_last_input_read_is_prefilled_behind_its_encoder_pass(tiny):
    """Once every input is read no window can join the batch: the engine is stepped (its prefill
    queued behind the encoder pass on the GPU) without waiting for the pass to finish, a clip's
    latency ~1.2 ms shorter on an H100."""
    import time

    asr = Transcriber.load(tiny, "cpu", max_batch=16, encoder_batch=4)
    last, stepped_busy = [-1e9], []
    encode, step = asr._encode, asr.engine.step
    asr._encoding = lambda: time.monotonic() - last[0] < 30.0
    asr._encode = lambda *args: (encode(*args), last.__setitem__(0, time.monotonic()))[0]
    asr.engine.step = lambda: (stepped_busy.append(asr._encoding()), step())[1]
    audio = (0.1 * np.random.default_rng(4).standard_normal(32000)).astype(np.float32)
    t = time.monotonic()
    got = list(asr.transcribe_many([("clip", lambda: audio)], "Please transcribe this audio into text", 3))
    assert len(got) == 1 and not isinstance(got[0][1], Exception)
    assert stepped_busy and stepped_busy[0] and time.monotonic() - t < 20.0


def test_a_bfloat16_checkpoint_reads_as_stored_and_loads_the_same(rounded_tiny):
    """The hub checkpoint is bfloat16: read without widening, its tensors are bfloat16 views of
    the file; the model built from it holds exactly the numbers of the same values in float32."""
    from tilekernels.weights import BF16

    raw = load_tensors(rounded_tiny[BF16], widen=False)
    assert {v.dtype for v in raw.values()} == {BF16}
    widened, f32 = load_tensors(rounded_tiny[BF16]), load_tensors(rounded_tiny[np.float32])
    assert all(widened[k].dtype == np.float32 and np.array_equal(widened[k], f32[k]) for k in f32)
    a, b = GlmAsr.load(rounded_tiny[np.float32]), GlmAsr.load(rounded_tiny[BF16])
    for x, y in zip(*((m.w["decoder"][0].qkv[0], *m.w["encoder"][0].qkv, m.w["lm_head"], m.w["norm"].weight)
                      for m in (a, b))):
        assert x.dtype == y.dtype == np.float32 and np.array_equal(x, y)


def test_profile_marks_the_first_file(tiny, audio_dir):
    """profile=true on transcribe: the stages of the run on stderr after the transcript, marked
    up to the first file written."""
    r = cli(audio_dir / "speech16k.wav", f"model.path={tiny}", "max_new_tokens=2", "device=cpu", "profile=true")
    assert r.returncode == 0, r.stderr
    assert "profile:" not in r.stdout
    marks = [line.split(" at ")[0].strip() for line in r.stderr.splitlines() if " at " in line]
    assert marks == ["options read", "model loaded", "first file written"]
    assert "  model load " in r.stderr and "  checkpoint read " in r.stderr


def test_each_model_keeps_the_precision_it_was_loaded_with(tiny):
    """gpt at fp32, then GLM-ASR at bf16 and the process set to tf32: every product of gpt's
    engine and teacher-forced logits still runs at fp32 ('highest'), GLM-ASR's at bf16, and the
    process's setting is left as it was set."""
    import gpt
    import tilekernels as tk
    from tilekernels.runtime import precision, set_precision

    lm = gpt.load("shakespeare", device="cpu", precision="fp32")
    asr = glm_asr.load(str(tiny), device="cpu", precision="bf16")
    seen: dict[str, set] = {"gpt": set(), "asr": set()}

    def spy(name, fn):
        def call(*args, **kwargs):
            seen[name].add(tk.get_matmul_precision())
            return fn(*args, **kwargs)
        return call

    lm.model.step, lm.model.forward = spy("gpt", lm.model.step), spy("gpt", lm.model.forward)
    m = asr.transcriber.model
    m.step, m.encode = spy("asr", m.step), spy("asr", m.encode)
    set_precision("tf32")           # the conftest puts the process's setting back after the test
    lm.generate("To be", max_new_tokens=3, temperature=0)
    lm.logits([[1, 2, 3]])
    asr.transcribe((0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32), 16000,
                   max_new_tokens=2, vad="none")
    assert seen == {"gpt": {"highest"}, "asr": {"medium"}}
    assert (lm.engine().precision, asr.transcriber.engine.precision, precision()) == ("fp32", "bf16", "tf32")


GUARD = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_the_loop_guard_decodes_a_looping_segment_again(tiny):
    """The tiny model loops ('7777...') on the first segment of pause3s (compression ratio above
    2.4) and less on the second: with the guard the first is decoded again at rising temperatures
    until its text compresses less, the second keeps its greedy tokens; the draws are seeded by
    the segment, so the result is the same every run; temperature 0 alone is greedy only."""
    from glm_asr.pipeline import compression_ratio

    asr = glm_asr.load(str(tiny), device="cpu")
    clip = Path(__file__).parent / "fixtures" / "pause3s.flac"
    greedy = asr.transcribe(clip, max_new_tokens=40)
    guarded = asr.transcribe(clip, max_new_tokens=40, temperature=GUARD)
    assert [s.temperature for s in greedy.segments] == [0.0, 0.0]
    first, second = guarded.segments
    assert greedy.segments[0].compression_ratio > 2.4 >= greedy.segments[1].compression_ratio
    assert first.temperature in GUARD[1:] and first.compression_ratio <= 2.4
    assert first.compression_ratio == round(compression_ratio(first.text), 3) and first.tokens != greedy.segments[0].tokens
    assert (second.temperature, second.tokens) == (0.0, greedy.segments[1].tokens)
    again = asr.transcribe(clip, max_new_tokens=40, temperature=GUARD)
    assert [(s.tokens, s.temperature) for s in again.segments] == [(s.tokens, s.temperature) for s in guarded.segments]
    strict = asr.transcribe(clip, max_new_tokens=40, temperature=GUARD, compression_ratio_threshold=0.01)
    assert all(s.temperature in GUARD for s in strict.segments)      # every attempt fails: the least looping kept


def test_the_loop_guard_retries_unlikely_segments(tiny):
    """A segment whose tokens' mean log-probability is below logprob_threshold is decoded again;
    when every attempt fails, the likeliest attempt that does not loop is kept, so the kept
    segment is at least as likely as greedy's; None turns the check off."""

    asr = glm_asr.load(str(tiny), device="cpu")
    clip = Path(__file__).parent / "fixtures" / "pause3s.flac"
    greedy = asr.transcribe(clip, max_new_tokens=40, temperature=GUARD, logprob_threshold=None)
    loose = asr.transcribe(clip, max_new_tokens=40, temperature=GUARD, logprob_threshold=-50.0)
    assert [s.tokens for s in loose.segments] == [s.tokens for s in greedy.segments]
    second = greedy.segments[1]
    assert second.temperature == 0.0 and -50 < second.avg_logprob < 0
    strict = asr.transcribe(clip, max_new_tokens=40, temperature=GUARD, logprob_threshold=second.avg_logprob / 2)
    kept = strict.segments[1]
    assert kept.avg_logprob >= second.avg_logprob and kept.compression_ratio <= 2.4
    again = asr.transcribe(clip, max_new_tokens=40, temperature=GUARD, logprob_threshold=second.avg_logprob / 2)
    assert [(s.tokens, s.temperature) for s in again.segments] == [(s.tokens, s.temperature) for s in strict.segments]
    with pytest.raises(glm_asr.ASRError, match="logprob_threshold must be"):
        asr.transcribe(clip, temperature=GUARD, logprob_threshold=1.0)


def test_context_is_read_after_the_instruction(tiny):
    """context goes into the window's prompt after the instruction (the tokens the model reads
    change, so do its scores on the tiny model); the CLI's option is the API's; one that leaves
    no room is refused before any work."""
    from glm_asr.api import PROMPT
    from glm_asr.pipeline import with_context

    asr = glm_asr.load(str(tiny), device="cpu")
    clip = Path(__file__).parent / "fixtures" / "one.flac"
    assert with_context(PROMPT, "Ophelia, Elsinore") == f"{PROMPT}. Context: Ophelia, Elsinore"
    assert with_context(PROMPT, None) == with_context(PROMPT, "") == PROMPT
    plain = asr.transcribe(clip, max_new_tokens=12, vad="none")
    hinted = asr.transcribe(clip, max_new_tokens=12, vad="none", context="Ophelia, Elsinore")
    same = asr.transcribe(clip, max_new_tokens=12, vad="none", prompt=with_context(PROMPT, "Ophelia, Elsinore"))
    assert (hinted.segments[0].tokens, hinted.segments[0].avg_logprob) == (same.segments[0].tokens,
                                                                           same.segments[0].avg_logprob)
    assert hinted.segments[0].avg_logprob != plain.segments[0].avg_logprob
    r = cli(clip, f"model.path={tiny}", "device=cpu", "max_new_tokens=12", "vad=none", "output_format=json",
            "context='Ophelia, Elsinore'")
    assert r.returncode == 0, r.stderr
    seg = json.loads(r.stdout)["segments"][0]
    assert (seg["tokens"], seg["avg_logprob"]) == (hinted.segments[0].tokens, hinted.segments[0].avg_logprob)
    with pytest.raises(glm_asr.ASRError, match="exceeds"):
        asr.transcribe(clip, context="word " * 2000)


def test_the_loop_guard_on_the_command_line(tiny, tmp_path):
    """temperature=[...] on the CLI gives the API's segments; bad values are one line each."""

    clip = Path(__file__).parent / "fixtures" / "pause3s.flac"
    r = cli(clip, f"model.path={tiny}", "device=cpu", "max_new_tokens=40", "output_format=json",
            "temperature=[0,0.2,0.4,0.6,0.8,1.0]")
    assert r.returncode == 0, r.stderr
    api = glm_asr.load(str(tiny), device="cpu").transcribe(clip, max_new_tokens=40, temperature=GUARD)
    assert [(s["tokens"], s["temperature"]) for s in json.loads(r.stdout)["segments"]] == [
        (s.tokens, s.temperature) for s in api.segments]
    for bad, message in (("temperature=x", "temperature must be a number"),
                         ("temperature=[0,-1]", "temperature must be a number from 0"),
                         ("compression_ratio_threshold=0", "compression_ratio_threshold must be"),
                         ("logprob_threshold=0.5", "logprob_threshold must be")):
        r = cli(clip, f"model.path={tiny}", "device=cpu", bad)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_a_missing_input_is_said_before_the_model_loads(tmp_path):
    """A typo'd path is the error, not the model that was never needed (here no checkpoint at all)."""
    r = cli(tmp_path / "typo.wav", f"model.path={tmp_path / 'no-model'}", "device=cpu")
    assert r.returncode == 1 and r.stderr.strip() == f"error: {tmp_path / 'typo.wav'}: no such file", r.stderr


def test_with_output_dir_a_short_file_is_not_held_behind_a_long_one(tiny, audio_dir, tmp_path):
    """in_order=False (what the CLI uses with output_dir): each file comes back once it is done
    (two windows decoding at once: the short file's is done long before the long one's ten)."""
    import soundfile as sf

    sf.write(tmp_path / "five.flac", np.tile(sf.read(audio_dir / "long.flac", dtype="float32")[0], 5), 16000)
    asr = glm_asr.load(str(tiny), device="cpu", max_batch=2)
    files = [str(tmp_path / "five.flac"), str(audio_dir / "speech16k.wav")]
    kept = [r.source for r in asr.transcribe_many(files, vad="none", max_new_tokens=2)]
    first_done = [r.source for r in asr.transcribe_many(files, vad="none", max_new_tokens=2, in_order=False)]
    assert kept == files and first_done == files[::-1]


def test_sigterm_stops_as_ctrl_c_does(tiny, audio_dir, tmp_path):
    """SIGTERM mid-run (a batch system's stop): exit 143, no traceback, standard input's copy and
    the scratch folder removed, also while it waits on a pipe that sends nothing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "glm_asr.transcribe", "-", f"model.path={tiny}", "device=cpu", "vad=none"]

    def stopped_while_copying(stdin) -> None:
        p = subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + 120
        while not list(scratch.rglob("stdin*")) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 143 and b"Traceback" not in err and list(scratch.iterdir()) == [], err

    with open(audio_dir / "long.flac", "rb") as stdin:
        stopped_while_copying(stdin)
    read, write = os.pipe()                 # a producer that has sent nothing yet
    try:
        stopped_while_copying(read)
    finally:
        os.close(read)
        os.close(write)


def test_inputs_a_python_user_passes(tiny, audio_dir):
    """A file's bytes or a binary file object transcribe as the path does; a single path given to
    transcribe_many, a list given to transcribe, channel-first samples, a text-mode file and a
    bad setting of transcribe_many are one ASRError at the call; a non-path among many inputs is
    that input's error, the others go on."""
    import io

    asr = glm_asr.load(str(tiny), device="cpu")
    path = audio_dir / "speech16k.wav"
    kw = dict(max_new_tokens=3, vad="none")
    want = asr.transcribe(path, **kw).text
    assert asr.transcribe(path.read_bytes(), **kw).text == want
    with open(path, "rb") as f:
        r = asr.transcribe(f, **kw)
    assert r.text == want and r.source == str(path)
    assert asr.transcribe(io.BytesIO(path.read_bytes()), **kw).text == want
    x, rate = sf.read(path, dtype="float32", always_2d=True)
    for call, message in [
        (lambda: asr.transcribe_many(str(path)), "transcribe_many takes a list"),
        (lambda: asr.transcribe([path, path]), "transcribe takes one input"),
        (lambda: asr.transcribe(np.ascontiguousarray(x.T), sample_rate=rate), "channels first? pass samples.T"),
        (lambda: asr.transcribe(io.StringIO("text"), **kw), "binary mode"),
        (lambda: asr.transcribe(3, **kw), "got int"),
        (lambda: asr.transcribe_many([path], max_new_tokens=0), "max_new_tokens"),
    ]:
        with pytest.raises(glm_asr.ASRError, match=message.replace("?", r"\?")):
            call()
    rs = list(asr.transcribe_many([path, x[:, 0], path], **kw))
    assert [r.error for r in rs] == [None, "<ndarray>: expected a file path, got ndarray (samples go to transcribe)",
                                     None]
    assert rs[0].text == rs[2].text == want
    assert [r.text for r in asr.transcribe_many(np.array([str(path)]), **kw)] == [want]     # an array of paths


def test_calls_from_several_threads_take_turns(tiny):
    """Threads transcribing on one model at once each get their own transcript (they take turns
    with the engine); an unfinished transcribe_many of the same thread makes another call an
    error until it is closed."""
    import threading

    asr = glm_asr.load(str(tiny), device="cpu")
    files = [str(FIXTURES / f) for f in ("one.flac", "pause3s.flac", "pause05.flac")]
    want = [asr.transcribe(f, max_new_tokens=12).text for f in files]
    got = [None] * len(files)
    start = threading.Barrier(len(files))

    def work(i):
        start.wait()
        got[i] = asr.transcribe(files[i], max_new_tokens=12).text

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(files))]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert got == want
    many = asr.transcribe_many(files, max_new_tokens=12)
    assert next(many).text == want[0]
    with pytest.raises(RuntimeError, match="unfinished: read it to the end or close"):
        asr.transcribe(files[1], max_new_tokens=12)
    many.close()
    assert asr.transcribe(files[1], max_new_tokens=12).text == want[1] and not asr.transcriber.engine.busy


def test_previews_grow_into_each_segments_text(tiny):
    """transcribe_many's preview: for a shown source without the loop guard, the text so far of
    the next segment, each preview extending the last and the segment's text extending it; none
    with the guard on (a retry may change the text)."""
    from glm_asr.audio import Audio
    from glm_asr.pipeline import Fallback
    from glm_asr.vad import VadOptions

    t = Transcriber.load(Path(tiny), "cpu")
    source = ("a", lambda: Audio(str(FIXTURES / "pause3s.flac")))
    for guard, want_previews in ((None, True), (Fallback((0.0, 0.5)), False)):
        log = []
        out = list(t.transcribe_many([(*source, True, guard)], "x", 40, vad=VadOptions(),
                                     partial=lambda name, seg, *_: log.append(("segment", seg["text"])),
                                     preview=lambda name, text: log.append(("preview", text.strip()))))
        texts = [s["text"] for s in out[0][1]]
        assert [x for k, x in log if k == "segment"] == texts and len(texts) == 2
        assert any(k == "preview" for k, _ in log) == want_previews
        shown = ""                                              # the text so far of the next segment
        for kind, text in log:
            assert text.startswith(shown), (kind, text, shown)
            shown = "" if kind == "segment" else text
