"""Stage-by-stage exactness of our GLM-ASR math against transformers, on the CPU.

    python tools/parity_glm_asr_cpu.py      # needs torch and transformers>=5 installed

A small GlmAsrConfig with random weights (std 0.2, so every stage matters), our numpy
reference kernels against torch in fp32: encoder states, projector output and prefill
logits. The GPU parity tool measures the same model at full size with TF32 kernels; this
one separates the model's math (should agree to ~1e-6) from TF32 rounding.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from glm_asr.features import audio_tokens, log_mel, valid_frames
from glm_asr.model import GlmAsr
from parity_glm_asr import prompt_ids, synthetic_speechlike


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def main():
    from transformers import GlmAsrConfig, GlmAsrForConditionalGeneration

    torch.manual_seed(0)
    cfg = GlmAsrConfig(audio_config=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4),
                       text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=60000))
    hf = GlmAsrForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = GlmAsr.load(Path(d), "cpu")
    audio = synthetic_speechlike(6.0)
    feat = log_mel(audio)
    frames = valid_frames(len(audio))
    n = audio_tokens(frames)
    ids = prompt_ids(ours.config, n)
    core = getattr(hf, "model", hf)
    with torch.no_grad():
        ft = torch.tensor(feat[None])
        states = core.audio_tower(ft).last_hidden_state
        proj = core.multi_modal_projector(states.reshape(1, -1, cfg.audio_config.intermediate_size))
        mask = torch.zeros(1, 3000, dtype=torch.long)
        mask[0, :frames] = 1
        logits = hf(input_ids=torch.tensor([ids]), input_features=ft, input_features_mask=mask).logits[0, -1]
    our_states = ours.audio_tower(feat[None])
    print(f"encoder states rel err {rel(our_states, states.double().numpy()):.2e}")
    print(f"projector      rel err {rel(ours.project(our_states), proj.double().numpy()):.2e}")
    emb = ours.encode(feat[None])[0, :n]
    got = ours.forward(ours.embed(np.array(ids), emb), ours.new_cache(len(ids)))[0]
    print(f"prefill logits rel err {rel(got, logits.double().numpy()):.2e}")


if __name__ == "__main__":
    main()
