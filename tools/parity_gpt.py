"""GPT-2 parity against transformers' GPT2LMHeadModel (GPU host).

    python tools/parity_gpt.py [--embedded DIR] [--out DIR]

Builds GPT2LMHeadModel at the gpt2 (124M) config with seeded random weights, saves it
with save_pretrained (safetensors), loads it with our loader onto the GPU and compares
prefill logits on a 64-token prompt (relative error, TF32 bound 1e-3) and 64 greedy
tokens (must be identical). Does the same for the embedded Shakespeare model. At precision
bf16 (bfloat16 matrices and products): the prefill logits and those of the 64 decode steps
teacher forced with transformers' greedy tokens, against transformers fp32, beside
transformers' own bfloat16 model on the same tokens (the bar bf16 must clear).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import cupy
import numpy as np

from benchlib import gpu_name, versions, write_result
from gpt.model import GPT
from tilekernels.runtime import GREEDY, Engine, generate, set_precision


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def bf16_parity(directory: Path, hf, prompt: list[int], tokens: list[int]) -> dict:
    """Precision bf16 against transformers fp32, beside transformers' own bfloat16 model: the
    prefill logits, and each decode step's (one token at a time through the decode kernels)
    fed transformers' greedy tokens; relative errors, the largest over the steps."""
    import torch

    seq = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        ref = hf(seq).logits[0].double().cpu().numpy()
        hf.to(torch.bfloat16)
        theirs = hf(seq).logits[0].double().cpu().numpy()
        hf.to(torch.float32)
    n = len(prompt)
    set_precision("bf16")
    try:
        ours = GPT.load(directory, "gpu")
        cache = ours.new_cache(1, len(prompt) + len(tokens))
        pre = cupy.asnumpy(ours.forward(cupy.asarray([prompt]), cupy.arange(n)[None], cache, last_only=False))[0]
        steps = [cupy.asnumpy(ours.forward(cupy.asarray([[t]]), cupy.asarray([[n + i]]), cache))[0]
                 for i, t in enumerate(tokens[:-1])]
    finally:
        set_precision("tf32")
    forced = max(rel_err(g, r) for g, r in zip(steps, ref[n:]))
    hf_forced = max(rel_err(g, r) for g, r in zip(theirs[n:n + len(steps)], ref[n:]))
    row = {"prefill_logits_rel_err_bf16": rel_err(pre, ref[:n]), "transformers_bf16_prefill_rel_err": rel_err(theirs[:n], ref[:n]),
           "teacher_forced_steps": len(steps), "teacher_forced_logits_rel_err_max_bf16": forced,
           "transformers_bf16_teacher_forced_rel_err_max": hf_forced}
    row["bf16_at_least_as_good_as_transformers_bf16"] = (row["prefill_logits_rel_err_bf16"] <= row[
        "transformers_bf16_prefill_rel_err"] and forced <= hf_forced)
    print(f"  bf16: prefill logits rel err {row['prefill_logits_rel_err_bf16']:.2e} (transformers bf16 "
          f"{row['transformers_bf16_prefill_rel_err']:.2e}), teacher-forced decode max {forced:.2e} "
          f"(transformers bf16 {hf_forced:.2e})")
    return row


def compare(name: str, directory: Path, hf, prompt: list[int], new_tokens: int = 64) -> dict:
    import torch

    ours = GPT.load(directory, "gpu")
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits[0].double().cpu().numpy()
        hf_tokens = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=ours.config.eos_token_id)[0, len(prompt):].tolist()
    cache = ours.new_cache(1, len(prompt))
    got = cupy.asnumpy(ours.forward(cupy.asarray([prompt]), cupy.arange(len(prompt))[None], cache,
                                    last_only=False))[0].astype(np.float64)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    out = generate(Engine(ours, 1), [prompt], new_tokens, GREEDY)[0].tokens
    eos = ours.config.eos_token_id
    hf_tokens = hf_tokens[: hf_tokens.index(eos) + 1] if eos in hf_tokens else hf_tokens     # eos kept, as ours
    row = {"model": name, "prompt_tokens": len(prompt), "logits_rel_err": rel, "rel_err_bound": 1e-3,
           "greedy_tokens": len(hf_tokens), "tokens_identical": out == hf_tokens,
           "first_mismatch": next((i for i, (a, b) in enumerate(zip(out, hf_tokens)) if a != b), None),
           "ours": out, "transformers": hf_tokens}
    print(f"{name}: logits rel err {rel:.2e}, {len(hf_tokens)} greedy tokens identical: {out == hf_tokens}")
    if len(hf_tokens) > 1:
        row.update(bf16_parity(directory, hf, prompt, hf_tokens))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--embedded", default=str(Path(__file__).resolve().parents[1] /
                                              "packages/gpt/src/gpt/data/shakespeare"))
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config()).cuda().eval()        # the gpt2 (124M) configuration
    prompt = np.random.default_rng(0).integers(0, 50257, 64).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        rows.append(compare("gpt2-124M-random", Path(tmp), hf, prompt))
    del hf
    emb = Path(args.embedded)
    if (emb / "model.safetensors").exists():
        hf = GPT2LMHeadModel.from_pretrained(emb, torch_dtype=torch.float32).cuda().eval()
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(emb / "tokenizer.json"))
        rows.append(compare("shakespeare-embedded", emb, hf, tok.encode("ROMEO:\nBut soft, what light").ids))
    ok = all(r["tokens_identical"] and r["logits_rel_err"] <= 1e-3 for r in rows)
    write_result("gpt-parity", {"gpu": gpu_name(), "versions": versions(), "pass": ok, "rows": rows}, args.out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
