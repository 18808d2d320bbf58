"""Shared pieces of the GPU benchmark and parity tools: timing, versions, result files."""
from __future__ import annotations

import itertools
import json
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_name() -> str:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()


def gpu_slug() -> str:
    """'NVIDIA H200' -> 'h200', for result file names."""
    name = gpu_name().lower().replace("nvidia", "").strip()
    return name.split()[0].replace("/", "-") if name else "gpu"


def versions() -> dict:
    import cupy
    import cuda.tile as ct
    import numpy

    out = {"python": platform.python_version(), "numpy": numpy.__version__, "cupy": cupy.__version__,
           "cuda_tile": ct.__version__, "cuda_driver": cupy.cuda.runtime.driverGetVersion()}
    for mod in ("torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return out


def random_gpt2():
    """gpt2 (124M) with transformers' random initialisation (torch's current seed), saved in the
    Hugging Face layout and loaded on the GPU by our loader."""
    import tempfile

    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt.model import GPT

    with tempfile.TemporaryDirectory() as tmp:
        GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp)
        return GPT.load(Path(tmp), "gpu")


def prompted_decoder(model, batch: int, prompt: int, capacity: int, sampler=None):
    """(DecodeGraph, its cache, the prompt ids (batch, prompt), the prompt's logits): a cache of
    `capacity` positions holding a random prompt (seed 0), as the decode timings start from,
    its tokens picked by sampler (greedy by default; started on the prompt here).
    Call it under the non-default stream the decoder will run on."""
    import cupy
    import numpy as np

    from gpt.graph import DecodeGraph

    ids = np.random.default_rng(0).integers(0, 50257, (batch, prompt))
    cache = model.new_cache(batch, capacity)
    logits = model.forward(cupy.asarray(ids), cupy.arange(prompt)[None].repeat(batch, 0), cache)
    decode = DecodeGraph(model.embedding_tables, lambda x: model.step(x, cache), cache, sampler)
    decode.sampler.start(ids.tolist())
    return decode, cache, ids, logits


def time_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median device time of fn() in ms, CUDA events around each call on the current stream."""
    import cupy

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def graph_ms_cupy(fn, inner: int = 20, reps: int = 10) -> float:
    """Device time of fn() in ms: `inner` calls captured in one CUDA graph, replays timed with
    events (median), so host launch cost is excluded and only the kernels are measured."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    with stream, cupy.cuda.using_allocator(pool.malloc):
        fn()
        stream.begin_capture()
        for _ in range(inner):
            fn()
        graph = stream.end_capture()
        graph.launch(stream)
        times = []
        for _ in range(reps):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / inner)
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    """How many copies of nbytes of operands make 256 MB (five times an H100's L2), at least 2."""
    return max(2, -(-(256 << 20) // nbytes))


def rotating_ms(inputs: list, fn) -> float:
    """Per-call device ms of fn(item) chained over the distinct operand copies `inputs` in one
    CUDA graph (graph_ms_cupy), so every call reads its operands from HBM; frees them after."""
    import cupy

    calls = itertools.cycle(inputs)
    ms = graph_ms_cupy(lambda: fn(next(calls)), inner=len(inputs), reps=5)
    inputs.clear()
    cupy.get_default_memory_pool().free_all_blocks()
    return ms


def graph_ms_torch(fn, inner: int = 20, reps: int = 10) -> float:
    """graph_ms_cupy for torch code (torch.cuda.graph capture)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner)
    return statistics.median(times)


def first_call_ms(fn) -> float:
    """Wall time of the first call (includes cuTile's JIT compile on a fresh host)."""
    import time

    import cupy

    t = time.perf_counter()
    fn()
    cupy.cuda.get_current_stream().synchronize()
    return (time.perf_counter() - t) * 1e3


def torch_stream_sync():
    """Make torch and cupy share the default stream ordering (both use the legacy stream)."""
    import torch

    torch.cuda.synchronize()


def write_result(name: str, payload: dict, out_dir: str | None, markdown: str | None = None) -> Path:
    out = Path(out_dir) if out_dir else ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{gpu_slug()}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown)
    print(f"wrote {path}", file=sys.stderr)
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
