"""torch tensors (and JAX arrays, where JAX is installed) into every op: the same bits as CuPy
arrays, the caller's type back, torch's current stream, torch.compile graphs of the registered
ops, and tilekernels installed on its own from packages/tilekernels."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tilekernels as tk

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def host(a):
    """A torch tensor or CuPy array as a contiguous numpy array of its bits (bfloat16 as uint16)."""
    import cupy
    import torch

    if isinstance(a, torch.Tensor):
        a = cupy.from_dlpack(a.view(torch.int16)).view(np.uint16) if a.dtype == torch.bfloat16 else cupy.from_dlpack(a)
    elif a.dtype == tk.weights.BF16:
        a = a.view(np.uint16)
    return cupy.ascontiguousarray(a).get()


def same_bits(a, b) -> bool:
    a, b = host(a), host(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def to_cupy(a):
    import cupy
    import torch

    if isinstance(a, torch.Tensor):
        return tk.weights.to_bf16(cupy.from_dlpack(a.float())) if a.dtype == torch.bfloat16 else cupy.from_dlpack(a)
    if isinstance(a, tuple):
        return tuple(to_cupy(x) for x in a)
    return {torch.bfloat16: tk.weights.BF16, torch.float32: np.float32}.get(a, a)


CASES = ["layernorm", "layernorm bf16 out", "rmsnorm", "gelu tanh", "gelu erf", "silu", "swiglu", "softmax",
         "softmax axis", "linear", "linear 1 row gelu residual", "linear bf16 weight", "linear norm", "attention",
         "rope_cos_sin", "rope", "embedding", "argmax", "logprobs", "sample", "conv1d", "lstm"]


def cases() -> dict:
    """name: (op, args, kwargs) with torch arguments, odd sizes."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(shape, device="cuda", generator=g).to(dtype)

    x, w, b = r(7, 769), r(769), r(769)
    pos = torch.arange(3, 10, device="cuda")
    cos, sin = tk.rope_cos_sin(pos, 64)
    ids = torch.randint(0, 1000, (3, 7), device="cuda", generator=g)
    tokens = torch.randint(0, 1000, (5,), device="cuda", generator=g)
    table = [
        ("layernorm", tk.layernorm, (x, w, b, 1e-5), {}),
        ("layernorm bf16 out", tk.layernorm, (x, w, b), {"out_dtype": torch.bfloat16}),
        ("rmsnorm", tk.rmsnorm, (x, w, 1e-6), {}),
        ("gelu tanh", tk.gelu, (x,), {}),
        ("gelu erf", tk.gelu, (x, "none"), {}),
        ("silu", tk.silu, (x,), {}),
        ("swiglu", tk.swiglu, (x, r(7, 769)), {}),
        ("softmax", tk.softmax, (r(8, 50257),), {}),
        ("softmax axis", tk.softmax, (r(3, 5, 7),), {"axis": 1}),
        ("linear", tk.linear, (r(7, 768), r(769, 768), r(769)), {}),
        ("linear 1 row gelu residual", tk.linear, (r(1, 768), r(769, 768), r(769), "gelu_tanh"),
         {"residual": r(1, 769)}),
        ("linear bf16 weight", tk.linear, (r(7, 768), r(769, 768, dtype=torch.bfloat16)), {}),
        ("linear norm", tk.linear, (r(7, 768), r(769, 768)), {"norm": tk.LayerNorm(r(768), r(768))}),
        ("attention", tk.attention, (r(2, 4, 7, 64), r(2, 2, 9, 64), r(2, 2, 9, 64), True), {}),
        ("rope_cos_sin", tk.rope_cos_sin, (pos, 64), {}),
        ("rope", tk.rope, (r(1, 7, 4, 64), cos, sin), {}),
        ("embedding", tk.embedding, (ids, r(1000, 769)), {}),
        ("argmax", tk.argmax, (r(5, 1000),), {}),
        ("logprobs", tk.logprobs, (r(5, 1000), tokens, 5), {}),
        ("sample", tk.sample, (r(5, 1000), torch.rand(5, device="cuda", generator=g)), {"temperature": 0.8}),
        ("conv1d", tk.conv1d, (r(2, 8, 33), r(16, 8, 3), r(16)), {"stride": 2, "padding": 1}),
        ("lstm", tk.lstm, (r(9, 3, 128), r(128, 32)), {}),
    ]
    return {name: rest for name, *rest in table}


def test_every_op_is_covered():
    assert list(cases()) == CASES
    covered = {name.split()[0] for name in CASES} | {"split_qkv", "decode_attention"}   # and the test below
    assert {name for name in tk.__all__ if getattr(getattr(tk, name), "__code__", None) is tk.gelu.__code__} == covered


@pytest.mark.parametrize("name", CASES)
def test_torch_tensors_give_cupys_bits_as_torch(name):
    import torch

    op, args, kwargs = cases()[name]
    got = op(*args, **kwargs)
    want = op(*to_cupy(args), **{k: to_cupy(v) if k != "norm" else tk.LayerNorm(to_cupy(v.weight), to_cupy(v.bias))
                                 for k, v in kwargs.items()})
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g_, w_ in zip(got, want):
        assert isinstance(g_, torch.Tensor) and g_.is_cuda, (name, type(g_))
        assert same_bits(g_, w_), name
    if name == "layernorm bf16 out":
        assert got[0].dtype == torch.bfloat16


def test_arrays_written_in_place_come_back_as_themselves():
    """out= and KV caches: the kernels write the caller's tensors, and out= is returned as itself."""
    import torch

    x = torch.randn(6, 1000, device="cuda")
    out = torch.full((6,), -1, dtype=torch.int64, device="cuda")
    assert tk.argmax(x, out) is out and torch.equal(out, x.argmax(-1))
    qkv = torch.randn(1, 7, 8 * 64, device="cuda")
    kc, vc = torch.zeros(1, 2, 16, 64, device="cuda"), torch.zeros(1, 2, 16, 64, device="cuda")
    q = tk.split_qkv(qkv, kc, vc, torch.tensor([3], dtype=torch.int32, device="cuda"), 4)
    heads = qkv.view(1, 7, 8, 64)
    assert torch.equal(q, heads[:, :, :4].transpose(1, 2))
    assert torch.equal(kc[:, :, 3:10], heads[:, :, 4:6].transpose(1, 2)) and not kc[:, :, 10:].any()
    assert torch.equal(vc[:, :, 3:10], heads[:, :, 6:].transpose(1, 2))
    import cupy

    kc2, vc2, qkv1 = kc.clone(), vc.clone(), torch.randn(1, 1, 8 * 64, device="cuda")
    o = tk.decode_attention(qkv1, kc, vc, torch.tensor([10], dtype=torch.int32, device="cuda"), 4)
    want = tk.decode_attention(cupy.from_dlpack(qkv1), cupy.from_dlpack(kc2), cupy.from_dlpack(vc2),
                               cupy.array([10], np.int32), 4)
    assert isinstance(o, torch.Tensor) and same_bits(o, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and kc[:, :, 10].any()


def test_a_cpu_tensor_is_a_clear_error():
    import torch

    with pytest.raises(TypeError, match=r"^weight: a torch tensor on cpu; tilekernels runs CUDA arrays"):
        tk.linear(torch.randn(2, 8, device="cuda"), torch.randn(3, 8))


def test_runs_on_torchs_current_stream():
    """A side stream kept busy, then its tensor refilled and the op called on it: the op sees
    the refilled values only if it runs on that stream (another stream would run at once)."""
    import torch

    side = torch.cuda.Stream()
    x = torch.zeros(64, 4096, device="cuda")
    new = torch.randn(64, 4096, device="cuda")
    want = tk.softmax(new)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)          # ~0.1 s of spinning on the side stream
        x.copy_(new)
        y = tk.softmax(x)
        y2 = torch.ops.tilekernels.softmax(x) if _ops() else y
    side.synchronize()
    assert torch.equal(y, want) and torch.equal(y2, want)


def _ops() -> bool:
    import tilekernels.torch_ops  # noqa: F401  (registers torch.ops.tilekernels)

    return True


def test_registered_ops_compile_whole():
    """A block of registered ops under torch.compile(fullgraph=True): one graph, the eager bits."""
    import torch

    _ops()
    ops = torch.ops.tilekernels
    g = torch.Generator(device="cuda").manual_seed(1)
    x, w1, b1 = (torch.randn(s, device="cuda", generator=g) for s in ((2, 7, 768), (3072, 768), (3072,)))
    w2, gamma, beta = (torch.randn(s, device="cuda", generator=g) for s in ((768, 3072), (768,), (768,)))
    q, k = torch.randn(2, 4, 7, 64, device="cuda", generator=g), torch.randn(2, 2, 7, 64, device="cuda", generator=g)
    cos, sin = torch.randn(7, 32, device="cuda", generator=g), torch.randn(7, 32, device="cuda", generator=g)

    def block(x, q, k):
        h = ops.linear(ops.layernorm(x, gamma, beta), w1, b1, "gelu_tanh")
        y = ops.linear(h, w2, None, None, x)
        a = ops.attention(ops.rope(q.transpose(1, 2).contiguous(), cos, sin).transpose(1, 2).contiguous(), k, k, True)
        z = ops.gelu(ops.rmsnorm(y, gamma)) + ops.silu(y) * 2 + ops.swiglu(y, y)
        return ops.softmax(z, -1), a * 1.5, ops.argmax(z), ops.embedding(ops.argmax(z), w2.T.contiguous())

    eager = block(x, q, k)
    compiled = torch.compile(block, fullgraph=True)(x, q, k)
    for e, c in zip(eager, compiled):
        assert c.dtype == e.dtype and c.shape == e.shape and torch.allclose(c, e, rtol=1e-5, atol=1e-5)
    assert torch.equal(eager[2], compiled[2])


def test_jax_arrays():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((7, 769)).astype(np.float32))
    y = tk.layernorm(x)
    assert isinstance(y, jax.Array)
    assert np.array_equal(np.asarray(y), tk.layernorm(__import__("cupy").asarray(np.asarray(x))).get())


def test_installs_alone_and_runs_from_torch(tmp_path):
    """pip installs packages/tilekernels (no other project package) into a fresh directory;
    a process that sees only it and the host's packages imports it there and runs an op on torch
    tensors."""
    pytest.importorskip("hatchling", reason="building the wheel offline needs hatchling")
    import cuda.tile

    target = tmp_path / "site"
    site = str(Path(cuda.tile.__file__).resolve().parents[2])     # the host's cuda.tile and hatchling
    env = {**os.environ, "PYTHONPATH": site}
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(ROOT / "packages" / "tilekernels")], check=True, env=env, cwd=tmp_path)
    env["PYTHONPATH"] = f"{target}:{site}"
    code = ("import torch, tilekernels as tk, tilekernels.torch_ops\n"
            "x = torch.randn(3, 769, device='cuda')\n"
            "y = torch.ops.tilekernels.layernorm(x)\n"
            "ref = torch.nn.functional.layer_norm(x, (769,))\n"
            "assert isinstance(y, torch.Tensor) and (y - ref).abs().max() < 1e-5\n"
            "print(tk.__file__)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path, capture_output=True,
                         text=True)
    assert out.stdout.strip().startswith(str(target)), out.stdout
