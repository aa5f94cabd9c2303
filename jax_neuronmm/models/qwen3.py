"""Qwen3 (dense): GQA with a plain (w * x) RMSNorm over each query and key head before RoPE, SiLU gated MLP, no
attention bias by default, tied or untied LM head. Everything else is the shared decoder skeleton."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jax_neuronmm.models.decoder import CausalLM, hf_decoder_fields
from jax_neuronmm.models.layers import RopeConfig
from jax_neuronmm.models.llama import LlamaDecoderLayer


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig(theta=1e6)
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int | None = None  # the context length; None: unknown (generate does not check it)
    hidden_act: str = "silu"
    mlp_bias: bool = False  # Qwen3's MLPs have none; the field the Llama layer it shares reads

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Qwen3Config:
        """From a parsed HF config.json of model_type "qwen3". Sliding-window layers (use_sliding_window, or
        sliding_attention in layer_types) are refused: no released Qwen3 uses them."""
        layer_types = hf.get("layer_types") or ()
        if hf.get("use_sliding_window") or "sliding_attention" in layer_types:
            raise ValueError("use_sliding_window: Qwen3 sliding-window layers are not supported, expected false")
        rope_params = hf.get("rope_parameters") or {}
        if not rope_params:
            rope_params = dict(hf.get("rope_scaling") or {})
            rope_params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        return cls(
            **hf_decoder_fields(hf),
            rope=RopeConfig.from_hf(rope_params, default_theta=10000.0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            hidden_act=str(hf.get("hidden_act", "silu")),
        )

    @classmethod
    def preset(cls, name: str, **overrides) -> Qwen3Config:
        """Random-init shapes: "tiny" (tests, demos) or "0.6b" (Qwen3-0.6B)."""
        presets = {
            "tiny": dict(
                vocab_size=512,
                hidden_size=128,
                intermediate_size=384,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                head_dim=32,
                max_position_embeddings=512,
            ),
            "0.6b": dict(
                vocab_size=151936,
                hidden_size=1024,
                intermediate_size=3072,
                num_layers=28,
                num_heads=16,
                num_kv_heads=8,
                head_dim=128,
                max_position_embeddings=40960,
            ),
        }
        if name not in presets:
            raise ValueError(f"preset: got {name!r}, expected one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})


class Qwen3(CausalLM):
    """Qwen3 causal LM: `model(token_ids [B, T]) -> logits [B, T, vocab]` (see CausalLM.__call__ for the cache)."""

    def __init__(
        self, config: Qwen3Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, tokenizer=None, eos_token_ids=()
    ):
        super().__init__(
            config,
            lambda index, rngs: LlamaDecoderLayer(config, dtype=dtype, rngs=rngs, qk_norm=True),
            norm_unit_offset=False,
            dtype=dtype,
            rngs=rngs,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
        )
