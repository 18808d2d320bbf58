"""tilekernels.runtime: what running a model takes beyond its ops, shared by every model and
owned by none: checkpoints, tokenizers, devices, the KV cache, CUDA graphs, sampling, the
continuous-batching engine (engine, scheduler, slots, model runner) and the command lines'
common parts.

Control flows one way: a model implements DecoderModel (protocol.py) and the runtime calls it.
Reading checkpoints and tokenizers needs the `models` extra (safetensors, huggingface_hub,
tokenizers), imported when used; server.py (the OpenAI-compatible servers' shared parts) the
`serve` extra (fastapi, uvicorn, python-multipart, prometheus-client).
"""
from .checkpoint import CheckpointError, from_model_config, load_tensors, read_config, resolve, take
from .device import device_stream, freeze_heap, gpu_problem, kernel_manifest, load_model, move_weights, pick_device
from .engine import MAX_BATCH, Engine, Event, check_length
from .generation import generate, requests, text_pieces, warm_up
from .graphs import DecodeGraph, ShapeGraphs, graphed
from .kvcache import KVCache
from .precision import PRECISIONS, precision, set_precision, using
from .protocol import DecoderModel
from .runner import ModelRunner
from .sampler import GREEDY, Sampler, Sampling
from .sequence import Completion, Request, TokenLogprob
from .tokenizer import TextStream, load_tokenizer, token_name

__all__ = ["GREEDY", "MAX_BATCH", "PRECISIONS", "CheckpointError", "Completion", "DecodeGraph", "DecoderModel",
           "Engine", "Event", "KVCache", "ModelRunner", "Request", "Sampler", "Sampling", "ShapeGraphs",
           "TextStream", "check_length", "device_stream", "freeze_heap", "from_model_config", "generate",
           "gpu_problem", "graphed", "kernel_manifest", "load_model", "load_tensors", "load_tokenizer",
           "move_weights", "pick_device", "precision", "read_config", "requests", "resolve", "set_precision", "take",
           "TokenLogprob", "text_pieces", "token_name", "using", "warm_up"]
