"""The decoder-only language model skeleton both families share, its decoder block and static-shape KV cache.

A family subclasses `CausalLM`, passing its config and a factory for its `DecoderLayer`s, and overrides `embed` /
`unembed` where it differs (Gemma scales embeddings and soft-caps logits). `CausalLM.__call__` handles positions,
padding masks, sliding windows and the cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_neuronmm import decoder_math
from jax_neuronmm.explicit_sharding import typed_alike
from jax_neuronmm.models.layers import Attention, AttentionSpec, GatedMLP, RMSNorm, attention_mask, linear
from jax_neuronmm.models.validation import check_param_dtype, check_token_ids


def hf_decoder_fields(hf: Mapping[str, Any]) -> dict:
    """The config fields every family reads alike from a parsed HF config.json: sizes, head counts, RMSNorm eps,
    attention bias and context length (head_dim defaults to hidden / heads, kv heads to heads)."""
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    max_positions = hf.get("max_position_embeddings")
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=None if max_positions is None else int(max_positions),
    )


def eos_token_ids_of(hf: Mapping[str, Any]) -> tuple[int, ...]:
    """The end-of-sequence ids a parsed HF config.json names (top level or text_config), as a tuple (maybe empty)."""
    eos = hf.get("eos_token_id", (hf.get("text_config") or {}).get("eos_token_id"))
    return tuple(int(i) for i in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer in fixed-size slot arrays (one static shape for the whole generation).

    keys, values: all layers stacked, [L, B, S, kv_heads, head_dim] (one array each, so a decode step over all
    layers updates them in place). slot_valid [B, S] bool: slot holds a real (non-pad) token.
    slot_positions [B, S] int32: that token's position. length: int32 scalar, slots written so far (the next write
    goes to slot `length`; all rows write the same slot, padding is expressed through slot_valid).
    """

    keys: jax.Array
    values: jax.Array
    slot_valid: jax.Array
    slot_positions: jax.Array
    length: jax.Array

    @property
    def max_length(self) -> int:
        return self.slot_valid.shape[1]

    def key_slots(self, positions: jax.Array, token_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(slot_valid, slot_positions) [B, S] once this call's tokens (positions, token_mask [B, T]) are written
        at slots [length, length + T)."""
        start = (0, self.length)
        return (
            jax.lax.dynamic_update_slice(*typed_alike(self.slot_valid, token_mask), start),
            jax.lax.dynamic_update_slice(*typed_alike(self.slot_positions, positions), start),
        )


@dataclasses.dataclass(frozen=True)
class LayerVariant:
    """How a family's decoder block differs from the plain pre-norm block: its RMSNorm eps and (1 + w) offset,
    biases, QK-norm eps (None: no QK-norms), MLP activation and Gemma 3's sandwich norms."""

    norm_eps: float
    norm_unit_offset: bool
    attention_bias: bool
    qk_norm_eps: float | None
    activation: str
    mlp_bias: bool
    sandwich: bool


class DecoderLayer(nnx.Module):
    """One pre-norm decoder block; `layer(x [B, T, hidden], positions, mask, kv, write_index) -> (x, kv)`:

        x = x + attn(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))

    With `sandwich` (Gemma 3) the attention and MLP outputs are normed as well:

        x = x + post_attention_layernorm(attn(input_layernorm(x)))
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    """

    def __init__(self, hidden: int, intermediate: int, spec: AttentionSpec, variant: LayerVariant, *, dtype, rngs):
        norm = dict(eps=variant.norm_eps, unit_offset=variant.norm_unit_offset, param_dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, **norm)
        # QK-norms are RMSNorms of the family's kind: (1 + w) for Gemma 3, w for Qwen3.
        self.self_attn = Attention(
            hidden,
            spec,
            use_bias=variant.attention_bias,
            qk_norm_eps=variant.qk_norm_eps,
            qk_norm_unit_offset=variant.norm_unit_offset,
            dtype=dtype,
            rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(hidden, **norm)
        if variant.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, **norm)
            self.post_feedforward_layernorm = RMSNorm(hidden, **norm)
        self.mlp = GatedMLP(
            hidden, intermediate, activation=variant.activation, use_bias=variant.mlp_bias, dtype=dtype, rngs=rngs
        )
        self.sandwich = variant.sandwich

    def norms(self) -> tuple[RMSNorm, ...]:
        """The hidden-size norms in `decoder_math.decoder_layer` order (2, or 4 with sandwich)."""
        names = ("input_layernorm", "post_attention_layernorm")
        if self.sandwich:
            names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        return tuple(getattr(self, name) for name in names)

    def __call__(self, x, positions, mask, kv, write_index):
        return decoder_math.decoder_layer(
            x,
            norms=self.norms(),
            attention=lambda h: self.self_attn(h, positions, mask, kv, write_index),
            mlp=self.mlp,
            sandwich=self.sandwich,
        )


class CausalLM(nnx.Module):
    """Base for decoder-only LMs: token embeddings, `config.num_layers` decoder layers, a final RMSNorm, and an
    LM head (None when `config.tie_word_embeddings`: logits then come from the embedding matrix).

    make_layer(index, rngs) builds layer `index`. The parts are created in that order (embeddings, layers, norm,
    head), which fixes how `rngs` (default `nnx.Rngs(0)`) is consumed. `dtype` is the parameter and activation
    dtype. `tokenizer` (a `tokenizers.Tokenizer` or None) and `eos_token_ids` (a tuple, maybe empty) are what a
    checkpoint ships with; the loaders pass them, random-init models have none.
    """

    def __init__(
        self,
        config,
        make_layer,
        *,
        norm_unit_offset: bool,
        dtype,
        rngs: nnx.Rngs | None,
        tokenizer=None,
        eos_token_ids=(),
    ):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = jnp.dtype(check_param_dtype(type(self).__name__, dtype))
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        bad_eos = [i for i in self.eos_token_ids if not 0 <= i < config.vocab_size]
        if bad_eos:
            raise ValueError(f"eos_token_ids: got {bad_eos}, expected ids in [0, {config.vocab_size})")
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.layers = nnx.List([make_layer(i, rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, unit_offset=norm_unit_offset, param_dtype=dtype
        )
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """Hidden states [B, T, hidden] of token_ids [B, T]."""
        return self.embed_tokens(token_ids)

    def unembed(self, hidden: jax.Array) -> jax.Array:
        """Logits [B, T, vocab] of final-normed hidden states [B, T, hidden]."""
        if self.lm_head is None:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden)

    def attention_specs(self):
        """One `AttentionSpec` per layer."""
        return [layer.self_attn.spec for layer in self.layers]

    def init_cache(self, batch: int, max_length: int) -> KVCache:
        """An empty cache of `max_length` slots for `batch` sequences, in the model's dtype."""
        specs = self.attention_specs()
        if len({(spec.num_kv_heads, spec.head_dim) for spec in specs}) != 1:
            raise ValueError("layers: every layer needs the same kv heads and head_dim for one stacked KV cache")
        shape = (len(specs), batch, max_length, specs[0].num_kv_heads, specs[0].head_dim)
        return KVCache(
            keys=jnp.zeros(shape, self.dtype),
            values=jnp.zeros(shape, self.dtype),
            slot_valid=jnp.zeros((batch, max_length), bool),
            slot_positions=jnp.zeros((batch, max_length), jnp.int32),
            length=jnp.zeros((), jnp.int32),
        )

    def __call__(
        self,
        token_ids: jax.Array,
        *,
        positions: jax.Array | None = None,
        token_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        logits_at: jax.Array | None = None,
    ):
        """Logits [B, T, vocab] for token_ids [B, T] (int).

        logits_at [B] int: only the logits at that column of each row, [B, 1, vocab] (prefill needs just the
        last real token's; unembedding every position over the vocabulary would be wasted).

        positions [B, T]: token positions (default 0..T-1, or continuing after the cache's valid tokens is the
        caller's job). token_mask [B, T] bool: False marks padding (such tokens are never attended to; their own
        logits are meaningless). With a cache, returns (logits, updated cache) and writes this call's tokens at
        slots [cache.length, cache.length + T).

        Concrete token_ids outside [0, vocab_size) raise ValueError (under jit the ids are abstract and unchecked:
        `generate` checks its prompts before tracing).
        """
        if not isinstance(token_ids, jax.core.Tracer):
            check_token_ids(token_ids, self.config.vocab_size, name="token_ids")
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim != 2 or not jnp.issubdtype(token_ids.dtype, jnp.integer):
            raise ValueError(f"token_ids: got shape {token_ids.shape} dtype {token_ids.dtype}, expected int [B, T]")
        batch, tokens = token_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
        positions = jnp.asarray(positions, jnp.int32)
        token_mask = jnp.ones((batch, tokens), bool) if token_mask is None else jnp.asarray(token_mask, bool)
        for name, array in (("positions", positions), ("token_mask", token_mask)):
            if array.shape != (batch, tokens):
                raise ValueError(f"{name}: got shape {array.shape}, expected {(batch, tokens)} like token_ids")

        if cache is None:
            key_valid, key_positions, write_index = token_mask, positions, None
        else:
            write_index = cache.length
            key_valid, key_positions = cache.key_slots(positions, token_mask)

        masks = {}
        x = self.embed(token_ids)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            window = layer.self_attn.spec.sliding_window
            if window not in masks:
                masks[window] = attention_mask(positions, key_positions, key_valid, window)
            kv = None if cache is None else (cache.keys[i], cache.values[i])
            x, (k, v) = layer(x, positions, masks[window], kv, write_index)
            new_keys.append(k)
            new_values.append(v)
        if logits_at is not None:
            x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)
        logits = self.unembed(self.norm(x))
        if cache is None:
            return logits
        new_cache = KVCache(
            keys=jnp.stack(new_keys),
            values=jnp.stack(new_values),
            slot_valid=key_valid,
            slot_positions=key_positions,
            length=cache.length + tokens,
        )
        return logits, new_cache
