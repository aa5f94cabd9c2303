"""The decoder-only language model skeleton both families share, and its static-shape KV cache.

A family subclasses `CausalLM` and provides `embed`, `layers` (each `layer(x, positions, mask, kv, write_index)`),
`norm` and `unembed`. `CausalLM.__call__` handles positions, padding masks, sliding windows and the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_neuronmm.models.layers import attention_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer in fixed-size slot arrays (one static shape for the whole generation).

    keys, values: per layer [B, S, kv_heads, head_dim]. slot_valid [B, S] bool: slot holds a real (non-pad) token.
    slot_positions [B, S] int32: that token's position. length: int32 scalar, slots written so far (the next write
    goes to slot `length`; all rows write the same slot, padding is expressed through slot_valid).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    slot_valid: jax.Array
    slot_positions: jax.Array
    length: jax.Array

    @property
    def max_length(self) -> int:
        return self.slot_valid.shape[1]


class CausalLM(nnx.Module):
    """Base for decoder-only LMs. Subclasses set self.config, self.compute_dtype, self.layers, self.norm and define
    embed/unembed."""

    tokenizer = None  # a `tokenizers.Tokenizer` when loaded from a checkpoint that ships tokenizer.json
    eos_token_ids: tuple[int, ...] = ()  # from the checkpoint config, when loaded from one

    def embed(self, token_ids: jax.Array) -> jax.Array:
        raise NotImplementedError

    def unembed(self, hidden: jax.Array) -> jax.Array:
        raise NotImplementedError

    def attention_specs(self):
        """One `AttentionSpec` per layer."""
        return [layer.self_attn.spec for layer in self.layers]

    @property
    def dtype(self):
        """Parameter and activation dtype chosen at construction."""
        return self.compute_dtype

    def init_cache(self, batch: int, max_length: int) -> KVCache:
        """An empty cache of `max_length` slots for `batch` sequences, in the model's dtype."""
        keys, values = [], []
        for spec in self.attention_specs():
            shape = (batch, max_length, spec.num_kv_heads, spec.head_dim)
            keys.append(jnp.zeros(shape, self.dtype))
            values.append(jnp.zeros(shape, self.dtype))
        return KVCache(
            keys=tuple(keys),
            values=tuple(values),
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
    ):
        """Logits [B, T, vocab] for token_ids [B, T] (int).

        positions [B, T]: token positions (default 0..T-1, or continuing after the cache's valid tokens is the
        caller's job). token_mask [B, T] bool: False marks padding (such tokens are never attended to; their own
        logits are meaningless). With a cache, returns (logits, updated cache) and writes this call's tokens at
        slots [cache.length, cache.length + T).
        """
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
            key_valid = jax.lax.dynamic_update_slice(cache.slot_valid, token_mask, (0, write_index))
            key_positions = jax.lax.dynamic_update_slice(cache.slot_positions, positions, (0, write_index))

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
        logits = self.unembed(self.norm(x))
        if cache is None:
            return logits
        new_cache = KVCache(
            keys=tuple(new_keys),
            values=tuple(new_values),
            slot_valid=key_valid,
            slot_positions=key_positions,
            length=cache.length + tokens,
        )
        return logits, new_cache
