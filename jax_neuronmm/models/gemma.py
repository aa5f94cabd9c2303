"""Gemma 1 and Gemma 3 (text): (1 + w) RMSNorm in fp32, GELU-tanh MLP, embeddings scaled by sqrt(hidden).

Gemma 3 adds QK-norm, pre/post "sandwich" norms around attention and MLP, sliding-window layers (per
`layer_types`) with their own RoPE base, query scaling by `query_pre_attn_scalar`, and optional logit soft-capping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_neuronmm import decoder_math
from jax_neuronmm.models.decoder import CausalLM, DecoderLayer, LayerVariant, hf_decoder_fields
from jax_neuronmm.models.layers import AttentionSpec, RopeConfig

VARIANTS = ("gemma", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    variant: str  # "gemma" (Gemma 1) or "gemma3_text"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    rope: RopeConfig = RopeConfig(theta=10000.0)  # full-attention layers
    local_rope: RopeConfig | None = None  # sliding-window layers (Gemma 3)
    layer_types: tuple[str, ...] | None = None  # per layer, from LAYER_TYPES; None = all full
    sliding_window: int | None = None
    query_pre_attn_scalar: float | None = None  # None: scale queries by head_dim ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int | None = None  # the context length; None: unknown (generate does not check it)

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant: got {self.variant!r}, expected one of {VARIANTS}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types: got {len(self.layer_types)} entries, expected num_layers={self.num_layers}"
                )
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"layer_types: got {sorted(unknown)}, expected entries from {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_window: must be set when layer_types has sliding_attention layers")

    @property
    def is_gemma3(self) -> bool:
        return self.variant == "gemma3_text"

    def layer_type(self, index: int) -> str:
        return "full_attention" if self.layer_types is None else self.layer_types[index]

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> GemmaConfig:
        """From a parsed HF config.json of model_type "gemma" or "gemma3_text"."""
        model_type = hf.get("model_type")
        if model_type not in VARIANTS:
            raise ValueError(f"model_type: got {model_type!r}, expected one of {VARIANTS}")
        common = dict(hf_decoder_fields(hf), tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))
        if model_type == "gemma":
            act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
            # Gemma 1 releases say "gelu" but were trained with the tanh approximation (HF maps it the same way).
            act = "gelu_pytorch_tanh" if act == "gelu" else act
            rope_params = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0)}
            return cls(variant="gemma", hidden_act=act, rope=RopeConfig.from_hf(rope_params, 10000.0), **common)
        return cls(variant="gemma3_text", **_gemma3_fields(hf), **common)

    @classmethod
    def preset(cls, name: str, **overrides) -> GemmaConfig:
        """Random-init shapes: "gemma-tiny", "gemma-2b" (Gemma 1 2B), "gemma3-tiny", "gemma3-270m" (Gemma 3
        270M) and "gemma3-1b" (Gemma 3 1B), as their published config.json files give them."""

        def gemma3_pattern(layers):  # five sliding-window layers, then one full-attention layer
            return tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))

        gemma3_common = dict(
            variant="gemma3_text",
            vocab_size=262144,
            num_heads=4,
            num_kv_heads=1,
            head_dim=256,
            rope=RopeConfig(theta=1e6),
            local_rope=RopeConfig(theta=1e4),
            sliding_window=512,
            query_pre_attn_scalar=256,
            max_position_embeddings=32768,
        )
        presets = {
            "gemma-tiny": dict(
                variant="gemma",
                vocab_size=512,
                hidden_size=128,
                intermediate_size=384,
                num_layers=2,
                num_heads=4,
                num_kv_heads=1,
                head_dim=32,
                max_position_embeddings=512,
            ),
            "gemma-2b": dict(
                variant="gemma",
                vocab_size=256000,
                hidden_size=2048,
                intermediate_size=16384,
                num_layers=18,
                num_heads=8,
                num_kv_heads=1,
                head_dim=256,
                max_position_embeddings=8192,
            ),
            "gemma3-tiny": dict(
                variant="gemma3_text",
                vocab_size=512,
                hidden_size=128,
                intermediate_size=384,
                num_layers=3,
                num_heads=4,
                num_kv_heads=2,
                head_dim=32,
                rope=RopeConfig(theta=1e6),
                local_rope=RopeConfig(theta=1e4),
                sliding_window=8,
                query_pre_attn_scalar=32,
                layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                max_position_embeddings=512,
            ),
            "gemma3-270m": dict(
                gemma3_common,
                hidden_size=640,
                intermediate_size=2048,
                num_layers=18,
                layer_types=gemma3_pattern(18),
            ),
            "gemma3-1b": dict(
                gemma3_common,
                hidden_size=1152,
                intermediate_size=6912,
                num_layers=26,
                layer_types=gemma3_pattern(26),
            ),
        }
        if name not in presets:
            raise ValueError(f"preset: got {name!r}, expected one of {sorted(presets)}")
        fields = {**presets[name], **overrides}
        if "num_layers" in overrides and fields.get("layer_types") is not None:
            pattern = presets[name]["layer_types"]
            fields["layer_types"] = tuple(pattern[i % len(pattern)] for i in range(fields["num_layers"]))
        return cls(**fields)


def _gemma3_fields(hf: Mapping[str, Any]) -> dict:
    """The Gemma-3-specific fields of an HF gemma3_text config (old and new rope layouts)."""
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = int(hf.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    rope_params = hf.get("rope_parameters")
    if rope_params and "full_attention" in rope_params:
        global_params = rope_params.get("full_attention") or {}
        local_params = rope_params.get("sliding_attention") or {}
    else:
        global_params = dict(rope_params or hf.get("rope_scaling") or {})
        global_params.setdefault("rope_theta", hf.get("rope_theta", 1e6))
        local_params = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: got True, only causal Gemma 3 text models are supported")
    return dict(
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        rope=RopeConfig.from_hf(global_params, 1e6),
        local_rope=RopeConfig.from_hf(local_params, 1e4),
        layer_types=tuple(layer_types),
        sliding_window=hf.get("sliding_window"),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
    )


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, config: GemmaConfig, index: int, *, dtype, rngs: nnx.Rngs):
        sliding = config.layer_type(index) == "sliding_attention"
        scalar = config.query_pre_attn_scalar if config.query_pre_attn_scalar is not None else config.head_dim
        spec = AttentionSpec(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            scaling=float(scalar) ** -0.5,
            rope=config.local_rope if sliding else config.rope,
            sliding_window=config.sliding_window if sliding else None,
            logit_softcap=config.attn_logit_softcapping,
        )
        super().__init__(
            config.hidden_size,
            config.intermediate_size,
            spec,
            LayerVariant(
                norm_eps=config.rms_norm_eps,
                norm_unit_offset=True,
                attention_bias=config.attention_bias,
                qk_norm_eps=config.rms_norm_eps if config.is_gemma3 else None,
                activation=config.hidden_act,
                mlp_bias=False,
                sandwich=config.is_gemma3,
            ),
            dtype=dtype,
            rngs=rngs,
        )


class Gemma(CausalLM):
    """Gemma 1 / Gemma 3 text causal LM: `model(token_ids [B, T]) -> logits [B, T, vocab]`."""

    def __init__(
        self, config: GemmaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, tokenizer=None, eos_token_ids=()
    ):
        super().__init__(
            config,
            lambda index, rngs: GemmaDecoderLayer(config, index, dtype=dtype, rngs=rngs),
            norm_unit_offset=True,
            dtype=dtype,
            rngs=rngs,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
        )

    def embed(self, token_ids: jax.Array) -> jax.Array:
        # sqrt(hidden) is rounded to the parameter dtype first, as the reference implementation does.
        scale = jnp.asarray(self.config.hidden_size**0.5, self.dtype)
        return super().embed(token_ids) * scale

    def unembed(self, hidden: jax.Array) -> jax.Array:
        return decoder_math.soft_cap(super().unembed(hidden), self.config.final_logit_softcapping)
