"""Write a tiny GLM-ASR checkpoint for tests: seeded random weights, tiny dimensions, the
hub's file layout and key names, and a tokenizer.json with GLM-ASR's special tokens. The
weights are bfloat16 values (the hub checkpoint's dtype), stored as float32, so the GPU keeps
the matrices in bfloat16 as it does for the real checkpoint (tilekernels.compact).

    python tools/make_tiny_glm_asr.py OUT_DIR [--shards N]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from ml_dtypes import bfloat16 as BF16
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|pad|>"]
TEXT = ("Please transcribe this audio into text. The quick brown fox jumps over the lazy dog. "
        "你好，世界。 Bonjour à tous, ça va? ") * 30


def tokenizer(vocab: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def make(out: Path, shards: int = 1, seed: int = 0, enc=64, enc_layers=2, enc_heads=4, dec=64, dec_layers=2,
         dec_heads=4, kv_heads=2, dec_inner=128) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    ids = {s: tok.token_to_id(s) for s in SPECIAL}
    hd = dec // dec_heads
    config = {
        "model_type": "glmasr", "architectures": ["GlmAsrForConditionalGeneration"],
        "audio_token_id": ids["<|pad|>"], "projector_hidden_act": "gelu", "tie_word_embeddings": False,
        "audio_config": {"model_type": "glmasr_encoder", "hidden_size": enc, "intermediate_size": 4 * enc,
                         "num_hidden_layers": enc_layers, "num_attention_heads": enc_heads,
                         "num_key_value_heads": enc_heads, "hidden_act": "gelu", "max_position_embeddings": 1500,
                         "num_mel_bins": 128,
                         "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}},
        "text_config": {"model_type": "llama", "vocab_size": vocab, "hidden_size": dec, "intermediate_size": dec_inner,
                        "num_hidden_layers": dec_layers, "num_attention_heads": dec_heads, "num_key_value_heads": kv_heads,
                        "head_dim": hd, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "hidden_act": "silu",
                        "eos_token_id": [ids["<|endoftext|>"], ids["<|user|>"]],
                        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)

    def r(*shape, s=0.1):
        return (rng.standard_normal(shape) * s).astype(BF16).astype(np.float32)

    t = {"audio_tower.conv1.weight": r(enc, 128, 3), "audio_tower.conv1.bias": r(enc),
         "audio_tower.conv2.weight": r(enc, enc, 3), "audio_tower.conv2.bias": r(enc),
         "audio_tower.norm.weight": 1 + r(enc), "audio_tower.norm.bias": r(enc)}
    for i in range(enc_layers):
        p = f"audio_tower.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + n + ".weight"], t[p + n + ".bias"] = 1 + r(enc), r(enc)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{n}.weight"] = r(enc, enc)
            if n != "k_proj":
                t[p + f"self_attn.{n}.bias"] = r(enc)
        t[p + "mlp.fc1.weight"], t[p + "mlp.fc1.bias"] = r(4 * enc, enc), r(4 * enc)
        t[p + "mlp.fc2.weight"], t[p + "mlp.fc2.bias"] = r(enc, 4 * enc), r(enc)
    t["multi_modal_projector.linear_1.weight"], t["multi_modal_projector.linear_1.bias"] = r(2 * dec, 4 * enc), r(2 * dec)
    t["multi_modal_projector.linear_2.weight"], t["multi_modal_projector.linear_2.bias"] = r(dec, 2 * dec), r(dec)
    for i in range(dec_layers):
        p = f"language_model.model.layers.{i}."
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = 1 + r(dec), 1 + r(dec)
        t[p + "self_attn.q_proj.weight"], t[p + "self_attn.o_proj.weight"] = r(dec_heads * hd, dec), r(dec, dec_heads * hd)
        t[p + "self_attn.k_proj.weight"], t[p + "self_attn.v_proj.weight"] = r(kv_heads * hd, dec), r(kv_heads * hd, dec)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = r(dec_inner, dec), r(dec_inner, dec)
        t[p + "mlp.down_proj.weight"] = r(dec, dec_inner)
    t["language_model.model.embed_tokens.weight"] = r(vocab, dec, s=1.0)
    t["language_model.model.norm.weight"] = 1 + r(dec)
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shards", type=int, default=1)
    args = ap.parse_args()
    print(make(Path(args.out), args.shards))
