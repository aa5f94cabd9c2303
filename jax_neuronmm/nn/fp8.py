"""Flax NNX modules with fp8 e4m3 weights and fp32 per-output-channel scales (inference only).

  Fp8Linear     y = (x·kernel)·diag(kernel_scale) + bias: a dense projection or LM head (`Fp8Linear.from_linear`,
                `Fp8Linear.from_embedding` for a tied head)
  Fp8SVDLinear  y = ((x·u)·diag(u_scale))·v·diag(v_scale) + bias through `svd_matmul` (`Fp8SVDLinear.from_svd`)
  Fp8SVDMLP     the gated MLP of three Fp8SVDLinear projections through the fused `svd_mlp` (`Fp8SVDMLP.from_svd`)

Weights are float8_e4m3fn holding Trainium's e4m3 values (±240), made by `compress.quantize_fp8` (float8_e4m3 arrays
are taken as the same bits; values beyond ±240 or NaN, and NaN / ±inf scales, are a ValueError); they and their
scales are `Fp8Weight` variables, not `nnx.Param`s, so optimizers and `nnx.grad` over Params leave them alone.
Fp8Linear computes with XLA ops (the fp8 values widened to the activations' dtype, exact; float32 sums, then the
scale): there is no dense fp8 NKI kernel yet. Fp8SVDLinear calls the fused primitive, kernels included.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_neuronmm.compress.quantize import quantize_fp8
from jax_neuronmm.decoder_math import scaled_linear
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear
from jax_neuronmm.shapes import FP8_DTYPE, check_fp8_contents, fp8_storage, is_fp8
from jax_neuronmm.svd_matmul import svd_matmul
from jax_neuronmm.svd_mlp import svd_mlp
from jax_neuronmm.weights import Factored


class Fp8Weight(nnx.Variable):
    """An fp8 weight or its float32 scales: saved and loaded with the model's state, never trained."""


def fp8_dense(x, kernel, kernel_scale, *, precision=None):
    """(x·kernel)·diag(kernel_scale): x [..., K] (float), kernel [K, N] fp8, kernel_scale [N] float32 → [..., N]
    in x's dtype; the fp8 values are widened to x's dtype (exactly) and the products summed in float32
    (`decoder_math.scaled_linear`, which the decode step's XLA lowering uses too)."""
    kernel = fp8_storage(kernel)
    if not is_fp8(kernel.dtype):
        raise TypeError(f"fp8_dense: kernel has dtype {kernel.dtype}; expected {FP8_DTYPE.name} or float8_e4m3")
    check_fp8_contents("fp8_dense", {"kernel": kernel, "kernel_scale": kernel_scale})
    return scaled_linear(x, kernel, kernel_scale, precision=precision)


def _checked_pair(op, name, values, scale, columns):
    """(values, scale) as JAX arrays, values in the fp8 storage dtype; TypeError for a wrong dtype or shape,
    ValueError for values known here beyond ±240 or NaN, or non-finite scales (`shapes.check_fp8_contents`)."""
    values, scale = fp8_storage(jnp.asarray(values)), jnp.asarray(scale)
    if not is_fp8(values.dtype) or values.ndim != 2:
        raise TypeError(
            f"{name}: got {values.dtype}{list(values.shape)}, expected a 2-D {FP8_DTYPE.name} (or float8_e4m3) array"
        )
    if scale.dtype != jnp.float32 or tuple(scale.shape) != (values.shape[1],):
        raise TypeError(
            f"{name}_scale: got {scale.dtype}{list(scale.shape)}, expected float32 [{values.shape[1]}] (one per "
            f"{columns})"
        )
    check_fp8_contents(op, {name: values, f"{name}_scale": scale})
    return values, scale


class Fp8Linear(nnx.Module):
    """y = (x·kernel)·diag(kernel_scale) + bias; x [..., in_features] → [..., out_features].

    kernel [in_features, out_features] fp8, kernel_scale [out_features] float32, bias [out_features] or None.
    dtype: the compute dtype (inputs are cast to it; None keeps the inputs' dtype).
    """

    def __init__(self, kernel, kernel_scale, bias=None, *, dtype=None, precision=None):
        kernel, kernel_scale = _checked_pair("Fp8Linear", "kernel", kernel, kernel_scale, "output feature")
        self.kernel = Fp8Weight(kernel)
        self.kernel_scale = Fp8Weight(kernel_scale)
        self.bias = nnx.Param(jnp.asarray(bias)) if bias is not None else nnx.data(None)
        self.in_features, self.out_features = kernel.shape
        self.dtype = dtype
        self.precision = precision

    def __call__(self, inputs):
        if self.dtype is not None:
            inputs = inputs.astype(self.dtype)
        y = fp8_dense(inputs, self.kernel[...], self.kernel_scale[...], precision=self.precision)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y

    @classmethod
    def from_linear(cls, linear: nnx.Linear) -> Fp8Linear:
        """`linear` with its kernel rounded to nearest per output feature (`compress.quantize_fp8`)."""
        if not isinstance(linear, nnx.Linear):
            raise TypeError(f"linear: got {type(linear).__name__}, expected an nnx.Linear")
        values, scale = quantize_fp8(linear.kernel[...])
        bias = linear.bias[...] if linear.bias is not None else None
        return cls(values, scale, bias, dtype=linear.dtype, precision=linear.precision)

    @classmethod
    def from_embedding(cls, embed: nnx.Embed, *, dtype=None) -> Fp8Linear:
        """The LM head of a tied embedding [vocab, hidden]: kernel = embeddingᵀ [hidden, vocab] in fp8 with one
        scale per vocabulary entry (logits = hidden · embeddingᵀ, as `nnx.Embed.attend`); dtype: the compute
        dtype, the embedding's by default."""
        values, scale = quantize_fp8(embed.embedding[...], axis=-2)
        return cls(values.T, scale, None, dtype=dtype if dtype is not None else embed.dtype)


class Fp8SVDLinear(nnx.Module):
    """y = ((x·u)·diag(u_scale))·v·diag(v_scale) + bias through `svd_matmul` (fused kernels on Trainium).

    u [in_features, rank] and v [rank, out_features] fp8, u_scale [rank] and v_scale [out_features] float32.
    """

    def __init__(self, u, v, u_scale, v_scale, bias=None, *, dtype=None, precision=None):
        u, u_scale = _checked_pair("Fp8SVDLinear", "u", u, u_scale, "rank")
        v, v_scale = _checked_pair("Fp8SVDLinear", "v", v, v_scale, "output feature")
        self.u, self.v = Fp8Weight(u), Fp8Weight(v)
        self.u_scale, self.v_scale = Fp8Weight(u_scale), Fp8Weight(v_scale)
        self.bias = nnx.Param(jnp.asarray(bias)) if bias is not None else nnx.data(None)
        self.in_features, self.rank = u.shape
        self.out_features = v.shape[1]
        self.dtype = dtype
        self.precision = precision

    def __call__(self, inputs):
        if self.dtype is not None:
            inputs = inputs.astype(self.dtype)
        y = svd_matmul(
            inputs,
            self.u[...],
            self.v[...],
            u_scale=self.u_scale[...],
            v_scale=self.v_scale[...],
            precision=self.precision,
        )
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y

    @classmethod
    def from_svd(cls, layer: SVDLinear) -> Fp8SVDLinear:
        """`layer`'s factors quantized per column (u per rank, v per output feature)."""
        if not isinstance(layer, SVDLinear):
            raise TypeError(f"layer: got {type(layer).__name__}, expected an SVDLinear")
        (u, u_scale), (v, v_scale) = quantize_fp8(layer.u[...]), quantize_fp8(layer.v[...])
        bias = layer.bias[...] if layer.bias is not None else None
        return cls(u, v, u_scale, v_scale, bias, dtype=layer.dtype, precision=layer.precision)


class Fp8SVDMLP(nnx.Module):
    """Gated MLP (act(x·Ug·Vg) * (x·Uu·Vu))·Ud·Vd with fp8 factors, through the fused `svd_mlp` primitive.

    gate_proj, up_proj, down_proj: bias-free Fp8SVDLinear layers; activation "silu" or "gelu_tanh".
    """

    def __init__(self, gate_proj: Fp8SVDLinear, up_proj: Fp8SVDLinear, down_proj: Fp8SVDLinear, *, activation, dtype):
        for name, layer in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if not isinstance(layer, Fp8SVDLinear) or layer.bias is not None:
                raise TypeError(f"{name}: expected a bias-free Fp8SVDLinear, got {type(layer).__name__}")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.activation = activation
        self.dtype = dtype

    def __call__(self, inputs):
        if self.dtype is not None:
            inputs = inputs.astype(self.dtype)
        gate, up, down = (
            Factored(layer.u[...], layer.v[...], layer.u_scale[...], layer.v_scale[...])
            for layer in (self.gate_proj, self.up_proj, self.down_proj)
        )
        return svd_mlp(inputs, gate, up, down, activation=self.activation, precision=self.gate_proj.precision)

    @classmethod
    def from_svd(cls, mlp: SVDMLP) -> Fp8SVDMLP:
        """`mlp`'s six factors quantized per column."""
        if not isinstance(mlp, SVDMLP):
            raise TypeError(f"mlp: got {type(mlp).__name__}, expected an SVDMLP")
        layers = [Fp8SVDLinear.from_svd(layer) for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
        return cls(*layers, activation=mlp.activation, dtype=mlp.dtype)
