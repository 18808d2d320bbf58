"""Hugging Face checkpoints as arrays: locating, reading, checking.

Shared by both models. A checkpoint is a hub id (resolved through huggingface_hub, so the
HF cache, `revision` and HF_HUB_OFFLINE behave as usual) or a local directory holding
config.json and model.safetensors or a sharded model.safetensors.index.json.
float16 and bfloat16 tensors are widened to float32 (a bfloat16's 16-bit pattern becomes the
top half of a float32), or bfloat16 ones kept as stored (load_tensors(widen=False)); read into
numpy (views of the mapped file) or straight onto the GPU (load_tensors(device='gpu')).
"""
from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path

import numpy as np

from ..weights import BF16
from ..weights import widen as widen_bf16
from .device import device_stream
from .profile import stage


class CheckpointError(Exception):
    """A checkpoint that cannot be found, read or matched to its model; one line for the user."""


def resolve(model: str, revision: str | None = None, patterns: tuple[str, ...] = ()) -> Path:
    """A local directory for `model`: the directory itself, or the hub snapshot of that id."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{model}: is a file, not a checkpoint directory")
    if model.startswith((".", "/", "~")):
        raise CheckpointError(f"{model}: no such directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError

    allow = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", *patterns]
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=allow))
    except HFValidationError:
        raise CheckpointError(f"{model}: not a directory and not a valid hub id") from None
    except Exception as e:  # offline, unreachable, unknown repo, gated: all end the same way
        raise CheckpointError(f"{model}: not in the local cache and the hub is unreachable or refused "
                              f"({type(e).__name__}); give a local checkpoint directory") from None


def from_model_config(model_cfg) -> Path:
    """The checkpoint directory a CLI model config names: `path` if set, else hub `id` (+ `revision`)."""
    source = model_cfg.get("path") or model_cfg.get("id")
    if not source:
        raise CheckpointError("no model given: set model=NAME or model.path=DIR")
    return resolve(str(source), model_cfg.get("revision"))


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = [directory / s for s in shards]
    else:
        files = [directory / "model.safetensors"]
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f}: missing")
    return files


_STORED = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}   # as the file holds them


def _read_header(path: Path, size: int) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated or not a safetensors file")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise CheckpointError(f"{path}: corrupt header (claims {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt header (not JSON)") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def load_tensors(directory: Path, strip_prefixes: tuple[str, ...] = (), widen: bool = True,
                 device: str = "cpu") -> dict:
    """Every tensor of the checkpoint, keyed by name (prefixes removed): float32, or with widen
    False a bfloat16 tensor as bfloat16 (ml_dtypes). On the CPU each is a view of the file mapped
    into memory where its dtype allows (no copy); with device 'gpu' each is uploaded as stored
    (cupy; a bfloat16 tensor moves half the bytes of its float32 form, widened there), so that
    what a model makes of its weights (concatenation, transposes, folded norms) runs on the GPU."""
    with stage("checkpoint read"):
        files = [(path, *_tensor_table(path, strip_prefixes)) for path in safetensors_files(directory)]
    if device == "gpu":
        with stage("checkpoint to the device"):
            tensors = {k: v for path, start, table in files for k, v in _upload(path, start, table).items()}
    else:
        tensors = {k: v for path, start, table in files for k, v in _views(path, start, table).items()}
    return {k: widen_bf16(v) for k, v in tensors.items()} if widen else tensors


def _tensor_table(path: Path, strip_prefixes: tuple[str, ...]) -> tuple[int, list[tuple]]:
    """(where the data begins, [(key, dtype, shape, begin, end) of each tensor, offsets from that
    start]) of one safetensors file, checked (safetensors itself checks the header's layout)."""
    from safetensors import SafetensorError, safe_open

    size = path.stat().st_size
    header, data_start = _read_header(path, size)
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors ({e})") from None
    table = []
    for name, meta in header.items():
        dtype = meta.get("dtype")
        if dtype not in _STORED:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        begin, end = meta["data_offsets"]
        if data_start + end > size:
            raise CheckpointError(f"{path}: truncated (tensor {name} runs past the end)")
        key = next((name[len(p):] for p in strip_prefixes if name.startswith(p)), name)
        table.append((key, dtype, tuple(meta["shape"]), begin, end))
    return data_start, table


def _views(path: Path, data_start: int, table: list[tuple]) -> dict[str, np.ndarray]:
    """A checked file's tensors as views of it mapped into memory (float16 widened, and an
    unaligned tensor copied)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r") if table else None
    out = {}
    for key, dtype, shape, begin, end in table:
        bits = raw[data_start + begin: data_start + end]
        if (data_start + begin) % _STORED[dtype].itemsize:        # unaligned: a copy
            bits = bits.copy()
        tensor = bits.view(_STORED[dtype]).reshape(shape)
        out[key] = tensor.view(BF16) if dtype == "BF16" else tensor.astype(np.float32) if dtype == "F16" else tensor
    return out


CHUNK = 16 << 20        # bytes of the file a read-ahead buffer holds
BUFFERS = 4             # chunks read ahead (a thread each) while earlier ones are copied


def read_ahead(path: Path, begin: int, end: int, buffers: list, before_refill=None):
    """path's bytes [begin, end) as (offset, memoryview) chunks the size of buffers[0], read into
    the ring `buffers` by one thread each ahead of the caller: chunk i + len(buffers) goes into
    chunk i's buffer once the caller has asked for the chunk after i and before_refill(i) has
    returned (a GPU caller waits there for the copies out of it). Reads go through the page
    cache, not a mapping of the file: no page faults, and several at a time."""
    from concurrent.futures import ThreadPoolExecutor

    size, n = len(buffers[0]), len(buffers)
    count = -(-(end - begin) // size)
    fd = os.open(path, os.O_RDONLY)

    def read(i: int) -> memoryview:
        view = memoryview(buffers[i % n])[: min(size, end - begin - i * size)]
        got = 0
        while got < len(view):
            k = os.preadv(fd, [view[got:]], begin + i * size + got)
            if k == 0:
                raise CheckpointError(f"{path}: truncated")
            got += k
        return view

    try:
        with ThreadPoolExecutor(n) as pool:
            pending = [pool.submit(read, i) for i in range(min(n, count))]
            for i in range(count):
                view = pending[i].result()
                yield begin + i * size, view
                if i + n < count:
                    if before_refill is not None:
                        before_refill(i)
                    pending.append(pool.submit(read, i + n))
    finally:
        os.close(fd)


def _upload(path: Path, data_start: int, table: list[tuple]) -> dict:
    """A checked file's tensors on the GPU as stored (bfloat16 as bfloat16, float16 widened there):
    each gets its own allocation, filled by asynchronous copies out of pinned chunks of the file
    read ahead (read_ahead), so reading, copying and the transfer overlap."""
    import cupy
    import cupyx

    out, spans = {}, []
    for key, dtype, shape, begin, end in table:
        a = cupy.empty(shape, dtype=_STORED[dtype])
        out[key] = a
        if end > begin:
            spans.append((data_start + begin, data_start + end, a))
    if spans:
        spans.sort(key=lambda s: s[0])
        stream = device_stream(cupy)        # after what the current stream holds (a freed block's last use)
        events: list = [None] * BUFFERS
        j = 0
        chunks = read_ahead(path, spans[0][0], max(s[1] for s in spans),
                            [cupyx.empty_pinned((CHUNK,), np.uint8) for _ in range(BUFFERS)],
                            lambda i: events[i % BUFFERS].synchronize())
        try:
            for i, (lo, view) in enumerate(chunks):
                hi, src = lo + len(view), np.frombuffer(view, np.uint8).ctypes.data
                while spans[j][1] <= lo:        # the spans before this chunk are copied
                    j += 1
                for b, e, a in itertools.islice(spans, j, None):
                    if b >= hi:
                        break
                    s, t = max(b, lo), min(e, hi)
                    cupy.cuda.runtime.memcpyAsync(a.data.ptr + s - b, src + s - lo, t - s,
                                                  cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
                events[i % BUFFERS] = stream.record()
        finally:
            stream.synchronize()        # no copy still reads a pinned buffer once it is freed
    return {k: a.view(BF16) if a.dtype == np.uint16 else a.astype(np.float32) if a.dtype == np.float16 else a
            for k, a in out.items()}


def take(tensors: dict[str, np.ndarray], key: str, shape: tuple[int, ...]) -> np.ndarray:
    """tensors[key], checked against the shape the config implies."""
    if key not in tensors:
        raise CheckpointError(f"missing tensor {key} (expected shape {shape})")
    t = tensors[key]
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"tensor {key}: expected shape {tuple(shape)}, found {tuple(t.shape)}")
    return t
