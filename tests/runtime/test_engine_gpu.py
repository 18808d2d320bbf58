"""The continuous-batching engine on the GPU at gpt2's real size (random weights in the HF layout):
a request's tokens are the same alone and in batches of 8 and 64 with ragged prompts, mid-run
arrivals and settings of its own; at precision bf16 (bfloat16 matrices and KV cache) too."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import tilekernels as tk
from tilekernels.runtime import Engine, Sampling, device_stream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt2"))
from checkpoints import make_gpt2  # noqa: E402
from engine_runs import GREEDY, run  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return make_gpt2(tmp_path_factory.mktemp("gpt2"), n_embd=768, n_head=12, n_layer=12, n_positions=1024,
                     vocab=50257)


def workload(seed: int, n: int, longest: int = 300, most_new: int = 40):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 50257, rng.integers(1, longest + 1)).tolist(), int(rng.integers(1, most_new + 1)))
            for _ in range(n)]


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_tokens_do_not_depend_on_the_batch(gpt2_dir, precision):
    """Greedy and sampled rows (each with its own settings and seed) decode the same tokens
    alone, in batches of 8 joining as others finish, and 64 at once."""
    from gpt.model import GPT
    from tilekernels.runtime import set_precision

    work = workload(0, 40)
    kinds = [GREEDY, GREEDY, Sampling(temperature=0.8, top_k=50), Sampling(temperature=1.0, top_p=0.9,
                                                                            repetition_penalty=1.2)]
    settings = [kinds[i % len(kinds)] for i in range(len(work))]
    seeds = list(range(len(work)))
    set_precision(precision)
    try:
        gpt2 = GPT.load(gpt2_dir, "gpu")        # at bf16: bfloat16 matrices
        assert (gpt2.blocks[0].fc1[0].dtype == tk.weights.BF16) == (precision == "bf16")
        with device_stream(gpt2.xp):
            kv = tk.weights.BF16 if precision == "bf16" else np.float32
            one = Engine(gpt2, 1, kv_dtype=kv)
            alone = [run(one, [w], [s], [seed])[0] for w, s, seed in zip(work, settings, seeds)]
            assert [len(t) for t in alone] == [n for _, n in work]
            assert run(Engine(gpt2, 8, kv_dtype=kv), work, settings, seeds, arrive_every=1) == alone
            assert run(Engine(gpt2, 64, kv_dtype=kv), work, settings, seeds) == alone
    finally:
        set_precision("tf32")


def same_scores(a, b, tol=1e-5) -> bool:
    """The same tokens and alternatives, log-probabilities within tol (a prefill of 64 ragged
    prompts runs its products in other tiles than one prompt's)."""
    return len(a) == len(b) and all(x.token == y.token and [i for i, _ in x.top] == [i for i, _ in y.top]
                                    and abs(x.logprob - y.logprob) <= tol for x, y in zip(a, b))


def test_logprobs_equal_transformers_and_do_not_depend_on_the_batch(tmp_path):
    """Sampled rows' token logprobs (decode graph) and prompt logprobs (scored prefill) at fp32
    equal log_softmax of transformers' teacher-forced logits within 1e-4, alternatives included,
    and are the same alone and 64 at once (gpt2's size, transformers' own random init)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from gpt.model import GPT
    from tilekernels.runtime import generate, set_precision

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    work = workload(1, 64, longest=100, most_new=12)
    sampling = Sampling(temperature=0.8, top_k=50, logprobs=5, prompt_logprobs=5)
    set_precision("fp32")
    try:
        gpt2 = GPT.load(tmp_path, "gpu")
        with device_stream(gpt2.xp):
            many = generate(Engine(gpt2, 64), [p for p, _ in work], 12, sampling, seed=5)
            one = Engine(gpt2, 1)
            for i in (63, 17, 0):       # row i draws from [5, i]: alone, row 0's draws are the same
                alone = generate(one, [work[i][0]], 12, sampling, seed=5)[0]
                assert len(alone.prompt_logprobs) == len(work[i][0])
                assert same_scores(alone.prompt_logprobs[1:], many[i].prompt_logprobs[1:])
            assert alone.tokens == many[0].tokens and same_scores(alone.logprobs, many[0].logprobs)
    finally:
        set_precision("tf32")
    torch.backends.cuda.matmul.allow_tf32 = False
    for (prompt, _), out in list(zip(work, many))[::8]:
        seq = prompt + out.tokens
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq], device="cuda")).logits[0].double(), -1).cpu().numpy()
        places = out.prompt_logprobs[1:] + out.logprobs
        for j, t in enumerate(places):
            assert t.token == seq[j + 1]
            assert abs(t.logprob - ref[j, t.token]) <= 1e-4
            top = np.argsort(-ref[j], kind="stable")[:5]
            assert [i for i, _ in t.top] == top.tolist()
            assert np.allclose([v for _, v in t.top], ref[j, top], atol=1e-4)
