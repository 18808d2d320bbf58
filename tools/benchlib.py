"""Shared pieces of the GPU benchmark, parity and profiling tools: timing, versions, result
files, and the random models, checkpoints and inputs more than one tool builds (tools import
nothing from each other, only this module; it reaches the tests' checkpoint makers). Heavy imports (cupy, torch, transformers) happen inside the
functions, so every tool's --help works on a machine without them."""
from __future__ import annotations

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
    from tilekernels import compiler

    out = {"python": platform.python_version(), "numpy": numpy.__version__, "cupy": cupy.__version__,
           "cuda_tile": ct.__version__, "tileiras": ".".join(map(str, compiler.version() or ())) or None,
           "cuda_driver": cupy.cuda.runtime.driverGetVersion()}
    for mod in ("torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return out


def speech_dense(seconds: float = 29.0, seed: int = 0):
    """Speech from start to end (16 kHz float32): the espeak-ng sentences of the test fixtures
    (tests/asr/fixtures) one after another in a seeded order, 0.2-0.6 s apart, over their noise,
    from 0.3 s to within 0.5 s of the end; 29 s by default, so that Silero VAD's one padded
    segment and a fixed window hold the same audio (the same decoding work either way)."""
    import json

    import numpy as np
    import soundfile as sf

    fixtures = ROOT / "tests" / "asr" / "fixtures"
    meta = json.loads((fixtures / "fixtures.json").read_text())
    clips = []
    for name, f in meta["files"].items():
        x, _ = sf.read(fixtures / name, dtype="float32")
        clips += [x[s["start"]:s["end"]] for s in f["speech"]]
    rng = np.random.default_rng(seed)
    out = (rng.standard_normal(int(16000 * seconds)) * meta["noise_rms"]).astype(np.float32)
    at, end = int(0.3 * 16000), len(out) - int(0.5 * 16000)
    while True:
        clip = clips[int(rng.integers(len(clips)))]
        if at + len(clip) > end:
            break
        out[at:at + len(clip)] += clip
        at += len(clip) + int(rng.uniform(0.2, 0.6) * 16000)
    return out


def glm_prompt_ids(cfg, n_audio: int) -> list[int]:
    """GLM-ASR's transcription prompt's shape with fixed ids (no tokenizer needed): cfg is our
    GlmAsrConfig or transformers' (both have audio_token_id)."""
    import numpy as np

    rng = np.random.default_rng(1)
    user, assistant, boa, eoa, nl = 59253, 59254, 59256, 59257, 10
    text = rng.integers(100, 50000, 8).tolist()
    return [user, nl, boa] + [cfg.audio_token_id] * n_audio + [eoa, user, nl] + text + [assistant, nl]


def random_glm_asr_checkpoint(directory: str, weights: str):
    """transformers' GLM-ASR at full size with seeded random weights, saved to `directory` in
    bfloat16 ('bf16', the hub checkpoint's dtype) or float32; returned in float32 on the GPU
    (bfloat16 values widen exactly). Ours loads from the directory (GlmAsr.load) where wanted."""
    import torch
    from transformers import GlmAsrConfig, GlmAsrForConditionalGeneration

    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = GlmAsrForConditionalGeneration(GlmAsrConfig()).float().eval()
    state = None
    if weights == "bf16":   # round the parameters only: buffers (RoPE frequencies) stay float32
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.to(torch.bfloat16))
        state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    hf.save_pretrained(directory, state_dict=state, safe_serialization=True)
    return hf


def word_tokenizer(directory: Path, cfg) -> None:
    """tokenizer.json: GLM-ASR's special tokens at the config's ids, the prompt's words, and a
    word for every other id, so the pipeline's prompts encode as on the hub and whatever random
    weights decode is text (noise, but streamed and written as a transcript's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = {"<|user|>": 59253, "<|assistant|>": 59254, "<|begin_of_audio|>": 59256, "<|end_of_audio|>": 59257,
               "<|pad|>": cfg.audio_token_id, "<|endoftext|>": 59246}
    words = "Please transcribe this audio into text . \n [UNK]".split(" ")
    vocab = {w: i + 100 for i, w in enumerate(words)} | special
    taken = set(vocab.values())
    vocab |= {f"w{i}": i for i in range(cfg.text_config.vocab_size) if i not in taken}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(special))
    tok.save(str(directory / "tokenizer.json"))


def served_checkpoint(kind: str, directory: Path, small: bool = False) -> None:
    """A checkpoint a server loads, written to directory: 'gpt' (gpt2 124M, seeded random weights,
    a tokenizer trained here: tests/gpt2/checkpoints.py) or 'asr' (GLM-ASR-Nano as
    random_glm_asr_checkpoint writes it, with word_tokenizer); small: the tests' tiny ones."""
    if kind == "gpt":
        sys.path.insert(0, str(ROOT / "tests" / "gpt2"))
        from checkpoints import make_gpt2

        size = {} if small else dict(n_embd=768, n_head=12, n_layer=12, n_positions=1024, vocab=50257)
        make_gpt2(directory, **size)
    elif small:
        from glm_asr.synthetic import write_checkpoint

        write_checkpoint(directory)
    else:
        hf = random_glm_asr_checkpoint(str(directory), "bf16")
        word_tokenizer(directory, hf.config)


def rand(*shape):
    """N(0, 0.02^2) float32 on the GPU."""
    import cupy

    return cupy.random.standard_normal(shape, dtype=cupy.float32) * 0.02


def random_glm_asr(encoder: bool = False, weights: str = "bf16"):
    """GLM-ASR-Nano at full size with weights drawn on the GPU, stored as GlmAsr.to leaves
    them: the text decoder's matrices of bfloat16 values in bfloat16 (weights='bf16', the hub
    checkpoint's dtype) or float32 ones ('fp32'), RMSNorms with their weight, the encoder's and
    projector's matrices so too at precision bf16 (else float32), its LayerNorms folded; the audio
    encoder and projector only when asked."""
    import cupy
    from transformers import GlmAsrConfig

    import tilekernels as tk
    from glm_asr.config import GlmAsrConfig as Config
    from glm_asr.model import GlmAsr

    def mat(*shape):
        m = rand(*shape)
        return tk.compact((m.view(cupy.uint32) & 0xFFFF0000).view(cupy.float32)) if weights == "bf16" else m

    cfg = Config.from_hf(GlmAsrConfig().to_dict())
    d, e = cfg.decoder, cfg.encoder
    n, hd = d.hidden_size, d.head_dim

    def rms():
        return tk.RMSNorm(rand(n) + 1, d.rms_norm_eps)
    w = {"decoder": [tk.Block(rms(), (mat((d.num_heads + 2 * d.num_kv_heads) * hd, n), None),
                              (mat(n, d.num_heads * hd), None), rms(), (mat(2 * d.intermediate_size, n), None),
                              (mat(n, d.intermediate_size), None), "swiglu")
                     for _ in range(d.num_layers)],
         "embed": mat(d.vocab_size, n), "norm": rms(), "lm_head": mat(d.vocab_size, n)}
    if encoder:
        c, inner = e.hidden_size, e.intermediate_size
        ln = tk.LayerNorm(None, None)

        def lin_(n_out, n_in):
            return (mat if tk.get_matmul_precision() == "medium" else rand)(n_out, n_in), rand(n_out)
        w["encoder"] = [tk.Block(ln, lin_((e.num_heads + 2 * e.num_kv_heads) * e.head_dim, c),
                                 lin_(c, e.num_heads * e.head_dim), ln, lin_(inner, c), lin_(c, inner), e.activation)
                        for _ in range(e.num_layers)]
        w["conv1"] = rand(c, e.num_mel_bins, 3), rand(c)
        w["conv2"] = rand(c, c, 3), rand(c)
        w["enc_norm"] = tk.LayerNorm(rand(c) + 1, rand(c))
        w["proj1"] = lin_(2 * n, inner)
        w["proj2"] = lin_(n, 2 * n)
    return GlmAsr(cfg, w)


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


def result_json(payload: dict) -> str:
    """payload as JSON a key a line, a list of rows a row a line: a changed figure is a changed
    row in a diff, and ~12% fewer bytes than one value a line."""
    def value(v) -> str:
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            return "[\n  " + ",\n  ".join(json.dumps(r) for r in v) + "\n ]"
        return json.dumps(v)
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(v)}" for k, v in payload.items()) + "\n}\n"


def write_result(name: str, payload: dict, out_dir: str | None, markdown: str | None = None) -> Path:
    out = Path(out_dir) if out_dir else ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{gpu_slug()}.json"
    path.write_text(result_json(payload))
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown)
    print(f"wrote {path}", file=sys.stderr)
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
