"""Silero VAD's 16 kHz weights from its ONNX file into the safetensors glm_asr.vad reads, and the
ONNX model's own probabilities over two test fixtures (the parity reference of tests/asr/test_vad.py).

    uv run --with onnx --with onnxruntime python tools/convert_silero.py silero_vad_16k_op15.onnx

The file is silero-vad's (MIT, github.com/snakers4/silero-vad, src/silero_vad/data; its license is
glm_asr/data/LICENSE.silero-vad). Its 16 kHz graph, per 576-sample frame: a reflect pad of 64
on the right, an STFT as a convolution with a periodic-Hann DFT basis (computed by glm_asr.vad,
not stored), four 3-tap convolutions with ReLU, an LSTM cell, ReLU and a 1x1 convolution to a
sigmoid. Stored: the convolutions (Cout, Cin, 3), the LSTM in PyTorch's gate order (i, f, g, o),
the head; float32.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import soundfile as sf
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "packages" / "glm_asr" / "src" / "glm_asr" / "data" / "silero_vad_16k.safetensors"
FIXTURES = ROOT / "tests" / "asr" / "fixtures"
REFERENCE = FIXTURES / "silero_onnx_probs.npz"


def onnx_probs(path: str, x: np.ndarray) -> np.ndarray:
    """The model's probabilities frame by frame as silero-vad feeds it: each 512-sample frame after
    the last 64 samples of the one before, the state carried, the input zero padded."""
    import onnxruntime

    sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = np.concatenate([x, np.zeros(-len(x) % 512, np.float32)])
    state, context, out = np.zeros((2, 1, 128), np.float32), np.zeros(64, np.float32), []
    for i in range(0, len(x), 512):
        p, state = sess.run(None, {"input": np.concatenate([context, x[i:i + 512]])[None], "state": state,
                                   "sr": np.array(16000, np.int64)})
        out.append(p[0, 0])
        context = x[i + 448:i + 512]
    return np.array(out, np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("onnx_file")
    args = ap.parse_args()
    import onnx
    from onnx import numpy_helper

    w = {i.name: numpy_helper.to_array(i).astype(np.float32) for i in onnx.load(args.onnx_file).graph.initializer}
    out = {}
    for k in range(4):
        out[f"encoder.{k}.weight"] = w[f"model.encoder.{k}.reparam_conv.weight"]
        out[f"encoder.{k}.bias"] = w[f"model.encoder.{k}.reparam_conv.bias"]
    for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        out[f"lstm.{k}"] = w[f"model.decoder.rnn.{k}"]
    out["head.weight"] = w["model.decoder.decoder.2.weight"][0, :, 0]
    out["head.bias"] = w["model.decoder.decoder.2.bias"]
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(OUT))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    ref = {name: onnx_probs(args.onnx_file, sf.read(FIXTURES / f"{name}.flac", dtype="float32")[0])
           for name in ("pause05", "noise")}
    np.savez_compressed(REFERENCE, **ref)
    print(f"wrote {REFERENCE} ({', '.join(f'{k}: {len(v)} frames' for k, v in ref.items())})")


if __name__ == "__main__":
    main()
