"""gpt.generate's options on a tiny GPT-2 (CPU): a plain stop= is one stop string, bad option
values are one line, a too-long prompt writes nothing, and max_batch chunks completions
without changing greedy results while each chunk draws from its own seed."""
import os
import re
import subprocess
import sys

import pytest
from checkpoints import generate, make_gpt2

from gpt.model import GPT
from tilekernels.runtime import Sampling, load_tokenizer

GREEDY = Sampling(temperature=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gpt2(tmp_path_factory.mktemp("gpt_opts"), n_positions=64)


@pytest.fixture(scope="module")
def loaded(ckpt):
    return GPT.load(ckpt), load_tokenizer(ckpt)


def cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": "/tmp/empty-hf-home"}
    return subprocess.run([sys.executable, "-m", "gpt.generate", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def one_error_line(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    for n in needles:
        assert n in lines[0], (n, lines[0])


HYDRA_WORDS = {"true", "false", "null", "nan", "inf"}


def stop_candidate(text: str) -> str | None:
    """A 2-3 letter substring s of text (plain on a Hydra command line) such that one of its
    characters occurs before s does: cutting at any single character of s would cut earlier."""
    for n in (2, 3):
        for i in range(len(text) - n + 1):
            s = text[i: i + n]
            if not re.fullmatch(r"[A-Za-z]+", s) or s.lower() in HYDRA_WORDS:
                continue
            at = text.index(s)
            if min(text.index(c) for c in s) < at:
                return s
    return None


def test_plain_stop_is_one_stop_string(ckpt, loaded):
    model, tok = loaded
    for prompt in ("To be", "whether", "the slings and arrows of", "Caf"):
        text = generate(model, tok, [prompt], 20, GREEDY)[0].text
        s = stop_candidate(text)
        if s:
            break
    else:
        pytest.fail("no greedy continuation has a usable stop string")
    before = text[: text.index(s)]
    assert len(before) > min(text.index(c) for c in s)          # a per-character stop would end sooner
    api = generate(model, tok, [prompt], 20, GREEDY, stop=s)[0]       # a str, not a list
    assert api.text == before and api.finish_reason == "stop"
    r = cli(f"model.path={ckpt}", f"prompt={prompt}", f"stop={s}", "temperature=0", "max_new_tokens=20",
            "device=cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout == prompt + before + "\n", (s, text, r.stdout)


def test_a_newline_in_a_stop_string_from_the_shell():
    """stop='["\\n\\n",Sir]' (as the README writes it: the shell passes a backslash and an n) stops
    at the first blank line, as prompt_file reads a literal \\n."""
    base = ["model=shakespeare", "prompt=ROMEO:", "temperature=0", "max_new_tokens=60", "device=cpu"]
    whole = cli(*base).stdout
    assert "\n\n" in whole[len("ROMEO:"):]
    cut = cli(*base, 'stop=["\\n\\n",Sir]').stdout
    assert cut == whole[: whole.index("\n\n", len("ROMEO:"))] + "\n"


@pytest.mark.parametrize("arg,message", [
    ("max_new_tokens=abc", "max_new_tokens must be an integer"),
    ("max_new_tokens=2.7", "max_new_tokens must be an integer"),
    ("seed=abc", "seed must be an integer"),
    ("num_samples=abc", "num_samples must be an integer"),
    ("max_batch=0", "max_batch must be an integer >= 1, got 0"),
])
def test_bad_option_one_line(ckpt, arg, message):
    r = cli(f"model.path={ckpt}", "prompt=To be", "max_new_tokens=4", arg, "device=cpu")
    one_error_line(r, message)


def test_too_long_prompt_writes_nothing(ckpt, tmp_path):
    p = tmp_path / "long.txt"
    p.write_text(" ".join(["To be, or not to be, that is the question:"] * 10))         # 100 words
    r = cli(f"model.path={ckpt}", f"prompt_file={p}", "max_new_tokens=4", "device=cpu")
    one_error_line(r, "exceeds the model's 64 positions")


def test_max_batch_greedy_is_unchanged(loaded):
    model, tok = loaded
    small = generate(model, tok, ["To be"], 8, GREEDY, num_samples=5, max_batch=2)
    whole = generate(model, tok, ["To be"], 8, GREEDY, num_samples=5, max_batch=32)
    assert len(small) == len(whole) == 5
    assert [o.tokens for o in small] == [o.tokens for o in whole]
    assert all(o.tokens == whole[0].tokens and len(o.tokens) > 0 for o in small)
    assert [o.text for o in small] == [o.text for o in whole]


def test_max_batch_chunks_draw_from_their_own_seeds(loaded):
    model, tok = loaded
    s = Sampling(temperature=1.0, top_k=0)
    a = generate(model, tok, ["To be"], 12, s, seed=5, num_samples=5, max_batch=2)
    b = generate(model, tok, ["To be"], 12, s, seed=5, num_samples=5, max_batch=2)
    assert [o.tokens for o in a] == [o.tokens for o in b]           # a seed repeats
    assert len(a) == 5 and all(len(o.tokens) > 0 for o in a)
    chunks = [[o.tokens for o in a[0:2]], [o.tokens for o in a[2:4]], [a[4].tokens]]
    assert chunks[0] != chunks[1], "chunks 1 and 2 drew the same tokens: the same seed for each chunk"
    assert chunks[0][0] != chunks[0][1]                             # rows of one chunk differ too
    assert a[4].tokens not in (chunks[0][0], chunks[1][0])


def test_cli_max_batch_greedy_samples(ckpt):
    r = cli(f"model.path={ckpt}", "prompt=To be", "num_samples=5", "max_batch=2", "temperature=0",
            "max_new_tokens=6", "device=cpu")
    assert r.returncode == 0, r.stderr
    blocks = r.stdout.split("--- sample ")[1:]
    assert [b.split(" ---\n", 1)[0] for b in blocks] == ["1", "2", "3", "4", "5"]
    bodies = {b.split(" ---\n", 1)[1] for b in blocks}
    assert len(bodies) == 1 and bodies.pop().startswith("To be")


def test_profile_prints_where_the_time_went(ckpt):
    """profile=true: after the completion, stderr says where the run's time went (runtime.profile),
    stdout holds the completion alone; a value that is not a boolean is one error line."""
    r = cli(f"model.path={ckpt}", "prompt=To be", "max_new_tokens=4", "temperature=0", "device=cpu", "profile=true")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("To be") and "profile" not in r.stdout
    lines = r.stderr.splitlines()
    assert lines[0].startswith("profile: ") and "since the process started" in lines[0]
    marks = [line.split()[0:2] for line in lines if " at " in line]
    assert [" ".join(m) for m in marks] == ["options read", "model loaded", "first token"]
    times = [float(line.split(" at ")[1].split()[0]) for line in lines if " at " in line]
    assert times == sorted(times) and times[0] > 0
    for stage in ("checkpoint read", "weights prepared", "model load"):
        assert any(line.strip().startswith(stage) and line.endswith("(1x)") for line in lines), (stage, lines)
    assert any(line.strip().startswith("kernels: 0 compiled here") for line in lines)
    one_error_line(cli(f"model.path={ckpt}", "device=cpu", "profile=maybe"), "profile must be true or false")
