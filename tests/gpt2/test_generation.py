"""The sampler on hand-made logits, the generation loop, streaming text, the CLI."""
import os
import subprocess
import sys

import numpy as np
import pytest
from checkpoints import generate, make_gpt2

from gpt import LanguageModel
from gpt.model import GPT
from tilekernels.runtime import Sampler, Sampling
from tilekernels.runtime import TextStream, load_tokenizer


def test_sampler_greedy_seeded_and_penalised():
    """The Sampler picks with tk.sample: greedy without uniforms; a seed repeats its draws and
    draws at the softmax's rates; seen tokens are penalised and the chosen ones marked."""
    logits = np.log(np.array([[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]], np.float32))
    assert Sampler(Sampling(temperature=0), np, 2, 3)(logits).tolist() == [1, 0]

    def draws(seed, n=1):
        s = Sampler(Sampling(), np, 2, 3, seed)
        return [s(logits, u).tolist() for u in s.uniforms(n)]

    assert draws(7, 5) == draws(7, 5) and draws(7, 50) != draws(8, 50)
    first = np.array(draws(0, 4000))[:, 0]
    assert abs(np.mean(first == 1) - 0.6) < 0.03
    s = Sampler(Sampling(temperature=0, repetition_penalty=4.0), np, 2, 3)
    s.start([[1], [2, 0]])
    assert s(logits).tolist() == [2, 0] and s.seen.tolist() == [[0, 1, 1], [1, 0, 1]]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)])
def test_sampling_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        Sampling(**bad)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gpt2(tmp_path_factory.mktemp("gen"), n_positions=64)


def test_tokenizer_round_trip_and_streaming(ckpt):
    tok = load_tokenizer(ckpt)
    text = "Café naïve 東京 émigré, to be or not."
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    eot = tok.token_to_id("<|endoftext|>")
    for skip in (False, True):                  # special tokens kept, or skipped as decode skips them
        stream = TextStream(tok, skip_special_tokens=skip)
        pieces = [stream.push(i) for i in [*ids, eot, *ids]]
        assert stream.text == tok.decode([*ids, eot, *ids], skip_special_tokens=skip) == "".join(pieces)


def test_generate_batch_seed_and_stop(ckpt):
    model, tok = GPT.load(ckpt), load_tokenizer(ckpt)
    s = Sampling(temperature=1.0, top_k=50)
    a = generate(model, tok, ["To be", "the slings and arrows of"], 12, s, seed=3, num_samples=2)
    b = generate(model, tok, ["To be", "the slings and arrows of"], 12, s, seed=3, num_samples=2)
    assert [o.tokens for o in a] == [o.tokens for o in b] and len(a) == 4
    greedy = generate(model, tok, ["To be"], 10, Sampling(temperature=0))[0]
    alone = generate(model, tok, ["the slings and arrows of"], 10, Sampling(temperature=0))[0]
    batched = generate(model, tok, ["To be", "the slings and arrows of"], 10, Sampling(temperature=0))
    assert [o.tokens for o in batched] == [greedy.tokens, alone.tokens]     # left padding is invisible
    text = greedy.text
    if len(text) > 3:
        stop = text[2:4]
        out = generate(model, tok, ["To be"], 10, Sampling(temperature=0), stop=[stop])[0]
        pieces = list(LanguageModel(model, tok).stream("To be", 10, temperature=0, stop=[stop]))
        assert out.text == text[: text.index(stop)] and "".join(pieces) == out.text


def test_scores_at_full_context_seeds_by_prompt_and_empty_stops(ckpt):
    """A text of all the model's positions can be scored (the scoring pass feeds no new token);
    a prompt's seeded samples are the same wherever it sits among the prompts; an empty stop
    string stops nothing."""
    lm = LanguageModel(GPT.load(ckpt), load_tokenizer(ckpt))
    ids = [int(t) for t in np.random.default_rng(0).integers(1, 200, 64)]
    scored = lm.score([ids])[0]
    logits = lm.logits(ids)[0].astype(np.float64)
    want = logits[np.arange(63), ids[1:]] - np.log(np.exp(logits[:63] - logits[:63].max(1, keepdims=True)).sum(1)) \
        - logits[:63].max(1)
    assert scored[0] is None and np.allclose([t.logprob for t in scored[1:]], want, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        lm.generate([ids], max_new_tokens=2)
    assert len(lm.generate([ids[:60]], max_new_tokens=4, temperature=0)[0].tokens) <= 4     # 64 in all
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):      # its last step would embed
        lm.generate([ids[:60]], max_new_tokens=5)                               # a token at position 64
    both = lm.generate(["To be", "the slings"], max_new_tokens=8, temperature=1.0, seed=11, num_samples=2)
    alone = lm.generate("the slings", max_new_tokens=8, temperature=1.0, seed=11, num_samples=2)
    assert [o.tokens for o in both[2:]] == [o.tokens for o in alone] and alone[0].tokens != alone[1].tokens
    plain = lm.generate("To be", max_new_tokens=8, temperature=0, stop=["zz"])[0]
    assert lm.generate("To be", max_new_tokens=8, temperature=0, stop=["", "zz"])[0].text == plain.text != ""


def test_prompt_too_long_is_refused(ckpt):
    model, tok = GPT.load(ckpt), load_tokenizer(ckpt)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        generate(model, tok, [list(range(60))], 10, Sampling())


def cli(*args, env=None):
    e = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpt.generate", *args], capture_output=True, text=True,
                          env=e, timeout=300)


def test_cli_end_to_end(ckpt, tmp_path):
    r = cli(f"model.path={ckpt}", "prompt=To be", "max_new_tokens=8", "seed=1", "device=cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("To be") and len(r.stdout) > len("To be\n")
    again = cli(f"model.path={ckpt}", "prompt=To be", "max_new_tokens=8", "seed=1", "device=cpu")
    assert again.stdout == r.stdout
    (tmp_path / "p.txt").write_text("whether")
    r = cli(f"model.path={ckpt}", f"prompt_file={tmp_path / 'p.txt'}", "max_new_tokens=4", "num_samples=2",
            "device=cpu")
    assert r.returncode == 0 and r.stdout.count("--- sample") == 2
    r = cli(f"model.path={ckpt}", "prompt=", "max_new_tokens=4", "device=cpu")          # starts from eos
    assert r.returncode == 0, r.stderr


def test_prompt_file_lines_decode_the_same_at_any_max_batch(ckpt, tmp_path):
    """prompt_file: one prompt a line (blank lines skipped, \\n a newline), all through one engine;
    greedy text is the same decoded one at a time (max_batch=1) and together (max_batch=8)."""
    (tmp_path / "p.txt").write_text("To be\n\nwhether 'tis\\nnobler\nthe\nslings and arrows of outrageous\nO\n")
    outs = [cli(f"model.path={ckpt}", f"prompt_file={tmp_path / 'p.txt'}", "max_new_tokens=10", "temperature=0",
                f"max_batch={b}", "device=cpu") for b in (1, 8)]
    assert all(r.returncode == 0 for r in outs), outs[0].stderr
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.count("--- sample") == 5
    assert "--- sample 2 ---\nwhether 'tis\nnobler" in outs[0].stdout


@pytest.mark.parametrize("args,message", [
    (["model=gpt2"], "not in the local cache and the hub is unreachable"),
    (["model.path=/nonexistent/dir"], "/nonexistent/dir: no such directory"),
    (["temperature=-1"], "temperature must be a number from 0 to 100, got -1.0"),
    (["temperature=inf"], "temperature must be a number from 0 to 100, got inf"),
    (["temperature=nan"], "temperature must be a number from 0 to 100, got nan"),
    (["repetition_penalty=1e308"], "repetition_penalty must be a number from 0.01 to 100"),
    (["repetition_penalty=1e-40"], "repetition_penalty must be a number from 0.01 to 100"),
    (["top_p=0"], "top_p must be a number > 0 and <= 1"),
    (["top_p=1.5"], "top_p must be a number > 0 and <= 1"),
    (["top_k=-3"], "top_k must be an integer from 0 to 2**31 - 1"),
    (["top_k=1000000000000"], "top_k must be an integer from 0 to 2**31 - 1"),
    (["seed=-1"], "seed must be an integer from 0 to 2**63 - 1"),
    (["prompt_file=/nonexistent.txt"], "prompt_file /nonexistent.txt: cannot read"),
    (["prompt_file=/dev/zero"], "prompt_file /dev/zero: not a regular file"),
    (["max_new_tokens=500"], "exceeds the model's 64 positions"),
])
def test_cli_bad_input_one_line(ckpt, args, message):
    base = [] if args[0].startswith("model") else [f"model.path={ckpt}"]
    r = cli(*base, *args, "device=cpu", env={"HF_HOME": "/tmp/empty-hf-home"})
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_prompt_file_past_16_mb_is_one_error_line(ckpt, tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(16 * 2 ** 20 + 1)
    r = cli(f"model.path={ckpt}", f"prompt_file={big}", "device=cpu")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip() == f"error: prompt_file {big}: larger than 16 MB"


def test_vocab_and_merges_tokenizer(ckpt, tmp_path):
    """GPT-2's original tokenizer files load when there is no tokenizer.json."""
    tok = load_tokenizer(ckpt)
    d = tmp_path / "old"
    d.mkdir()
    tok.model.save(str(d))
    assert sorted(p.name for p in d.iterdir()) == ["merges.txt", "vocab.json"]
    old = load_tokenizer(d)
    text = "whether 'tis nobler in the mind"
    assert old.encode(text).ids == tok.encode(text).ids and old.decode(old.encode(text).ids) == text


def test_two_streams_read_in_turn_and_a_generate_between(ckpt):
    """Streams open at once on one model share its engine: each one's pieces join to its own
    generate() text, read in turn, or across a generate() call made while one is open."""
    lm = LanguageModel(GPT.load(ckpt), load_tokenizer(ckpt))
    kw = dict(max_new_tokens=24, temperature=0)
    want = [lm.generate(p, **kw)[0].text for p in ("To be", "the slings")]
    a, b, got = lm.stream("To be", **kw), lm.stream("the slings", **kw), ["", ""]
    for pa, pb in zip(a, b):
        got[0], got[1] = got[0] + pa, got[1] + pb
    got[0], got[1] = got[0] + "".join(a), got[1] + "".join(b)
    assert got == want and all(want)
    s = lm.stream("To be", **kw)
    first = next(s)
    assert lm.generate("the slings", **kw)[0].text == want[1]
    assert first + "".join(s) == want[0]


def test_calls_from_several_threads_at_once_give_their_own_results(ckpt):
    """Threads generating, streaming and scoring on one model at once share its engine (they step
    it in turn): each gets what it gets alone."""
    import threading

    lm = LanguageModel(GPT.load(ckpt), load_tokenizer(ckpt))
    kw = dict(max_new_tokens=24, temperature=1.0, seed=5)
    prompts = ["To be", "the slings and arrows", "of outrageous", "fortune"]
    def score():        # rounded: a prefill shared with other prompts may move the CPU's sums by ~1e-7
        return [(s.token, round(s.logprob, 4)) for s in lm.score(prompts[0])[0][1:]]

    want = [lm.generate(p, **kw)[0].tokens for p in prompts] + [score(), "".join(lm.stream("To be", **kw))]
    got = [None] * len(want)

    def work(i):
        for _ in range(3):
            if i < len(prompts):
                got[i] = lm.generate(prompts[i], **kw)[0].tokens
            else:
                got[i] = score() if i == len(prompts) else "".join(lm.stream("To be", **kw))
            if got[i] != want[i]:
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(want))]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert got == want


def test_api_arguments_as_python_users_pass_them(ckpt):
    """One text or one list of ids is one prompt (generate, encode, stream); stop=None is no stop;
    wrong types are one GPTError naming the argument, and stream's is raised at the call."""
    from gpt import GPTError

    lm = LanguageModel(GPT.load(ckpt), load_tokenizer(ckpt))
    kw = dict(max_new_tokens=6, temperature=0)
    ids = lm.encode("To be")
    assert ids == lm.encode(["To be"]) and len(ids) == 1
    want = lm.generate("To be", **kw)[0]
    assert lm.generate(ids[0], **kw)[0].tokens == lm.generate(np.array(ids[0]), **kw)[0].tokens == want.tokens
    assert lm.generate("To be", stop=None, **kw)[0].text == "".join(lm.stream(ids[0], stop=None, **kw)) == want.text
    two = [o.tokens for o in lm.generate(["To be", "or not"], **kw)]
    assert [o.tokens for o in lm.generate(np.array(["To be", "or not"]), **kw)] == two
    assert [o.tokens for o in lm.generate((p for p in ["To be", "or not"]), **kw)] == two
    assert "".join(lm.stream([], **kw)) == "".join(lm.stream("", **kw))
    assert lm.generate("To be", logit_bias={str(want.tokens[0]): -100}, **kw)[0].tokens[0] != want.tokens[0]
    assert lm.generate("To be", stop={want.text[2:4]}, **kw)[0].text == want.text[:2]
    for call, message in [
        (lambda: lm.generate("To be", max_new_tokens=6.0), "max_new_tokens must be an integer"),
        (lambda: lm.generate("To be", top_k=None), "top_k must be an integer"),
        (lambda: lm.generate("To be", num_samples=2.0), "num_samples must be an integer"),
        (lambda: lm.generate("To be", min_p=None), "min_p must be a number"),
        (lambda: lm.generate("To be", logit_bias={"a": 1}), "logit_bias must map token ids to numbers"),
        (lambda: lm.generate("To be", logit_bias={-1: 1}), "logit_bias token ids must be integers >= 0"),
        (lambda: lm.generate("To be", stop=[1]), "stop must be a string"),
        (lambda: lm.generate(b"To be"), "got bytes"),
        (lambda: lm.generate([["To", 1]]), "a prompt must be text or a list of token ids"),
        (lambda: lm.stream("To be", temperature=-1), "temperature"),
        (lambda: lm.stream(["To be", "or not"]), "stream takes one prompt"),
        (lambda: lm.stream("To be", max_new_tokens=10_000), "exceeds the model"),
    ]:
        with pytest.raises(GPTError, match=message):
            call()


def test_a_stream_the_collector_closes_inside_a_step_cancels_there(ckpt):
    """An abandoned stream in a reference cycle is closed by the garbage collector wherever it
    runs, inside the engine's step of the same thread too: its cancel takes the (re-entrant)
    engine lock there, not a deadlock."""
    import gc
    import threading

    lm = LanguageModel(GPT.load(ckpt), load_tokenizer(ckpt))
    kw = dict(max_new_tokens=12, temperature=0)
    want = lm.generate("the slings", **kw)[0].tokens
    done = []

    def work():
        for _ in range(5):
            s = lm.stream("To be", **kw)
            next(s)
            cycle = [s]
            cycle.append(cycle)
            del s, cycle
            engine, step = lm.engine(), lm.engine().step

            def step_collecting():      # a collection inside the step, as an allocation there can start
                gc.collect()
                return step()
            engine.step = step_collecting
            try:
                done.append(lm.generate("the slings", **kw)[0].tokens == want)
            finally:
                del engine.step
    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(60)
    assert done == [True] * 5 and not lm.engine().busy


def test_a_closed_output_pipe_ends_it_quietly():
    """python -m gpt.generate | head -c 0: the reader that went away ends it without an error
    line, exit 141 (as a tool SIGPIPE ends), not 'error: [Errno 32] Broken pipe'. The reader goes
    before the first write (reading a byte first raced the generation: a reader slower than the
    whole 250 tokens saw exit 0)."""
    p = subprocess.Popen([sys.executable, "-m", "gpt.generate", "device=cpu", "prompt=To be", "max_new_tokens=250",
                          "seed=1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(120) == 141 and err == b"", err
