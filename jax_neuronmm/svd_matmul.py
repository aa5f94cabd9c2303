"""The `svd_matmul` primitive: y = (x·u)·v in one fused operation.

x [..., K], u [K, r], v [r, N] -> y [..., N]; internally the operands may carry `n_batch` leading dims shared by
all three (vmap over stacked weights). With fp8 factors u_scale [*B, r] and v_scale [*B, N] follow and
y = ((x·u)·diag(u_scale))·v·diag(v_scale), differentiable in x only. The file holds the op's whole story: the
public function, the primitive's rules (the transpose in x is svd_matmul with vᵀ, uᵀ), then the XLA reference, the
kernel launches and the sharding factor rule, registered at the bottom.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_neuronmm import explicit_sharding, lowering, shapes
from jax_neuronmm._compat import Primitive, ad, apply_primitive, batching
from jax_neuronmm.kernel_calls import KernelLaunches, array_namespace, fp8_weight_dtype, kernel_fp8, split_leading
from jax_neuronmm.reference import batched_dot, swap_last, token_contract
from jax_neuronmm.shapes import accumulation_dtype
from jax_neuronmm.sharding import FactorRule, check_varying_axes, leading_factors, match_varying_axes
from nki_kernels import dispatch

svd_matmul_p = Primitive("svd_matmul")
svd_matmul_p.def_impl(functools.partial(apply_primitive, svd_matmul_p))


def svd_matmul(x, u, v, *, u_scale=None, v_scale=None, precision=None, preferred_element_type=None, out_sharding=None):
    """Low-rank product (x·u)·v as one fused operation; with fp8 factors ((x·u)·diag(u_scale))·v·diag(v_scale).

    Args:
      x: activations [..., K]; leading dims are tokens (their product may be 0).
      u: left factor [K, r].
      v: right factor [r, N].
      u_scale, v_scale: None for float factors (x's dtype). With fp8 factors (u and v float8_e4m3fn or
        float8_e4m3, the same bits, holding Trainium e4m3 values, |value| ≤ 240; see `compress.quantize_fp8`)
        both are required: float32 per-column scales u_scale [r] and v_scale [N]. Values known at call time
        beyond ±240 (or NaN), or NaN / ±inf scales, are a ValueError; traced ones read as NaN on every backend,
        as on the device (`shapes.fp8_read`). fp8 factors are inference-only: x is differentiable, u, v and the
        scales are not.
      precision: None, a `jax.lax.Precision` (or its name), or a pair of them.
      preferred_element_type: dtype of the result; defaults to x's dtype.
        Products accumulate in float32 either way (float64 for float64 inputs).
      out_sharding: as in `jnp.matmul`: None, a NamedSharding or a PartitionSpec of the
        result under Explicit mesh axes; needed when K or r is split in both operands
        that contract it (see explicit_sharding.py).

    Returns:
      [..., N] in `preferred_element_type` (or x's dtype). The rank-r intermediate (scaled by u_scale) is
      rounded to x's dtype, as the kernels keep it in SBUF.
    """
    op = "svd_matmul"
    x, u, v = jnp.asarray(x), shapes.fp8_storage(jnp.asarray(u)), shapes.fp8_storage(jnp.asarray(v))
    scales = [None if s is None else jnp.asarray(s) for s in (u_scale, v_scale)]
    shapes.check_activations(op, "x", x)
    shapes.check_matrix(op, "u", u, rows=x.shape[-1], rows_from="x.shape[-1] (K)")
    shapes.check_matrix(op, "v", v, rows=u.shape[1], rows_from="u.shape[1] (rank r)")
    if shapes.check_scaled_factors(op, [("u", u, "v", v, *scales)]):
        shapes.check_float_dtypes(op, {"x": x})
        shapes.check_fp8_contents(op, {"u": u, "v": v, "u_scale": scales[0], "v_scale": scales[1]})
        operands = (x, u, v, *scales)
    else:
        shapes.check_float_dtypes(op, {"x": x, "u": u, "v": v})
        operands = (x, u, v)
    out_dtype = shapes.result_dtype(op, x.dtype, preferred_element_type)
    out_sharding = explicit_sharding.check_out_sharding(op, out_sharding, x.ndim)
    operands = match_varying_axes(*operands)  # inside shard_map: see sharding.py
    return svd_matmul_p.bind(
        *operands,
        n_batch=0,
        precision=shapes.canonical_precision(op, precision),
        out_dtype=out_dtype,
        out_sharding=out_sharding,
    )


OPERAND_NAMES = ("x", "u", "v", "u_scale", "v_scale")  # the last two only with fp8 factors


def _bind(*operands, **params):
    return svd_matmul_p.bind(*match_varying_axes(*operands), **params)


@svd_matmul_p.def_abstract_eval
def _abstract_eval(x, u, v, *scales, n_batch, precision, out_dtype, out_sharding):
    del precision
    operands = (x, u, v, *scales)
    names = OPERAND_NAMES[: len(operands)]
    check_varying_axes("svd_matmul", names, operands)
    sharding = explicit_sharding.result_sharding(
        "svd_matmul", factor_rule(n_batch, x.ndim, len(operands)), names, operands, out_sharding
    )
    return x.update(shape=x.shape[:-1] + v.shape[-1:], dtype=out_dtype, weak_type=False, sharding=sharding)


def check_weights_constant(op, names, tangents):
    """fp8 weights and their scales are inference-only: a tangent for any of them is an error."""
    varying = [n for n, t in zip(names, tangents) if type(t) is not ad.Zero]
    if varying:
        raise TypeError(
            f"{op}: cannot differentiate with respect to {', '.join(varying)}: fp8 factors and their scales are "
            f"inference-only (only x is differentiable); quantize after training, or differentiate float factors"
        )


def _jvp(primals, tangents, **params):
    if len(primals) > 3:
        check_weights_constant("svd_matmul", OPERAND_NAMES[1:], tangents[1:])
        return _bind(*primals, **params), _bind(tangents[0], *primals[1:], **params)
    x, u, v = primals
    dx, du, dv = tangents
    y = _bind(x, u, v, **params)
    terms = []
    if type(dx) is not ad.Zero:
        terms.append(_bind(dx, u, v, **params))
    if type(du) is not ad.Zero:
        terms.append(_bind(x, du, v, **params))
    if type(dv) is not ad.Zero:
        terms.append(_bind(x, u, dv, **params))
    if not terms:
        return y, ad.Zero(y.aval.to_tangent_aval())
    return y, functools.reduce(jnp.add, terms)


def _transpose(ct, x, u, v, *scales, n_batch, precision, out_dtype, out_sharding):
    undefined = [ad.is_undefined_primal(a) for a in (x, u, v, *scales)]
    if sum(undefined) != 1 or (scales and not undefined[0]):
        raise NotImplementedError("svd_matmul is linear in one operand at a time (in x only with fp8 factors)")
    target = (x, u, v, *scales)[undefined.index(True)].aval
    if type(ct) is ad.Zero:
        return [ad.Zero(target.to_tangent_aval()) if d else None for d in undefined]
    ct = ct.astype(target.dtype)
    if scales:
        # y = ((x·u)·diag(su))·v·diag(sv)  =>  x̄ = ((ȳ·diag(sv))·vᵀ)·diag(su)·uᵀ: scaled fp8 factors again, the
        # second one with unit scales.
        u_scale, v_scale = scales
        acc = accumulation_dtype(ct.dtype)
        ct_scaled = (ct.astype(acc) * per_column(v_scale, ct, n_batch).astype(acc)).astype(ct.dtype)
        ones = jnp.ones(u_scale.shape[:n_batch] + u.shape[-2:-1], u_scale.dtype)
        ct_x = _bind(
            ct_scaled,
            swap_last(v),
            swap_last(u),
            u_scale,
            ones,
            n_batch=n_batch,
            precision=precision,
            out_dtype=np.dtype(target.dtype),
            out_sharding=explicit_sharding.sharding_of(target),
        )
        return [ct_x, None, None, None, None]
    if undefined[0]:
        # y = x·u·v  =>  x̄ = ȳ·vᵀ·uᵀ: again a fused low-rank product.
        ct_x = _bind(
            ct,
            swap_last(v),
            swap_last(u),
            n_batch=n_batch,
            precision=precision,
            out_dtype=np.dtype(target.dtype),
            out_sharding=explicit_sharding.sharding_of(target),
        )
        return [ct_x, None, None]
    # Under Explicit mesh axes cotangents are typed like their primals (as lax.dot_general's transpose does).
    if undefined[1]:
        ct_v = batched_dot(
            ct,
            swap_last(v),
            n_batch,
            precision,
            target.dtype,  # ȳ·vᵀ [*B, *T, r]
            out_sharding=explicit_sharding.rank_intermediate_sharding(jax.typeof(ct), target, -1),
        )
        return [
            None,
            token_contract(
                x, ct_v, n_batch, precision, target.dtype, out_sharding=explicit_sharding.sharding_of(target)
            ),
            None,
        ]
    xu = batched_dot(
        x,
        u,
        n_batch,
        precision,
        x.dtype,  # rounded as in the forward pass
        out_sharding=explicit_sharding.rank_intermediate_sharding(jax.typeof(x), target, -2),
    )
    return [
        None,
        None,
        token_contract(xu, ct, n_batch, precision, target.dtype, out_sharding=explicit_sharding.sharding_of(target)),
    ]


def _batch(args, dims, *, n_batch, out_sharding, **params):
    x, *weights = args
    bx = dims[0]
    if all(d is None for d in dims[1:]):
        # Only activations are batched: the new axis is one more token dim.
        out_sharding = explicit_sharding.batched_out_sharding(out_sharding, n_batch, x, bx)
        return (
            _bind(jnp.moveaxis(x, bx, n_batch), *weights, n_batch=n_batch, out_sharding=out_sharding, **params),
            n_batch,
        )
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    batched = next(i for i, d in enumerate(dims) if d is not None)
    out_sharding = explicit_sharding.batched_out_sharding(out_sharding, 0, args[batched], dims[batched])
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
    return _bind(*args, n_batch=n_batch + 1, out_sharding=out_sharding, **params), 0


# --- Lowering: the XLA reference, the kernel launches, the factor rule ---------------------------------------


def per_column(scale, a, n_batch):
    """scale [*B, C] shaped to broadcast against a [*B, *T, C]."""
    return scale.reshape(scale.shape[:n_batch] + (1,) * (a.ndim - n_batch - 1) + scale.shape[-1:])


def svd_matmul_ref(x, u, v, u_scale=None, v_scale=None, *, n_batch=0, precision=None, out_dtype=None):
    """(x·u)·v with the intermediate rounded to x's dtype; result in out_dtype (the XLA lowering).

    x [*B, *T, K], u [*B, K, r], v [*B, r, N] -> [*B, *T, N]; B: the n_batch leading dims.
    With fp8 factors and scales u_scale [*B, r], v_scale [*B, N] it computes what the kernels do: fp8 values
    widened to x's dtype (exact; NaN beyond ±240, as Trainium reads them: `shapes.fp8_read`), products
    accumulated in float32, the float32 sum scaled by u_scale and rounded to x's dtype, then the second
    product's float32 sum scaled by v_scale and rounded to out_dtype.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if u_scale is None:
        xu = batched_dot(x, u, n_batch, precision, x.dtype)
        return batched_dot(xu, v, n_batch, precision, out_dtype)
    acc = accumulation_dtype(x.dtype)
    xu = batched_dot(x, shapes.fp8_read(u).astype(x.dtype), n_batch, precision, acc)
    xu = (xu * per_column(u_scale, xu, n_batch).astype(acc)).astype(x.dtype)
    y = batched_dot(xu, shapes.fp8_read(v).astype(x.dtype), n_batch, precision, acc)
    return (y * per_column(v_scale, y, n_batch).astype(acc)).astype(out_dtype)


def _plan(x, u, v, *scales, target, n_batch, **unused_params):
    """(kernel, block kwargs) for one launch per batch element, or None when the result is empty."""
    _, _, _, t = split_leading(x, n_batch, 1)
    k, r, n = x.shape[-1], u.shape[-1], v.shape[-1]
    weight_dtype = fp8_weight_dtype("svd_matmul", x.dtype) if scales else None
    if 0 in (t, k, r, n):
        return None
    return dispatch.svd_matmul_plan(t, k, r, n, x.dtype, target, weight_dtype=weight_dtype)


def _run(plan, x, u, v, *scales, n_batch, precision, out_dtype):
    """(x·u)·v through the fused kernel: x [*B, *T, K], u [*B, K, r], v [*B, r, N] (, u_scale [*B, r],
    v_scale [*B, N] with fp8 factors) -> [*B, *T, N]."""
    del precision  # the kernels always accumulate in fp32 PSUM
    xp = array_namespace(x)
    batch, tokens, n_flat, t = split_leading(x, n_batch, 1)
    k, r, n = x.shape[-1], u.shape[-1], v.shape[-1]
    out_shape = batch + tokens + (n,)
    if plan is None:
        return xp.zeros(out_shape, out_dtype)
    kernel, blocks = plan
    if scales:
        u, v = kernel_fp8(u), kernel_fp8(v)
    xs, us, vs = x.reshape(n_flat, t, k), u.reshape(n_flat, k, r), v.reshape(n_flat, r, n)
    flat_scales = [s.reshape(n_flat, s.shape[-1]) for s in scales]
    ys = [kernel(xs[b], us[b], vs[b], *(s[b] for s in flat_scales), **blocks) for b in range(n_flat)]
    return xp.stack(ys).reshape(out_shape).astype(out_dtype)


def factor_rule(n_batch, x_ndim, n_operands=3):
    """x [*B, *T, k], u [*B, k, r], v [*B, r, n] (, u_scale [*B, r], v_scale [*B, n]) -> [*B, *T, n]; k and r
    are summed; scales split with their factor's columns (a scale multiplies its column before the sum)."""
    batch, tokens = leading_factors(n_batch, x_ndim)
    scales = (batch + ("r",), batch + ("n",)) if n_operands > 3 else ()
    return FactorRule(
        operands=(batch + tokens + ("k",), batch + ("k", "r"), batch + ("r", "n"), *scales),
        result=batch + tokens + ("n",),
        reduction=("k", "r"),
    )


ad.primitive_jvps[svd_matmul_p] = _jvp
ad.primitive_transposes[svd_matmul_p] = _transpose
batching.primitive_batchers[svd_matmul_p] = _batch
lowering.register(
    svd_matmul_p, reference=svd_matmul_ref, kernels=KernelLaunches("svd_matmul", _plan, _run), partitioning=factor_rule
)
