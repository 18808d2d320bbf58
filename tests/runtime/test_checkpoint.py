"""Reading safetensors checkpoints: the read-ahead chunks, and the GPU upload against the CPU's
views of the same file (every dtype, unaligned tensors, tensors across chunk boundaries)."""
import json
import struct

import numpy as np
import pytest

from tilekernels.runtime import checkpoint, load_tensors
from tilekernels.weights import BF16


def test_read_ahead_returns_the_bytes_in_order_with_buffers_reused(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    for size, n in ((7, 2), (1000, 4), (200_000, 3)):
        got, refilled = bytearray(), []
        for offset, view in checkpoint.read_ahead(path, 5, 100_001, [bytearray(size) for _ in range(n)],
                                                  refilled.append):
            assert offset == 5 + len(got) and 0 < len(view) <= size
            got += bytes(view)
        assert bytes(got) == data[5:100_001].tobytes()
        chunks = -(-(100_001 - 5) // size)
        assert refilled == list(range(max(0, chunks - n)))     # each buffer refilled only after its copies


def test_read_ahead_reports_a_file_shorter_than_asked(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        list(checkpoint.read_ahead(path, 0, 200, [bytearray(64), bytearray(64)]))


def odd_checkpoint(directory, rng):
    """A safetensors file whose tensors are float32, float16 and bfloat16, some at offsets not
    a multiple of their width, one empty (written by hand: safetensors' writer aligns them)."""
    tensors = {"a.f32": rng.standard_normal((3, 5)).astype("<f4"), "b.odd": rng.standard_normal(1).astype("<f2"),
               "c.bf16": (rng.standard_normal((7, 769)).astype(np.float32).view(np.uint32) >> 16).astype("<u2"),
               "d.f16": rng.standard_normal((2, 3)).astype("<f2"), "e.empty": np.zeros((0, 4), "<f4"),
               "f.f32": rng.standard_normal(1001).astype("<f4")}
    dtypes = {"<f4": "F32", "<f2": "F16", "<u2": "BF16"}
    header, blob = {}, b""
    for name, t in tensors.items():
        header[name] = {"dtype": dtypes[t.dtype.str], "shape": list(t.shape),
                        "data_offsets": [len(blob), len(blob) + t.nbytes]}
        blob += t.tobytes()
    text = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + blob)
    return tensors


def test_odd_tensors_read_as_stored_on_the_cpu(tmp_path, rng):
    tensors = odd_checkpoint(tmp_path, rng)
    got = load_tensors(tmp_path, widen=False)
    for name, t in tensors.items():
        want = t.view(BF16) if t.dtype == np.uint16 else t.astype(np.float32)
        assert got[name].dtype == want.dtype and got[name].shape == t.shape
        assert got[name].tobytes() == want.tobytes()


@pytest.mark.gpu
def test_the_gpu_upload_holds_the_bytes_the_cpu_reads(tmp_path, rng, monkeypatch):
    """Chunks a few hundred bytes long: tensors start and end inside chunks and span several."""
    import cupy

    odd_checkpoint(tmp_path, rng)
    cpu = load_tensors(tmp_path, widen=False)
    for chunk in (256, 1000, checkpoint.CHUNK):
        monkeypatch.setattr(checkpoint, "CHUNK", chunk)
        gpu = load_tensors(tmp_path, widen=False, device="gpu")
        assert gpu.keys() == cpu.keys()
        for k, v in cpu.items():
            assert isinstance(gpu[k], cupy.ndarray) and gpu[k].dtype == v.dtype and gpu[k].shape == v.shape
            assert gpu[k].get().tobytes() == v.tobytes(), (chunk, k)
