"""The math of one decoder layer as pure jnp functions, written once for the models and the decode-step primitive.

The NNX models and `decode_step`'s XLA lowering both call these, so a decode step computes what the model's own
forward computes. Projections, norms and the MLP come in as callables (an NNX submodule, or a closure over one
layer's slice of stacked weights), which keeps compression's input recorders and factored modules working.
Layouts: activations [B, T, features]; heads [B, T, heads, head_dim]; caches [B, S, kv_heads, head_dim]; RoPE
tables [B, T, head_dim] float32; mask biases [B, T, S] float32 (0 visible, float32 min hidden).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_neuronmm.explicit_sharding import reshape, split_alike, typed_alike
from jax_neuronmm.reference import jnp_activation
from jax_neuronmm.shapes import accumulation_dtype, fp8_read

MASKED = float(jnp.finfo(jnp.float32).min)  # the bias of an invisible key: a row with no visible key stays finite


def rms_norm(x, weight, *, eps: float, unit_offset: bool):
    """RMS normalization of x [..., F] over its last axis with weight [F].

    unit_offset=False (Llama): weight * normalize(x in fp32).astype(x.dtype).
    unit_offset=True (Gemma): (normalize(x) * (1 + weight)) all in fp32, then cast to x.dtype.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def linear(x, kernel):
    """x [..., K] @ kernel [K, N] in x's dtype (as `nnx.Linear` without bias computes it)."""
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def scaled_linear(x, kernel, scale, *, precision=None):
    """(x [..., K] @ kernel [K, N])·diag(scale [N]) in x's dtype, for fp8 kernels with float32 per-column scales:
    kernel widened to x's dtype (exact for fp8; NaN beyond ±240, as Trainium reads it: `shapes.fp8_read`),
    products summed in float32 (float64 for float64 x), the sum scaled, then rounded to x's dtype: what the NKI
    kernels compute as they evict PSUM."""
    acc = accumulation_dtype(x.dtype)
    y = lax.dot_general(
        x,
        fp8_read(kernel).astype(x.dtype),
        (((x.ndim - 1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=acc,
    )
    return (y * scale.astype(acc)).astype(x.dtype)


def rope_tables(positions, inverse_frequencies):
    """(cos, sin) [B, T, head_dim] float32 of positions [B, T] and inverse frequencies [head_dim // 2]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies, jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate x [B, T, heads, head_dim] by tables [B, T, head_dim] (rounded to x's dtype first)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :].astype(x.dtype) + rotated * sin[:, :, None, :].astype(x.dtype)


def mask_bias(visible):
    """[..., T, S] float32 additive attention bias of a bool visibility mask: 0 visible, MASKED not."""
    return jnp.where(visible, jnp.float32(0), jnp.float32(MASKED))


def attend(q, keys, values, bias, *, scaling: float, logit_softcap: float | None):
    """Grouped-query attention of q [B, T, heads, D] over keys / values [B, S, kv_heads, D] -> [B, T, heads·D].

    Scores (q·k)·scaling in q's dtype, then float32: soft-capped (tanh(s / cap)·cap) when logit_softcap is set,
    plus bias [B, T, S]; softmax over S; weights rounded to q's dtype. Query head h reads kv head h // G.
    """
    batch, tokens, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    groups = num_heads // num_kv_heads
    q = split_alike(reshape(q, (batch, tokens, num_kv_heads, groups, head_dim)), (0, 2), keys, (0, 2))
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys.astype(q.dtype)) * jnp.asarray(scaling, q.dtype)
    scores = scores.astype(jnp.float32)
    scores = soft_cap(scores, logit_softcap)
    weights = jax.nn.softmax(scores + bias[:, None, None, :, :], axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, values.astype(q.dtype))
    return reshape(out, (batch, tokens, num_heads * head_dim))


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """Layer `layer`'s K/V in a paged cache, for `self_attention`'s kv: k_pool, v_pool [L, num_blocks,
    block_size, kv_heads, D] as they were before this call (blocks shared by all rows); read_slots [B, S] the flat slot
    (block·block_size + offset) of each key a row reads, through its block table; write_columns [B, T] the column
    of that read view where each of this call's tokens goes (S for a token not written: padding, inactive rows).

    The pools are only read here; the caller writes every layer's new K/V into them once, after the last layer,
    so the pools update in place instead of being copied layer by layer."""

    k_pool: jax.Array
    v_pool: jax.Array
    layer: int
    read_slots: jax.Array
    write_columns: jax.Array

    def read(self, k, v):
        """Each row's keys and values [B, S, kv_heads, D]: its cached ones gathered through the table, with this
        call's k / v [B, T, kv_heads, D] (rounded to the pool dtype, as they will be stored) in their columns."""
        rows = jnp.arange(k.shape[0])[:, None]
        views = []
        for pool, new in ((self.k_pool, k), (self.v_pool, v)):
            block_size = pool.shape[2]
            # One gather from the whole pool (no per-layer slice, no reshape: the pool stays in place).
            view = pool[self.layer, self.read_slots // block_size, self.read_slots % block_size]
            views.append(view.at[rows, self.write_columns].set(new.astype(pool.dtype), mode="drop"))
        return views


@dataclasses.dataclass(frozen=True)
class AttentionProjections:
    """One attention layer's weights as callables x -> x·W (an NNX submodule, or a closure over a layer's slice of
    stacked weights), and its optional per-head q / k norms over head_dim (both or neither)."""

    q: Callable
    k: Callable
    v: Callable
    o: Callable
    q_norm: Callable | None = None
    k_norm: Callable | None = None


@dataclasses.dataclass(frozen=True)
class AttentionGeometry:
    """Head layout and score scaling of one attention layer: query heads, grouped KV heads, head size, the factor
    the scores are multiplied by, and the soft-cap of the scores (None: none)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    logit_softcap: float | None = None


def self_attention(
    x, projections: AttentionProjections, geometry: AttentionGeometry, *, cos, sin, bias, kv, write_index
):
    """Self-attention of x [B, T, hidden] -> (output [B, T, hidden], (keys, values)).

    q/k/v projections, optional per-head q/k norms (over head_dim), RoPE from cos / sin, then attention over the
    keys: with kv None this call's own keys (S == T); with kv = (keys, values) [B, S, kv_heads, D] this call's
    keys / values are first written at slots [write_index, write_index + T); with a `PagedKV` each row reads its
    keys through its block table, this call's among them, and the returned kv is this call's (k, v) in the pool
    dtype, for the caller to write into the pools.
    bias [B, T, S].
    """
    batch, tokens, _ = x.shape
    heads, kv_heads, head_dim = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
    q = reshape(projections.q(x), (batch, tokens, heads, head_dim))
    k = reshape(projections.k(x), (batch, tokens, kv_heads, head_dim))
    v = reshape(projections.v(x), (batch, tokens, kv_heads, head_dim))
    if projections.q_norm is not None:
        q = projections.q_norm(q)
        k = projections.k_norm(k)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    scores = dict(scaling=geometry.scaling, logit_softcap=geometry.logit_softcap)
    if isinstance(kv, PagedKV):
        keys, values = kv.read(k, v)
        out = attend(q, keys, values, bias, **scores)
        return projections.o(out), (k.astype(kv.k_pool.dtype), v.astype(kv.v_pool.dtype))
    if kv is not None:
        zero = jnp.zeros((), jnp.asarray(write_index).dtype)  # one index dtype (Python 0 is int64 under x64)
        start = (zero, write_index, zero, zero)
        # Under Explicit mesh axes k / v come split like their projections; the cache keeps its own split.
        k = lax.dynamic_update_slice(*typed_alike(kv[0], k.astype(kv[0].dtype)), start)
        v = lax.dynamic_update_slice(*typed_alike(kv[1], v.astype(kv[1].dtype)), start)
    out = attend(q, k, v, bias, **scores)
    return projections.o(out), (k, v)


def gated_mlp(x, *, gate_proj: Callable, up_proj: Callable, down_proj: Callable, activation: str):
    """down_proj(act(gate_proj(x)) * up_proj(x)), everything in x's dtype; activation: an activations.py name."""
    return down_proj(jnp_activation(activation)(gate_proj(x)) * up_proj(x))


def decoder_layer(x, *, norms, attention: Callable, mlp: Callable, sandwich: bool):
    """One pre-norm decoder block x [B, T, hidden] -> (x, kv); attention(h) -> (y, kv), mlp(h) -> y.

    norms: callables (input, post_attention) or, with sandwich (Gemma 3), (input, post_attention, pre_feedforward,
    post_feedforward):
        x = x + attn(norms[0](x));             x = x + mlp(norms[1](x))
        x = x + norms[1](attn(norms[0](x)));   x = x + norms[3](mlp(norms[2](x)))    (sandwich)
    """
    attn_out, kv = attention(norms[0](x))
    if sandwich:
        x = x + norms[1](attn_out)
        x = x + norms[3](mlp(norms[2](x)))
    else:
        # Here norms[1] is the pre-MLP norm (Llama's and Gemma 1's post_attention_layernorm).
        x = x + attn_out
        x = x + mlp(norms[1](x))
    return x, kv


def soft_cap(x, cap: float | None):
    """tanh(x / cap)·cap, or x when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap
