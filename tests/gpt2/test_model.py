"""GPT-2 loading (every HF layout) and the model against an independent float64 forward."""
import json

import numpy as np
import pytest
from checkpoints import gpt2_tensors, make_gpt2, make_tokenizer

from tilekernels.runtime import CheckpointError
from gpt.model import GPT


def forward64(t: dict, cfg: dict, ids: np.ndarray) -> np.ndarray:
    """Plain float64 GPT-2 (no cache, full causal attention): logits (T, V)."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    n, h = cfg["n_embd"], cfg["n_head"]

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * t[p + ".weight"] + t[p + ".bias"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    T = len(ids)
    x = t["wte.weight"][ids] + t["wpe.weight"][:T]
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        qkv = ln(x, p + "ln_1") @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]
        q, k, v = (qkv[:, j * n:(j + 1) * n].reshape(T, h, -1).transpose(1, 0, 2) for j in range(3))
        s = q @ k.transpose(0, 2, 1) / np.sqrt(n // h)
        s[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
        a = np.exp(s - s.max(-1, keepdims=True))
        a = (a / a.sum(-1, keepdims=True)) @ v
        x = x + a.transpose(1, 0, 2).reshape(T, n) @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
        m = gelu(ln(x, p + "ln_2") @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"])
        x = x + m @ t[p + "mlp.c_proj.weight"] + t[p + "mlp.c_proj.bias"]
    head = t.get("lm_head.weight", t["wte.weight"])
    return ln(x, "ln_f") @ head.T


def logits(model, ids):
    cache = model.new_cache(1, len(ids))
    return model.forward(np.array([ids]), np.arange(len(ids))[None], cache, last_only=False)[0]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tok):
    return make_gpt2(tmp_path_factory.mktemp("plain"), tokenizer=tok)


def test_model_matches_float64_forward(plain, tok):
    cfg = json.loads((plain / "config.json").read_text())
    t = gpt2_tensors(cfg["vocab_size"])
    ids = [3, 17, 99, 5, 250, 42, 7]
    got = logits(GPT.load(plain), ids)
    ref = forward64(t, cfg, np.array(ids))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("layout", [dict(prefix="transformer."), dict(shards=3), dict(lm_head=True),
                                    dict(dtype="float16"), dict(dtype="bfloat16")])
def test_every_layout_loads(tmp_path, tok, plain, layout):
    d = make_gpt2(tmp_path / "ckpt", tokenizer=tok, **layout)
    model, base = GPT.load(d), GPT.load(plain)
    ids = [1, 2, 3, 4, 5]
    if layout.get("lm_head"):       # the file's own head (make_gpt2 writes wte reversed), not wte
        cfg = json.loads((d / "config.json").read_text())
        t = gpt2_tensors(cfg["vocab_size"])
        t["lm_head.weight"] = t["wte.weight"][::-1]
        ref = forward64(t, cfg, np.array(ids))
        assert np.linalg.norm(logits(model, ids) - ref) / np.linalg.norm(ref) < 1e-5
        return
    tol = {"float16": 1e-2, "bfloat16": 3e-2}.get(layout.get("dtype"), 1e-6)
    a, b = logits(model, ids), logits(base, ids)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < tol


def test_scale_attn_by_inverse_layer_idx(tmp_path, tok):
    a = GPT.load(make_gpt2(tmp_path / "a", tokenizer=tok))
    b = GPT.load(make_gpt2(tmp_path / "b", tokenizer=tok, config_extra={"scale_attn_by_inverse_layer_idx": True}))
    assert b.config.attn_scale(1) == pytest.approx(a.config.attn_scale(1) / 2)
    assert not np.allclose(logits(a, [1, 2, 3]), logits(b, [1, 2, 3]))


def test_kv_cache_decode_equals_full_recompute(plain):
    model = GPT.load(plain)
    ids = [5, 9, 100, 31, 8, 77, 2, 64]
    full = logits(model, ids)
    cache = model.new_cache(1, len(ids))
    step = [model.forward(np.array([ids[:3]]), np.arange(3)[None], cache)]
    for i in range(3, len(ids)):
        step.append(model.forward(np.array([[ids[i]]]), np.array([[i]]), cache))
    np.testing.assert_allclose(np.concatenate(step), full[2:], rtol=1e-4, atol=1e-5)


def test_left_padded_batch_equals_single_runs(plain):
    model = GPT.load(plain)
    a, b = [5, 9, 100, 31, 8], [7, 44]
    cache = model.new_cache(2, 5)
    cache.kv_start[...] = [0, 3]            # left padding, as the runner sets it
    pad = model.config.eos_token_id
    batch = np.array([a, [pad] * 3 + b])
    pos = np.array([np.arange(5), [0, 0, 0, 0, 1]])
    out = model.forward(batch, pos, cache)
    np.testing.assert_allclose(out[0], logits(model, a)[-1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[1], logits(model, b)[-1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mutate,match", [
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors: missing"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]), "truncated"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"),
     "corrupt header"),
    (lambda d: (d / "config.json").write_text('{"model_type": "llama"}'), "not a GPT-2 model"),
    (lambda d: (d / "config.json").write_text("{nope"), "not valid JSON"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "n_embd": 48, "n_head": 2})),
     r"tensor h.0.ln_1.weight: expected shape \(48,\), found \(32,\)"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "activation_function": "swish"})), "swish"),
])
def test_bad_checkpoints_are_named(tmp_path, tok, mutate, match):
    d = make_gpt2(tmp_path / "ckpt", tokenizer=tok)
    mutate(d)
    with pytest.raises(CheckpointError, match=match):
        GPT.load(d)


def test_missing_key_is_named(tmp_path, tok):
    from safetensors.numpy import load_file, save_file

    d = make_gpt2(tmp_path / "ckpt", tokenizer=tok)
    t = load_file(str(d / "model.safetensors"))
    del t["h.1.mlp.c_fc.bias"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor h.1.mlp.c_fc.bias \(expected shape \(128,\)\)"):
        GPT.load(d)
