"""GLM-ASR parity against transformers' GlmAsrForConditionalGeneration (GPU host; --cpu: any host).

    python tools/parity_glm_asr.py [--out DIR] [--seconds 12] [--tokens 32] [--weights bf16|fp32]
    python tools/parity_glm_asr.py --cpu        # needs torch and transformers>=5, no GPU

Builds the model from the full-size default config (GLM-ASR-Nano dimensions) with seeded
random weights, saves it with save_pretrained (safetensors) in bfloat16 as the hub checkpoint
is published (--weights fp32: in float32), loads it with our loader onto the GPU (a bfloat16
checkpoint's matrices stay bfloat16 there), runs transformers on it in float32, and for the
same synthetic audio compares: input features with
WhisperFeatureExtractor(feature_size=128) (max abs diff, bound 1e-4), prefill logits
(relative error, bound 1e-3; at precision bf16 beside transformers' own bf16 run), the
logits of 32 decode steps teacher forced with transformers' greedy tokens (each step's relative
error, bound 1e-3: the decode kernels; at bf16 beside transformers' own bf16 run), and
the 32 greedy tokens (ours through tilekernels.runtime's ModelRunner, as transcription
decodes): identical up to transformers' first near-tie (greedy_agreement), which random
weights make, and one of its two there.
transformers runs in full fp32 (TF32 off), so the error measured is ours alone. Our logits
are measured at both matmul precisions: 'highest' (3xTF32, fp32-accurate) is the one held
to the bound; 'high' (TF32, the default) is reported next to transformers' own TF32 drift
(the same model with TF32 allowed against itself without), which is the scale TF32 can reach.

--cpu: stage-by-stage exactness of our model's math on the CPU instead (numpy reference
kernels against torch in fp32, nothing written): a small GlmAsrConfig with random weights
(std 0.2, so every stage matters), 6 s of audio; encoder states, projector output and
prefill logits should agree to ~1e-6, which separates the model's math from the GPU run's
TF32 rounding. The other options do not apply.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

import tilekernels as tk

from benchlib import glm_prompt_ids, gpu_name, random_glm_asr_checkpoint, versions, write_result
from glm_asr.features import audio_tokens, log_mel, valid_frames
from glm_asr.synthetic import speechlike
from glm_asr.model import GlmAsr
from glm_asr.pipeline import decode
from tilekernels.runtime import Engine, set_precision


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def teacher_forced(ours, prompt, tokens: list[int], ref) -> tuple[list[float], list[float]]:
    """(relative error, largest absolute error) of our logits against ref (steps, V) at each step
    of a decode fed the reference's tokens: the prompt's prefill, then one decode step a token
    (the decode kernels: decode attention over the cache, the one-row products)."""
    import cupy

    cache = ours.new_cache(1, prompt.shape[0] + len(tokens))
    got = [ours.forward(prompt[None], cache)[0]]
    for t in tokens[:len(ref) - 1]:
        got.append(ours.forward(ours.embed(cupy.array([[t]])), cache)[0])
    got = [cupy.asnumpy(g).astype(np.float64) for g in got]
    return [rel_err(g, r) for g, r in zip(got, ref)], [float(np.abs(g - r).max()) for g, r in zip(got, ref)]


def greedy_agreement(ours: list[int], ref_tokens: list[int], ref, abs_err: list[float], eos: set) -> dict:
    """Whether our greedy tokens are transformers' up to its first near-tie: a step whose top two
    logits are closer than twice our largest logit error there (teacher forced), where an
    fp32-accurate implementation may take either; random weights make such ties. At that step
    ours must be one of the two (an eos for an eos); past it the sequences may part. A sequence
    shorter than the other stopped at an eos (which neither list holds)."""
    def at(seq: list[int], i: int) -> int:
        return seq[i] if i < len(seq) else -1          # -1: stopped (an eos)

    rows = np.arange(len(ref))
    top2 = np.argsort(ref, axis=1)[:, -2:]
    margin = ref[rows, top2[:, 1]] - ref[rows, top2[:, 0]]
    n = len(abs_err)                                    # the steps teacher forced
    tie = next((i for i in range(n) if margin[i] <= 2 * abs_err[i]), None)
    ok = all(at(ours, i) == at(ref_tokens, i) for i in range(n if tie is None else tie))
    if tie is None:
        ok = ok and ours == ref_tokens
    else:
        two = top2[tie].tolist()
        ok = ok and (at(ours, tie) in two or (at(ours, tie) == -1 and any(t in eos for t in two)))
    parted = next((i for i in range(max(len(ours), len(ref_tokens))) if at(ours, i) != at(ref_tokens, i)), None)
    seen = parted is not None and parted < n
    return {"greedy_agree_until_tie": bool(ok), "first_near_tie_step": tie, "first_differing_step": parted,
            "margin_at_first_differing_step": float(margin[parted]) if seen else None,
            "abs_err_at_first_differing_step": abs_err[parted] if seen else None}


def cpu_parity() -> None:
    """--cpu: a small random GLM-ASR, ours (numpy) against transformers (torch fp32), stage by stage."""
    import torch
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
    audio = speechlike(6.0)
    feat = log_mel(audio)
    frames = valid_frames(len(audio))
    n = audio_tokens(frames)
    ids = glm_prompt_ids(ours.config, n)
    core = getattr(hf, "model", hf)
    with torch.no_grad():
        ft = torch.tensor(feat[None])
        states = core.audio_tower(ft).last_hidden_state
        proj = core.multi_modal_projector(states.reshape(1, -1, cfg.audio_config.intermediate_size))
        mask = torch.zeros(1, 3000, dtype=torch.long)
        mask[0, :frames] = 1
        logits = hf(input_ids=torch.tensor([ids]), input_features=ft, input_features_mask=mask).logits[0, -1]
    our_states = ours.audio_tower(feat[None])
    print(f"encoder states rel err {rel_err(our_states, states.double().numpy()):.2e}")
    print(f"projector      rel err {rel_err(ours.project(our_states), proj.double().numpy()):.2e}")
    emb = ours.encode(feat[None])[0, :n]
    got = ours.forward(ours.prompt_embeds(ids, emb)[None], ours.new_cache(1, len(ids)))[0]
    print(f"prefill logits rel err {rel_err(got, logits.double().numpy()):.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16", help="the checkpoint's dtype")
    ap.add_argument("--cpu", action="store_true",
                    help="stage-by-stage exactness of a small model on the CPU instead (no GPU; nothing written)")
    args = ap.parse_args()
    if args.cpu:
        return cpu_parity()
    import cupy
    import torch
    from transformers import WhisperFeatureExtractor

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    audio = speechlike(args.seconds)
    fe = WhisperFeatureExtractor(feature_size=128)
    ref_feat = fe(audio, sampling_rate=16000, return_tensors="np")["input_features"][0]
    ours_feat = log_mel(audio)
    feat_diff = float(np.abs(ours_feat - ref_feat).max())
    print(f"features: max abs diff {feat_diff:.2e}")

    tmp = tempfile.TemporaryDirectory()
    hf = random_glm_asr_checkpoint(tmp.name, args.weights)
    ours = GlmAsr.load(Path(tmp.name), "gpu")      # a bfloat16 checkpoint's matrices stay bfloat16 there
    frames = valid_frames(len(audio))
    n_audio = audio_tokens(frames)
    ids = glm_prompt_ids(ours.config, n_audio)
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
        # teacher forced: the logits that predicted each of those tokens, in one forward
        forced = torch.tensor([ids + hf_tokens[:-1]], device="cuda")
        ref_forced = hf(input_ids=forced, input_features=feats, input_features_mask=mask).logits[0, len(ids) - 1:]
        ref_forced = ref_forced.double().cpu().numpy()
        hf.to(torch.bfloat16)       # transformers' own bf16 run, the bar for our precision 'bf16'
        hf_bf16 = hf(input_ids=input_ids, input_features=feats.to(torch.bfloat16),
                     input_features_mask=mask).logits[0, -1]
        hf_bf16_rel = float(np.linalg.norm(hf_bf16.double().cpu().numpy() - ref_logits) / np.linalg.norm(ref_logits))
        hf_forced_bf16 = hf(input_ids=forced, input_features=feats.to(torch.bfloat16),
                            input_features_mask=mask).logits[0, len(ids) - 1:].double().cpu().numpy()
        hf_forced_bf16_rel = max(rel_err(g, r) for g, r in zip(hf_forced_bf16, ref_forced))
        del hf

    def prefill(precision: str):
        """(prefill logits rel err, audio embeddings) at a matmul precision."""
        tk.set_matmul_precision(precision)
        emb = ours.encode(cupy.asarray(ours_feat[None]))[0, :n_audio]
        got = cupy.asnumpy(ours.forward(ours.prompt_embeds(ids, emb)[None], ours.new_cache(1, len(ids))))[0]
        return rel_err(got, ref_logits), emb

    rel_tf32, _ = prefill("high")
    rel, emb = prefill("highest")          # the greedy tokens below run at 'highest' too
    eos = set(ours.config.eos_token_ids)
    hf_tokens = hf_tokens[: next((i for i, t in enumerate(hf_tokens) if t in eos), len(hf_tokens))]
    set_precision("fp32")
    forced_rel, forced_abs = teacher_forced(ours, ours.prompt_embeds(ids, emb), hf_tokens, ref_forced)
    our_tokens = decode(Engine(ours, 1), ids, emb, args.tokens)
    same = our_tokens == hf_tokens
    greedy = greedy_agreement(our_tokens, hf_tokens, ref_forced, forced_abs, eos)
    del ours
    set_precision("bf16")                   # loads as precision bf16 keeps it: encoder weights in bfloat16 too
    ours = GlmAsr.load(Path(tmp.name), "gpu")
    rel_bf16, emb = prefill("medium")
    forced_bf16 = max(teacher_forced(ours, ours.prompt_embeds(ids, emb), hf_tokens, ref_forced)[0])
    tmp.cleanup()
    print(f"prefill logits rel err {rel:.2e} (highest), {rel_tf32:.2e} (high, TF32; transformers' own TF32 "
          f"drift {hf_tf32_rel:.2e}), {rel_bf16:.2e} (medium, bf16; transformers' own bf16 {hf_bf16_rel:.2e}); "
          f"teacher-forced decode-step logits rel err max {max(forced_rel):.2e} over {len(forced_rel)} steps "
          f"({forced_bf16:.2e} at bf16; transformers' own bf16 {hf_forced_bf16_rel:.2e}); "
          f"{len(hf_tokens)} greedy tokens identical (highest): {same}; {greedy}")
    ok = feat_diff <= 1e-4 and rel <= 1e-3 and max(forced_rel) <= 1e-3 and greedy["greedy_agree_until_tie"]
    write_result("glm_asr-parity" + ("" if args.weights == "bf16" else "-fp32"), {
        "gpu": gpu_name(), "versions": versions(), "pass": ok, "audio_seconds": args.seconds,
        "checkpoint_dtype": args.weights,
        "features_max_abs_diff": feat_diff, "features_bound": 1e-4, "prompt_tokens": len(ids),
        "audio_tokens": n_audio, "prefill_logits_rel_err": rel, "rel_err_bound": 1e-3, "matmul_precision": "highest",
        "prefill_logits_rel_err_tf32": rel_tf32, "transformers_tf32_vs_fp32_rel_err": hf_tf32_rel,
        "prefill_logits_rel_err_bf16": rel_bf16, "transformers_bf16_vs_fp32_rel_err": hf_bf16_rel,
        "teacher_forced_logits_rel_err_max_bf16": forced_bf16,
        "transformers_bf16_teacher_forced_rel_err_max": hf_forced_bf16_rel,
        "bf16_at_least_as_good_as_transformers_bf16": rel_bf16 <= hf_bf16_rel and forced_bf16 <= hf_forced_bf16_rel,
        "teacher_forced_steps": len(forced_rel), "teacher_forced_logits_rel_err_max": max(forced_rel),
        "teacher_forced_logits_rel_err": forced_rel,
        "greedy_tokens": len(hf_tokens), "tokens_identical": same, **greedy, "ours": our_tokens, "transformers": hf_tokens,
    }, args.out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
