"""tilekernels.runtime: what running a model takes beyond its ops, shared by every model and
owned by none: checkpoints, tokenizers, devices, the KV cache, CUDA graphs, sampling, the
model runner and the token loop, and the command lines' common parts.

Control flows one way: a model implements DecoderModel (protocol.py) and the runtime calls it.
Reading checkpoints and tokenizers needs the `models` extra (safetensors, huggingface_hub,
tokenizers), imported when used; server.py (the OpenAI-compatible servers' shared parts) the
`serve` extra (fastapi, uvicorn, python-multipart, prometheus-client).
"""
from .checkpoint import CheckpointError, from_model_config, load_tensors, read_config, resolve, take
from .device import device_stream, gpu_problem, move_weights, pick_device
from .generation import Completion, check_length, generate, text_pieces
from .graphs import DecodeGraph, ShapeGraphs, graphed
from .kvcache import KVCache
from .protocol import DecoderModel
from .runner import ModelRunner
from .sampling import GREEDY, Sampler, Sampling
from .tokenizer import TextStream, load_tokenizer

__all__ = ["GREEDY", "CheckpointError", "Completion", "DecodeGraph", "DecoderModel", "KVCache", "ModelRunner",
           "Sampler", "Sampling", "ShapeGraphs", "TextStream", "check_length", "device_stream", "from_model_config",
           "generate", "text_pieces", "gpu_problem", "graphed", "load_tensors", "load_tokenizer", "move_weights", "pick_device",
           "read_config", "resolve", "take"]
