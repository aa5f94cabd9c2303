"""prune_mlps: every gated MLP of a CausalLM narrowed to a fraction of its intermediate neurons (compress.prune).

Each MLP keeps `mlp_width(I, keep, block)` of its I neurons, the same number in every layer (the decode step stacks
the layers' weights), so gate_proj / up_proj become [hidden, I'] and down_proj [I', hidden] dense kernels and the
model's config says intermediate_size I'. Layer by layer, in order, each MLP is calibrated on what the already
pruned layers before it feed it (its gated activations over the calibration windows, each window's first position,
the <bos> attention sink, weighted up: SINK_WEIGHT), its neurons chosen by
`compress.prune.prune_neurons` under the down_proj output's Fisher metric when given (else the squared error), and
its kept down_proj rows refit. The kernels become `PrunedKernel`s (recording which of the dense model's neurons they
kept), which end-to-end distillation trains beside any SVD factors.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.compress import prune
from jax_neuronmm.compress.projections import MLP_PROJECTIONS
from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.layers import GatedMLP
from jax_neuronmm.pipeline import sequential

# Neurons removed together per round of the greedy choice: as accurate as one at a time, in a fraction of the time.
NEURONS_PER_ROUND = 16
# The weight of each calibration window's first position in the activations' Gram matrix. Every window starts with
# <bos>, whose hidden state is the attention sink every later token reads and is far larger than another token's; as
# one position in a window its error would barely count, so it is weighed like the window's other positions together.
SINK_WEIGHT = 255.0


def narrow_mlp(mlp: GatedMLP, kernels: dict, kept) -> None:
    """`mlp`'s projections replaced in place by the pruned `kernels` {name: gate / up [hidden, I'], down [I', hidden]}
    of the dense model's neurons `kept` [I'] (distinct, each below `mlp`'s width), held as PrunedKernels that
    record them. ValueError when kept or a kernel's shape is not that."""
    kept, width = tuple(int(i) for i in kept), mlp.gate_proj.out_features
    if not kept or len(set(kept)) != len(kept) or not all(0 <= i < width for i in kept):
        span = f"[{min(kept)}, {max(kept)}]" if kept else "none"
        raise ValueError(f"kept: expected distinct neuron indices in [0, {width}), got {len(kept)} in {span}")
    for name in MLP_PROJECTIONS:
        linear = getattr(mlp, name)
        kernel = np.asarray(kernels[name])
        expected = (len(kept), linear.out_features) if name == "down_proj" else (linear.in_features, len(kept))
        if kernel.shape != expected:
            raise ValueError(f"kernels[{name!r}]: got shape {kernel.shape}, expected {expected} for the kept neurons")
        linear.kernel = PrunedKernel(jnp.asarray(kernel, linear.kernel[...].dtype), kept=kept)
        linear.in_features, linear.out_features = kernel.shape


def mlp_width(intermediate: int, keep: float, block: int) -> int:
    """The neurons a pruned MLP keeps: keep·intermediate rounded down to a multiple of `block` (never more
    parameters than keep asks for); where that is no block at all, keep·intermediate rounded down, at least 1."""
    wanted = int(round(keep * intermediate, 6))  # rounded first: 0.29 * 100 is 28.999999999999996
    return wanted // block * block or max(wanted, 1)


def unprunable(model: CausalLM) -> str | None:
    """Why `prune_mlps` cannot take `model` (None: it can): it prunes dense gated MLPs without biases."""
    for index, layer in enumerate(model.layers):
        mlp = layer.mlp
        if not isinstance(mlp, GatedMLP) or not all(isinstance(getattr(mlp, n), nnx.Linear) for n in MLP_PROJECTIONS):
            return (
                f"layer {index}'s MLP is a {type(mlp).__name__} with factored or fp8 projections; "
                "pruning takes dense gated MLPs"
            )
        if any(getattr(mlp, n).bias is not None for n in MLP_PROJECTIONS):
            return f"layer {index}'s MLP has biases; pruning takes gated MLPs without them"
    return None


def prune_mlps(
    model: CausalLM,
    calibration_ids,
    width: int,
    output_grams=None,
    *,
    per_round: int = NEURONS_PER_ROUND,
    sink_weight: float = SINK_WEIGHT,
    progress: bool = True,
) -> None:
    """Prunes `model`'s gated MLPs in place to `width` neurons each (see the module docstring).

    calibration_ids [B, T]: token ids the activations are recorded on; output_grams: None, or
    {(layer index, "down_proj"): G [hidden, hidden]} (`pipeline.fisher.output_grams`) weighting each MLP's output
    error; per_round: neurons `prune_neurons` removes together per round; sink_weight: the weight of each window's
    first position in the activations' Gram matrix (SINK_WEIGHT). Every MLP must be a dense GatedMLP without biases
    (TypeError otherwise).
    """
    reason = unprunable(model)
    if reason is not None:
        raise TypeError(f"model: {reason}")
    if isinstance(sink_weight, bool) or not isinstance(sink_weight, (int, float)) or not sink_weight > 0:
        raise ValueError(f"sink_weight: got {sink_weight!r}, expected a positive number")
    x, positions, masks = sequential.calibration_batch(model, calibration_ids)
    windows, length = np.shape(calibration_ids)
    position_weights = np.tile(np.where(np.arange(length) == 0, float(sink_weight), 1.0), windows)
    for index, layer in enumerate(tqdm(model.layers, desc="pruning MLP neurons", unit="layer", disable=not progress)):
        mask = masks[layer.self_attn.spec.sliding_window]
        _, (hidden,) = sequential.record_inputs(layer, x, positions, mask, [("mlp", "down_proj")])
        hidden = hidden.astype(np.float64)
        mlp = layer.mlp
        metric = None if output_grams is None else output_grams[(index, "down_proj")]
        kept, down = prune.prune_neurons(
            hidden.T @ (hidden * position_weights[:, None]),
            np.asarray(mlp.down_proj.kernel[...]),
            width,
            metric,
            per_round=per_round,
        )
        kernels = {name: np.asarray(getattr(mlp, name).kernel[...])[:, kept] for name in ("gate_proj", "up_proj")}
        narrow_mlp(mlp, {**kernels, "down_proj": down}, kept)
        x = sequential.record_inputs(layer, x, positions, mask, [])[0]
    model.config = dataclasses.replace(model.config, intermediate_size=width)


def embedded(variable: PrunedKernel, name: str, intermediate: int) -> np.ndarray:
    """The pruned kernel `variable` of projection `name` placed in its dense shape, zero at the pruned neurons."""
    kernel = np.asarray(variable[...], np.float64)
    axis = 0 if name == "down_proj" else 1
    shape = list(kernel.shape)
    shape[axis] = intermediate
    full = np.zeros(shape)
    index = [slice(None), slice(None)]
    index[axis] = np.asarray(variable.kept)
    full[tuple(index)] = kernel
    return full
