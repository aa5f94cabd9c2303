"""Llama 3.x (also Llama 2 shapes): GQA, RoPE with optional llama3/linear scaling, tied or untied embeddings."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jax_neuronmm.models.decoder import CausalLM, DecoderLayer, LayerVariant, hf_decoder_fields
from jax_neuronmm.models.layers import AttentionSpec, RopeConfig


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig(theta=500000.0)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int | None = None  # the context length; None: unknown (generate does not check it)
    mlp_bias: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """From a parsed HF config.json of model_type "llama"."""
        rope_params = hf.get("rope_parameters") or {}
        if not rope_params:
            rope_params = dict(hf.get("rope_scaling") or {})
            rope_params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        return cls(
            **hf_decoder_fields(hf),
            rope=RopeConfig.from_hf(rope_params, default_theta=10000.0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=str(hf.get("hidden_act", "silu")),
        )

    @classmethod
    def preset(cls, name: str, **overrides) -> LlamaConfig:
        """Random-init shapes: "tiny" (tests, demos), "1b" (Llama-3.2-1B) or "8b" (Llama-3.1-8B)."""
        llama3_rope = RopeConfig(
            theta=500000.0,
            kind="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position=8192,
        )
        presets = {
            "tiny": dict(
                vocab_size=512,
                hidden_size=128,
                intermediate_size=384,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                head_dim=32,
                rope=llama3_rope,
                tie_word_embeddings=True,
                max_position_embeddings=512,
            ),
            "1b": dict(
                vocab_size=128256,
                hidden_size=2048,
                intermediate_size=8192,
                num_layers=16,
                num_heads=32,
                num_kv_heads=8,
                head_dim=64,
                rope=llama3_rope,
                tie_word_embeddings=True,
                max_position_embeddings=131072,
            ),
            "8b": dict(
                vocab_size=128256,
                hidden_size=4096,
                intermediate_size=14336,
                num_layers=32,
                num_heads=32,
                num_kv_heads=8,
                head_dim=128,
                rope=dataclasses.replace(llama3_rope, factor=8.0),
                tie_word_embeddings=False,
                max_position_embeddings=131072,
            ),
        }
        if name not in presets:
            raise ValueError(f"preset: got {name!r}, expected one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})


class LlamaDecoderLayer(DecoderLayer):
    """The Llama layer; with qk_norm, RMS norms (w * x) over each query and key head before RoPE (Qwen3's)."""

    def __init__(self, config, *, dtype, rngs: nnx.Rngs, qk_norm: bool = False):
        spec = AttentionSpec(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            scaling=config.head_dim**-0.5,
            rope=config.rope,
        )
        super().__init__(
            config.hidden_size,
            config.intermediate_size,
            spec,
            LayerVariant(
                norm_eps=config.rms_norm_eps,
                norm_unit_offset=False,
                attention_bias=config.attention_bias,
                qk_norm_eps=config.rms_norm_eps if qk_norm else None,
                activation=config.hidden_act,
                mlp_bias=config.mlp_bias,
                sandwich=False,
            ),
            dtype=dtype,
            rngs=rngs,
        )


class Llama(CausalLM):
    """Llama causal LM: `model(token_ids [B, T]) -> logits [B, T, vocab]` (see CausalLM.__call__ for the cache)."""

    def __init__(
        self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, tokenizer=None, eos_token_ids=()
    ):
        super().__init__(
            config,
            lambda index, rngs: LlamaDecoderLayer(config, dtype=dtype, rngs=rngs),
            norm_unit_offset=False,
            dtype=dtype,
            rngs=rngs,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
        )
