"""python -m glm_asr.warmup: a first run's one-time work done at install (tilekernels.prebuild runs it
once the kernels are built). A model of GLM-ASR-Nano's sizes (glm_asr.synthetic), one encoder layer
and two decoder layers, transcribes 30 s of speech-like audio from a FLAC file on this machine's GPU,
with vad silero and none, so that CuPy compiles and caches its own kernels (weight preparation,
features, the VAD, the cache's copies) and Python writes the bytecode of what a transcription
imports. The model's kernels are those of the kernel list (their shapes do not depend on the depth),
loaded from the cubin cache. CuPy's can: a prompt's keys go into its slot through a view of every
layer's cache, and one layer's view has a dimension fewer (another copy kernel). Only those caches
are kept."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path


def warm(device: str = "gpu", **sizes) -> list[str]:
    """Transcribe speech-like audio with a two-layer model of `sizes` (glm_asr.synthetic's keywords;
    default GLM-ASR-Nano's) on `device`, vad silero then none; the two texts."""
    import soundfile as sf

    from . import load, transcribe  # noqa: F401  (the command's modules: their bytecode)
    from .synthetic import NANO, speechlike, write_checkpoint

    with tempfile.TemporaryDirectory(prefix="glm_asr.warmup.") as scratch:
        model, audio = Path(scratch, "model"), Path(scratch, "speech.flac")
        write_checkpoint(model, enc_layers=1, dec_layers=2, dtype="bfloat16", **(sizes or NANO))
        sf.write(audio, speechlike(30.0), 16000)
        asr = load(str(model), device=device)
        texts = [asr.transcribe(audio, vad=vad, max_new_tokens=8).text for vad in ("silero", "none")]
    if device == "gpu":     # what other checkpoints' values lead a load to: exact compaction, a tied head's check
        import cupy

        import tilekernels as tk

        x = cupy.ones((1024, 1024), cupy.float32)     # large: CuPy's two-pass reductions, as a head's
        bool(cupy.array_equal(tk.widen(tk.compact(x)), x))
        tk.compact(x).view(cupy.uint16).copy()
    return texts


def main() -> int:
    began = time.perf_counter()
    try:
        from tilekernels.runtime.device import pick_device

        warm(pick_device("gpu"))                   # no GPU: nothing to warm (one line, before any work)
    except Exception as e:  # noqa: BLE001  (one line: what failed)
        print(f"error: glm_asr.warmup: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 1
    print(f"glm_asr.warmup: a first transcription's CuPy kernels and bytecode in {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
