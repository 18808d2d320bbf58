"""GLM-ASR parity against transformers' GlmAsrForConditionalGeneration (GPU host).

    python tools/parity_glm_asr.py [--out DIR] [--seconds 12] [--weights bf16|fp32]

Builds the model from the full-size default config (GLM-ASR-Nano dimensions) with seeded
random weights, saves it with save_pretrained (safetensors) in bfloat16 as the hub checkpoint
is published (--weights fp32: in float32), loads it with our loader onto the GPU (a bfloat16
checkpoint's matrices stay bfloat16 there), runs transformers on it in float32, and for the
same synthetic audio compares: input features with
WhisperFeatureExtractor(feature_size=128) (max abs diff, bound 1e-4), prefill logits
(relative error, bound 1e-3), and 32 greedy tokens (must be identical).
transformers runs in full fp32 (TF32 off), so the error measured is ours alone. Our logits
are measured at both matmul precisions: 'highest' (3xTF32, fp32-accurate) is the one held
to the bound; 'high' (TF32, the default) is reported next to transformers' own TF32 drift
(the same model with TF32 allowed against itself without), which is the scale TF32 can reach.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import cupy
import numpy as np
import torch

import tilekernels as tk

from benchlib import gpu_name, versions, write_result
from glm_asr.features import audio_tokens, log_mel, valid_frames
from glm_asr.model import GlmAsr

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def synthetic_speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """Harmonic tones with a syllable-rate envelope and noise: deterministic, non-trivial audio."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    x = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / 16000) / k for k in range(1, 6))
    x *= 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) * 0.2
    return (x + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


def prompt_ids(cfg, n_audio: int) -> list[int]:
    """The transcription prompt's shape with fixed ids (the real tokenizer is not needed here)."""
    rng = np.random.default_rng(1)
    user, assistant, boa, eoa, nl = 59253, 59254, 59256, 59257, 10
    text = rng.integers(100, 50000, 8).tolist()
    return [user, nl, boa] + [cfg.audio_token_id] * n_audio + [eoa, user, nl] + text + [assistant, nl]


def random_checkpoint(directory: str, weights: str):
    """transformers' GLM-ASR at full size with seeded random weights, saved to `directory` in
    bfloat16 ('bf16', the hub checkpoint's dtype) or float32; returned in float32 on the GPU
    (bfloat16 values widen exactly), as (model, our GlmAsr loaded from the directory)."""
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
    return hf, GlmAsr.load(Path(directory), "gpu")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16", help="the checkpoint's dtype")
    args = ap.parse_args()
    from transformers import WhisperFeatureExtractor

    audio = synthetic_speechlike(args.seconds)
    fe = WhisperFeatureExtractor(feature_size=128)
    ref_feat = fe(audio, sampling_rate=16000, return_tensors="np")["input_features"][0]
    ours_feat = log_mel(audio)
    feat_diff = float(np.abs(ours_feat - ref_feat).max())
    print(f"features: max abs diff {feat_diff:.2e}")

    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = random_checkpoint(tmp, args.weights)
    frames = valid_frames(len(audio))
    n_audio = audio_tokens(frames)
    ids = prompt_ids(ours.config, n_audio)
    feats = torch.tensor(ours_feat[None], device="cuda")
    mask = torch.zeros(1, 3000, dtype=torch.long, device="cuda")
    mask[0, :frames] = 1
    input_ids = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        ref_logits = hf(input_ids=input_ids, input_features=feats, input_features_mask=mask).logits[0, -1]
        ref_logits = ref_logits.double().cpu().numpy()
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        hf_tf32 = hf(input_ids=input_ids, input_features=feats, input_features_mask=mask).logits[0, -1]
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        hf_tf32_rel = float(np.linalg.norm(hf_tf32.double().cpu().numpy() - ref_logits) / np.linalg.norm(ref_logits))
        hf_tokens = hf.generate(input_ids=input_ids, input_features=feats, input_features_mask=mask,
                                max_new_tokens=args.tokens, do_sample=False)[0, len(ids):].tolist()
    def prefill(precision: str):
        """(prefill logits rel err, audio embeddings) at a matmul precision."""
        tk.set_matmul_precision(precision)
        emb = ours.encode(cupy.asarray(ours_feat[None]))[0, :n_audio]
        got = cupy.asnumpy(ours.forward(ours.embed(np.array(ids), emb), ours.new_cache(len(ids))))[0]
        return float(np.linalg.norm(got.astype(np.float64) - ref_logits) / np.linalg.norm(ref_logits)), emb

    rel_tf32, _ = prefill("high")
    rel, emb = prefill("highest")          # the greedy tokens below run at 'highest' too
    eos = set(ours.config.eos_token_ids)
    hf_tokens = hf_tokens[: next((i for i, t in enumerate(hf_tokens) if t in eos), len(hf_tokens))]
    our_tokens = ours.greedy(ids, emb, args.tokens)
    same = our_tokens == hf_tokens
    print(f"prefill logits rel err {rel:.2e} (highest), {rel_tf32:.2e} (high, TF32; transformers' own TF32 "
          f"drift {hf_tf32_rel:.2e}); {len(hf_tokens)} greedy tokens identical (highest): {same}")
    ok = feat_diff <= 1e-4 and rel <= 1e-3 and same
    write_result("glm_asr-parity" + ("" if args.weights == "bf16" else "-fp32"), {
        "gpu": gpu_name(), "versions": versions(), "pass": ok, "audio_seconds": args.seconds,
        "checkpoint_dtype": args.weights,
        "features_max_abs_diff": feat_diff, "features_bound": 1e-4, "prompt_tokens": len(ids),
        "audio_tokens": n_audio, "prefill_logits_rel_err": rel, "rel_err_bound": 1e-3, "matmul_precision": "highest",
        "prefill_logits_rel_err_tf32": rel_tf32, "transformers_tf32_vs_fp32_rel_err": hf_tf32_rel,
        "greedy_tokens": len(hf_tokens), "tokens_identical": same, "ours": our_tokens, "transformers": hf_tokens,
    }, args.out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
