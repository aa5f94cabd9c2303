"""Layer-by-layer compression of a CausalLM on calibration tokens (whitening, refit, local fine-tuning).

The model is walked one decoder layer at a time. Each projection is factored with the inputs X̃ that the
compressed model feeds it and fitted towards the outputs the dense model produces on its own inputs X:

  * whitening (method "whitened") uses X̃ when `sequential`, else X (the dense model's activations);
  * `refit` replaces v by the ridge solution of min ‖X̃·u·v − X·W‖ (compress.refit), which also absorbs the error
    of the layers before;
  * `local` fine-tunes each gated MLP's six factors so mlp(X̃) matches the dense MLP's output on X.

Within a layer the same order holds: q/k/v first, then o_proj on the compressed q/k/v's output, then the MLP on the
compressed attention's output, and down_proj on the hidden activations of the compressed gate/up. Without
`sequential` everything is calibrated on the dense model's activations (one-shot SVD-LLM).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.compress import svd
from jax_neuronmm.compress.local_finetune import LocalFinetuneOptions, finetune_mlp
from jax_neuronmm.compress.projections import ATTENTION_GROUPS, MLP_PROJECTIONS
from jax_neuronmm.compress.refit import DEFAULT_RIDGE, refit_v
from jax_neuronmm.models.layers import GatedMLP, activation_fn, attention_mask
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear



@dataclasses.dataclass(frozen=True)
class LayerwiseOptions:
    """What `compress_layers` does besides factoring. sequential / refit / local as in the module docstring;
    ridge: `refit_v`'s relative ridge; damping: the whitening's."""

    sequential: bool = False
    refit: bool = False
    local: LocalFinetuneOptions | None = None
    ridge: float = DEFAULT_RIDGE
    damping: float = svd.DEFAULT_DAMPING


class _Recorder(nnx.Module):
    """Wraps a linear layer and appends each input it sees to `sink` as numpy [n, in_features] float32."""

    def __init__(self, inner: nnx.Module, sink: list):
        self.inner = inner
        self.sink = sink

    def __call__(self, x):
        self.sink.append(np.asarray(x, np.float32).reshape(-1, x.shape[-1]))
        return self.inner(x)


def record_inputs(run, targets):
    """(run()'s result, [inputs [n, in_features] that each (parent, attribute) linear in `targets` received]),
    run eagerly (the recorders read concrete values). The linears are put back afterwards."""
    originals = [getattr(parent, name) for parent, name in targets]
    sinks = [[] for _ in originals]
    recorders = [_Recorder(original, sink) for original, sink in zip(originals, sinks)]
    for (parent, name), recorder in zip(targets, recorders):
        setattr(parent, name, recorder)
    try:
        result = run()
    finally:
        for (parent, name), original in zip(targets, originals):
            setattr(parent, name, original)
    return result, [sink[-1] for sink in sinks]


def svd_linear(linear: nnx.Linear, u, v) -> SVDLinear:
    """An SVDLinear with factors u [K, r], v [r, N] and `linear`'s bias, dtypes and precision."""
    layer = nnx.eval_shape(lambda: SVDLinear.like(linear, u.shape[-1]))
    layer.u.set_value(jnp.asarray(u, linear.param_dtype))
    layer.v.set_value(jnp.asarray(v, linear.param_dtype))
    if linear.bias is not None:
        layer.bias.set_value(jnp.asarray(linear.bias[...]))
    return layer


def calibration_batch(model, ids):
    """(hidden [B, T, hidden] after the embedding, positions [B, T], {sliding window: mask [B, T, T]})."""
    ids = jnp.asarray(ids, jnp.int32)
    batch, tokens = ids.shape
    positions = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    valid = jnp.ones((batch, tokens), bool)
    windows = {layer.self_attn.spec.sliding_window for layer in model.layers}
    masks = {window: attention_mask(positions, positions, valid, window) for window in windows}
    return model.embed(ids), positions, masks


def compress_layers(model, dense, calibration_ids, include, ranks, method: str, options: LayerwiseOptions,
                    fused_activation, *, progress: bool = True) -> None:
    """Replaces, in place, the projections of `model` (a clone of `dense`) by factored modules.

    ranks[(layer_index, projection_name)] -> rank. method "svd" | "whitened". fused_activation(mlp) -> svd_mlp's
    activation name or None (then the MLP keeps its GatedMLP with three SVDLinear). calibration_ids [B, T] may be
    None only for method "svd" without refit / local / sequential (then no model is run).
    """
    needs_data = method == "whitened" or options.refit or options.local is not None or options.sequential
    if needs_data:
        x_compressed, positions, masks = calibration_batch(model, calibration_ids)
        x_dense = x_compressed
    for index in tqdm(range(len(model.layers)), desc=f"compressing ({method})", disable=not progress, unit="layer"):
        layer, dense_layer = model.layers[index], dense.layers[index]
        if not needs_data:
            _factor_without_data(layer, include, ranks, index, fused_activation)
            continue
        mask = masks[layer.self_attn.spec.sliding_window]

        def run_dense():
            return dense_layer(x_dense, positions, mask, None, None)[0]

        def run_compressed():
            return layer(x_compressed if options.sequential else x_dense, positions, mask, None, None)[0]

        dense_taps = []
        if "attention" in include:
            dense_taps += [(dense_layer.self_attn, group[0]) for group in ATTENTION_GROUPS]
        if "mlp" in include:
            dense_taps.append((dense_layer.mlp, "gate_proj"))
        x_dense_next, dense_inputs = record_inputs(run_dense, dense_taps)
        if "attention" in include:
            for group, dense_in in zip(ATTENTION_GROUPS, dense_inputs):
                inputs = (record_inputs(run_compressed, [(layer.self_attn, group[0])])[1][0] if options.sequential
                          else dense_in)
                chol = svd.whitening(inputs, damping=options.damping)[0] if method == "whitened" else None
                for name in group:
                    linear = getattr(layer.self_attn, name)
                    u, v = _factor(linear.kernel[...], ranks[(index, name)], method, chol, inputs, dense_in, options)
                    setattr(layer.self_attn, name, svd_linear(linear, u, v))
        if "mlp" in include:
            if not isinstance(layer.mlp, GatedMLP):
                raise TypeError(f"model: MLP is a {type(layer.mlp).__name__}; is it compressed already?")
            dense_in = dense_inputs[-1]
            inputs = (record_inputs(run_compressed, [(layer.mlp, "gate_proj")])[1][0] if options.sequential
                      else dense_in)
            layer.mlp = _compress_mlp(layer.mlp, index, inputs, dense_in, ranks, method, options, fused_activation)
        if options.sequential:
            x_compressed = run_compressed()
        x_dense = x_dense_next


def whitened_spectra(dense, calibration_ids, include, *, damping: float = svd.DEFAULT_DAMPING,
                     progress: bool = True) -> dict:
    """{(layer_index, projection_name): whitened singular values σ [min(K, N)]} of every projection `include`
    selects, on the dense model's own activations (the input of rank allocation)."""
    x, positions, masks = calibration_batch(dense, calibration_ids)
    spectra = {}
    for index in tqdm(range(len(dense.layers)), desc="whitened spectra", disable=not progress, unit="layer"):
        layer = dense.layers[index]
        taps = [(layer.self_attn, group[0]) for group in ATTENTION_GROUPS] if "attention" in include else []
        if "mlp" in include:
            taps.append((layer.mlp, "gate_proj"))
        x_next, inputs = record_inputs(
            lambda: layer(x, positions, masks[layer.self_attn.spec.sliding_window], None, None)[0], taps)
        groups = list(ATTENTION_GROUPS) if "attention" in include else []
        if "mlp" in include:
            mlp = layer.mlp
            groups.append(("gate_proj", "up_proj"))
            inputs.append(_gated_hidden(inputs[-1], mlp.gate_proj.kernel[...], mlp.up_proj.kernel[...],
                                        mlp.activation))
            groups.append(("down_proj",))
        for group, group_inputs in zip(groups, inputs):
            chol = svd.whitening(group_inputs, damping=damping)[0]
            parent = layer.mlp if group[0] in MLP_PROJECTIONS else layer.self_attn
            for name in group:
                spectra[(index, name)] = svd.whitened_decomposition(getattr(parent, name).kernel[...], chol)[1]
        x = x_next
    return spectra


def _factor(kernel, rank, method, chol, inputs, dense_inputs, options, decomposition=None):
    """(u, v) of kernel [K, N]: whitened with `chol` (or plain SVD), v refitted towards dense_inputs·kernel."""
    kernel = np.asarray(kernel)
    if method == "whitened":
        u, v = svd.whitened_factors(kernel, chol, rank, decomposition)
    else:
        u, v = svd.truncated_svd(kernel, rank)
    if options.refit:
        v = refit_v(u, inputs, dense_inputs @ kernel.astype(np.float32), ridge=options.ridge)
    return u, v


def _factor_without_data(layer, include, ranks, index, fused_activation):
    if "attention" in include:
        for group in ATTENTION_GROUPS:
            for name in group:
                linear = getattr(layer.self_attn, name)
                setattr(layer.self_attn, name, svd_linear(linear, *svd.truncated_svd(linear.kernel[...],
                                                                                    ranks[(index, name)])))
    if "mlp" in include:
        if not isinstance(layer.mlp, GatedMLP):
            raise TypeError(f"model: MLP is a {type(layer.mlp).__name__}; is it compressed already?")
        mlp = layer.mlp
        factors = {name: svd.truncated_svd(getattr(mlp, name).kernel[...], ranks[(index, name)])
                   for name in MLP_PROJECTIONS}
        layer.mlp = _mlp_module(mlp, factors, fused_activation(mlp))


def _gated_hidden(x, gate, up, activation):
    """act(x·gate) * (x·up) in float32 numpy; gate / up are kernels [K, I] or (u, v) pairs."""
    def project(weight):
        return x @ weight if not isinstance(weight, tuple) else (x @ weight[0]) @ weight[1]

    return np.asarray(activation_fn(activation)(jnp.asarray(project(gate))), np.float32) * project(up)


def _compress_mlp(mlp: GatedMLP, index, inputs, dense_inputs, ranks, method, options, fused_activation):
    kernels = {name: np.asarray(getattr(mlp, name).kernel[...], np.float32) for name in MLP_PROJECTIONS}
    chol = svd.whitening(inputs, damping=options.damping)[0] if method == "whitened" else None
    factors = {}
    for name in ("gate_proj", "up_proj"):
        factors[name] = _factor(kernels[name], ranks[(index, name)], method, chol, inputs, dense_inputs, options)
    dense_hidden = _gated_hidden(dense_inputs, kernels["gate_proj"], kernels["up_proj"], mlp.activation)
    if options.sequential:  # down_proj sees what the compressed gate/up produce
        hidden = _gated_hidden(inputs, factors["gate_proj"], factors["up_proj"], mlp.activation)
    else:
        hidden = dense_hidden
    down_chol = svd.whitening(hidden, damping=options.damping)[0] if method == "whitened" else None
    factors["down_proj"] = _factor(kernels["down_proj"], ranks[(index, "down_proj")], method, down_chol, hidden,
                                   dense_hidden, options)
    fused = fused_activation(mlp)
    if options.local is not None and fused is not None:
        flat = {f"{name.split('_')[0]}_{part}": value
                for name, pair in factors.items() for part, value in zip("uv", pair)}
        tuned = finetune_mlp(flat, inputs, dense_hidden @ kernels["down_proj"], fused, options.local)
        factors = {name: (tuned[f"{name.split('_')[0]}_u"], tuned[f"{name.split('_')[0]}_v"])
                   for name in MLP_PROJECTIONS}
    return _mlp_module(mlp, factors, fused)


def _mlp_module(mlp: GatedMLP, factors: dict, fused: str | None):
    """SVDMLP (fused svd_mlp) when `fused` names its activation, else the GatedMLP with three SVDLinear."""
    converted = {name: svd_linear(getattr(mlp, name), *factors[name]) for name in MLP_PROJECTIONS}
    if fused is None:
        for name, layer in converted.items():
            setattr(mlp, name, layer)
        return mlp
    return SVDMLP.from_projections(*(converted[name] for name in MLP_PROJECTIONS), activation=fused)
