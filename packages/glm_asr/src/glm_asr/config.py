"""GLM-ASR hyperparameters, read from the checkpoint's config.json (never hard-coded)."""
from __future__ import annotations

from dataclasses import dataclass

from tilekernels.runtime import CheckpointError


@dataclass(frozen=True)
class EncoderConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_mel_bins: int
    rotary_dim: int
    rope_theta: float
    activation: str


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int


@dataclass(frozen=True)
class GlmAsrConfig:
    encoder: EncoderConfig
    decoder: DecoderConfig
    audio_token_id: int
    projector_activation: str
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict, generation: dict | None = None) -> "GlmAsrConfig":
        if cfg.get("model_type") != "glmasr":
            raise CheckpointError(f"config.json: model_type {cfg.get('model_type')!r} is not GLM-ASR "
                                  f"(expected 'glmasr')")
        try:
            a, t = cfg["audio_config"], cfg["text_config"]
            enc = _encoder(a)
            dec = _decoder(t)
            eos = _ids(t.get("eos_token_id")) + _ids(cfg.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id"))
            return cls(enc, dec, int(cfg.get("audio_token_id", 59260)), _act(cfg.get("projector_hidden_act", "gelu")),
                       bool(cfg.get("tie_word_embeddings", True)), tuple(dict.fromkeys(eos)))
        except KeyError as e:
            raise CheckpointError(f"config.json: missing {e.args[0]}") from None


def _ids(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _rope(c: dict) -> dict:
    rope = dict(c.get("rope_parameters") or {})
    rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"config.json: rope_type {rope['rope_type']!r} is not supported")
    return rope


def _act(name: str) -> str:
    acts = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}
    if name not in acts:
        raise CheckpointError(f"config.json: activation {name!r} is not supported")
    return acts[name]


def _encoder(a: dict) -> EncoderConfig:
    heads = int(a["num_attention_heads"])
    head_dim = int(a.get("head_dim") or a["hidden_size"] // heads)
    rope = _rope({**a, "partial_rotary_factor": a.get("partial_rotary_factor", 0.5)})
    return EncoderConfig(int(a["hidden_size"]), int(a["intermediate_size"]), int(a["num_hidden_layers"]), heads,
                         int(a.get("num_key_value_heads") or heads), head_dim, int(a.get("num_mel_bins", 128)),
                         int(head_dim * float(rope["partial_rotary_factor"])), float(rope["rope_theta"]),
                         _act(a.get("hidden_act", "gelu")))


def _decoder(t: dict) -> DecoderConfig:
    heads = int(t["num_attention_heads"])
    if t.get("model_type", "llama") != "llama":
        raise CheckpointError(f"config.json: text model {t.get('model_type')!r} is not supported (llama only)")
    if t.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: text hidden_act {t.get('hidden_act')!r} is not supported")
    return DecoderConfig(int(t["vocab_size"]), int(t["hidden_size"]), int(t["intermediate_size"]),
                         int(t["num_hidden_layers"]), heads, int(t.get("num_key_value_heads") or heads),
                         int(t.get("head_dim") or t["hidden_size"] // heads), float(t.get("rms_norm_eps", 1e-6)),
                         float(_rope(t)["rope_theta"]), int(t.get("max_position_embeddings", 8192)))
