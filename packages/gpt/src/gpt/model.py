"""GPT-2, written once against the tilekernels ops: numpy arrays run it on the CPU
(reference kernels), cupy arrays on the GPU (cuTile kernels)."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

import tilekernels as tk
from tilekernels.runtime import KVCache, load_model, load_tensors, move_weights, read_config, take

from .config import GPTConfig

KERNELS = Path(__file__).resolve().parent / "kernels"      # kernel_manifest's lists


class GPT:
    """A tilekernels.runtime.DecoderModel: the runtime runs its token loop."""

    def __init__(self, config: GPTConfig, wte, wpe, blocks: list[tk.Block], ln_f: tk.LayerNorm, lm_head: tuple):
        self.config, self.wte, self.wpe, self.blocks, self.ln_f, self.lm_head = (
            config, wte, wpe, blocks, ln_f, lm_head)
        self.xp = tk.array_module(wte)
        self.eos_ids = (config.eos_token_id,)
        self.max_positions = config.n_positions

    # ------------------------------------------------------------ loading
    @classmethod
    def load(cls, directory: Path, device: str = "cpu") -> "GPT":
        """Read config.json and the safetensors of a GPT-2 checkpoint directory; on the GPU the
        kernels the model launches build meanwhile, in worker processes (tilekernels.cubins)."""
        c = GPTConfig.from_hf(read_config(directory))
        return load_model(lambda dev: cls._read(directory, c, dev), device, KERNELS, c.n_embd, c.n_head, c.vocab_size)

    @classmethod
    def _read(cls, directory: Path, config: GPTConfig, device: str = "cpu") -> "GPT":
        t = load_tensors(directory, strip_prefixes=("transformer.",), device=device)
        c, v, inner = config.n_embd, config.vocab_size, config.inner
        xp = tk.array_module(t["wte.weight"]) if "wte.weight" in t else np

        def lin(key, n_in, n_out):     # Conv1D stores [in, out]; kernels take [out, in]
            return (xp.ascontiguousarray(take(t, key + ".weight", (n_in, n_out)).T),
                    take(t, key + ".bias", (n_out,)))

        def ln(key):
            return tk.LayerNorm(take(t, key + ".weight", (c,)), take(t, key + ".bias", (c,)),
                                config.layer_norm_epsilon)

        blocks = []
        for i in range(config.n_layer):
            p = f"h.{i}."
            # each LayerNorm's scale and shift fold into the projection after it (tk.fold_norm)
            ln_1, *qkv = tk.fold_norm(ln(p + "ln_1"), *lin(p + "attn.c_attn", c, 3 * c))
            ln_2, *fc = tk.fold_norm(ln(p + "ln_2"), *lin(p + "mlp.c_fc", c, inner))
            blocks.append(tk.Block(ln_1, tuple(qkv), lin(p + "attn.c_proj", c, c), ln_2, tuple(fc),
                                   lin(p + "mlp.c_proj", inner, c), config.activation))
        wte = take(t, "wte.weight", (v, c))
        lm_head = take(t, "lm_head.weight", (v, c)) if "lm_head.weight" in t else wte
        ln_f, *lm_head = tk.fold_norm(ln("ln_f"), lm_head)
        return cls(config, wte, take(t, "wpe.weight", (config.n_positions, c)), blocks, ln_f, tuple(lm_head))

    def to(self, device: str) -> "GPT":
        """Move every weight to 'cpu' (numpy) or 'gpu' (cupy). At precision bf16 (tk matmul
        precision 'medium') the GPU's projection and head matrices are bfloat16, rounded as
        transformers' bfloat16 model rounds them: half the bytes a decode step streams, and
        bfloat16 products (the embedding tables, biases and norms stay float32)."""
        rounded = tk.get_matmul_precision() == "medium"
        tables = move_weights((self.wte, self.wpe, self.ln_f), device)
        blocks, lm_head = move_weights((self.blocks, self.lm_head), device, rounded=rounded)
        return GPT(self.config, tables[0], tables[1], blocks, tables[2], lm_head)

    # ------------------------------------------------------------ inference
    def new_cache(self, batch: int, length: int, dtype=np.float32) -> KVCache:
        c = self.config
        return KVCache.allocate(self.xp, c.n_layer, batch, c.n_head, length, c.head_dim, dtype=dtype)

    def forward(self, ids, positions, cache: KVCache, last_only: bool = True):
        """Logits for the new tokens ids (B, T) at positions (B, T), appending them to the cache.

        Returns (B, V) for the last position when last_only, else (B, T, V).
        """
        cache.begin(ids.shape[1])
        logits = self.step(self.embed(ids, positions), cache, last_only)
        cache.length += ids.shape[1]
        return logits

    @property
    def embedding_tables(self) -> tuple:
        """(token table, position table): what embed reads (a decode graph gathers from them)."""
        return self.wte, self.wpe

    def embed(self, ids, positions):
        """Token plus position embeddings (B, T, C) of ids at positions (B, T)."""
        return tk.embedding(ids, self.wte, positions, self.wpe)

    def step(self, x, cache: KVCache, last_only: bool = True):
        """The device work of forward from the embeddings x (B, T, C), for the span announced by
        cache.begin (graph-capturable)."""
        for i, block in enumerate(self.blocks):
            x = block(x, partial(cache.attend, i, heads=self.config.n_head, scale=self.config.attn_scale(i)))
        if last_only:
            x = cache.final(x)
        return tk.linear(x, *self.lm_head, norm=self.ln_f)


__all__ = ["GPT", "GPTConfig"]
