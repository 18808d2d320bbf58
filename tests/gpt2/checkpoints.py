"""Small GPT-2 checkpoints in the exact Hugging Face file layouts, made for the tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
        "the slings and arrows of outrageous fortune. Café, naïve, 東京, and émigré words too.\n") * 20


def make_tokenizer(vocab: int = 300) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def gpt2_tensors(vocab: int, n_embd=32, n_layer=2, n_positions=64, inner=None, seed=0) -> dict:
    """Random weights with GPT-2's names; Conv1D weights stored [in, out]."""
    rng = np.random.default_rng(seed)
    inner = inner or 4 * n_embd

    def r(*shape, s=0.2):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    t = {"wte.weight": r(vocab, n_embd), "wpe.weight": r(n_positions, n_embd),
         "ln_f.weight": 1 + r(n_embd, s=0.1), "ln_f.bias": r(n_embd, s=0.1)}
    for i in range(n_layer):
        p = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            t[p + ln + ".weight"], t[p + ln + ".bias"] = 1 + r(n_embd, s=0.1), r(n_embd, s=0.1)
        for name, n_in, n_out in (("attn.c_attn", n_embd, 3 * n_embd), ("attn.c_proj", n_embd, n_embd),
                                  ("mlp.c_fc", n_embd, inner), ("mlp.c_proj", inner, n_embd)):
            t[p + name + ".weight"], t[p + name + ".bias"] = r(n_in, n_out), r(n_out, s=0.05)
        t[p + "attn.bias"] = np.tril(np.ones((n_positions, n_positions), np.float32))[None, None]
    return t


def make_gpt2(directory: Path, *, prefix: str = "", dtype: str = "float32", shards: int = 1,
              lm_head: bool = False, n_layer: int = 2, n_head: int = 2, n_embd: int = 32, n_positions: int = 64,
              config_extra: dict | None = None, tokenizer: Tokenizer | None = None, vocab: int | None = None) -> Path:
    """Write config.json, tokenizer.json and model.safetensors (or shards + index); vocab: rows of
    the embedding (default: the tokenizer's)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or make_tokenizer()
    vocab = vocab or tok.get_vocab_size()
    tok.save(str(directory / "tokenizer.json"))
    config = {"model_type": "gpt2", "vocab_size": vocab, "n_positions": n_positions, "n_embd": n_embd,
              "n_layer": n_layer, "n_head": n_head, "n_inner": None, "layer_norm_epsilon": 1e-5,
              "activation_function": "gelu_new", "eos_token_id": tok.token_to_id("<|endoftext|>"),
              **(config_extra or {})}
    (directory / "config.json").write_text(json.dumps(config))
    tensors = gpt2_tensors(vocab, n_embd, n_layer, n_positions)
    if lm_head:
        tensors["lm_head.weight"] = tensors["wte.weight"][::-1].copy()
    tensors = {prefix + k if k != "lm_head.weight" else k: v for k, v in tensors.items()}
    if dtype == "float16":
        tensors = {k: v.astype(np.float16) for k, v in tensors.items()}
    elif dtype == "bfloat16":
        tensors = {k: to_bf16(v) for k, v in tensors.items()}
    names = sorted(tensors)
    if shards == 1:
        _save(tensors, directory / "model.safetensors", dtype)
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in names[s::shards]}
            _save(part, directory / fname, dtype)
            weight_map.update({k: fname for k in part})
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even) as uint16."""
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _save(tensors: dict, path: Path, dtype: str) -> None:
    """safetensors.numpy cannot write bfloat16: write uint16 as U16, then relabel BF16."""
    save_file(tensors, str(path))
    if dtype == "bfloat16":
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8: 8 + n])
        for k, meta in header.items():
            if k != "__metadata__":
                meta["dtype"] = "BF16"
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def generate(model, tokenizer, prompts, max_new_tokens: int, sampling, **options):
    """gpt's Python API (LanguageModel.generate) for a loaded GPT and tokenizer under a Sampling."""
    from gpt import LanguageModel

    s = sampling
    return LanguageModel(model, tokenizer).generate(prompts, max_new_tokens, s.temperature, s.top_k, s.top_p,
                                                    s.repetition_penalty, **options)
