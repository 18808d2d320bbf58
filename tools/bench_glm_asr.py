"""GLM-ASR stage times and end to end, ours vs transformers eager (GPU host).

    python tools/bench_glm_asr.py [--out DIR] [--weights bf16|fp32] [--lengths 5,30,120] [--files 32]

Full-size config with random weights in a checkpoint of bfloat16 values as the hub's
(--weights fp32: float32 values), both sides computing in fp32 (TF32 allowed on both sides;
ours keeps the bfloat16 matrices as such on the GPU, transformers widens them); 5 s, 30 s and
120 s of synthetic audio; each 30 s window is one request generating exactly 64 tokens
(end-of-sequence ignored) on both sides. 'total' is end to end, samples to tokens, one pass:
glm_asr.pipeline's window loop (window_tokens) through one tilekernels.runtime.ModelRunner on
our side, the feature extractor and generate() per window on transformers' ('total_first_run':
our first pass at that length, which pays cuTile's compiles and the graph captures). Stages,
timed apart on a further pass: features, encoder, projector, prefill (ours: the runner's
prompt pass to its first token, the prompt's embeddings built, the prefill replayed from its
graph and the first token picked on the device), decode (one window's whole greedy request
minus that prefill, in tokens/s over the 63 steps after the prefill's token). Then 32
different 30 s files transcribed one after another as glm_asr.transcribe does (windows encoded
8 at a time, greedy decode per window), reported as times real time.
"""
from __future__ import annotations

import argparse
import time

import cupy

from benchlib import (glm_prompt_ids, gpu_name, markdown_table, random_glm_asr_checkpoint, synthetic_speechlike,
                      versions, write_result)
from glm_asr.features import windows
from glm_asr.pipeline import decode, window_tokens
from tilekernels.runtime import ModelRunner

NEW = 64


def clock(fn):
    import torch

    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3


def first_token(runner: ModelRunner, ids: list[int], audio_embeds):
    """The runner's prompt pass alone: the prompt's embeddings, the prefill (replayed from its
    graph once captured) and the first token picked, as every request starts."""
    tokens = runner.tokens(runner.model.prompt_embeds(ids, audio_embeds)[None], [ids], NEW)
    try:
        return next(tokens)
    finally:
        tokens.close()          # no decode steps


def ours_run(runner: ModelRunner, audio):
    m = runner.model
    st = {}
    wins, st["features"] = clock(lambda: windows(audio, xp=cupy))
    feats = cupy.stack([w.features for w in wins])
    states, st["encoder"] = clock(lambda: m.audio_tower(feats))
    emb, st["projector"] = clock(lambda: m.project(states))
    st["prefill"] = st["decode"] = 0.0
    for j, w in enumerate(wins):
        ids = glm_prompt_ids(m.config, w.tokens)
        _, t_prefill = clock(lambda: first_token(runner, ids, emb[j, : w.tokens]))
        out, t_all = clock(lambda: decode(runner, ids, emb[j, : w.tokens], NEW, ignore_eos=True))  # prefill + 63 steps
        assert len(out) == NEW, len(out)
        st["prefill"] += t_prefill
        st["decode"] += t_all - t_prefill
    return st, len(wins)


def ours_transcribe(runner: ModelRunner, audio) -> int:
    """Samples to tokens with glm_asr.pipeline's window loop; returns the tokens generated."""
    runs = window_tokens(runner, windows(audio, xp=cupy), lambda n: glm_prompt_ids(runner.model.config, n), NEW,
                         ignore_eos=True)
    return sum(len(tokens) for _, tokens in runs)


def hf_inputs(hf, fe, chunk):
    """(ids, features, mask) of one 30 s window for transformers, and the feature time (ms)."""
    import torch

    inputs, t = clock(lambda: fe(chunk, sampling_rate=16000, return_tensors="pt", return_attention_mask=True))
    feats = inputs["input_features"].cuda()
    mask = inputs["attention_mask"].cuda()
    frames = int(mask.sum())
    n_audio = ((frames - 1) // 2 + 1 - 4) // 4 + 1
    return torch.tensor([glm_prompt_ids(hf.config, n_audio)], device="cuda"), feats, mask, t


def hf_chunks(audio):
    return [audio[start: start + 480000] for start in range(0, len(audio), 480000)]


def hf_transcribe(hf, fe, audio) -> int:
    """Samples to NEW tokens per window with transformers (features, then generate)."""
    import torch

    n = 0
    for chunk in hf_chunks(audio):
        ids, feats, mask, _ = hf_inputs(hf, fe, chunk)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, input_features=feats, input_features_mask=mask, do_sample=False,
                              max_new_tokens=NEW, min_new_tokens=NEW)
        n += out.shape[1] - ids.shape[1]
    return n


def hf_run(hf, fe, audio):
    import torch

    st = {"features": 0.0, "encoder": 0.0, "projector": 0.0, "prefill": 0.0, "decode": 0.0}
    for chunk in hf_chunks(audio):
        ids, feats, mask, t = hf_inputs(hf, fe, chunk)
        st["features"] += t
        with torch.no_grad():
            core = getattr(hf, "model", hf)            # transformers 5 nests the towers in .model
            states, t_enc = clock(lambda: core.audio_tower(feats).last_hidden_state)
            _, t_proj = clock(lambda: core.multi_modal_projector(
                states.reshape(1, -1, hf.config.audio_config.intermediate_size)))
            _, t = clock(lambda: hf(input_ids=ids, input_features=feats, input_features_mask=mask))
            st["encoder"] += t_enc
            st["projector"] += t_proj
            st["prefill"] += max(0.0, t - t_enc - t_proj)      # the forward minus its audio part
            kw = dict(input_ids=ids, input_features=feats, input_features_mask=mask, do_sample=False)
            _, t1 = clock(lambda: hf.generate(**kw, max_new_tokens=1, min_new_tokens=1))
            _, tn = clock(lambda: hf.generate(**kw, max_new_tokens=NEW, min_new_tokens=NEW))
            st["decode"] += tn - t1
    return st


def seconds_list(value: str) -> list[int]:
    """--lengths: positive whole seconds, comma-separated."""
    try:
        out = [int(s) for s in value.split(",")]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive whole seconds like 5,30,120, got {value!r}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16", help="the checkpoint's dtype")
    ap.add_argument("--lengths", type=seconds_list, default="5,30,120", help="audio lengths in seconds, comma-separated")
    ap.add_argument("--files", type=int, default=32, help="30 s files transcribed one after another (0: skip)")
    args = ap.parse_args()
    if args.files < 0:
        ap.error(f"--files: expected 0 or more, got {args.files}")
    import tempfile

    import torch
    from transformers import WhisperFeatureExtractor

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = random_glm_asr_checkpoint(tmp, args.weights)
    runner = ModelRunner(ours)      # its KV cache and captured graphs serve every request, as in transcription
    fe = WhisperFeatureExtractor(feature_size=128)
    rows = []
    warm = synthetic_speechlike(3.0)
    ours_run(runner, warm)
    hf_run(hf, fe, warm)
    for seconds in args.lengths:
        audio = synthetic_speechlike(seconds)
        _, cold = clock(lambda: ours_transcribe(runner, audio))    # first run: compiles new shapes, captures graphs
        n_ours, total_o = clock(lambda: ours_transcribe(runner, audio))
        n_hf, total_h = clock(lambda: hf_transcribe(hf, fe, audio))
        assert n_ours == n_hf, (n_ours, n_hf)
        o, n_win = ours_run(runner, audio)
        h = hf_run(hf, fe, audio)
        rows.append({"audio_s": seconds, "stage": "total_first_run", "ours_ms": round(cold, 1)})
        for stage in ("features", "encoder", "projector", "prefill", "decode"):
            rows.append({"audio_s": seconds, "stage": stage, "ours_ms": round(o[stage], 2),
                         "transformers_ms": round(h[stage], 2)})
        steps = n_win * (NEW - 1)       # the first token of each window comes from the prefill
        rows.append({"audio_s": seconds, "stage": "decode_tok_s", "ours": round(steps / o["decode"] * 1e3, 1),
                     "transformers": round(steps / h["decode"] * 1e3, 1)})
        rows.append({"audio_s": seconds, "stage": "total", "ours_ms": round(total_o, 1), "transformers_ms": round(total_h, 1),
                     "ours_real_time_factor": round(total_o / 1e3 / seconds, 4),
                     "transformers_real_time_factor": round(total_h / 1e3 / seconds, 4)})
        print(rows[-1], flush=True)
    if args.files:
        files = [synthetic_speechlike(30.0, seed=s) for s in range(args.files)]
        ours_transcribe(runner, files[0])
        tokens, ms = clock(lambda: sum(ours_transcribe(runner, a) for a in files))
        rows.append({"audio_s": args.files * 30, "stage": f"{args.files} files x 30 s, total", "ours_ms": round(ms, 1),
                     "ours_times_real_time": round(args.files * 30 / (ms / 1e3), 1), "tokens": tokens})
        print(rows[-1], flush=True)
    dtype = "bfloat16 (the hub checkpoint's)" if args.weights == "bf16" else "float32"
    md = (f"GPU: {gpu_name()}; checkpoint in {dtype}, fp32 arithmetic, TF32 allowed; {NEW} tokens per 30 s "
          "window.\n\n") + markdown_table(
        ["audio s", "stage", "ours", "transformers"],
        [[r["audio_s"], r["stage"], r.get("ours_ms", r.get("ours")), r.get("transformers_ms", r.get("transformers", ""))]
         for r in rows])
    write_result("glm_asr" + ("" if args.weights == "bf16" else "-fp32"),
                 {"gpu": gpu_name(), "versions": versions(), "checkpoint_dtype": args.weights, "rows": rows}, args.out, md)


if __name__ == "__main__":
    main()
