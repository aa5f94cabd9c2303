"""Building blocks shared by the Llama, Gemma and Qwen3 families (Flax NNX).

The math lives in `jax_neuronmm.decoder_math` (shared with the decode-step primitive); these modules hold the
parameters and call it. Layouts: activations are [batch, tokens, features]; a linear layer's kernel is
[in_features, out_features]
(x @ kernel), the transpose of a PyTorch `nn.Linear.weight`. Attention heads are [batch, tokens, heads, head_dim].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_neuronmm import decoder_math
from jax_neuronmm.compress.projections import MLP_PROJECTIONS
from jax_neuronmm.reference import jnp_activation
from nki_kernels.activations import FUSED_ACTIVATIONS, HF_ACTIVATIONS

ROPE_KINDS = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: base `theta` and an optional frequency scaling (`kind`)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope_type: got {self.kind!r}, expected one of {ROPE_KINDS}")

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None, default_theta: float) -> RopeConfig:
        """From an HF rope dict (`rope_parameters`, or legacy `rope_scaling` plus `rope_theta`)."""
        params = dict(params or {})
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        theta = float(params.get("rope_theta", default_theta))
        if kind == "default":
            return cls(theta=theta)
        if kind == "linear":
            return cls(theta=theta, kind=kind, factor=float(params["factor"]))
        if kind == "llama3":
            return cls(
                theta=theta,
                kind=kind,
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position=int(params["original_max_position_embeddings"]),
            )
        raise ValueError(f"rope_type: got {kind!r}, expected one of {ROPE_KINDS}")

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        """[head_dim // 2] float32 inverse frequencies, computed as HF computes them (float32 powers)."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv_freq = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.kind == "linear":
            return (inv_freq / np.float32(self.factor)).astype(np.float32)
        if self.kind == "llama3":
            low_freq_wavelen = self.original_max_position / self.low_freq_factor
            high_freq_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            return np.where(is_medium, smoothed, scaled).astype(np.float32)
        return inv_freq


def rope_tables(positions: jax.Array, rope: RopeConfig, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, head_dim] float32 of positions [B, T] under `rope` (rotate-half, as HF checkpoints use)."""
    return decoder_math.rope_tables(positions, rope.inverse_frequencies(head_dim))


def activation_fn(name: str):
    """The jnp function of an HF `hidden_act` name."""
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"hidden_act: got {name!r}, expected one of {tuple(HF_ACTIVATIONS)}")
    return jnp_activation(HF_ACTIVATIONS[name])


class RMSNorm(nnx.Module):
    """RMS normalization over the last axis.

    unit_offset=False (Llama): weight * normalize(x in fp32).astype(x.dtype).
    unit_offset=True (Gemma): (normalize(x) * (1 + weight)) all in fp32, then cast to x.dtype; weight starts at 0.
    """

    def __init__(self, dim: int, *, eps: float, unit_offset: bool, param_dtype=jnp.float32):
        self.eps = float(eps)
        self.unit_offset = bool(unit_offset)
        init = jnp.zeros if unit_offset else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return decoder_math.rms_norm(x, self.weight[...], eps=self.eps, unit_offset=self.unit_offset)


def linear(in_features: int, out_features: int, *, use_bias: bool, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """Linear layer with kernel [in_features, out_features] in `dtype` (parameters and compute)."""
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


class GatedMLP(nnx.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)); x [..., hidden] -> [..., hidden].

    The three projections are separate submodules (kernels [hidden, intermediate] and [intermediate, hidden]) so
    that compression can replace the projections, or the whole MLP, with low-rank modules of the same interface.
    """

    def __init__(self, hidden: int, intermediate: int, *, activation: str, use_bias: bool, dtype, rngs: nnx.Rngs):
        activation_fn(activation)  # validate early
        self.activation = activation
        self.gate_proj = linear(hidden, intermediate, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.up_proj = linear(hidden, intermediate, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.down_proj = linear(intermediate, hidden, use_bias=use_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return decoder_math.gated_mlp(
            x,
            gate_proj=self.gate_proj,
            up_proj=self.up_proj,
            down_proj=self.down_proj,
            activation=HF_ACTIVATIONS[self.activation],
        )


def fused_mlp_activation(mlp: GatedMLP):
    """svd_mlp's activation name when `mlp` can become one fused SVDMLP (no biases, SiLU or GELU-tanh), else None.
    Compression and checkpoint loading both ask, so a loaded model has the structure compression gave it."""
    if any(getattr(mlp, name).bias is not None for name in MLP_PROJECTIONS):
        return None
    # An MLP whose activation the kernels do not apply is compressed projection by projection.
    activation = HF_ACTIVATIONS.get(mlp.activation)
    return activation if activation in FUSED_ACTIVATIONS else None


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    rope: RopeConfig
    sliding_window: int | None = None
    logit_softcap: float | None = None


def attention_mask(
    query_positions: jax.Array, key_positions: jax.Array, key_valid: jax.Array, sliding_window: int | None
) -> jax.Array:
    """[B, T, S] bool: key s is visible to query t.

    Causality and windows are decided on token positions (not slots), so any padding layout works: a key is visible
    when it holds a real token at a position <= the query's and, with a window W, within W - 1 positions of it.
    """
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    visible = key_valid[:, None, :] & (k <= q)
    if sliding_window is not None:
        visible = visible & (q - k < sliding_window)
    return visible


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional QK-norm and a static-shape KV cache.

    q/k/v/o projections have kernels [hidden, heads*head_dim] ([heads*head_dim, hidden] for o_proj). The QK-norms
    (with qk_norm_eps) are RMSNorms over head_dim, (1 + w) with qk_norm_unit_offset (Gemma 3), w without (Qwen3).
    """

    def __init__(
        self,
        hidden: int,
        spec: AttentionSpec,
        *,
        use_bias: bool,
        qk_norm_eps: float | None,
        qk_norm_unit_offset: bool = True,
        dtype,
        rngs: nnx.Rngs,
    ):
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({spec.num_heads}) must be a multiple of num_key_value_heads "
                f"({spec.num_kv_heads})"
            )
        self.spec = spec
        q_features = spec.num_heads * spec.head_dim
        kv_features = spec.num_kv_heads * spec.head_dim
        self.q_proj = linear(hidden, q_features, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.k_proj = linear(hidden, kv_features, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.v_proj = linear(hidden, kv_features, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.o_proj = linear(q_features, hidden, use_bias=use_bias, dtype=dtype, rngs=rngs)
        if qk_norm_eps is None:
            self.q_norm = None
            self.k_norm = None
        else:
            norm = dict(eps=qk_norm_eps, unit_offset=qk_norm_unit_offset, param_dtype=dtype)
            self.q_norm = RMSNorm(spec.head_dim, **norm)
            self.k_norm = RMSNorm(spec.head_dim, **norm)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None,
        write_index: jax.Array | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [B, T, hidden], positions [B, T], mask [B, T, S].

        Without a cache (kv None) S == T and the keys are this call's tokens. With a cache, kv holds
        ([B, S, kv_heads, head_dim],) * 2 and this call's keys/values are written at slots
        [write_index, write_index + T). Returns (output [B, T, hidden], (keys, values)).
        """
        spec = self.spec
        cos, sin = rope_tables(positions, spec.rope, spec.head_dim)
        projections = decoder_math.AttentionProjections(
            self.q_proj, self.k_proj, self.v_proj, self.o_proj, q_norm=self.q_norm, k_norm=self.k_norm
        )
        geometry = decoder_math.AttentionGeometry(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scaling, logit_softcap=spec.logit_softcap
        )
        return decoder_math.self_attention(
            x,
            projections,
            geometry,
            cos=cos,
            sin=sin,
            bias=decoder_math.mask_bias(mask),
            kv=kv,
            write_index=write_index,
        )
