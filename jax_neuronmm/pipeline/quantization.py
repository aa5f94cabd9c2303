"""quantize_model: a copy of a model whose projections and LM head hold fp8 e4m3 weights with fp32 scales.

Dense projections become `nn.nnx.Linear`, SVD-factored ones stay `SVDLinear` / `SVDMLP` (each factor quantized per
column), the LM head a Linear (a tied embedding stays bf16 for the lookup; the head gets its own transposed copy,
one scale per vocabulary entry), all in `WeightFormat.FP8_E4M3`, one scale per output channel. Without calibration
ids the values are rounded to nearest (`compress.quantize_fp8`); with them, dense weights are rounded with error
feedback against the Gram matrix of their inputs on the calibration tokens (`compress.gptq_fp8`, GPTQ), the inputs
recorded from the unquantized model (one pass over its layers). SVD factors stay rounded to nearest unless
`calibrate_factors` (then u against x's Gram matrix, v against that of x·u with its quantized u), which measured
worse than rounding to nearest, while GPTQ helps the dense projections and head (benchmarks/results/fp8_accuracy.md).

Quantized models generate through `decode_step` like any other: `models.decode.decode_plan` stacks their fp8 values
and scales as the step's operands (`DecodeSpec.fp8_weights` names them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.compress.gram import check_damping
from jax_neuronmm.compress.projections import ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from jax_neuronmm.compress.quantize import WEIGHT_DTYPES, gptq_fp8
from jax_neuronmm.compress.svd import single_threaded_blas
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.layers import GatedMLP, activation_fn
from jax_neuronmm.models.validation import check_token_windows
from jax_neuronmm.nn.nnx import SVDMLP, Linear, SVDLinear, describe
from jax_neuronmm.pipeline import sequential
from jax_neuronmm.reference import jnp_activation
from jax_neuronmm.weights import WeightFormat

TARGETS = ("attention", "mlp", "head")


def _quantized(module, where, gram=None, damping=None, calibrate_factors=False):
    """The fp8 module of a projection; gram: None (round to nearest) or XᵀX [K, K] of its inputs (GPTQ, for SVD
    factors only with calibrate_factors)."""
    fp8 = WeightFormat.FP8_E4M3
    if isinstance(module, nnx.Linear):
        if gram is None:
            return Linear.from_linear(module, fp8)
        values, scale = gptq_fp8(module.kernel[...], gram, damping=damping)
        bias = module.bias[...] if module.bias is not None else None
        return Linear(values, bias, kernel_scale=scale, dtype=module.dtype, precision=module.precision)
    if isinstance(module, SVDLinear) and not module.format.scaled:
        if gram is None or not calibrate_factors:
            return module.quantized(fp8)
        u, u_scale = gptq_fp8(module.u[...], gram, damping=damping)
        u64 = np.asarray(u, np.float64) * np.asarray(u_scale, np.float64)
        v, v_scale = gptq_fp8(module.v[...], u64.T @ gram @ u64, damping=damping)  # v's inputs: x·u (quantized)
        bias = module.bias[...] if module.bias is not None else None
        scales = dict(u_scale=u_scale, v_scale=v_scale)
        return SVDLinear.from_values(u, v, bias, **scales, dtype=module.dtype, precision=module.precision)
    raise TypeError(
        f"quantize_model: {where} is {describe(module)}; expected nnx.Linear or SVDLinear with float weights"
    )


class _Recorder(nnx.Module):
    """Wraps a module and appends each input it sees, as [n, features], to `sink`."""

    def __init__(self, inner, sink):
        self.inner = inner
        self.sink = sink

    def __call__(self, x, *args, **kwargs):
        self.sink.append(x.reshape(-1, x.shape[-1]))
        return self.inner(x, *args, **kwargs)


# Inputs recorded per layer: q/k/v share one, o_proj has its own, the MLP's projections share its input.
_TAPS = (("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp",))


def _tapped_layer(graphdef, state, x, positions, mask):
    layer = nnx.merge(graphdef, state)
    sinks = [[] for _ in _TAPS]
    for path, sink in zip(_TAPS, sinks):
        parent = layer
        for name in path[:-1]:
            parent = getattr(parent, name)
        setattr(parent, path[-1], _Recorder(getattr(parent, path[-1]), sink))
    return layer(x, positions, mask, None, None)[0], [sink[-1] for sink in sinks]


_tapped_layer_jit = jax.jit(_tapped_layer, static_argnums=(0,))


def _gram(inputs):
    x = np.asarray(inputs, np.float64)
    return x.T @ x


def _projected(layer, x):
    """x [n, K] float32 through a projection in float32: x·W (+ bias), fp8 values times their scales."""

    def f32(param):
        return param[...].astype(jnp.float32)

    scaled = isinstance(layer, (Linear, SVDLinear)) and layer.format.scaled
    if isinstance(layer, SVDLinear):
        xu = x @ f32(layer.u) * f32(layer.u_scale) if scaled else x @ f32(layer.u)
        out = xu @ f32(layer.v) * f32(layer.v_scale) if scaled else xu @ f32(layer.v)
    else:
        out = x @ f32(layer.kernel) * f32(layer.kernel_scale) if scaled else x @ f32(layer.kernel)
    return out if layer.bias is None else out + f32(layer.bias)


def _mlp_hidden(mlp, x):
    """The MLP's gated hidden act(x·Wg) * (x·Wu) [n, I] float32 (down_proj's input) for inputs x [n, H]; its
    projections dense or factored, in fp8 or not."""
    x = jnp.asarray(x, jnp.float32)
    act = jnp_activation(mlp.activation) if isinstance(mlp, SVDMLP) else activation_fn(mlp.activation)
    return np.asarray(act(_projected(mlp.gate_proj, x)) * _projected(mlp.up_proj, x), np.float32)


def _calibration_grams(model, ids, progress):
    """Yields per layer {"qkv", "o", "mlp", "down"}: the Gram matrices of the inputs each group of projections
    receives in `model` on the token ids, then (last) the Gram matrix of the LM head's input."""
    x, positions, masks = sequential.calibration_batch(model, ids)
    bar = tqdm(total=len(model.layers), desc="calibrating fp8", disable=not progress, unit="layer")
    with bar:
        for layer in model.layers:
            graphdef, state = nnx.split(layer)
            x, (qkv, o, mlp) = _tapped_layer_jit(
                graphdef, state, x, positions, masks[layer.self_attn.spec.sliding_window]
            )
            yield {"qkv": _gram(qkv), "o": _gram(o), "mlp": _gram(mlp), "down": _gram(_mlp_hidden(layer.mlp, mlp))}
            bar.update()
    hidden = np.asarray(model.norm(x), np.float32)
    yield _gram(hidden.reshape(-1, hidden.shape[-1]))


def quantize_model(
    model: CausalLM,
    weight_dtype="float8_e4m3",
    calibration_ids=None,
    targets=TARGETS,
    *,
    damping: float = 0.01,
    calibrate_factors: bool = False,
    progress: bool = True,
) -> CausalLM:
    """A copy of `model` with fp8 weights in `targets`; the input model is left unchanged.

    Args:
      model: a CausalLM (Llama, Gemma), dense or compressed by `compress_model`.
      weight_dtype: "float8_e4m3" (Trainium's e4m3, ±240, stored as float8_e4m3fn), the only format.
      calibration_ids: None (round to nearest), or token ids [B, T] of representative text: error-feedback
        rounding against each weight's calibration inputs (GPTQ, see the module docstring).
      targets: a subset of ("attention", "mlp", "head"): the attention projections, the MLPs, the LM head.
      damping: GPTQ's diagonal damping, a fraction of the Gram matrix's mean diagonal (a finite number >= 0:
        ValueError otherwise, checked with or without calibration_ids).
      calibrate_factors: with calibration_ids, round SVD factors with GPTQ too (measured worse: module docstring).
      progress: show a progress bar over the layers while calibrating.

    Returns:
      The quantized copy. Its `nnx.state` saves and loads with `compress.save_compressed` / `load_compressed`.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"quantize_model: weight_dtype={weight_dtype!r}; expected one of {WEIGHT_DTYPES}")
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets or set(targets) - set(TARGETS):
        raise ValueError(f"quantize_model: targets={targets!r}; expected a non-empty subset of {TARGETS}")
    if not isinstance(model, CausalLM):
        raise TypeError(f"quantize_model: model is a {type(model).__name__}; expected a CausalLM")
    damping = check_damping("quantize_model", damping)
    grams = None
    if calibration_ids is not None:
        ids = check_token_windows(calibration_ids, model.config.vocab_size, name="quantize_model: calibration_ids")
        grams = _calibration_grams(model, ids, progress)
    with single_threaded_blas():  # the Gram matrices and GPTQ's updates run beside JAX's threads
        return _quantize(model, targets, grams, damping, calibrate_factors)


def _quantize(model, targets, grams, damping, calibrate_factors):
    """quantize_model's work on a clone of `model`: each weight in `targets` rounded with its Gram matrix from
    `grams` (a `_calibration_grams` generator, consumed layer by layer), or to nearest when grams is None."""
    quantized = nnx.clone(model)
    for index, layer in enumerate(quantized.layers):
        gram = next(grams) if grams is not None else {}
        if "attention" in targets:
            for name in ATTENTION_PROJECTIONS:
                module = getattr(layer.self_attn, name)
                group = gram.get("o" if name == "o_proj" else "qkv")
                where = f"layer {index} {name}"
                setattr(layer.self_attn, name, _quantized(module, where, group, damping, calibrate_factors))
        if "mlp" in targets:
            mlp = layer.mlp
            if not isinstance(mlp, (SVDMLP, GatedMLP)):
                raise TypeError(f"quantize_model: layer {index} mlp is a {type(mlp).__name__}")
            projections = {
                name: _quantized(
                    getattr(mlp, name),
                    f"layer {index} mlp.{name}",
                    gram.get("down" if name == "down_proj" else "mlp"),
                    damping,
                    calibrate_factors,
                )
                for name in MLP_PROJECTIONS
            }
            if isinstance(mlp, SVDMLP):
                layer.mlp = SVDMLP.from_projections(*projections.values(), activation=mlp.activation)
            else:
                for name, module in projections.items():
                    setattr(mlp, name, module)
    if "head" in targets:
        head_gram = next(grams) if grams is not None else None
        if quantized.lm_head is None:
            # lm_head was None (static); the head now holds data.
            embed = quantized.embed_tokens
            if head_gram is None:
                head = Linear.from_embedding(embed, WeightFormat.FP8_E4M3)
            else:
                values, scale = gptq_fp8(embed.embedding[...].T, head_gram, damping=damping)
                head = Linear(values, kernel_scale=scale, dtype=embed.dtype)
            quantized.lm_head = nnx.data(head)
        else:
            quantized.lm_head = _quantized(quantized.lm_head, "lm_head", head_gram, damping, calibrate_factors)
    return quantized
