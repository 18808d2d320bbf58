"""Hugging Face checkpoints as arrays: locating, reading, checking.

Shared by both models. A checkpoint is a hub id (resolved through huggingface_hub, so the
HF cache, `revision` and HF_HUB_OFFLINE behave as usual) or a local directory holding
config.json and model.safetensors or a sharded model.safetensors.index.json.
float16 and bfloat16 tensors are widened to float32 (a bfloat16's 16-bit pattern becomes the
top half of a float32), or bfloat16 ones kept as stored (load_tensors(widen=False)); read into
numpy (views of the mapped file) or straight onto the GPU (load_tensors(device='gpu')).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..weights import BF16
from ..weights import widen as widen_bf16
from .profile import stage


class CheckpointError(Exception):
    """A checkpoint that cannot be found, read or matched to its model; one line for the user."""


def resolve(model: str, revision: str | None = None, patterns: tuple[str, ...] = ()) -> Path:
    """A local directory for `model`: the directory itself, or the hub snapshot of that id."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{model}: is a file; model.path must be a checkpoint directory")
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
                              f"({type(e).__name__}); use model.path=DIR") from None


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


_WIDTH = {"F32": 4, "F16": 2, "BF16": 2}


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
        tensors = _load_tensors(directory, strip_prefixes)
    if device == "gpu":
        import cupy

        with stage("checkpoint to the device"):
            tensors = {k: cupy.asarray(v.view(np.uint16)).view(BF16) if v.dtype == BF16 else cupy.asarray(v)
                       for k, v in tensors.items()}
    return {k: widen_bf16(v) for k, v in tensors.items()} if widen else tensors


def _load_tensors(directory: Path, strip_prefixes: tuple[str, ...]) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    out: dict[str, np.ndarray] = {}
    for path in safetensors_files(directory):
        size = path.stat().st_size
        header, data_start = _read_header(path, size)
        raw = None
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name, meta in header.items():
                    dtype = meta.get("dtype")
                    if dtype not in _WIDTH:
                        raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
                    begin, end = meta["data_offsets"]
                    if data_start + end > size:
                        raise CheckpointError(f"{path}: truncated (tensor {name} runs past the end)")
                    if dtype == "F16":
                        tensor = f.get_tensor(name).astype(np.float32)
                    else:
                        if raw is None:
                            raw = np.memmap(path, dtype=np.uint8, mode="r")
                        bits = raw[data_start + begin: data_start + end]
                        if (data_start + begin) % _WIDTH[dtype]:      # unaligned: a copy
                            bits = bits.copy()
                        tensor = bits.view("<u2").view(BF16) if dtype == "BF16" else bits.view("<f4")
                        tensor = tensor.reshape(meta["shape"])
                    key = name
                    for p in strip_prefixes:
                        if key.startswith(p):
                            key = key[len(p):]
                            break
                    out[key] = tensor
        except (SafetensorError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors ({e})") from None
    return out


def take(tensors: dict[str, np.ndarray], key: str, shape: tuple[int, ...]) -> np.ndarray:
    """tensors[key], checked against the shape the config implies."""
    if key not in tensors:
        raise CheckpointError(f"missing tensor {key} (expected shape {shape})")
    t = tensors[key]
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"tensor {key}: expected shape {tuple(shape)}, found {tuple(t.shape)}")
    return t
