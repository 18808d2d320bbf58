"""GLM-ASR: a Whisper-style audio encoder with partial RoPE, a 4-frame-merging MLP
projector, and a Llama decoder, all written against the tilekernels ops (numpy arrays
run on the CPU references, cupy arrays on the cuTile kernels)."""
from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import numpy as np

import tilekernels as tk
from tilekernels.precision import input_dtype
from tilekernels.runtime import (CheckpointError, KVCache, graphed, load_model, load_tensors, move_weights,
                                 read_config, take)
from tilekernels.weights import empty

from .config import GlmAsrConfig

KERNELS = Path(__file__).resolve().parent / "kernels"      # kernel_manifest's lists


class GlmAsr:
    """The audio side (encode) and a tilekernels.runtime.DecoderModel (the text decoder),
    whose token loop the runtime runs."""

    def __init__(self, config: GlmAsrConfig, w: dict):
        self.config, self.w = config, w
        self.xp = tk.array_module(w["embed"])
        self.eos_ids = config.eos_token_ids
        self.max_positions = config.decoder.max_positions
        self._tower = graphed(self.xp, self.audio_tower_eager, "encoder")     # one captured graph per window count
        self._encode = graphed(self.xp, lambda features: self.project(self.audio_tower_eager(features)), "encoder")

    # ------------------------------------------------------------ loading
    @classmethod
    def load(cls, directory: Path, device: str = "cpu") -> "GlmAsr":
        gen_path = directory / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        cfg = GlmAsrConfig.from_hf(read_config(directory), generation)
        e, d = cfg.encoder, cfg.decoder
        return load_model(lambda dev: cls._read(directory, cfg, dev), device, KERNELS, e.hidden_size, d.hidden_size,
                          d.vocab_size)

    @classmethod
    def _read(cls, directory: Path, cfg: GlmAsrConfig, device: str = "cpu") -> "GlmAsr":
        # read where the model runs (on the GPU the checkpoint is uploaded as stored and prepared
        # there): the text decoder's matrices as stored (bfloat16 in the hub checkpoint: half the
        # bytes, and they stay bfloat16); the rest, which folding the encoder's norms computes
        # with, in float32. transformers 5 save_pretrained writes the decoder as
        # language_model.model.model.*; the hub checkpoint has language_model.model.*: accept both
        t = {k.replace("language_model.model.model.", "language_model.model."):
             v if k.startswith("language_model.") and v.ndim == 2 else tk.widen(v)
             for k, v in load_tensors(directory, widen=False, device=device).items()}
        xp = tk.array_module(next(iter(t.values()))) if t else np
        e, d = cfg.encoder, cfg.decoder
        c, hd = e.hidden_size, e.head_dim

        def lin(key, n_out, n_in, bias=True):
            return take(t, key + ".weight", (n_out, n_in)), (take(t, key + ".bias", (n_out,)) if bias else None)

        def ln(key, n):
            return tk.LayerNorm(take(t, key + ".weight", (n,)), take(t, key + ".bias", (n,)))   # nn.LayerNorm eps 1e-5

        w = {"conv1": (take(t, "audio_tower.conv1.weight", (c, e.num_mel_bins, 3)), take(t, "audio_tower.conv1.bias", (c,))),
             "conv2": (take(t, "audio_tower.conv2.weight", (c, c, 3)), take(t, "audio_tower.conv2.bias", (c,))),
             "enc_norm": ln("audio_tower.norm", c)}
        w["encoder"] = []
        for i in range(e.num_layers):
            p = f"audio_tower.layers.{i}."
            (qw, qb), (kw, _), (vw, vb) = (lin(p + "self_attn.q_proj", e.num_heads * hd, c),
                                           lin(p + "self_attn.k_proj", e.num_kv_heads * hd, c, bias=False),
                                           lin(p + "self_attn.v_proj", e.num_kv_heads * hd, c))
            ln1, *qkv = tk.fold_norm(ln(p + "input_layernorm", c), tk.stack_rows([qw, kw, vw]),
                                     xp.concatenate([qb, xp.zeros(len(kw), xp.float32), vb]))
            w["encoder"].append(tk.Block(
                ln1, tuple(qkv), lin(p + "self_attn.o_proj", c, e.num_heads * hd),
                ln(p + "post_attention_layernorm", c), lin(p + "mlp.fc1", e.intermediate_size, c),
                lin(p + "mlp.fc2", c, e.intermediate_size), e.activation))
        w["proj1"] = lin("multi_modal_projector.linear_1", 2 * d.hidden_size, e.intermediate_size)
        w["proj2"] = lin("multi_modal_projector.linear_2", d.hidden_size, 2 * d.hidden_size)
        n, D = d.hidden_size, d.head_dim
        w["decoder"] = []
        for i in range(d.num_layers):
            p = f"language_model.model.layers.{i}."

            def m(k, rows, cols=n):
                return take(t, p + k + ".weight", (rows, cols))
            qkv = tk.stack_rows([m("self_attn.q_proj", d.num_heads * D), m("self_attn.k_proj", d.num_kv_heads * D),
                                 m("self_attn.v_proj", d.num_kv_heads * D)])
            gate_up = tk.stack_rows([m("mlp.gate_proj", d.intermediate_size), m("mlp.up_proj", d.intermediate_size)])
            # the RMSNorms stay as they are (the decode kernels apply them), so the matrices keep
            # the checkpoint's values: bfloat16 ones are stored as such on the GPU (tk.compact)
            w["decoder"].append(tk.Block(
                tk.RMSNorm(take(t, p + "input_layernorm.weight", (n,)), d.rms_norm_eps), (qkv, None),
                (m("self_attn.o_proj", n, d.num_heads * D), None),
                tk.RMSNorm(take(t, p + "post_attention_layernorm.weight", (n,)), d.rms_norm_eps), (gate_up, None),
                (m("mlp.down_proj", n, d.intermediate_size), None), "swiglu"))
        w["embed"] = take(t, "language_model.model.embed_tokens.weight", (d.vocab_size, n))
        head = t.get("language_model.lm_head.weight")
        if cfg.tie_word_embeddings:
            # as transformers does: a tied head is the embedding, whatever else the file holds
            if head is not None and not bool(xp.array_equal(tk.widen(head), tk.widen(w["embed"]))):
                print("note: config ties the output head to embed_tokens; ignoring the different "
                      "language_model.lm_head.weight in the checkpoint", file=sys.stderr)
            head = w["embed"]
        elif head is None:
            raise CheckpointError("missing tensor language_model.lm_head.weight (tie_word_embeddings is false)")
        else:
            head = take(t, "language_model.lm_head.weight", (d.vocab_size, n))
        w["norm"] = tk.RMSNorm(take(t, "language_model.model.norm.weight", (n,)), d.rms_norm_eps)
        w["lm_head"] = head
        return cls(cfg, w)

    def to(self, device: str) -> "GlmAsr":
        """Move every weight to 'cpu' (numpy) or 'gpu' (cupy). On the GPU the text decoder's
        matrices, which every decode step streams, stay bfloat16 when the checkpoint's are (exact,
        half the bytes); the encoder's too at precision bf16 (tk matmul precision 'medium'), whose
        products then take bfloat16 inputs, and float32 otherwise (TF32 products ran slower
        widening bfloat16 tiles)."""
        text = ("decoder", "embed", "lm_head", "norm")
        whole = tk.get_matmul_precision() == "medium"
        moved = move_weights({k: v for k, v in self.w.items() if k not in text}, device, compact=whole)
        moved.update(move_weights({k: self.w[k] for k in text}, device, compact=True))
        return GlmAsr(self.config, moved)

    # ------------------------------------------------------------ audio side
    def encode(self, features):
        """(W, 128, 3000) log-mel windows -> (W, 375, C_text) audio embeddings; on the GPU the
        encoder and the projector replayed from one graph per window count."""
        return self._encode(features)

    def audio_tower(self, features):
        """(W, 128, 3000) log-mel windows -> (W, 1500, C_audio) encoder states; on the GPU
        replayed from a CUDA graph captured once per window count (a few hundred kernels)."""
        return self._tower(features)

    def audio_tower_eager(self, features):
        """audio_tower, each op called from Python."""
        e, xp, w = self.config.encoder, self.xp, self.w
        x = tk.conv1d(features, *w["conv1"], stride=1, padding=1, activation="gelu")
        x = tk.conv1d(x, *w["conv2"], stride=2, padding=1, activation="gelu")
        x = xp.ascontiguousarray(x.transpose(0, 2, 1))                      # (W, T, C)
        b, t, c = x.shape
        cos, sin = tk.rope_cos_sin(xp.arange(t), e.rotary_dim, e.rope_theta)               # tables by position
        start = xp.zeros(1, np.int32)
        # the fused projection and q, k, v in the dtype the output projection takes (bfloat16 at
        # precision bf16): the attention then multiplies in bfloat16 and hands that projection
        # its input as it is; split_qkv reads half the bytes
        dtype = input_dtype(w["encoder"][0].o[0])
        k = empty(xp, (b, e.num_kv_heads, t, e.head_dim), dtype)
        v = empty(xp, k.shape, dtype)

        def attend(qkv, out_dtype):    # bidirectional within the window; k, v: (B, H, T, D) scratch
            q = tk.split_qkv(qkv, k, v, start, e.num_heads, cos, sin, e.rotary_dim, q_dtype=out_dtype)
            return tk.attention(q, k, v, causal=False)

        for block in w["encoder"]:
            x = block(x, attend, qkv_dtype=dtype)
        return w["enc_norm"](x)

    def project(self, states):
        """Encoder states (W, T, C) -> text-space embeddings (W, T/4, C_text), 4 frames merged."""
        merged = states.reshape(states.shape[0], -1, self.config.encoder.intermediate_size)
        h = tk.linear(merged, *self.w["proj1"], activation=self.config.projector_activation)
        return tk.linear(h, *self.w["proj2"])

    # ------------------------------------------------------------ text side (the DecoderModel)
    @property
    def embedding_tables(self) -> tuple:
        return self.w["embed"], None

    def new_cache(self, batch: int, length: int, dtype=np.float32) -> KVCache:
        d = self.config.decoder
        return KVCache.allocate(self.xp, d.num_layers, batch, d.num_kv_heads, length, d.head_dim,
                                rope_theta=d.rope_theta, dtype=dtype)

    def embed(self, ids, positions=None):
        """Token embeddings (B, T, C) of ids (B, T); positions come from the cache (RoPE)."""
        return tk.embedding(ids, self.w["embed"])

    def prompt_embeds(self, ids: list[int], audio_embeds):
        """Token embeddings (T, C) of a prompt with its audio placeholders replaced, in order."""
        xp = self.xp
        x = tk.embedding(xp.asarray(np.asarray(ids)), self.w["embed"])
        x[xp.asarray(np.flatnonzero(np.asarray(ids) == self.config.audio_token_id))] = audio_embeds
        return x

    def forward(self, x, cache: KVCache):
        """Llama decoder over new input embeddings x (B, T, C); last-position logits (B, V)."""
        t = x.shape[1]
        cache.begin(t)
        logits = self.step(x, cache)
        cache.length += t
        return logits

    def step(self, x, cache: KVCache):
        """The device work of forward for the span cache.begin announced (graph-capturable)."""
        d, w = self.config.decoder, self.w
        for i, block in enumerate(w["decoder"]):       # RoPE from the cache's tables
            x = block(x, partial(cache.attend, i, heads=d.num_heads, scale=d.head_dim ** -0.5))
        return tk.linear(cache.final(x), w["lm_head"], norm=w["norm"])
