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
