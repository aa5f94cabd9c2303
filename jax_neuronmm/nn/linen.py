"""Flax Linen modules with SVD-factored weights: `SVDDense` (drop-in for `nn.Dense`) and the gated `SVDMLP`.

Both call the `svd_matmul` / `svd_mlp` primitives, so a jitted model reaches the fused kernels on Trainium (and the
XLA reference lowering elsewhere). Parameters: `u` [in_features, rank], `v` [rank, features], `bias` [features] —
the names `compress_params` produces from an `nn.Dense`'s `kernel`; `params_from_dense` converts one layer's (or one
MLP's) dense parameters directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes

from jax_neuronmm.compress import svd
from jax_neuronmm.nn.factorize import factorize_kernel, gated_hidden, three_ranks
from jax_neuronmm.svd_matmul import svd_matmul
from jax_neuronmm.svd_mlp import svd_mlp
from jax_neuronmm.weights import Factored
from nki_kernels.activations import FUSED_ACTIVATIONS

default_factor_init = nn.initializers.lecun_normal()

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class SVDDense(nn.Module):
    """y = (x·u)·v + bias, x [..., K] → y [..., features], with u [K, rank], v [rank, features].

    Attributes follow `nn.Dense`, plus `rank`; `u_init` / `v_init` replace `kernel_init` (LeCun normal by default).
    """

    features: int
    rank: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    u_init: Any = default_factor_init
    v_init: Any = default_factor_init
    bias_init: Any = nn.initializers.zeros_init()
    preferred_element_type: Any = None

    @nn.compact
    def __call__(self, inputs):
        svd.check_rank(self.rank, (inputs.shape[-1], self.features))
        u = self.param("u", self.u_init, (inputs.shape[-1], self.rank), self.param_dtype)
        v = self.param("v", self.v_init, (self.rank, self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, u, v, bias = dtypes.promote_dtype(inputs, u, v, bias, dtype=self.dtype)
        y = svd_matmul(inputs, u, v, precision=self.precision, preferred_element_type=self.preferred_element_type)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return y

    @staticmethod
    def params_from_dense(
        dense_params: Mapping,
        *,
        rank: int | None = None,
        keep: float | None = None,
        method: str = "svd",
        calibration=None,
        block: int = 128,
        damping: float = svd.DEFAULT_DAMPING,
    ) -> dict:
        """{"u", "v"[, "bias"]} approximating an `nn.Dense`'s {"kernel"[, "bias"]} (one layer's params).

        Exactly one of rank / keep. For method="whitened", calibration is the layer's inputs [n, in_features]. Use
        with `SVDDense(features, rank=params["u"].shape[-1], use_bias="bias" in params)`.
        """
        if "kernel" not in dense_params:
            raise ValueError(f"dense_params must hold 'kernel' (an nn.Dense's params), got keys {list(dense_params)}")
        u, v = factorize_kernel(
            dense_params["kernel"],
            rank=rank,
            keep=keep,
            method=method,
            calibration=calibration,
            block=block,
            damping=damping,
        )
        params = {"u": jnp.asarray(u), "v": jnp.asarray(v)}
        if "bias" in dense_params:
            params["bias"] = jnp.asarray(dense_params["bias"])
        return params


class _Factors(nn.Module):
    """The bias-free u [in_features, rank], v [rank, features] of one SVDMLP projection."""

    features: int
    rank: int
    param_dtype: Any
    u_init: Any
    v_init: Any

    @nn.compact
    def __call__(self, in_features: int):
        svd.check_rank(self.rank, (in_features, self.features))
        u = self.param("u", self.u_init, (in_features, self.rank), self.param_dtype)
        v = self.param("v", self.v_init, (self.rank, self.features), self.param_dtype)
        return u, v


class SVDMLP(nn.Module):
    """Gated MLP y = (act(x·Ug·Vg) * (x·Uu·Vu))·Ud·Vd through the fused `svd_mlp` primitive (no biases).

    x [..., K] → y [..., out_features (default K)]. Params: gate_proj / up_proj / down_proj, each {"u", "v"}.
    `rank` is one int or (gate, up, down); activation "silu" (Llama) or "gelu_tanh" (Gemma).
    """

    intermediate_features: int
    rank: Any
    out_features: int | None = None
    activation: str = "silu"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    u_init: Any = default_factor_init
    v_init: Any = default_factor_init

    @nn.compact
    def __call__(self, inputs):
        if self.activation not in FUSED_ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(FUSED_ACTIVATIONS)}, got {self.activation!r}")
        in_features = inputs.shape[-1]
        out_features = in_features if self.out_features is None else self.out_features
        ranks = three_ranks(self.rank)
        shapes = (
            (self.intermediate_features, in_features),
            (self.intermediate_features, in_features),
            (out_features, self.intermediate_features),
        )
        factors = []
        for name, layer_rank, (features, layer_in) in zip(MLP_PROJECTIONS, ranks, shapes):
            factors += _Factors(features, layer_rank, self.param_dtype, self.u_init, self.v_init, name=name)(layer_in)
        inputs, *factors = dtypes.promote_dtype(inputs, *factors, dtype=self.dtype)
        gate, up, down = (Factored(u, v) for u, v in zip(factors[::2], factors[1::2]))
        return svd_mlp(inputs, gate, up, down, activation=self.activation, precision=self.precision)

    @staticmethod
    def params_from_dense(
        dense_params: Mapping,
        *,
        activation: str = "silu",
        rank=None,
        keep: float | None = None,
        method: str = "svd",
        calibration=None,
        block: int = 128,
        damping: float = svd.DEFAULT_DAMPING,
    ) -> dict:
        """SVDMLP params from {"gate_proj": {"kernel"}, "up_proj": {...}, "down_proj": {...}} (bias-free Dense).

        rank: one int or (gate, up, down); or keep. For method="whitened", calibration is the MLP's input
        activations [n, in_features]; the down projection is calibrated on act(x·Wg)*(x·Wu).
        """
        missing = [name for name in MLP_PROJECTIONS if name not in dense_params or "kernel" not in dense_params[name]]
        if missing:
            raise ValueError(f"dense_params needs {{'kernel'}} for each of {MLP_PROJECTIONS}; missing {missing}")
        with_bias = [name for name in MLP_PROJECTIONS if "bias" in dense_params[name]]
        if with_bias:
            raise ValueError(f"{with_bias} have a bias; svd_mlp's projections are bias-free")
        kernels = {name: np.asarray(dense_params[name]["kernel"]) for name in MLP_PROJECTIONS}
        ranks = three_ranks(rank) if rank is not None else (None, None, None)
        calibrations = {"gate_proj": calibration, "up_proj": calibration, "down_proj": None}
        if method == "whitened" and calibration is not None:
            calibrations["down_proj"] = gated_hidden(calibration, kernels["gate_proj"], kernels["up_proj"], activation)
        params = {}
        for name, layer_rank in zip(MLP_PROJECTIONS, ranks):
            u, v = factorize_kernel(
                kernels[name],
                rank=layer_rank,
                keep=keep,
                method=method,
                calibration=calibrations[name],
                block=block,
                damping=damping,
            )
            params[name] = {"u": jnp.asarray(u), "v": jnp.asarray(v)}
        return params
