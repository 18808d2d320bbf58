"""GLM-ASR checkpoints of seeded random weights in the hub's file layout and key names, at any size,
and speech-like audio: what the tests, the benchmarks and the install's warm-up (glm_asr.warmup) run
where no real checkpoint or recording may be downloaded.

    python -m glm_asr.synthetic OUT_DIR [--shards N]      # the tests' tiny checkpoint
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from ml_dtypes import bfloat16 as BF16

SPECIAL = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|pad|>"]
TEXT = ("Please transcribe this audio into text. The quick brown fox jumps over the lazy dog. "
        "你好，世界。 Bonjour à tous, ça va? ") * 30
# GLM-ASR-Nano-2512's sizes (its config.json): the shapes the shipped kernel list (kernels/*.txt) holds
NANO = dict(enc=1280, enc_heads=20, dec=2048, dec_heads=16, kv_heads=4, dec_inner=6144, vocab=59264)


def tokenizer(vocab: int = 400):
    """A byte-level BPE tokenizer trained here, with GLM-ASR's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok


def write_checkpoint(out: Path, shards: int = 1, seed: int = 0, enc=64, enc_layers=2, enc_heads=4, dec=64,
                     dec_layers=2, dec_heads=4, kv_heads=2, dec_inner=128, vocab: int | None = None,
                     dtype: str = "float32") -> Path:
    """config.json, tokenizer.json and model*.safetensors in `out`. The matrices are bfloat16 values,
    stored as float32 (the tiny default: the GPU keeps them in bfloat16 as it does the real
    checkpoint's) or as bfloat16 (the hub's, every tensor rounded); vocab: the model's (default: the
    tokenizer's)."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    tok.save(str(out / "tokenizer.json"))
    vocab = vocab or tok.get_vocab_size()
    ids = {s: tok.token_to_id(s) for s in SPECIAL}
    hd = dec // dec_heads
    audio = {"model_type": "glmasr_encoder", "hidden_size": enc, "intermediate_size": 4 * enc,
             "num_hidden_layers": enc_layers, "num_attention_heads": enc_heads, "num_key_value_heads": enc_heads,
             "hidden_act": "gelu", "max_position_embeddings": 1500, "num_mel_bins": 128,
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}}
    text = {"model_type": "llama", "vocab_size": vocab, "hidden_size": dec, "intermediate_size": dec_inner,
            "num_hidden_layers": dec_layers, "num_attention_heads": dec_heads, "num_key_value_heads": kv_heads,
            "head_dim": hd, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "hidden_act": "silu",
            "eos_token_id": [ids["<|endoftext|>"], ids["<|user|>"]],
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False}
    config = {"model_type": "glmasr", "architectures": ["GlmAsrForConditionalGeneration"],
              "audio_token_id": ids["<|pad|>"], "projector_hidden_act": "gelu", "tie_word_embeddings": False,
              "audio_config": audio, "text_config": text}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    store = {"float32": np.float32, "bfloat16": BF16}[dtype]

    def r(*shape, s=0.1):
        return (rng.standard_normal(shape) * s).astype(BF16).astype(store)

    def one(n):                                     # a norm's weight, near 1
        return (1 + r(n).astype(np.float32)).astype(store)

    t = {"audio_tower.conv1.weight": r(enc, 128, 3), "audio_tower.conv1.bias": r(enc),
         "audio_tower.conv2.weight": r(enc, enc, 3), "audio_tower.conv2.bias": r(enc),
         "audio_tower.norm.weight": one(enc), "audio_tower.norm.bias": r(enc)}
    for i in range(enc_layers):
        p = f"audio_tower.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + n + ".weight"], t[p + n + ".bias"] = one(enc), r(enc)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{n}.weight"] = r(enc, enc)
            if n != "k_proj":
                t[p + f"self_attn.{n}.bias"] = r(enc)
        t[p + "mlp.fc1.weight"], t[p + "mlp.fc1.bias"] = r(4 * enc, enc), r(4 * enc)
        t[p + "mlp.fc2.weight"], t[p + "mlp.fc2.bias"] = r(enc, 4 * enc), r(enc)
    proj = "multi_modal_projector.linear_"
    t[proj + "1.weight"], t[proj + "1.bias"] = r(2 * dec, 4 * enc), r(2 * dec)
    t[proj + "2.weight"], t[proj + "2.bias"] = r(dec, 2 * dec), r(dec)
    for i in range(dec_layers):
        p = f"language_model.model.layers.{i}."
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = one(dec), one(dec)
        a = p + "self_attn."
        t[a + "q_proj.weight"], t[a + "o_proj.weight"] = r(dec_heads * hd, dec), r(dec, dec_heads * hd)
        t[a + "k_proj.weight"], t[a + "v_proj.weight"] = r(kv_heads * hd, dec), r(kv_heads * hd, dec)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = r(dec_inner, dec), r(dec_inner, dec)
        t[p + "mlp.down_proj.weight"] = r(dec, dec_inner)
    t["language_model.model.embed_tokens.weight"] = r(vocab, dec, s=1.0)
    t["language_model.model.norm.weight"] = one(dec)
    t["language_model.lm_head.weight"] = r(vocab, dec, s=0.5)
    names = sorted(t)
    if shards == 1:
        save_file(t, str(out / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: t[k] for k in names[s::shards]}
            save_file(part, str(out / fname))
            weight_map.update({k: fname for k in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """Harmonic tones with a syllable-rate envelope and noise (16 kHz float32): deterministic audio
    that Silero VAD takes for speech."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    x = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / 16000) / k for k in range(1, 6))
    x *= 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) * 0.2
    return (x + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm_asr.synthetic", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the checkpoint's folder (made if missing)")
    ap.add_argument("--shards", type=int, default=1, help="safetensors files (with an index past 1)")
    args = ap.parse_args(argv)
    if args.shards < 1:
        ap.error(f"--shards {args.shards}: at least 1")
    try:
        print(write_checkpoint(Path(args.out), args.shards))
    except OSError as e:
        print(f"error: {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
