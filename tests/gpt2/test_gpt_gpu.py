"""The GPT-2 model on the GPU (cuTile kernels) against the same model on the CPU (references)."""
import cupy
import numpy as np
import pytest
from checkpoints import make_gpt2

from gpt.generation import generate
from gpt.model import GPT
from gpt.sampling import Sampling
from gpt.tokenizer import load_tokenizer

pytestmark = pytest.mark.gpu


def test_gpu_logits_and_greedy_tokens_match_cpu(tmp_path, poisoned):
    d = make_gpt2(tmp_path / "m", n_embd=128, n_head=2, n_layer=3, n_positions=128)
    cpu, gpu, tok = GPT.load(d, "cpu"), GPT.load(d, "gpu"), load_tokenizer(d)
    ids = list(range(3, 40))
    ref = cpu.forward(np.array([ids]), np.arange(len(ids))[None], cpu.new_cache(1, len(ids)), last_only=False)
    got = gpu.forward(cupy.asarray([ids]), cupy.arange(len(ids))[None], gpu.new_cache(1, len(ids)), last_only=False)
    # three TF32 layers of large random weights compound to ~1.5e-3 (the 124M parity run, with
    # HF's 0.02 init, stays under 1e-3); what must hold exactly is the greedy token stream below
    assert np.linalg.norm(got.get() - ref) / np.linalg.norm(ref) < 5e-3
    prompts = ["To be", "the slings and arrows of outrageous"]
    a = generate(cpu, tok, prompts, 20, Sampling(temperature=0))
    b = generate(gpu, tok, prompts, 20, Sampling(temperature=0))
    assert [o.tokens for o in a] == [o.tokens for o in b]


def twin_caches(tmp_path, length: int, kv_start=None):
    """A 2-layer model, two caches prefilled with the same two 4-token prompts (one for plain
    forward calls, one behind a DecodeGraph), the prefill logits and the graph."""
    from gpt.graph import DecodeGraph

    model = GPT.load(make_gpt2(tmp_path / "m", n_embd=128, n_head=2, n_layer=2, n_positions=64), "gpu")
    prompt, pos = cupy.asarray([[5, 6, 7, 8], [9, 10, 11, 12]]), cupy.arange(4)[None].repeat(2, 0)
    plain, graphed = model.new_cache(2, length, kv_start=kv_start), model.new_cache(2, length, kv_start=kv_start)
    logits = model.forward(prompt, pos, plain)
    model.forward(prompt, pos, graphed)
    return model, plain, graphed, logits, DecodeGraph(model.embedding_tables, lambda x: model.step(x, graphed), graphed)


def test_graph_replay_equals_plain_forward(tmp_path, poisoned):
    with cupy.cuda.Stream(non_blocking=True):
        model, plain, _, _, decode = twin_caches(tmp_path, 16, kv_start=[0, 2])
        for s, tok in enumerate([[3, 4], [100, 7], [42, 42]]):
            p = np.array([[4 + s], [2 + s]])
            ref = model.forward(cupy.asarray(tok)[:, None], cupy.asarray(p), plain).get()
            got = decode(np.array(tok), p).get()
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_greedy_chain_on_the_device_equals_stepwise_argmax(tmp_path, poisoned):
    """Two chained replays of CHAIN steps, then single steps (19 = 2 x 8 + 3)."""
    with cupy.cuda.Stream(non_blocking=True):
        model, plain, graphed, logits, decode = twin_caches(tmp_path, 32)
        first = logits.get().argmax(-1)
        ref, tok = [], first
        for s in range(19):
            tok = model.forward(cupy.asarray(tok)[:, None], cupy.full((2, 1), 4 + s), plain).get().argmax(-1)
            ref.append(tok)
        got = list(decode.greedy(first, np.array([4, 4]), 19))
    np.testing.assert_array_equal(np.array(got), np.array(ref))
    assert graphed.length == plain.length
