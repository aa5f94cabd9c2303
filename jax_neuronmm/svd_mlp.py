"""The `svd_mlp` primitive: a gated MLP whose three projections are low rank.

y = (act(x·Ug·Vg) * (x·Uu·Vu))·Ud·Vd with act ∈ {silu, gelu_tanh}; gate, up and down are `Factored` weights
(with scales when fp8). On Trainium it is two kernel calls (gate+up with the activation applied as PSUM is
evicted, written transposed; then down). Its JVP is that of the same computation written with `svd_matmul`, so
reverse mode runs through svd_matmul's kernels and needs no transpose rule here.
"""

import functools

import jax
import jax.numpy as jnp

from jax_neuronmm import explicit_sharding, lowering, shapes
from jax_neuronmm._compat import Primitive, ad, apply_primitive, batching
from jax_neuronmm.kernel_calls import KernelLaunches, array_namespace, fp8_weight_dtype, kernel_fp8, split_leading
from jax_neuronmm.reference import jnp_activation
from jax_neuronmm.shapes import accumulation_dtype
from jax_neuronmm.sharding import FactorRule, check_varying_axes, leading_factors, match_varying_axes
from jax_neuronmm.svd_matmul import check_weights_constant, svd_matmul_p, svd_matmul_ref
from jax_neuronmm.weights import factored_parts
from nki_kernels import dispatch
from nki_kernels.activations import FUSED_ACTIVATIONS

svd_mlp_p = Primitive("svd_mlp")
svd_mlp_p.def_impl(functools.partial(apply_primitive, svd_mlp_p))

PROJECTIONS = ("gate", "up", "down")
# The primitive's operands after x: the six factors, then (fp8 only) their six scales.
WEIGHT_NAMES = tuple(f"{p}.{f}" for p in PROJECTIONS for f in ("u", "v"))
SCALE_NAMES = tuple(f"{name}_scale" for name in WEIGHT_NAMES)


def svd_mlp(x, gate, up, down, *, activation="silu", precision=None, preferred_element_type=None, out_sharding=None):
    """Gated low-rank MLP (act(x·Ug·Vg) * (x·Uu·Vu))·Ud·Vd as one fused operation.

    With fp8 factors (all six float8_e4m3fn or float8_e4m3, values within ±240, see `compress.quantize_fp8`;
    values known at call time beyond it, or NaN / ±inf scales, are a ValueError) every weight carries its float32
    per-column scales (gate: u_scale [rg], v_scale [I]; up: [ru], [I]; down: [rd], [H_out]) and each projection is
    `svd_matmul`'s ((x·u)·diag(u_scale))·v·diag(v_scale). fp8 factors are inference-only (x is differentiable).

    Args:
      x: activations [..., H].
      gate, up: `Factored(u [H, r], v [r, I])` (r may differ), with u_scale, v_scale when fp8.
      down: `Factored(u [I, rd], v [rd, H_out])`, with scales when fp8.
      activation: "silu" (Llama) or "gelu_tanh" (Gemma), applied to the gate.
      precision: as in `svd_matmul`.
      preferred_element_type: dtype of the result; defaults to x's dtype.
      out_sharding: as in `svd_matmul`; needed under Explicit mesh axes when the
        intermediate size I or the down rank is split on both sides (Megatron layout).

    Returns:
      [..., H_out].
    """
    op = "svd_mlp"
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"{op}: activation={activation!r}; expected one of {sorted(FUSED_ACTIVATIONS)}")
    x = jnp.asarray(x)
    weights, scales = {}, {}
    for projection, weight in zip(PROJECTIONS, (gate, up, down)):
        u, v, u_scale, v_scale = factored_parts(op, projection, weight)
        weights[f"{projection}.u"], weights[f"{projection}.v"] = u, v
        scales[f"{projection}.u_scale"], scales[f"{projection}.v_scale"] = u_scale, v_scale
    shapes.check_activations(op, "x", x)
    hidden = x.shape[-1]
    shapes.check_matrix(op, "gate.u", weights["gate.u"], rows=hidden, rows_from="x.shape[-1] (H)")
    shapes.check_matrix(op, "gate.v", weights["gate.v"], rows=weights["gate.u"].shape[1], rows_from="gate.u.shape[1]")
    shapes.check_matrix(op, "up.u", weights["up.u"], rows=hidden, rows_from="x.shape[-1] (H)")
    shapes.check_matrix(op, "up.v", weights["up.v"], rows=weights["up.u"].shape[1], rows_from="up.u.shape[1]")
    intermediate = weights["gate.v"].shape[1]
    if weights["up.v"].shape[1] != intermediate:
        raise ValueError(
            f"{op}: up.v has shape {tuple(weights['up.v'].shape)}; its second dim must equal "
            f"gate.v.shape[1] (intermediate size I) = {intermediate}"
        )
    shapes.check_matrix(
        op, "down.u", weights["down.u"], rows=intermediate, rows_from="gate.v.shape[1] (intermediate size I)"
    )
    shapes.check_matrix(op, "down.v", weights["down.v"], rows=weights["down.u"].shape[1], rows_from="down.u.shape[1]")
    pairs = [
        (u_name, weights[u_name], v_name, weights[v_name], scales[f"{u_name}_scale"], scales[f"{v_name}_scale"])
        for u_name, v_name in zip(WEIGHT_NAMES[::2], WEIGHT_NAMES[1::2])
    ]
    if shapes.check_scaled_factors(op, pairs):
        shapes.check_float_dtypes(op, {"x": x})
        shapes.check_fp8_contents(op, {**weights, **scales})
        operands = (x, *weights.values(), *scales.values())
    else:
        shapes.check_float_dtypes(op, {"x": x, **weights})
        operands = (x, *weights.values())
    out_dtype = shapes.result_dtype(op, x.dtype, preferred_element_type)
    out_sharding = explicit_sharding.check_out_sharding(op, out_sharding, x.ndim)
    operands = match_varying_axes(*operands)  # inside shard_map: see sharding.py
    return svd_mlp_p.bind(
        *operands,
        activation=activation,
        n_batch=0,
        precision=shapes.canonical_precision(op, precision),
        out_dtype=out_dtype,
        out_sharding=out_sharding,
    )


@svd_mlp_p.def_abstract_eval
def _abstract_eval(x, *weights, activation, n_batch, precision, out_dtype, out_sharding):
    names = (("x",) + WEIGHT_NAMES + SCALE_NAMES)[: 1 + len(weights)]
    check_varying_axes("svd_mlp", names, (x,) + weights)
    sharding = explicit_sharding.result_sharding(
        "svd_mlp", factor_rule(n_batch, x.ndim, 1 + len(weights)), names, (x,) + weights, out_sharding
    )
    down_v = weights[5]
    return x.update(shape=x.shape[:-1] + down_v.shape[-1:], dtype=out_dtype, weak_type=False, sharding=sharding)


def _composite(x, *weights, activation, n_batch, precision, out_dtype, out_sharding):
    """svd_mlp written with svd_matmul (weights: the six factors, then their six scales with fp8 factors);
    numerically the same as the fused op."""
    gate_u, gate_v, up_u, up_v, down_u, down_v = weights[:6]
    gate_scales, up_scales, down_scales = (weights[6:8], weights[8:10], weights[10:12]) if weights[6:] else ((),) * 3
    acc = accumulation_dtype(x.dtype)
    mm = functools.partial(svd_matmul_p.bind, n_batch=n_batch, precision=precision)
    gate = mm(x, gate_u, gate_v, *gate_scales, out_dtype=acc, out_sharding=None)
    up = mm(x, up_u, up_v, *up_scales, out_dtype=acc, out_sharding=None)
    hidden = (jnp_activation(activation)(gate) * up).astype(x.dtype)
    return mm(hidden, down_u, down_v, *down_scales, out_dtype=out_dtype, out_sharding=out_sharding)


def _jvp(primals, tangents, **params):
    if len(primals) > 7:
        check_weights_constant("svd_mlp", WEIGHT_NAMES + SCALE_NAMES, tangents[1:])
        x, weights = primals[0], primals[1:]
        return jax.jvp(lambda x: _composite(x, *weights, **params), (x,), (ad.instantiate_zeros(tangents[0]),))
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(functools.partial(_composite, **params), tuple(primals), tangents)


def _batch(args, dims, *, n_batch, out_sharding, **params):
    if all(d is None for d in dims[1:]):
        out_sharding = explicit_sharding.batched_out_sharding(out_sharding, n_batch, args[0], dims[0])
        x = jnp.moveaxis(args[0], dims[0], n_batch)
        return svd_mlp_p.bind(x, *args[1:], n_batch=n_batch, out_sharding=out_sharding, **params), n_batch
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    batched = next(i for i, d in enumerate(dims) if d is not None)
    out_sharding = explicit_sharding.batched_out_sharding(out_sharding, 0, args[batched], dims[batched])
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
    return svd_mlp_p.bind(*args, n_batch=n_batch + 1, out_sharding=out_sharding, **params), 0


# --- Lowering: the XLA reference, the kernel launches, the factor rule ---------------------------------------


def svd_mlp_ref(x, *weights, activation="silu", n_batch=0, precision=None, out_dtype=None):
    """(act(x·Ug·Vg) * (x·Uu·Vu))·Ud·Vd; gate and up stay in float32 until the product (the XLA lowering).

    weights: the flat operands (gate.u, gate.v, up.u, up.v, down.u, down.v, then with fp8 factors their six
    scales); each projection is `svd_matmul_ref` (fp8: scaled float32 sums).
    """
    gate_u, gate_v, up_u, up_v, down_u, down_v = weights[:6]
    gate_scales, up_scales, down_scales = (weights[6:8], weights[8:10], weights[10:12]) if weights[6:] else ((),) * 3
    out_dtype = x.dtype if out_dtype is None else out_dtype
    acc = accumulation_dtype(x.dtype)
    mm = functools.partial(svd_matmul_ref, n_batch=n_batch, precision=precision)
    gate = mm(x, gate_u, gate_v, *gate_scales, out_dtype=acc)
    up = mm(x, up_u, up_v, *up_scales, out_dtype=acc)
    hidden = (jnp_activation(activation)(gate) * up).astype(x.dtype)
    return mm(hidden, down_u, down_v, *down_scales, out_dtype=out_dtype)


def _plan(x, *weights, target, activation, n_batch, **unused_params):
    """((gate_up kernel, kwargs), (down kernel, kwargs)) per batch element, or None when the result is empty."""
    (gate_u, gate_v, up_u, _, down_u, down_v), scales = weights[:6], weights[6:]
    weight_dtype = fp8_weight_dtype("svd_mlp", x.dtype) if scales else None
    _, _, _, t = split_leading(x, n_batch, 1)
    h, i, h_out = x.shape[-1], gate_v.shape[-1], down_v.shape[-1]
    ranks = gate_u.shape[-1], up_u.shape[-1], down_u.shape[-1]
    if 0 in (t, h, i, h_out, *ranks):
        # An empty contraction makes gate and up 0, and act(0) * 0 = 0 for both activations.
        return None
    return dispatch.svd_mlp_plan(t, h, i, *ranks, x.dtype, target, activation=activation, weight_dtype=weight_dtype)


def _run(plan, x, *weights, activation, n_batch, precision, out_dtype):
    """The gated low-rank MLP as two kernel launches per batch element (gate+up → hᵀ [I, T]; down → [T, H]);
    weights: the six factors, then their six scales with fp8 factors."""
    del activation, precision  # the plan carries the activation; the kernels accumulate in fp32 PSUM
    xp = array_namespace(x)
    batch, tokens, n_flat, t = split_leading(x, n_batch, 1)
    out_shape = batch + tokens + (weights[5].shape[-1],)
    if plan is None:
        return xp.zeros(out_shape, out_dtype)
    (gate_up, gate_up_kwargs), (down, down_kwargs) = plan
    factors, scales = weights[:6], weights[6:]
    if scales:
        factors = [kernel_fp8(w) for w in factors]
    flat = [a.reshape((n_flat,) + a.shape[n_batch:]) for a in (*factors, *scales)]
    xs = x.reshape(n_flat, t, x.shape[-1])
    ys = []
    for b in range(n_flat):
        gu, gv, uu, uv, du, dv, *s = (w[b] for w in flat)
        gate_up_scales, down_scales = s[:4], s[4:]
        hidden_t = gate_up(xs[b], gu, gv, uu, uv, *gate_up_scales, **gate_up_kwargs)
        ys.append(down(hidden_t, du, dv, *down_scales, **down_kwargs))
    return xp.stack(ys).reshape(out_shape).astype(out_dtype)


def factor_rule(n_batch, x_ndim, n_operands=7):
    """x [*B, *T, h], gate.u [*B, h, rg], gate.v [*B, rg, i], up.u [*B, h, ru], up.v [*B, ru, i],
    down.u [*B, i, rd], down.v [*B, rd, o] -> [*B, *T, o]: i and rd summed (Megatron), h, rg, ru never split
    (they feed the activation). With fp8 factors the six scales follow, each split with its factor's columns:
    [*B, rg], [*B, i], [*B, ru], [*B, i], [*B, rd], [*B, o]."""
    batch, tokens = leading_factors(n_batch, x_ndim)
    scales = tuple(batch + (f,) for f in ("rg", "i", "ru", "i", "rd", "o")) if n_operands > 7 else ()
    return FactorRule(
        operands=(
            batch + tokens + ("h",),
            batch + ("h", "rg"),
            batch + ("rg", "i"),
            batch + ("h", "ru"),
            batch + ("ru", "i"),
            batch + ("i", "rd"),
            batch + ("rd", "o"),
            *scales,
        ),
        result=batch + tokens + ("o",),
        reduction=("i", "rd"),
        need_replication=("h", "rg", "ru"),
    )


ad.primitive_jvps[svd_mlp_p] = _jvp
batching.primitive_batchers[svd_mlp_p] = _batch
lowering.register(
    svd_mlp_p, reference=svd_mlp_ref, kernels=KernelLaunches("svd_mlp", _plan, _run), partitioning=factor_rule
)
