"""compress_model: swap a model's dense projections for SVD-factored modules (fused svd_mlp / svd_matmul)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_neuronmm.compress import svd
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.layers import GatedMLP
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear
from nki_kernels.activations import FUSED_ACTIVATIONS, HF_ACTIVATIONS

INCLUDE_CHOICES = ("mlp", "attention")
METHODS = ("svd", "whitened")
_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _InputRecorder(nnx.Module):
    """Wraps a linear layer and appends every input it sees (as [n, in_features] numpy) to `sink`."""

    def __init__(self, inner: nnx.Module, sink: list):
        self.inner = inner
        self.sink = sink

    def __call__(self, x):
        self.sink.append(np.asarray(x, np.float32).reshape(-1, x.shape[-1]))
        return self.inner(x)


def _record_inputs(model: CausalLM, targets: list[tuple[nnx.Module, str]], calibration_ids) -> list[np.ndarray]:
    """Activations [n, in_features] entering each (parent, attribute) linear while the model runs calibration_ids."""
    sinks = [[] for _ in targets]
    originals = [getattr(parent, name) for parent, name in targets]
    for (parent, name), original, sink in zip(targets, originals, sinks):
        setattr(parent, name, _InputRecorder(original, sink))
    try:
        model(jnp.asarray(calibration_ids))  # eager on purpose: the recorders capture concrete values
    finally:
        for (parent, name), original in zip(targets, originals):
            setattr(parent, name, original)
    return [np.concatenate(sink, axis=0) for sink in sinks]


def _check_arguments(keep, rank, method, include, calibration_ids):
    if rank is None:
        svd.check_keep(keep)
    elif rank != "full" and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise ValueError(f"rank: got {rank!r}, expected None, a positive int or 'full'")
    if method not in METHODS:
        raise ValueError(f"method: got {method!r}, expected one of {METHODS}")
    include = (include,) if isinstance(include, str) else tuple(include)
    if not include or set(include) - set(INCLUDE_CHOICES):
        raise ValueError(f"include: got {include!r}, expected a non-empty subset of {INCLUDE_CHOICES}")
    if method == "whitened":
        if calibration_ids is None:
            raise ValueError("calibration_ids: method='whitened' needs calibration token ids [B, T]")
        ids = np.asarray(calibration_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"calibration_ids: got shape {ids.shape} dtype {ids.dtype}, expected int [B, T]")
    elif calibration_ids is not None:
        raise ValueError("calibration_ids: only used by method='whitened'; got it with method='svd'")
    return include


def _factor_options(linear: nnx.Linear, keep, rank, block) -> dict:
    if rank is None:
        return dict(keep=keep, block=block)
    full = min(linear.in_features, linear.out_features)
    return dict(rank=full if rank == "full" else rank)


def compress_model(
    model: CausalLM,
    keep: float = 0.8,
    method: str = "svd",
    calibration_ids=None,
    include=("mlp",),
    *,
    rank: int | str | None = None,
    block: int = 128,
) -> CausalLM:
    """A copy of `model` whose projections are SVD-factored; the input model is left unchanged.

    keep: fraction of each projection's parameters kept (rank from `block_aligned_rank(K, N, keep, block)`);
    rank: instead of keep, one rank for every projection, or "full" (min(K, N): reproduces the dense model).
    method: "svd" (plain truncation) or "whitened" (SVD-LLM whitening with the activations the model produces on
    calibration_ids [B, T]). include: "mlp" and/or "attention". Each gated MLP becomes one `SVDMLP` (the fused
    svd_mlp primitive) when its activation is fused-supported and it has no biases; otherwise, and for attention,
    each projection becomes an `SVDLinear` (svd_matmul).
    """
    if not isinstance(model, CausalLM):
        raise TypeError(f"model: got {type(model).__name__}, expected a jax_neuronmm.models CausalLM")
    include = _check_arguments(keep, rank, method, include, calibration_ids)
    model = nnx.clone(model)

    targets = []  # (parent module, attribute name) of each linear to factor, in model order
    for layer in model.layers:
        if "attention" in include:
            targets += [(layer.self_attn, name) for name in _ATTENTION_PROJECTIONS]
        if "mlp" in include:
            if not isinstance(layer.mlp, GatedMLP):
                raise TypeError(f"model: MLP is a {type(layer.mlp).__name__}; is it compressed already?")
            targets += [(layer.mlp, name) for name in MLP_PROJECTIONS]
    activations = (
        _record_inputs(model, targets, calibration_ids) if method == "whitened" else [None] * len(targets)
    )
    calibration = {(id(parent), name): acts for (parent, name), acts in zip(targets, activations)}

    for layer in model.layers:
        if "attention" in include:
            attn = layer.self_attn
            for name in _ATTENTION_PROJECTIONS:
                linear = getattr(attn, name)
                setattr(attn, name, SVDLinear.from_linear(
                    linear, method=method, calibration=calibration[(id(attn), name)],
                    **_factor_options(linear, keep, rank, block)))
        if "mlp" in include:
            layer.mlp = _compress_mlp(layer.mlp, keep, rank, block, method, calibration)
    return model


def fused_mlp_activation(mlp: GatedMLP):
    """svd_mlp's activation name when `mlp` can become one fused SVDMLP (no biases, SiLU or GELU-tanh), else None."""
    if any(getattr(mlp, name).bias is not None for name in MLP_PROJECTIONS):
        return None
    # An MLP whose activation the kernels do not apply is compressed projection by projection.
    activation = HF_ACTIVATIONS.get(mlp.activation)
    return activation if activation in FUSED_ACTIVATIONS else None


def _compress_mlp(mlp: GatedMLP, keep, rank, block, method, calibration):
    fused_activation = fused_mlp_activation(mlp)
    if fused_activation is not None:
        if rank is None:
            rank_options = dict(keep=keep, block=block)
        else:
            rank_options = dict(rank=tuple(
                min(p.in_features, p.out_features) if rank == "full" else rank
                for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)))
        return SVDMLP.from_linears(
            mlp.gate_proj, mlp.up_proj, mlp.down_proj, activation=fused_activation, method=method,
            calibration=calibration[(id(mlp), "gate_proj")], **rank_options)
    for name in MLP_PROJECTIONS:
        linear = getattr(mlp, name)
        setattr(mlp, name, SVDLinear.from_linear(
            linear, method=method, calibration=calibration[(id(mlp), name)],
            **_factor_options(linear, keep, rank, block)))
    return mlp
