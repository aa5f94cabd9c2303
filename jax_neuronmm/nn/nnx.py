"""Flax NNX layers on the fused primitives: `SVDLinear` (drop-in for `nnx.Linear`, SVD factors), the gated `SVDMLP`
and `Linear` (a dense projection), each in any `WeightFormat`.

A layer's format is a value (`layer.format`), not its class: FLOAT layers hold trainable `nnx.Param`s, FP8_E4M3
layers fp8 values and their float32 per-column scales as `QuantizedWeight`s (saved with the state, never trained).
`SVDLinear` / `SVDMLP` call `svd_matmul` / `svd_mlp`, so a jitted model reaches the fused kernels on Trainium.
Parameter names (`u` [in, rank], `v` [rank, out], `kernel`, their `*_scale`, `bias`) are those `compress_params`
and the checkpoints use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx
from flax.linen import dtypes

from jax_neuronmm import explicit_sharding
from jax_neuronmm.compress import svd
from jax_neuronmm.compress.quantize import quantize_fp8
from jax_neuronmm.nn.factorize import factorize_kernel, gated_hidden, three_ranks
from jax_neuronmm.nn.fp8 import checked_fp8_values, fp8_dense
from jax_neuronmm.shapes import fp8_storage
from jax_neuronmm.svd_matmul import svd_matmul
from jax_neuronmm.svd_mlp import svd_mlp
from jax_neuronmm.weights import Factored, WeightFormat
from nki_kernels.activations import FUSED_ACTIVATIONS

default_factor_init = nnx.initializers.lecun_normal()


@dataclasses.dataclass(frozen=True)
class FactorInit:
    """The initializers of an SVD layer's u, v and bias (as `nnx.Linear`'s kernel_init / bias_init): LeCun normal
    factors by default, which keep the output variance of a LeCun-initialized dense layer, and a zero bias."""

    u: Callable = default_factor_init
    v: Callable = default_factor_init
    bias: Callable = nnx.initializers.zeros_init()


def _given(array, *, cast: bool = True):
    """An initializer returning `array` as given, nothing drawn at random: in the requested dtype (cast), or in its
    own (a bias copied with its dtype)."""
    return lambda key, shape, dtype: jnp.asarray(array, dtype if cast else None)


_ZEROS = FactorInit(nnx.initializers.zeros_init(), nnx.initializers.zeros_init())


class QuantizedWeight(nnx.Variable):
    """Quantized weight values or their scales: saved and loaded with the model's state, never trained."""


def describe(module) -> str:
    """A module's type for messages, with its weight format when it has one: "a Linear in FP8_E4M3"."""
    format = getattr(module, "format", None)
    return f"a {type(module).__name__}" + (f" in {format.name}" if isinstance(format, WeightFormat) else "")


def quantize(weight, format: WeightFormat, axis: int = -1):
    """(values, scale) of a float weight [K, N] in `format`, one scale per output channel along `axis` (scale None
    for FLOAT, whose values are the weight itself)."""
    if format is WeightFormat.FLOAT:
        return jnp.asarray(weight), None
    if format is WeightFormat.FP8_E4M3:
        return quantize_fp8(weight, axis=axis)
    raise ValueError(f"format: got {format!r}, expected a WeightFormat")


def _stored(op, name, values, scale, columns):
    """(variable of values, variable of scale or nnx.data(None), format) of one stored matrix: Params for float
    values (scale must be None), QuantizedWeights for fp8 ones (checked: `nn.fp8.checked_fp8_values`)."""
    values = fp8_storage(jnp.asarray(values))
    format = WeightFormat.of(values.dtype)
    if format.scaled:
        values, scale = checked_fp8_values(op, name, values, scale, columns)
        return QuantizedWeight(values), QuantizedWeight(scale), format
    if scale is not None:
        raise TypeError(f"{op}: {name}_scale given with {values.dtype} {name}; scales go with fp8 values only")
    return nnx.Param(values), nnx.data(None), format


class Linear(nnx.Module):
    """y = x·kernel + bias in any WeightFormat, with a scaled format (x·kernel)·diag(kernel_scale) + bias.

    kernel [in_features, out_features] (the format follows its dtype), kernel_scale [out_features] float32 for fp8
    values, bias [out_features] or None. dtype: the compute dtype (inputs cast to it; None keeps theirs). fp8 runs
    as XLA ops (`nn.fp8.fp8_dense`): there is no dense fp8 kernel. The models' float projections are Flax's own
    `nnx.Linear`; `Linear.from_linear` converts one to a format.
    """

    def __init__(self, kernel, bias=None, *, kernel_scale=None, dtype=None, precision=None):
        self.kernel, self.kernel_scale, self.format = _stored(
            "Linear", "kernel", kernel, kernel_scale, "output feature"
        )
        self.bias = nnx.Param(jnp.asarray(bias)) if bias is not None else nnx.data(None)
        self.in_features, self.out_features = self.kernel[...].shape
        self.dtype = dtype
        self.precision = precision

    def __call__(self, inputs):
        if self.dtype is not None:
            inputs = inputs.astype(self.dtype)
        if self.format.scaled:
            y = fp8_dense(inputs, self.kernel[...], self.kernel_scale[...], precision=self.precision)
        else:
            kernel = self.kernel[...].astype(inputs.dtype)
            y = jnp.matmul(inputs, kernel, precision=self.precision)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y

    @classmethod
    def from_linear(cls, linear: nnx.Linear, format: WeightFormat = WeightFormat.FP8_E4M3) -> Linear:
        """`linear` with its kernel in `format` (rounded to nearest per output feature for fp8)."""
        _check_linear(linear, "linear")
        values, scale = quantize(linear.kernel[...], format)
        bias = linear.bias[...] if linear.bias is not None else None
        return cls(values, bias, kernel_scale=scale, dtype=linear.dtype, precision=linear.precision)

    @classmethod
    def from_embedding(cls, embed: nnx.Embed, format: WeightFormat = WeightFormat.FP8_E4M3, *, dtype=None) -> Linear:
        """The LM head of a tied embedding [vocab, hidden]: kernel = embeddingᵀ [hidden, vocab] in `format` with one
        scale per vocabulary entry (logits = hidden · embeddingᵀ, as `nnx.Embed.attend`); dtype: the compute
        dtype, the embedding's by default."""
        values, scale = quantize(embed.embedding[...], format, axis=-2)
        return cls(values.T, kernel_scale=scale, dtype=dtype if dtype is not None else embed.dtype)


class SVDLinear(nnx.Module):
    """y = (x·u)·v + bias, x [..., in_features] → y [..., out_features], with u [in_features, rank], v [rank, out];
    in a scaled format ((x·u)·diag(u_scale))·v·diag(v_scale) + bias.

    Arguments follow `nnx.Linear`, plus `rank`; `init` (a `FactorInit`) replaces `kernel_init` / `bias_init`. The
    constructor makes a FLOAT layer; `from_values` takes stored values of any format, `quantized` converts one.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        init: FactorInit = FactorInit(),
        preferred_element_type=None,
        rngs: nnx.Rngs,
    ):
        svd.check_rank(rank, (in_features, out_features))
        self.u = nnx.Param(init.u(rngs.params(), (in_features, rank), param_dtype))
        self.v = nnx.Param(init.v(rngs.params(), (rank, out_features), param_dtype))
        self.u_scale, self.v_scale = nnx.data(None), nnx.data(None)
        self.bias = nnx.Param(init.bias(rngs.params(), (out_features,), param_dtype)) if use_bias else nnx.data(None)
        self.format = WeightFormat.FLOAT
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.preferred_element_type = preferred_element_type

    def __call__(self, inputs):
        bias = self.bias[...] if self.bias is not None else None
        if self.format.scaled:
            inputs = inputs if self.dtype is None else inputs.astype(self.dtype)
            u, v = self.u[...], self.v[...]
            scales = dict(u_scale=self.u_scale[...], v_scale=self.v_scale[...])
        else:
            inputs, u, v, bias = dtypes.promote_dtype(inputs, self.u[...], self.v[...], bias, dtype=self.dtype)
            scales = {}
        y = svd_matmul(
            inputs, u, v, **scales, precision=self.precision, preferred_element_type=self.preferred_element_type
        )
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return y

    @classmethod
    def from_values(cls, u, v, bias=None, *, u_scale=None, v_scale=None, dtype=None, precision=None) -> SVDLinear:
        """The SVDLinear storing u [in_features, r] and v [r, out_features] as given, its format following their
        dtype: fp8 values need their float32 scales u_scale [r] and v_scale [out_features] (TypeError without
        them, ValueError for values beyond ±240 or non-finite scales), float ones none. dtype: the compute dtype."""
        u_var, u_scale_var, u_format = _stored("SVDLinear", "u", u, u_scale, "rank")
        v_var, v_scale_var, v_format = _stored("SVDLinear", "v", v, v_scale, "output feature")
        if u_format is not v_format:
            raise TypeError(f"SVDLinear: u is {u_format.name} and v {v_format.name}; expected one format for both")
        (k, rank), (rank_v, n) = u_var[...].shape, v_var[...].shape
        if rank_v != rank:
            raise ValueError(f"SVDLinear: u, v: got shapes {(k, rank)} and {(rank_v, n)}, expected [K, r] and [r, N]")
        bias_dtype = jnp.asarray(bias).dtype if bias is not None else jnp.float32
        layer = cls(
            k,
            n,
            rank,
            use_bias=bias is not None,
            dtype=dtype,
            param_dtype=bias_dtype,
            precision=precision,
            init=dataclasses.replace(_ZEROS, bias=_given(bias, cast=False)),
            rngs=nnx.Rngs(0),
        )
        layer.u, layer.v, layer.u_scale, layer.v_scale, layer.format = u_var, v_var, u_scale_var, v_scale_var, u_format
        return layer

    def quantized(self, format: WeightFormat = WeightFormat.FP8_E4M3) -> SVDLinear:
        """This FLOAT layer with its factors in `format`, each quantized per column (u per rank, v per output
        feature); bias, dtype and precision kept."""
        if self.format.scaled:
            raise TypeError(f"SVDLinear.quantized: the layer is already {self.format.name}; expected a FLOAT layer")
        (u, u_scale), (v, v_scale) = quantize(self.u[...], format), quantize(self.v[...], format)
        bias = self.bias[...] if self.bias is not None else None
        return SVDLinear.from_values(
            u, v, bias, u_scale=u_scale, v_scale=v_scale, dtype=self.dtype, precision=self.precision
        )

    @classmethod
    def from_linear(
        cls,
        linear: nnx.Linear,
        *,
        rank: int | None = None,
        keep: float | None = None,
        method: str = "svd",
        calibration=None,
        block: int = 128,
        damping: float = svd.DEFAULT_DAMPING,
    ) -> SVDLinear:
        """An SVDLinear approximating `linear` (same features, bias, dtypes, precision).

        Exactly one of rank / keep (fraction of parameters kept, rank from `block_aligned_rank`). method "svd" or
        "whitened"; for "whitened", calibration is the layer's input activations [n, in_features].
        """
        _check_linear(linear, "linear")
        u, v = factorize_kernel(
            linear.kernel[...],
            rank=rank,
            keep=keep,
            method=method,
            calibration=calibration,
            block=block,
            damping=damping,
        )
        return cls.from_factors(linear, u, v)

    @classmethod
    def from_factors(cls, linear: nnx.Linear, u, v) -> SVDLinear:
        """The SVDLinear with factors u [in_features, r], v [r, out_features] (cast to `linear`'s param_dtype) and
        `linear`'s bias (copied), dtypes and precision. Built directly from the arrays: nothing is traced or drawn
        at random."""
        _check_linear(linear, "linear")
        rank = u.shape[-1] if u.ndim == 2 else None
        if rank is None or u.shape != (linear.in_features, rank) or v.shape != (rank, linear.out_features):
            raise ValueError(
                f"u, v: got shapes {u.shape} and {v.shape}, expected [{linear.in_features}, r] and "
                f"[r, {linear.out_features}] for a {linear.in_features} -> {linear.out_features} linear"
            )

        bias = linear.bias[...] if linear.bias is not None else None
        return cls(
            linear.in_features,
            linear.out_features,
            rank,
            use_bias=bias is not None,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            precision=linear.precision,
            preferred_element_type=linear.preferred_element_type,
            init=FactorInit(_given(u), _given(v), _given(bias, cast=False)),
            rngs=nnx.Rngs(0),
        )

    @classmethod
    def like(cls, linear: nnx.Linear, rank: int, *, rngs: nnx.Rngs | None = None) -> SVDLinear:
        """A randomly initialized SVDLinear of `rank` with `linear`'s features, bias use, dtypes and precision
        (abstract under `nnx.eval_shape`; callers fill the factors)."""
        _check_linear(linear, "linear")
        return cls(
            linear.in_features,
            linear.out_features,
            rank,
            use_bias=linear.bias is not None,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            precision=linear.precision,
            preferred_element_type=linear.preferred_element_type,
            rngs=rngs if rngs is not None else nnx.Rngs(0),
        )


def _check_linear(linear, name: str) -> None:
    if not isinstance(linear, nnx.Linear):
        raise TypeError(
            f"{name}: got {type(linear).__name__}, expected an nnx.Linear (kernel [in_features, "
            "out_features]); convolutions and LinearGeneral are not supported"
        )


def _check_gated_projections(gate_proj, up_proj, down_proj, expected_type) -> None:
    """TypeError / ValueError unless gate/up [K → I] and down [I → N] are bias-free `expected_type` layers."""
    projections = (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj))
    for name, layer in projections:
        if not isinstance(layer, expected_type):
            raise TypeError(f"{name}: got {type(layer).__name__}, expected {expected_type.__name__}")
        if layer.bias is not None:
            raise ValueError(f"{name} has a bias; svd_mlp's projections are bias-free")
    shapes = {name: (layer.in_features, layer.out_features) for name, layer in projections}
    if (up_proj.in_features, up_proj.out_features) != shapes[
        "gate_proj"
    ] or down_proj.in_features != gate_proj.out_features:
        raise ValueError(
            f"gate_proj, up_proj, down_proj: got (in, out) features {shapes}, expected gate_proj and up_proj "
            "[K → I] and down_proj [I → N] (same K and I)"
        )


class SVDMLP(nnx.Module):
    """Gated MLP y = (act(x·Ug·Vg) * (x·Uu·Vu))·Ud·Vd through the fused `svd_mlp` primitive (no biases).

    x [..., in_features] → y [..., out_features (default in_features)]. Sub-modules `gate_proj`, `up_proj`
    [in_features → intermediate_features] and `down_proj` [intermediate_features → out_features] are bias-free
    SVDLinear layers holding the factors, all in one format (`format`); `rank` is one int or (gate, up, down).
    activation: "silu" (Llama) or "gelu_tanh" (Gemma). The constructor makes a FLOAT MLP; `from_projections` takes
    layers of any format, `quantized` converts one.
    """

    def __init__(
        self,
        in_features: int,
        intermediate_features: int,
        rank,
        *,
        out_features: int | None = None,
        activation: str = "silu",
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        init: FactorInit = FactorInit(),
        rngs: nnx.Rngs,
    ):
        if activation not in FUSED_ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(FUSED_ACTIVATIONS)}, got {activation!r}")
        out_features = in_features if out_features is None else out_features
        gate_rank, up_rank, down_rank = three_ranks(rank)
        common = dict(
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            init=init,
            rngs=rngs,
        )
        self.gate_proj = SVDLinear(in_features, intermediate_features, gate_rank, **common)
        self.up_proj = SVDLinear(in_features, intermediate_features, up_rank, **common)
        self.down_proj = SVDLinear(intermediate_features, out_features, down_rank, **common)
        self.activation = activation
        self.dtype = dtype
        self.precision = precision

    @property
    def format(self) -> WeightFormat:
        """The format of the three projections (one, checked by `from_projections`)."""
        return self.gate_proj.format

    def __call__(self, inputs):
        layers = (self.gate_proj, self.up_proj, self.down_proj)
        if self.format.scaled:
            inputs = inputs if self.dtype is None else inputs.astype(self.dtype)
            gate, up, down = (Factored(p.u[...], p.v[...], p.u_scale[...], p.v_scale[...]) for p in layers)
        else:
            inputs, *factors = dtypes.promote_dtype(
                inputs, *(factor for layer in layers for factor in (layer.u[...], layer.v[...])), dtype=self.dtype
            )
            gate, up, down = (Factored(u, v) for u, v in zip(factors[::2], factors[1::2]))
        # An MLP's result joins the residual stream: under Explicit mesh axes it is split like its input, features
        # whole (a Megatron-split MLP leaves partial sums, which svd_mlp would otherwise ask to be placed).
        return svd_mlp(
            inputs,
            gate,
            up,
            down,
            activation=self.activation,
            precision=self.precision,
            out_sharding=explicit_sharding.features_unsplit(inputs),
        )

    @classmethod
    def from_linears(
        cls,
        gate_proj: nnx.Linear,
        up_proj: nnx.Linear,
        down_proj: nnx.Linear,
        *,
        activation: str = "silu",
        rank=None,
        keep: float | None = None,
        method: str = "svd",
        calibration=None,
        block: int = 128,
        damping: float = svd.DEFAULT_DAMPING,
    ) -> SVDMLP:
        """An SVDMLP approximating a gated MLP of three bias-free `nnx.Linear` layers.

        rank: one int or (gate, up, down); or keep (per-projection `block_aligned_rank`). For method="whitened",
        calibration is the MLP's input activations [n, in_features]; the down projection is calibrated on
        act(x·Wg)*(x·Wu) computed from the dense layers.
        """
        _check_gated_projections(gate_proj, up_proj, down_proj, nnx.Linear)
        if activation not in FUSED_ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(FUSED_ACTIVATIONS)}, got {activation!r}")
        ranks = three_ranks(rank) if rank is not None else (None, None, None)
        down_calibration = None
        if method == "whitened" and calibration is not None:
            down_calibration = gated_hidden(calibration, gate_proj.kernel[...], up_proj.kernel[...], activation)
        converted = [
            SVDLinear.from_linear(
                linear,
                rank=layer_rank,
                keep=keep,
                method=method,
                calibration=layer_calibration,
                block=block,
                damping=damping,
            )
            for linear, layer_rank, layer_calibration in (
                (gate_proj, ranks[0], calibration),
                (up_proj, ranks[1], calibration),
                (down_proj, ranks[2], down_calibration),
            )
        ]
        return cls.from_projections(*converted, activation=activation)

    @classmethod
    def from_projections(
        cls, gate_proj: SVDLinear, up_proj: SVDLinear, down_proj: SVDLinear, *, activation: str = "silu"
    ) -> SVDMLP:
        """The SVDMLP made of three bias-free SVDLinear layers of one format as they are (their factors are kept,
        not copied).

        gate_proj, up_proj: [in_features → intermediate]; down_proj: [intermediate → out_features].
        """
        _check_gated_projections(gate_proj, up_proj, down_proj, SVDLinear)
        layers = {"gate_proj": gate_proj, "up_proj": up_proj, "down_proj": down_proj}
        formats = {name: layer.format.name for name, layer in layers.items()}
        if len(set(formats.values())) > 1:
            raise TypeError(f"gate_proj, up_proj, down_proj: got formats {formats}; expected one format for all three")
        # Built with zero factors (cheaper than tracing the random initializers) and then given the layers.
        mlp = cls(
            gate_proj.in_features,
            gate_proj.out_features,
            (gate_proj.rank, up_proj.rank, down_proj.rank),
            out_features=down_proj.out_features,
            activation=activation,
            dtype=gate_proj.dtype,
            param_dtype=gate_proj.param_dtype,
            precision=gate_proj.precision,
            init=_ZEROS,
            rngs=nnx.Rngs(0),
        )
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = gate_proj, up_proj, down_proj
        return mlp

    def quantized(self, format: WeightFormat = WeightFormat.FP8_E4M3) -> SVDMLP:
        """This FLOAT MLP with its six factors in `format`, each quantized per column."""
        layers = (self.gate_proj, self.up_proj, self.down_proj)
        return SVDMLP.from_projections(*(p.quantized(format) for p in layers), activation=self.activation)
