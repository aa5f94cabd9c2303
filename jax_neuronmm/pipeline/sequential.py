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

import contextvars
import dataclasses
import functools
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.compress import svd
from jax_neuronmm.compress.projections import ATTENTION_GROUPS, ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from jax_neuronmm.compress.refit import DEFAULT_RIDGE, refit_v
from jax_neuronmm.models.layers import GatedMLP, activation_fn, attention_mask, fused_mlp_activation
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear
from jax_neuronmm.pipeline.local_finetune import LocalFinetuneOptions, finetune_mlp


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
    """Wraps a linear layer and appends each input it sees to `sink`, reshaped to [n, in_features]."""

    def __init__(self, inner: nnx.Module, sink: list):
        self.inner = inner
        self.sink = sink

    def __call__(self, x):
        self.sink.append(x.reshape(-1, x.shape[-1]))
        return self.inner(x)


def _tapped_forward(graphdef, state, x, positions, mask, taps):
    """Traced body of `record_inputs`: the layer rebuilt from (graphdef, state), its output and the inputs of the
    projections at `taps`."""
    layer = nnx.merge(graphdef, state)
    sinks = [[] for _ in taps]
    for (parent, name), sink in zip(taps, sinks):
        module = getattr(layer, parent)
        setattr(module, name, _Recorder(getattr(module, name), sink))
    return layer(x, positions, mask, None, None)[0], [sink[-1] for sink in sinks]


# One compilation per layer structure (graphdef: the modules and static fields such as the sliding window) and
# shapes: the decoder layers of a family share it, so calibrating an 18-layer model compiles one or two passes.
_tapped_forward_jit = jax.jit(_tapped_forward, static_argnums=(0, 5))


def record_inputs(layer, x, positions, mask, taps):
    """(layer(x, positions, mask)'s output [B, T, hidden], [the input [B*T, in_features] each projection at `taps`
    received, float32 numpy]), compiled. taps: (submodule, projection) attribute names, e.g. ("mlp", "gate_proj")."""
    output, inputs = _dispatch_pass(layer, x, positions, mask, taps)
    return output, _to_host(inputs)


def _dispatch_pass(layer, x, positions, mask, taps):
    """`record_inputs` without waiting: JAX runs the pass asynchronously and the recorded inputs stay device
    arrays until `_to_host`."""
    graphdef, state = nnx.split(layer)
    return _tapped_forward_jit(graphdef, state, x, positions, mask, tuple(taps))


def _to_host(inputs) -> list:
    return [np.asarray(recorded, np.float32) for recorded in inputs]


def calibration_batch(model, ids):
    """(hidden [B, T, hidden] after the embedding, positions [B, T], {sliding window: mask [B, T, T]})."""
    ids = jnp.asarray(ids, jnp.int32)
    windows = tuple(dict.fromkeys(layer.self_attn.spec.sliding_window for layer in model.layers))
    positions, masks = _positions_and_masks(ids.shape, windows)
    return model.embed(ids), positions, dict(zip(windows, masks))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _positions_and_masks(shape, windows):
    """positions [B, T] and one mask [B, T, T] per window, compiled as one program (run eagerly, each op
    would compile on its own)."""
    batch, tokens = shape
    positions = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    valid = jnp.ones((batch, tokens), bool)
    return positions, tuple(attention_mask(positions, positions, valid, window) for window in windows)


def compress_layers(
    model,
    dense,
    calibration_ids,
    include,
    ranks,
    method: str,
    options: LayerwiseOptions,
    *,
    output_chols: dict | None = None,
    decompositions: dict | None = None,
    progress: bool = True,
) -> None:
    """Replaces, in place, the projections of `model` (a clone of `dense`) by factored modules.

    ranks[(layer_index, projection_name)] -> rank, or None: that projection stays dense (an MLP with a dense
    projection keeps its GatedMLP, its other projections SVDLinear). method "svd" | "whitened". A fully factored MLP
    becomes one fused SVDMLP where `fused_mlp_activation` allows, else a GatedMLP of three SVDLinear.
    calibration_ids [B, T] may be None only for method "svd" without refit / local / sequential (then no model is
    run). output_chols
    {(layer_index, projection_name): L [N, N]} (method "whitened"): the output-side weighting of each projection's
    truncation (`svd.output_whitening` of `pipeline.fisher.output_grams`); projections it lacks are unweighted.
    decompositions {(layer_index, projection_name): (S, SVD, L)} (`sensitivity.kl_sensitivity` fills it, from the
    dense model's inputs on the same calibration windows): method "whitened" without sequential / refit / local then
    truncates them instead of running the calibration pass and the SVDs again (the same factors); it must hold every
    projection `include` selects.
    """
    if output_chols and method != "whitened":
        raise ValueError(f"output_chols: an output weighting of the whitened truncation; got method {method!r}")
    output_chols = output_chols or {}
    needs_data = method == "whitened" or options.refit or options.local is not None or options.sequential
    for layer in model.layers:
        if "mlp" in include and not isinstance(layer.mlp, GatedMLP):
            raise TypeError(f"model: MLP is a {type(layer.mlp).__name__}; is it compressed already?")
    bar = tqdm(total=len(model.layers), desc=f"compressing ({method})", disable=not progress, unit="layer")
    if decompositions:
        if method != "whitened" or options.sequential or options.refit or options.local is not None:
            raise ValueError(
                "decompositions: the dense model's whitened truncations, usable only by method 'whitened' without "
                f"sequential / refit / local; got method {method!r} with {options}"
            )
        with bar:
            _factor_decomposed(model.layers, include, ranks, decompositions, bar)
        return
    if not needs_data:
        with bar:
            _factor_without_data(model.layers, include, ranks, bar)
        return
    x_compressed, positions, masks = calibration_batch(model, calibration_ids)
    dense_passes = dense_calibration(dense.layers, x_compressed, positions, masks, calibration_taps(include))
    # BLAS pinned to one thread once for both lanes (threadpoolctl's limits are process-wide).
    with bar, svd.single_threaded_blas(), futures.ThreadPoolExecutor(1, thread_name_prefix="factor") as lane:
        for index, (layer, dense_inputs) in enumerate(zip(model.layers, dense_passes)):
            mask = masks[layer.self_attn.spec.sliding_window]

            def compressed_inputs(tap):
                return record_inputs(layer, x_compressed, positions, mask, [tap])[1][0]

            if "attention" in include:
                for group, dense_in in zip(ATTENTION_GROUPS, dense_inputs):
                    inputs = compressed_inputs(("self_attn", group[0])) if options.sequential else dense_in
                    chol = svd.whitening(inputs, damping=options.damping)[0] if method == "whitened" else None
                    for name in group:
                        if ranks[(index, name)] is None:
                            continue  # stays dense
                        linear = getattr(layer.self_attn, name)
                        u, v = _factor(
                            linear.kernel[...],
                            ranks[(index, name)],
                            method,
                            chol,
                            inputs,
                            dense_in,
                            options,
                            output_chols.get((index, name)),
                        )
                        setattr(layer.self_attn, name, SVDLinear.from_factors(linear, u, v))
            if "mlp" in include:
                dense_in, dense_hidden = dense_inputs[-2:]
                inputs = compressed_inputs(("mlp", "gate_proj")) if options.sequential else dense_in
                layer.mlp = _compress_mlp(
                    layer.mlp,
                    index,
                    inputs,
                    dense_in,
                    dense_hidden,
                    ranks,
                    method,
                    options,
                    lane,
                    output_chols,
                )
            if options.sequential:
                x_compressed = record_inputs(layer, x_compressed, positions, mask, [])[0]
            bar.update()


def calibration_taps(include) -> list:
    """The (submodule, projection) inputs calibration records: the first projection of each attention group, and
    the MLP's gate_proj and down_proj (the gated hidden)."""
    taps = [("self_attn", group[0]) for group in ATTENTION_GROUPS] if "attention" in include else []
    return taps + [("mlp", "gate_proj"), ("mlp", "down_proj")] if "mlp" in include else taps


def dense_calibration(layers, x, positions, masks, taps):
    """Yields, for each of the dense `layers` in order, [inputs [n, K] float32 recorded at `taps`], the layers fed
    their own outputs starting from x (one compiled pass per layer).

    The next layer's pass is dispatched before a layer's inputs are yielded, so JAX computes it on its own threads
    while the caller factors this layer on the host (single-threaded LAPACK): the passes cost almost no wall time.
    """
    pending = None
    for layer in layers:
        x, inputs = _dispatch_pass(layer, x, positions, masks[layer.self_attn.spec.sliding_window], taps)
        if pending is not None:
            yield _to_host(pending)
        pending = inputs
    if pending is not None:
        yield _to_host(pending)


def _factor(kernel, rank, method, chol, inputs, dense_inputs, options, out_chol=None):
    """(u, v) of kernel [K, N]: whitened with `chol` (outputs weighted by out_chol when given) or plain SVD, v
    refitted towards dense_inputs·kernel."""
    kernel = np.asarray(kernel)
    if method == "whitened":
        u, v = svd.whitened_factors(kernel, chol, rank, out_chol=out_chol)
    else:
        u, v = svd.truncated_svd(kernel, rank)
    if options.refit:
        v = refit_v(u, inputs, dense_inputs @ kernel.astype(np.float32), ridge=options.ridge)
    return u, v


def _selected(include) -> list:
    """The (submodule, projection) pairs of a layer that `include` selects."""
    attention = [("self_attn", name) for name in ATTENTION_PROJECTIONS] if "attention" in include else []
    return attention + ([("mlp", name) for name in MLP_PROJECTIONS] if "mlp" in include else [])


def _install(layer, include, factors) -> None:
    """Replaces layer's selected projections by their factors {projection name: (u, v)}; a selected projection
    without factors stays dense."""
    if "attention" in include:
        for name in ATTENTION_PROJECTIONS:
            if name in factors:
                setattr(layer.self_attn, name, SVDLinear.from_factors(getattr(layer.self_attn, name), *factors[name]))
    if "mlp" in include:
        layer.mlp = _mlp_module(layer.mlp, factors, fused_mlp_activation(layer.mlp))


def _factor_without_data(layers, include, ranks, bar) -> None:
    """Plain SVD of every projection `include` selects, two at a time (one per core; LAPACK releases the GIL),
    each layer's modules replaced once its factors are ready."""
    selected = _selected(include)
    with svd.single_threaded_blas(), futures.ThreadPoolExecutor(2, thread_name_prefix="factor") as pool:
        jobs = [
            {
                name: pool.submit(
                    svd.truncated_svd,
                    np.asarray(getattr(getattr(layer, parent), name).kernel[...]),
                    ranks[(index, name)],
                )
                for parent, name in selected
            }
            for index, layer in enumerate(layers)
        ]
        for layer, factors in zip(layers, jobs):
            _install(layer, include, {name: job.result() for name, job in factors.items()})
            bar.update()


def _factor_decomposed(layers, include, ranks, decompositions, bar) -> None:
    """Every projection `include` selects truncated from its precomputed whitened decomposition."""
    selected = _selected(include)
    missing = [(i, name) for i in range(len(layers)) for _, name in selected if (i, name) not in decompositions]
    if missing:
        raise ValueError(f"decompositions: no entry for {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for index, layer in enumerate(layers):
        factors = {}
        for parent, name in selected:
            if ranks[(index, name)] is None:
                continue  # stays dense
            chol, decomposition, out_chol = decompositions[(index, name)]
            kernel = np.asarray(getattr(getattr(layer, parent), name).kernel[...])
            factors[name] = svd.whitened_factors(kernel, chol, ranks[(index, name)], decomposition, out_chol)
        _install(layer, include, factors)
        bar.update()


def _gated_hidden(x, gate, up, activation):
    """act(x·gate) * (x·up) in float32 numpy; gate / up are kernels [K, I] or (u, v) pairs."""

    def project(weight):
        return x @ weight if not isinstance(weight, tuple) else (x @ weight[0]) @ weight[1]

    return np.asarray(activation_fn(activation)(jnp.asarray(project(gate))), np.float32) * project(up)


def _compress_mlp(
    mlp: GatedMLP,
    index,
    inputs,
    dense_inputs,
    dense_hidden,
    ranks,
    method,
    options,
    lane: futures.Executor,
    output_chols: dict,
):
    """The factored MLP. inputs / dense_inputs [n, hidden]: what the compressed / dense model feed it;
    dense_hidden [n, intermediate]: the dense MLP's down_proj input on dense_inputs; output_chols as in
    `compress_layers`.

    Factorizations that do not depend on each other run two at a time, one on `lane` (an executor with one
    worker): numpy's LAPACK releases the GIL, so single-threaded factorizations use two cores side by side.
    """
    kernels = {name: np.asarray(getattr(mlp, name).kernel[...], np.float32) for name in MLP_PROJECTIONS}
    whitened = method == "whitened"

    def factor(name, chol, x, dense_x):
        """name's (u, v), or its dense kernel when its rank is None."""
        if ranks[(index, name)] is None:
            return kernels[name]
        return _factor(
            kernels[name], ranks[(index, name)], method, chol, x, dense_x, options, output_chols.get((index, name))
        )

    def factor_down(hidden):
        chol = svd.whitening(hidden, damping=options.damping)[0] if whitened else None
        return factor("down_proj", chol, hidden, dense_hidden)

    # Without sequential, down_proj sees the dense model's hidden activations: it is factored beside gate/up. The
    # lane runs in this thread's context (a copy), so svd.damping_summary collects its damping too.
    down = (
        None
        if options.sequential or ranks[(index, "down_proj")] is None
        else lane.submit(contextvars.copy_context().run, factor_down, dense_hidden)
    )
    gate_up_factored = any(ranks[(index, name)] is not None for name in ("gate_proj", "up_proj"))
    chol = svd.whitening(inputs, damping=options.damping)[0] if whitened and gate_up_factored else None
    up = (
        lane.submit(contextvars.copy_context().run, factor, "up_proj", chol, inputs, dense_inputs)
        if options.sequential
        else None
    )
    factors = {"gate_proj": factor("gate_proj", chol, inputs, dense_inputs)}
    factors["up_proj"] = up.result() if up is not None else factor("up_proj", chol, inputs, dense_inputs)
    if ranks[(index, "down_proj")] is None:  # stays dense: no hidden activations to factor it on
        factors["down_proj"] = kernels["down_proj"]
    elif options.sequential:  # down_proj sees what the compressed gate/up produce
        factors["down_proj"] = factor_down(
            _gated_hidden(inputs, factors["gate_proj"], factors["up_proj"], mlp.activation)
        )
    else:
        factors["down_proj"] = down.result()
    factors = {name: weight for name, weight in factors.items() if isinstance(weight, tuple)}  # dense ones stay
    fused = fused_mlp_activation(mlp)
    if options.local is not None and fused is not None and len(factors) == len(MLP_PROJECTIONS):
        flat = {
            f"{name.split('_')[0]}_{part}": value for name, pair in factors.items() for part, value in zip("uv", pair)
        }
        tuned = finetune_mlp(flat, inputs, dense_hidden @ kernels["down_proj"], fused, options.local)
        factors = {
            name: (tuned[f"{name.split('_')[0]}_u"], tuned[f"{name.split('_')[0]}_v"]) for name in MLP_PROJECTIONS
        }
    return _mlp_module(mlp, factors, fused)


def _mlp_module(mlp: GatedMLP, factors: dict, fused: str | None):
    """SVDMLP (fused svd_mlp) when `fused` names its activation and every projection has factors; else the GatedMLP
    with an SVDLinear for each projection in `factors` {name: (u, v)} (the others stay dense)."""
    converted = {
        name: SVDLinear.from_factors(getattr(mlp, name), *factors[name]) for name in MLP_PROJECTIONS if name in factors
    }
    if fused is None or len(converted) < len(MLP_PROJECTIONS):
        for name, layer in converted.items():
            setattr(mlp, name, layer)
        return mlp
    return SVDMLP.from_projections(*(converted[name] for name in MLP_PROJECTIONS), activation=fused)
