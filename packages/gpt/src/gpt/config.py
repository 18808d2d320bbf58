"""GPT-2 hyperparameters, read from a Hugging Face config.json and checked."""
from __future__ import annotations

from dataclasses import dataclass

from tilekernels.runtime import CheckpointError

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu": "gelu"}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_tanh"          # tilekernels activation name
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    eos_token_id: int = 50256

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner(self) -> int:
        return self.n_inner or 4 * self.n_embd

    def attn_scale(self, layer: int) -> float:
        scale = self.head_dim ** -0.5 if self.scale_attn_weights else 1.0
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale

    @classmethod
    def from_hf(cls, cfg: dict) -> "GPTConfig":
        kind = cfg.get("model_type")
        if kind != "gpt2":
            raise CheckpointError(f"config.json: model_type {kind!r} is not a GPT-2 model (expected 'gpt2')")
        act = cfg.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise CheckpointError(f"config.json: activation_function {act!r} is not supported "
                                  f"(supported: {', '.join(ACTIVATIONS)})")
        if cfg.get("add_cross_attention"):
            raise CheckpointError("config.json: add_cross_attention is not supported")
        try:
            c = cls(vocab_size=int(cfg["vocab_size"]), n_positions=int(cfg["n_positions"]),
                    n_embd=int(cfg["n_embd"]), n_layer=int(cfg["n_layer"]), n_head=int(cfg["n_head"]),
                    n_inner=cfg.get("n_inner"), layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
                    activation=ACTIVATIONS[act], scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
                    scale_attn_by_inverse_layer_idx=bool(cfg.get("scale_attn_by_inverse_layer_idx", False)),
                    eos_token_id=int(cfg.get("eos_token_id", 50256)))
        except KeyError as e:
            raise CheckpointError(f"config.json: missing {e.args[0]}") from None
        if c.n_embd % c.n_head:
            raise CheckpointError(f"config.json: n_embd {c.n_embd} is not a multiple of n_head {c.n_head}")
        return c
