"""The OpenAI-compatible servers (python -m gpt.serve, python -m glm_asr.serve) as subprocesses on
loopback, driven by the official openai client: results equal the CLIs', errors, concurrency, drain."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpt2"))
from checkpoints import make_gpt2  # noqa: E402
from serving import concurrently, error_of, get, post, start  # noqa: E402

ONE = ROOT / "tests/asr/fixtures/one.flac"


# ---------------------------------------------------------------- gpt

@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory):
    return make_gpt2(tmp_path_factory.mktemp("srv_gpt") / "tiny")


@pytest.fixture(scope="module")
def gpt_server(request, gpt_ckpt, tmp_path_factory):
    return start(request, "gpt.serve", [f"model.path={gpt_ckpt}"], tmp_path_factory.mktemp("gpt_tmp"))


@pytest.fixture(scope="module")
def gpt_locked(request, gpt_ckpt, tmp_path_factory):
    return start(request, "gpt.serve", [f"model.path={gpt_ckpt}", "api_key=secret", "max_queue=0"],
                 tmp_path_factory.mktemp("gpt_locked_tmp"))


def gpt_cli(ckpt, *args) -> str:
    return subprocess.run([sys.executable, "-m", "gpt.generate", f"model.path={ckpt}", "device=cpu", *args],
                          check=True, capture_output=True, text=True).stdout


def test_gpt_completion_equals_cli_and_stream(gpt_server, gpt_ckpt):
    c = gpt_server.client()
    r = c.completions.create(model="tiny", prompt="To be", max_tokens=20, temperature=0)
    assert gpt_cli(gpt_ckpt, "prompt=To be", "max_new_tokens=20", "temperature=0") == "To be" + r.choices[0].text + "\n"
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].logprobs is None and r.usage.completion_tokens >= 1
    chunks = list(c.completions.create(model="tiny", prompt="To be", max_tokens=20, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    echo = c.completions.create(model="tiny", prompt="To be", max_tokens=20, temperature=0, echo=True)
    assert echo.choices[0].text == "To be" + r.choices[0].text
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_gpt_logprobs_echo_and_scoring(gpt_server, gpt_ckpt):
    """logprobs in OpenAI's completions shape equal the API's (lm.generate(logprobs=), lm.score);
    echo puts the prompt's first (null, no alternatives); max_tokens 0 scores the prompt alone;
    a stream carries every token's logprobs once, in order; vLLM's tokenizer endpoints."""
    import gpt
    from tilekernels.runtime import token_name

    lm = gpt.load(str(gpt_ckpt), "cpu")
    c = gpt_server.client()
    want = lm.generate("To be", max_new_tokens=6, temperature=0.9, top_k=50, seed=3, logprobs=3)[0]
    r = c.completions.create(model="tiny", prompt="To be", max_tokens=6, temperature=0.9, seed=3, logprobs=3,
                             extra_body={"top_k": 50}).choices[0]
    assert r.text == want.text
    assert np.allclose(r.logprobs.token_logprobs, [t.logprob for t in want.logprobs], atol=1e-6)
    assert all(len(top) in (3, 4) and max(top.values()) >= lp - 1e-6 and abs(top[tok] - lp) < 1e-5   # its own too
               for top, lp, tok in zip(r.logprobs.top_logprobs, r.logprobs.token_logprobs, r.logprobs.tokens))
    assert r.logprobs.tokens == [token_name(lm.tokenizer, t) for t in want.tokens]
    assert all(r.text[at:].startswith(t)
               for at, t in zip(r.logprobs.text_offset, r.logprobs.tokens) if not t.startswith("bytes:"))
    texts = ["To be or not", "to be"]
    scored = c.completions.create(model="tiny", prompt=texts, max_tokens=0, echo=True, logprobs=1, temperature=0)
    ref = lm.score(texts, top=1)
    for choice, prompt, want_lp in zip(sorted(scored.choices, key=lambda ch: ch.index), texts, ref):
        assert choice.text == prompt and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert np.allclose(lp.token_logprobs[1:], [t.logprob for t in want_lp[1:]], atol=1e-6)
        assert "".join(lp.tokens) == prompt and len(lp.tokens) == len(want_lp)
    assert scored.usage.completion_tokens == 0
    streamed = list(c.completions.create(model="tiny", prompt="To be", max_tokens=6, temperature=0.9, seed=3,
                                         logprobs=3, echo=True, stream=True, extra_body={"top_k": 50}))
    lps = [x for ch in streamed if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert lps[0] is None and np.allclose(lps[len(lm.encode(["To be"])[0]):], [t.logprob for t in want.logprobs],
                                          atol=1e-6)
    settings = dict(temperature=0.8, seed=2, min_p=0.05, presence_penalty=0.6, frequency_penalty=0.3,
                    logit_bias={7: 4.0, 9: -100.0})
    want = lm.generate("To be", max_new_tokens=8, top_k=0, **settings)[0]
    r = c.completions.create(model="tiny", prompt="To be", max_tokens=8, presence_penalty=0.6, frequency_penalty=0.3,
                             temperature=0.8, seed=2, logit_bias={"7": 4.0, "9": -100.0},
                             extra_body={"min_p": 0.05, "top_k": 0}).choices[0]
    assert r.text == want.text and 9 not in want.tokens
    headers = {"content-type": "application/json"}
    status, tok = post(gpt_server.url("/tokenize"), json.dumps({"prompt": "To be"}).encode(), headers)
    assert status == 200 and json.loads(tok)["tokens"] == lm.encode(["To be"])[0]
    status, text = post(gpt_server.url("/detokenize"), json.dumps({"tokens": json.loads(tok)["tokens"]}).encode(),
                        headers)
    assert status == 200 and json.loads(text)["prompt"] == "To be"
    status, bad = post(gpt_server.url("/detokenize"), json.dumps({"tokens": [10 ** 9]}).encode(), headers)
    assert status == 400 and bad["error"]["param"] == "tokens"
    status, info = get(gpt_server.url("/tokenizer_info"))
    assert status == 200 and json.loads(info)["eos_token"] == "<|endoftext|>"


def test_gpt_end_token_is_a_generated_token(gpt_server, gpt_ckpt):
    """The end token that ends a completion is one of its tokens, as vLLM's: in logprobs (named
    <|endoftext|>) and usage, with no text; so lm-evaluation-harness's echo + max_tokens=1
    request, which drops the last logprob as the generated one, keeps every prompt token's."""
    import gpt

    lm = gpt.load(str(gpt_ckpt), "cpu")
    eos = lm.model.config.eos_token_id
    ends = dict(temperature=0, logit_bias={eos: 100.0})
    want = lm.generate("To be", max_new_tokens=5, logprobs=1, **ends)[0]
    assert want.tokens == [eos] and want.text == "" and want.finish_reason == "stop" and len(want.logprobs) == 1
    c = gpt_server.client()
    r = c.completions.create(model="tiny", prompt="To be", max_tokens=1, echo=True, logprobs=1, temperature=0,
                             logit_bias={str(eos): 100.0})
    lp, n = r.choices[0].logprobs, len(lm.encode(["To be"])[0])
    assert r.choices[0].text == "To be" and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert len(lp.tokens) == len(lp.token_logprobs) == n + 1 and lp.tokens[-1] == "<|endoftext|>"
    ref = lm.score(["To be"])[0]
    assert np.allclose(lp.token_logprobs[1:n], [t.logprob for t in ref[1:]], atol=1e-6)
    assert np.isclose(lp.token_logprobs[-1], want.logprobs[0].logprob, atol=1e-6)


def test_gpt_logprobs_name_each_token_apart(gpt_server, gpt_ckpt):
    """Tokens that are part of a character are named by their bytes ("bytes:\\xNN", OpenAI's),
    not all "\ufffd": each alternative keeps its own log-probability, so the likeliest one named
    in top_logprobs is the model's (lm-evaluation-harness's is_greedy)."""
    import gpt
    from tilekernels.runtime import token_name

    lm = gpt.load(str(gpt_ckpt), "cpu")
    text = "the \u00ef na\u00efve \u6771\u4eac caf\u00e9"
    ref = lm.score([text], top=5)[0]
    r = gpt_server.client().completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=5,
                                               temperature=0).choices[0].logprobs
    assert any(t.startswith("bytes:\\x") for t in r.tokens)
    for top, place in zip(r.top_logprobs[1:], ref[1:]):
        names = [token_name(lm.tokenizer, t) for t, _ in place.top]
        assert len(set(names)) == len(names) and max(top, key=top.get) == names[0]
        assert all(np.isclose(top[name], v, atol=1e-6) for name, (_, v) in zip(names, place.top))


def test_gpt_text_offsets_with_characters_of_several_tokens(gpt_server):
    """text_offset is where each token begins in the choice's text, also where a character takes
    several tokens (both begin where it does), and with echo the first new token's is the prompt's
    length."""
    prompt = "Caf\u00e9, na\u00efve, \u6771\u4eac and \u00e9migr\u00e9"
    for echo in (False, True):
        r = gpt_server.client().completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                   logprobs=1, echo=echo).choices[0]
        lp, text = r.logprobs, r.text
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
        whole = [i for i, t in enumerate(lp.tokens) if not t.startswith("bytes:")]
        assert len(whole) < len(lp.tokens)          # some character here takes several tokens
        assert all(text[lp.text_offset[i]:].startswith(lp.tokens[i]) for i in whole)
        if echo:
            n = len(lp.tokens) - 12 if r.finish_reason == "length" else None
            assert n is None or lp.text_offset[n] == len(prompt)


def test_gpt_n_seed_equals_api(gpt_server, gpt_ckpt):
    import gpt

    lm = gpt.load(str(gpt_ckpt), "cpu")
    want = lm.generate(["To be", "or not"], max_new_tokens=12, temperature=0.9, top_k=50, seed=7, num_samples=2)
    r = gpt_server.client().completions.create(model="tiny", prompt=["To be", "or not"], max_tokens=12,
                                               temperature=0.9, seed=7, n=2, extra_body={"top_k": 50})
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == [w.text for w in want]
    chunks = gpt_server.client().completions.create(model="tiny", prompt=["To be", "or not"], max_tokens=12,
                                                    temperature=0.9, seed=7, n=2, extra_body={"top_k": 50},
                                                    stream=True)
    texts = [""] * 4
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == [w.text for w in want]


def test_gpt_errors(gpt_server, gpt_locked):
    c = gpt_server.client()
    for kwargs, status in (({"logprobs": 21}, 400), ({"logprobs": -1}, 400), ({"logprobs": "x"}, 400),
                           ({"max_tokens": 0}, 400), ({"max_tokens": 1000}, 400), ({"top_p": 2.0}, 400),
                           ({"logit_bias": {"999999": 1}}, 400), ({"logit_bias": {"5": 101}}, 400),
                           ({"logit_bias": {"x": 1}}, 400), ({"extra_body": {"min_p": 1.5}}, 400),
                           ({"presence_penalty": 3}, 400), ({"frequency_penalty": -2.5}, 400),
                           ({"n": 0}, 400), ({"model": "nope"}, 404), ({"model": 5}, 400)):
        args = {"model": "tiny", "prompt": "To be", "max_tokens": 5, **kwargs}
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(**args)
        assert e.value.status_code == status, kwargs
        err = error_of(e.value)
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if status == 400:
            assert err["param"] == next(iter(kwargs.get("extra_body", kwargs))), (kwargs, err)
    status, body = get(gpt_server.url("/v1/nothing"))
    assert status == 404 and body["error"]["message"]
    status, body = post(gpt_server.url("/v1/completions"), b"{not json", {"content-type": "application/json"})
    assert status == 400 and "error" in body
    with pytest.raises(openai.AuthenticationError):
        gpt_locked.client("wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert gpt_locked.client("secret").completions.create(model="tiny", prompt="x", max_tokens=2).choices
    for path in ("/tokenize", "/detokenize"):       # the api_key guards every path but the probes'
        status, err = post(gpt_locked.url(path), b"{}", {"content-type": "application/json"})
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        status, err = post(gpt_locked.url(path), b"{}", {"content-type": "application/json",
                                                         "authorization": "Bearer secret"})
        assert status == 400
    assert get(gpt_locked.url("/tokenizer_info"))[0] == 401 and get(gpt_locked.url("/health"))[0] == 200
    # still fine after all that
    assert c.completions.create(model="tiny", prompt="To be", max_tokens=3, temperature=0).choices[0].text is not None


def test_gpt_16_concurrent(gpt_server, gpt_ckpt):
    import gpt

    lm = gpt.load(str(gpt_ckpt), "cpu")
    prompts = [f"To be {i}" for i in range(16)]
    want = [lm.generate(p, max_new_tokens=15, temperature=0)[0].text for p in prompts]
    got, errors = [None] * 16, []

    def one(i):
        try:
            c = gpt_server.client()
            if i % 2:
                got[i] = "".join(ch.choices[0].text for ch in c.completions.create(
                    model="tiny", prompt=prompts[i], max_tokens=15, temperature=0, stream=True) if ch.choices)
            else:
                got[i] = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=15,
                                              temperature=0).choices[0].text
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    concurrently(one, 16)
    assert not errors and got == want
    status, text = get(gpt_server.url("/metrics"))
    assert status == 200 and "gpt_generated_tokens_total" in text and "gpt_queue_depth" in text
    assert 'gpt_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'gpt_request_latency_seconds_count{endpoint="/v1/completions"}' in text


def test_gpt_requests_share_the_running_batch(request, tmp_path_factory):
    """Concurrent streams decode together (continuous batching): every stream has its first text
    before any of them has finished, where one request at a time would finish each first. (400
    tokens each: 60 of the tiny model took less than the requests' arrivals spread.)"""
    ckpt = make_gpt2(tmp_path_factory.mktemp("srv_gpt_long") / "tiny", n_positions=512)
    server = start(request, "gpt.serve", [f"model.path={ckpt}"], tmp_path_factory.mktemp("gpt_long_tmp"))
    first, last = [None] * 4, [None] * 4
    clients, ready = [server.client() for _ in range(4)], threading.Barrier(4, timeout=60)

    def one(i):     # clients built beforehand and released together: a slow start is not a late request
        ready.wait()
        stream = clients[i].completions.create(model="tiny", prompt=f"To be {i}", max_tokens=400, temperature=0,
                                               stream=True)
        for ch in stream:
            if ch.choices and ch.choices[0].text and first[i] is None:
                first[i] = time.perf_counter()
        last[i] = time.perf_counter()

    concurrently(one, 4)
    assert None not in first and None not in last
    assert max(first) < min(last)


def test_gpt_stream_ends_in_one_write():
    """A stream's last text, its finish_reason chunk, the usage chunk and [DONE] go out as one
    write: 64 streams ending in the same step are 64 sends on the event loop, not 256."""
    import asyncio
    from types import SimpleNamespace

    from gpt.serve import _events
    from tilekernels.runtime import Completion
    from tilekernels.runtime.server import EngineJob

    class Connected:
        async def is_disconnected(self):
            return False

    async def stream():
        job = EngineJob([])
        req = SimpleNamespace(echo=False, ids=[[1, 2]], n=1, prompt_texts=["ab"], include_usage=True,
                              prompt_tokens=2, logprobs=None, max_tokens=2)
        writes = _events(Connected(), job, req, "cmpl-1", 0, "gpt2", None)
        job.emit([(0, "Hello")])
        first = await writes.__anext__()
        job.emit([(0, " world")])
        job.future.set_result([Completion([5, 6], "Hello world", "length")])
        return first, [w async for w in writes]

    first, rest = asyncio.run(stream())
    assert '"text": "Hello"' in first and "[DONE]" not in first
    assert len(rest) == 1
    events = [json.loads(e[6:]) for e in rest[0].strip().split("\n\n")[:-1]]
    assert [e["choices"][0]["text"] for e in events[:2]] == [" world", ""]
    assert events[1]["choices"][0]["finish_reason"] == "length"
    assert events[2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert rest[0].endswith("data: [DONE]\n\n")


def test_gpt_sigterm_finishes_the_running_batch(request, gpt_ckpt, tmp_path_factory):
    """SIGTERM while rows decode: the running requests finish whole, then the server exits cleanly."""
    s = start(request, "gpt.serve", [f"model.path={gpt_ckpt}"], tmp_path_factory.mktemp("gpt_drain"))
    stream = s.client().completions.create(model="tiny", prompt="To be", max_tokens=60, temperature=0, n=16,
                                           stream=True)
    chunks = [next(iter(stream))]
    s.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)
    finished = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finished) == 16 and all(c.finish_reason in ("length", "stop") for c in finished)
    assert s.proc.wait(60) in (0, -signal.SIGTERM)      # ended by the signal, as uvicorn re-raises it


# ---------------------------------------------------------------- glm_asr

@pytest.fixture(scope="module")
def sounds(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv_audio")
    t = np.arange(int(16000 * 2.5)) / 16000
    sf.write(d / "tone.wav", (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000)
    t = np.arange(16000 * 65) / 16000
    sf.write(d / "long.flac", (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000)
    (d / "notaudio.wav").write_text("this is not audio")
    (d / "big.wav").write_bytes(b"\0" * (2 * 1024 * 1024 + 10))
    return d


@pytest.fixture(scope="module")
def asr_server(request, tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("asr_tmp")
    s = start(request, "glm_asr.serve", [f"model.path={tiny}", "served_model_name=tinyasr"], tmp)
    yield s
    assert not list(tmp.rglob("upload*")) and not list(tmp.glob("glm_asr.serve.*")), "uploads left behind"


@pytest.fixture(scope="module")
def asr_none(request, tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("asr_none_tmp")
    s = start(request, "glm_asr.serve", [f"model.path={tiny}", "served_model_name=tinyasr", "vad=none",
                                         "api_key=secret", "max_queue=0", "max_upload_mb=1", "timeout_read=2"], tmp)
    yield s
    assert not list(tmp.rglob("upload*")) and not list(tmp.glob("glm_asr.serve.*")), "uploads left behind"


def asr_cli(ckpt, path, *args) -> str:
    return subprocess.run([sys.executable, "-m", "glm_asr.transcribe", str(path), f"model.path={ckpt}", "device=cpu",
                           *args], check=True, capture_output=True, text=True).stdout


def test_asr_equals_cli(asr_server, asr_none, tiny, sounds):
    c = asr_server.client()
    with open(ONE, "rb") as f:
        r = c.audio.transcriptions.create(model="tinyasr", file=f)
    assert asr_cli(tiny, ONE) == r.text + "\n"
    with open(ONE, "rb") as f:
        srt = c.audio.transcriptions.create(model="tinyasr", file=f, response_format="srt", language="en",
                                            prompt="a hint", temperature=0)
    assert srt == asr_cli(tiny, ONE, "output_format=srt", "context=a hint")     # OpenAI's prompt: our context
    with open(ONE, "rb") as f:
        v = c.audio.transcriptions.create(model="tinyasr", file=f, response_format="verbose_json")
    assert v.text == r.text and v.segments and v.segments[0].id == 0 and v.duration > 0
    cli_json = json.loads(asr_cli(tiny, ONE, "output_format=json"))
    assert [(s.tokens, s.compression_ratio, s.no_speech_prob, s.avg_logprob) for s in v.segments] == [
        (s["tokens"], s["compression_ratio"], s["no_speech_prob"], s["avg_logprob"]) for s in cli_json["segments"]]
    from openai.types.audio import TranscriptionVerbose

    with open(ONE, "rb") as f:      # vad none: no VAD measure, still OpenAI's required float
        raw = asr_none.client("secret").audio.transcriptions.with_raw_response.create(model="tinyasr", file=f,
                                                                                      response_format="verbose_json")
    none = TranscriptionVerbose.model_validate(json.loads(raw.http_response.text), strict=True)
    assert none.segments and all(s.no_speech_prob == 0.0 for s in none.segments)
    with open(ONE, "rb") as f:      # a temperature of its own: sampled, seeded by the segment, as the CLI's
        hot = c.audio.transcriptions.create(model="tinyasr", file=f, response_format="verbose_json", temperature=0.9)
    cli_hot = json.loads(asr_cli(tiny, ONE, "output_format=json", "temperature=0.9"))["segments"]
    assert [(s.tokens, s.temperature) for s in hot.segments] == [(s["tokens"], 0.9) for s in cli_hot]
    with open(sounds / "tone.wav", "rb") as f:
        t = asr_none.client("secret").audio.transcriptions.create(model="tinyasr", file=f, response_format="text")
    assert t == asr_cli(tiny, sounds / "tone.wav", "vad=none")


def test_asr_errors(asr_server, asr_none, sounds):
    c = asr_server.client()
    for path, kwargs, status in ((ONE, {"temperature": 101}, 400), (ONE, {"response_format": "xml"}, 400),
                                 (ONE, {"prompt": "word " * 2000}, 400),
                                 (ONE, {"model": "whisper-1"}, 404), (sounds / "notaudio.wav", {}, 400)):
        with open(path, "rb") as f, pytest.raises(openai.APIStatusError) as e:
            c.audio.transcriptions.create(**{"model": "tinyasr", "file": f, **kwargs})
        assert e.value.status_code == status, kwargs
        assert set(error_of(e.value)) == {"message", "type", "param", "code"}
    with open(sounds / "big.wav", "rb") as f, pytest.raises(openai.APIStatusError) as e:
        asr_none.client("secret").audio.transcriptions.create(model="tinyasr", file=f)
    assert e.value.status_code == 413
    with open(ONE, "rb") as f, pytest.raises(openai.AuthenticationError):
        asr_none.client("wrong").audio.transcriptions.create(model="tinyasr", file=f)
    status, body = get(asr_server.url("/v1/audio/translations"))
    assert status == 404 and "error" in body


def test_asr_queue_full_503(asr_none, sounds):
    """max_queue=0: while a long request runs, another gets 503; the long one still completes."""
    result = {}

    def long():
        with open(sounds / "long.flac", "rb") as f:
            result["text"] = asr_none.client("secret").audio.transcriptions.create(model="tinyasr", file=f).text

    t = threading.Thread(target=long)
    t.start()
    deadline, seen = time.monotonic() + 30, None
    while time.monotonic() < deadline and seen is None and t.is_alive():
        status, text = get(asr_none.url("/metrics"))
        if "glm_asr_running_batch_size 1.0" in text:
            with open(sounds / "tone.wav", "rb") as f, pytest.raises(openai.APIStatusError) as e:
                asr_none.client("secret").audio.transcriptions.create(model="tinyasr", file=f)
            seen = e.value.status_code
        time.sleep(0.05)
    t.join(120)
    assert seen == 503 and "text" in result


def test_asr_concurrent(asr_server, tiny):
    want = asr_cli(tiny, ONE)
    got, errors = [None] * 16, []

    def one(i):
        try:
            with open(ONE, "rb") as f:
                got[i] = asr_server.client().audio.transcriptions.create(model="tinyasr", file=f).text + "\n"
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    concurrently(one, 16)
    assert not errors and got == [want] * 16
    status, text = get(asr_server.url("/metrics"))
    assert "glm_asr_audio_seconds_total" in text


def test_asr_requests_share_the_pipeline(request, tiny, sounds, tmp_path_factory):
    """Concurrent uploads are in flight in the one pipeline together (their windows share the
    encoder batches and the engine): the running gauge counts them, where one request at a time
    would never pass 1; every one completes with the same text."""
    s = start(request, "glm_asr.serve", [f"model.path={tiny}", "served_model_name=tinyasr", "vad=none"],
              tmp_path_factory.mktemp("asr_share"))
    texts, peak = [None] * 4, [0.0]

    def one(i):
        with open(sounds / "long.flac", "rb") as f:
            texts[i] = s.client().audio.transcriptions.create(model="tinyasr", file=f).text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        _, text = get(s.url("/metrics"))
        m = re.search(r"^glm_asr_running_batch_size ([0-9.]+)$", text, re.M)
        peak[0] = max(peak[0], float(m.group(1)) if m else 0.0)
        time.sleep(0.02)
    for t in threads:
        t.join(120)
    assert None not in texts and len(set(texts)) == 1
    assert peak[0] >= 2


def test_asr_sigterm_drains(request, tiny, sounds, tmp_path_factory):
    s = start(request, "glm_asr.serve", [f"model.path={tiny}", "served_model_name=tinyasr", "vad=none"],
              tmp_path_factory.mktemp("drain"))
    result = {}

    def long():
        try:
            with open(sounds / "long.flac", "rb") as f:
                result["text"] = s.client().audio.transcriptions.create(model="tinyasr", file=f).text
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=long)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "glm_asr_running_batch_size 1.0" in get(s.url("/metrics"))[1]:
            break
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert "text" in result, result
    assert s.proc.wait(60) in (0, -signal.SIGTERM)      # ended by the signal, as uvicorn re-raises it


def test_asr_stream_events_join_to_the_text(asr_server):
    """stream=true: OpenAI's transcript.text.delta events as a segment's tokens come (more than
    one a segment), then transcript.text.done; the deltas join to its text, which is the
    non-streamed response's."""
    pauses = ROOT / "tests/asr/fixtures/pause3s.flac"       # two sentences 3 s apart: two segments
    c = asr_server.client()
    with open(pauses, "rb") as f:
        whole = c.audio.transcriptions.create(model="tinyasr", file=f, response_format="verbose_json")
    want = whole.text
    with open(pauses, "rb") as f:
        events = list(c.audio.transcriptions.create(model="tinyasr", file=f, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    assert len(whole.segments) == 2 and len(kinds) - 1 > 2, kinds       # deltas within a segment
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == want
    assert events[-1].usage.output_tokens > 0 and events[-1].usage.input_tokens > 0
    with open(pauses, "rb") as f, pytest.raises(openai.BadRequestError) as e:
        c.audio.transcriptions.create(model="tinyasr", file=f, stream=True, response_format="srt")
    assert error_of(e.value)["param"] == "response_format"



def test_asr_realtime_server_vad_gives_the_files_segments(asr_server, tiny, tmp_path):
    """/v1/realtime with server_vad (the default): a 16 kHz file sent as pcm16 faster than real
    time, then a commit (the stream's end), gives the segments of glm_asr.transcribe on that file,
    in order, with the same times and texts: an item a segment, each speech_started, then
    speech_stopped, committed, deltas joining to its transcript, completed."""
    import base64

    from websockets.sync.client import connect

    parts = [sf.read(ROOT / "tests/asr/fixtures" / f, dtype="int16")[0] for f in ("pause3s.flac", "one.flac",
                                                                                  "pause05.flac")]
    pcm = np.concatenate(parts)
    wav = tmp_path / "three.wav"
    sf.write(wav, pcm, 16000, subtype="PCM_16")
    want = json.loads(asr_cli(tiny, wav, "output_format=json"))["segments"]
    assert len(want) >= 3
    with connect(asr_server.url("/v1/realtime").replace("http", "ws"), open_timeout=30) as ws:
        def event() -> dict:
            return json.loads(ws.recv(timeout=60))

        created = event()
        assert created["session"]["turn_detection"]["type"] == "server_vad"
        ws.send(json.dumps({"type": "transcription_session.update", "session": {
            "input_sample_rate": 16000, "turn_detection": {"type": "server_vad", "silence_duration_ms": 2000}}}))
        assert event()["session"]["turn_detection"]["silence_duration_ms"] == 2000      # OpenAI's name, an int
        for i in range(0, len(pcm), 1600):          # 100 ms an event, as fast as the socket takes them
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(pcm[i:i + 1600].astype("<i2").tobytes()).decode()}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        events = []
        while not events or events[-1]["type"] != "input_audio_buffer.cleared":
            events.append(event())
        items = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
        done: dict = {}
        while len(done) < len(items):
            e = event()
            events.append(e)
            if e["type"] == "conversation.item.input_audio_transcription.completed":
                done[e["item_id"]] = e
    got = [s for item in items for s in done[item]["segments"]]
    assert [(s["start"], s["end"], s["text"]) for s in got] == [(s["start"], s["end"], s["text"]) for s in want]
    for k, item in enumerate(items):
        mine = [e for e in events if e.get("item_id") == item]
        kinds = [e["type"].rsplit(".", 1)[-1] for e in mine]
        assert kinds[:3] == ["speech_started", "speech_stopped", "committed"] and kinds[-1] == "completed", kinds
        assert mine[0]["audio_start_ms"] == int(want[k]["start"] * 1000)
        assert mine[2]["previous_item_id"] == (items[k - 1] if k else None)
        assert "".join(e["delta"] for e in mine if e["type"].endswith("delta")) == mine[-1]["transcript"]


def test_asr_realtime_speech_without_end_is_cut_at_the_upload_limit(asr_none):
    """server_vad and a client that never commits, speaking on without a pause long enough to end
    a turn: once the pending audio would pass max_upload_mb (1 MB here: 33 s) the server ends the
    stream there itself, its segments committed and transcribed, and the session goes on. This
    server takes one upload at a time (max_queue=0): the items sent at full speed wait for room,
    none is refused."""
    import base64

    from websockets.sync.client import connect

    pcm = np.concatenate([sf.read(ROOT / "tests/asr/fixtures/pause05.flac", dtype="int16")[0]] * 8)    # ~43 s
    with connect(asr_none.url("/v1/realtime").replace("http", "ws"), open_timeout=30,
                 additional_headers={"Authorization": "Bearer secret"}) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "transcription_session.created"
        ws.send(json.dumps({"type": "session.update", "session": {"input_sample_rate": 16000}}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"
        for i in range(0, len(pcm), 8000):
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(pcm[i:i + 8000].astype("<i2").tobytes()).decode()}))
        committed, completed, busy = [], [], []
        deadline = time.monotonic() + 120
        while (not committed or len(completed) + len(busy) < len(committed)) and time.monotonic() < deadline:
            e = json.loads(ws.recv(timeout=60))
            if e["type"].endswith("transcription.failed"):
                busy.append(e)
            elif e["type"] == "input_audio_buffer.committed":
                committed.append(e["item_id"])
            elif e["type"].endswith("transcription.completed"):
                completed.append(e)
        assert not busy and len(committed) >= 2 and len(completed) == len(committed), busy
        assert all(s["end"] <= 36 for e in completed for s in e["segments"])     # cut at the limit, not at 43 s


def test_asr_realtime_with_openais_client_and_ga_session(asr_server, tiny, tmp_path):
    """The official openai client's Realtime connection (GA): a GA-shaped session.update (type
    transcription, audio.input's format, turn_detection null, transcription.prompt) takes effect
    and is answered in that shape; every event validates as the client's own type (event_id,
    usage); the transcript is the CLI's with that context."""
    import base64

    import soxr
    from openai.types.realtime import RealtimeServerEvent
    from pydantic import TypeAdapter

    server_event = TypeAdapter(RealtimeServerEvent)
    pcm = sf.read(ONE, dtype="float32")[0]
    at24k = (np.clip(soxr.resample(pcm, 16000, 24000), -1, 1) * 32767).astype("<i2")
    client = openai.OpenAI(base_url=asr_server.url("/v1"), api_key="x", max_retries=0)
    with client.realtime.connect(model="tinyasr") as conn:
        conn.recv()                     # transcription_session.created (beta's name: not a GA type)
        conn.session.update(session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None,
            "transcription": {"model": "tinyasr", "prompt": "Ophelia"}}}})
        updated = server_event.validate_python(json.loads(conn.recv_bytes()))
        assert updated.type == "session.updated" and updated.session.type == "transcription"
        assert updated.session.audio.input.turn_detection is None
        assert updated.session.audio.input.transcription.prompt == "Ophelia"
        conn.session.update(session={"type": "realtime"})
        refused = server_event.validate_python(json.loads(conn.recv_bytes()))
        assert refused.type == "error" and refused.error.param == "session.type"
        conn.input_audio_buffer.append(audio=base64.b64encode(at24k.tobytes()).decode())
        conn.input_audio_buffer.commit()
        seen = []
        while not seen or seen[-1].type != "conversation.item.input_audio_transcription.completed":
            seen.append(server_event.validate_python(json.loads(conn.recv_bytes())))
            assert seen[-1].event_id.startswith("event_") and seen[-1].type != "error", seen[-1]
    assert seen[0].type == "input_audio_buffer.committed"
    done = seen[-1]
    assert done.usage.type == "tokens" and done.usage.output_tokens >= 0 and done.usage.input_tokens > 0
    wav = tmp_path / "one24k.wav"
    sf.write(wav, at24k, 24000, subtype="PCM_16")
    assert done.transcript == json.loads(asr_cli(tiny, wav, "output_format=json", "context=Ophelia"))["text"]


def test_asr_live_client_prints_the_files_segments(asr_server, asr_none, tiny, tmp_path):
    """python -m glm_asr.live: a file, or raw pcm16 on standard input, streamed to the server
    prints one line an utterance: the CLI's segments of that file, with their times (also sent at
    full speed to a server that takes one upload at a time: its items wait, none is lost); a
    server that is not there is one error line."""
    from glm_asr.live import clock

    pcm = np.concatenate([sf.read(ROOT / "tests/asr/fixtures" / f, dtype="int16")[0]
                          for f in ("pause05.flac", "pause3s.flac")])
    wav = tmp_path / "two.wav"
    sf.write(wav, pcm, 16000, subtype="PCM_16")
    want = [s for s in json.loads(asr_cli(tiny, wav, "output_format=json"))["segments"] if s["text"].strip()]
    assert len(want) >= 2
    url = "url=" + asr_server.url("/v1/realtime").replace("http", "ws")
    live = [sys.executable, "-m", "glm_asr.live"]
    r = subprocess.run([*live, str(wav), url, "speed=0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"[{clock(s['start'])} --> {clock(s['end'])}] {s['text'].strip()}" for s in want]
    r = subprocess.run([*live, "-", url, "speed=0", "timestamps=false"], input=pcm.astype("<i2").tobytes(),
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().splitlines() == [s["text"].strip() for s in want]
    r = subprocess.run([*live, "-", url], input=b"", capture_output=True, timeout=120)
    assert r.returncode == 1 and r.stderr.decode() == "error: no audio to send: standard input was empty\n"
    r = subprocess.run([*live, str(wav), "url=ws://127.0.0.1:9/v1/realtime"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: cannot connect to") and len(r.stderr.splitlines()) == 1
    many = np.concatenate([np.concatenate([pcm, np.zeros(40000, np.int16)])] * 6)      # 12 utterances
    sf.write(tmp_path / "many.wav", many, 16000, subtype="PCM_16")
    busy = "url=" + asr_none.url("/v1/realtime").replace("http", "ws")       # one upload at a time (max_queue=0)
    r = subprocess.run([*live, str(tmp_path / "many.wav"), busy, "api_key=secret", "speed=0", "timestamps=false"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "" and len(r.stdout.splitlines()) >= 6, r.stderr
    (tmp_path / "junk.wav").write_bytes(b"RIFF" + bytes(100))
    for bad, server in ((tmp_path / "missing.wav", url), (tmp_path / "junk.wav", url),
                        (tmp_path / "missing.wav", "url=ws://127.0.0.1:9/v1/realtime")):   # the file's error first
        r = subprocess.run([*live, str(bad), server], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stderr.splitlines() == [r.stderr.strip()] and bad.name in r.stderr, r.stderr


def test_the_live_client_prints_in_order_past_a_failed_item(capsys):
    """glm_asr.live's printer: items in the order committed, each once it and those before it
    are done; a `.failed` item is an error line (exit status 1) and does not hold back the next."""
    import asyncio
    import io

    from glm_asr.live import show

    events = [{"type": "input_audio_buffer.committed", "item_id": "a"},
              {"type": "input_audio_buffer.committed", "item_id": "b"},
              {"type": "conversation.item.input_audio_transcription.completed", "item_id": "b", "transcript": " two"},
              {"type": "conversation.item.input_audio_transcription.failed", "item_id": "a",
               "error": {"message": "the queue is full"}},
              {"type": "input_audio_buffer.cleared"}]

    class Socket:
        async def recv(self):
            return json.dumps(events.pop(0))

    out = io.StringIO()
    assert asyncio.run(show(Socket(), False, out)) == 1
    assert out.getvalue() == "two\n" and capsys.readouterr().err == "error: the queue is full\n"


def test_a_realtime_sessions_items_wait_in_order_and_past_the_cap_fail():
    """A session's items wait for a full server in commit order (IN_FLIGHT under way at most); one
    past WAITING waiting items fails at once (queue_full), the others are transcribed; a closed
    session leaves nothing running."""
    import asyncio
    from types import SimpleNamespace

    from glm_asr import realtime
    from tilekernels.runtime.server import Job, QueueFull

    async def run():
        sent, submitted, full = [], [], [True]

        async def send(event):
            sent.append(event)

        class Worker:
            def submit(self, job):
                if full[0]:
                    raise QueueFull()
                submitted.append(job.name)
                job.future.set_result(SimpleNamespace(text=job.name, segments=[]))
                return job

        def make_job(item, audio, context):
            job = Job()
            job.name = item
            return job

        session = realtime.Session(send, Worker, make_job, 1 << 20)
        items = [f"item_{i:02d}" for i in range(realtime.WAITING + 1)]
        for item in items:
            await session.transcribe_item(item, np.zeros(1600, np.float32))
        refused = [e["item_id"] for e in sent if e["type"].endswith("failed")]
        full[0] = False
        while len([e for e in sent if e["type"].endswith("completed")]) < realtime.WAITING:
            await asyncio.sleep(0.05)
        session.close()
        await asyncio.sleep(0)
        return refused, submitted, session

    refused, submitted, session = asyncio.run(asyncio.wait_for(run(), 60))
    assert refused == [f"item_{realtime.WAITING:02d}"]
    assert submitted == [f"item_{i:02d}" for i in range(realtime.WAITING)]
    assert not session.queued and session.in_flight == 0 and not session.tasks


def test_asr_realtime_push_to_talk(asr_server, asr_none, tiny, tmp_path):
    """/v1/realtime, OpenAI's transcription events: after the session update, appended pcm16 and
    a commit give committed, deltas joining to the transcript, and completed; its text is the
    CLI's for a WAV of the same samples (at 16 kHz; at 24 kHz resampled as a file is). Bad events
    get error events and the session goes on; an empty commit does nothing; the api_key is
    checked at the handshake."""
    import base64

    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    pcm, _ = sf.read(ONE, dtype="int16")
    wav = tmp_path / "one.wav"
    sf.write(wav, pcm, 16000, subtype="PCM_16")
    want = asr_cli(tiny, wav, "output_format=json")
    b64 = lambda a: base64.b64encode(a.astype("<i2").tobytes()).decode()     # noqa: E731

    with connect(asr_server.url("/v1/realtime").replace("http", "ws"), open_timeout=30) as ws:
        def event() -> dict:
            return json.loads(ws.recv(timeout=60))

        def send(**e) -> None:
            ws.send(json.dumps(e))

        assert event()["type"] == "transcription_session.created"
        send(type="input_audio_buffer.append", audio=b64(pcm[:100]))
        assert event()["error"]["code"] == "session_not_set_up"
        send(type="transcription_session.update", session={"input_sample_rate": 16000, "turn_detection": None})
        assert event()["type"] == "transcription_session.updated"
        for bad, code in (({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_value"),
                          ({"type": "input_audio_buffer.append", "audio": "AA=="}, "invalid_value"),
                          ({"type": "no.such.event"}, "unknown_event"),
                          ({"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad"}}},
                           "unsupported"),
                          ({"type": "session.update", "session": {"turn_detection": {"threshold": 2}}},
                           "invalid_value"),
                          ({"type": "session.update", "session": {"turn_detection": {"eagerness": "low"}}},
                           "invalid_value"),
                          ({"type": "session.update", "session": {"turn_detection": {"prefix_padding_ms": 1e305}}},
                           "invalid_value"),
                          ({"type": "input_audio_buffer.append", "audio": b64(np.zeros(8 << 20, "<i2"))},
                           "invalid_value"),                      # 16 MiB: past OpenAI's 15, said, not closed
                          ({"type": "session.update", "session": {"input_sample_rate": 12345}}, "invalid_value"),
                          ({"type": "session.update", "session": {"input_sample_rate": 16000.0}}, "invalid_value")):
            send(**bad)
            got = event()
            assert got["type"] == "error" and got["error"]["code"] == code, (bad, got)
        ws.send(b"\x00\x01")
        assert event()["error"]["code"] == "invalid_event"
        send(type="input_audio_buffer.commit")          # nothing appended: nothing happens
        send(type="input_audio_buffer.append", audio=b64(np.zeros(7 << 20, "<i2")))     # 14 MiB: taken
        send(type="input_audio_buffer.append", audio=b64(pcm[:3000]))
        send(type="input_audio_buffer.clear")
        assert event()["type"] == "input_audio_buffer.cleared"
        for part in np.array_split(pcm, 4):
            send(type="input_audio_buffer.append", audio=b64(part))
        send(type="input_audio_buffer.commit")
        committed = event()
        assert committed["type"] == "input_audio_buffer.committed" and committed["previous_item_id"] is None
        deltas = []
        while (e := event())["type"] != "conversation.item.input_audio_transcription.completed":
            assert e["type"] == "conversation.item.input_audio_transcription.delta", e
            deltas.append(e["delta"])
        assert e["item_id"] == committed["item_id"] and "".join(deltas) == e["transcript"]
        assert e["transcript"] == json.loads(want)["text"]
        assert [(s["start"], s["end"], s["text"]) for s in e["segments"]] == [
            (s["start"], s["end"], s["text"]) for s in json.loads(want)["segments"]]
        send(type="session.update", session={"input_audio_transcription": {"prompt": "word " * 2000}})
        assert event()["error"]["param"] == "session.input_audio_transcription.prompt"   # no room left: refused
        send(type="input_audio_buffer.append", audio=b64(pcm[:24000]))
        send(type="session.update", session={"input_audio_transcription": {"prompt": "Ophelia"}})
        event()
        send(type="input_audio_buffer.commit")
        hinted = event()
        while (e := event())["type"] != "conversation.item.input_audio_transcription.completed":
            pass
        assert hinted["previous_item_id"] == committed["item_id"]
        sf.write(tmp_path / "head.wav", pcm[:24000], 16000, subtype="PCM_16")
        head = json.loads(asr_cli(tiny, tmp_path / "head.wav", "output_format=json", "context=Ophelia"))
        assert e["transcript"] and e["transcript"] == head["text"]
        send(type="session.update", session={"input_sample_rate": 24000, "turn_detection": None})
        assert event()["session"]["input_sample_rate"] == 24000
        import librosa

        up = np.round(librosa.resample(pcm.astype(np.float32) / 32768, orig_sr=16000, target_sr=24000) * 32768)
        send(type="input_audio_buffer.append", audio=b64(np.clip(up, -32768, 32767).astype(np.int16)))
        send(type="input_audio_buffer.commit")
        assert event()["previous_item_id"] == hinted["item_id"]
        while (e := event())["type"] != "conversation.item.input_audio_transcription.completed":
            pass
        assert isinstance(e["transcript"], str)
    with pytest.raises(InvalidStatus):
        connect(asr_none.url("/v1/realtime").replace("http", "ws"), additional_headers={"Authorization": "Bearer no"},
                open_timeout=30)
    with connect(asr_none.url("/v1/realtime").replace("http", "ws"), open_timeout=30,
                 additional_headers={"Authorization": "Bearer secret"}) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "transcription_session.created"
        time.sleep(3)       # past that server's timeout_read (2 s): a live session is not an idle request
        ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "input_audio_buffer.cleared"
