"""The `decode_step` primitive: one decode step over every decoder layer, then the final norm and the LM head.

    logits, k_cache, v_cache = decode_step(x, norms, qk_norms, q, k, v, o, gate, up, down, k_cache, v_cache,
                                           write_index, cos, sin, mask_bias, final_norm, head, spec=spec)

The operands are `nki_kernels.decode.DecodeOperands`' fields, in order (their shapes and dtypes are described
there once; `spec` is a `nki_kernels.decode.DecodeSpec`), with L = spec.num_layers:
  x [B, T, H] (embedded tokens), norms [L, 2 or 4, H], qk_norms [L, 2, D] or None,
  q, k, v, o, gate, up, down: each a dense [L, K, N] or a factored pair (u [L, K, Rmax], v [L, Rmax, N]), layer l
    using the first spec.ranks[...][l] columns / rows (the rest zeros),
  k_cache, v_cache [L, B, S, kv_heads, D] (this step's keys / values are written at slots
    [write_index, write_index + T)), write_index [1, 1] int32,
  cos, sin [NR, B, T, D] float32, mask_bias [NM, B, T, S] float32, final_norm [H], head: dense [H, V] or a pair
    (u [H, r], v [r, V]).
Results: logits [B, T, V] float32 (final soft-cap applied), the updated k_cache and v_cache.

fp8 weights: a weight named in spec.fp8_weights is given as float8_e4m3fn values within ±240
(`compress.quantize_fp8`) with float32 per-output-column scales: a dense one as
`nki_kernels.decode.Quantized(w [L, K, N], scale [L, N])`, a factored one as
`nki_kernels.decode.Factored(u, v, u_scale [L, Rmax], v_scale [L, N])` (the head's without the L axis). Both backends
compute x·W as (x·values)·diag(scale): the values widened to x's dtype, the products summed in float32, the sum
scaled, then rounded (for factors: ((x·u)·diag(u_scale)) rounded to x's dtype, then ·v·diag(v_scale)), which is
what the kernels do as they evict PSUM. The kernels need bf16 or fp16 x beside fp8 weights.

The primitive binds the operands as a pytree: `decode_step_p` takes the DecodeOperands' leaves, and its structure
(`treedef`, a static parameter; a function of the spec) regroups them, so a factored pair is a
`nki_kernels.decode.Factored` (an fp8 dense weight a `Quantized`) everywhere past the public function.

Backends: "xla" lowers to a `lax.scan` over the layers of `decoder_math.decoder_layer`, the same function the
models' layers call; "emulator" runs the looped NKI kernel (one launch per step) on the CPU emulator in a host
callback; "neuron" traces the same kernel call for Trainium. vmap over batch rows folds the rows into B (one
launch); a batched write_index or batched weights run as a `lax.map` of steps. Inference only: differentiating
it raises.

Bad operands raise a ValueError / TypeError naming the argument (`shapes.check_decode_operands`, i.e. the
contract's `check`). A write_index outside [0, S - T] is rejected on every backend: at the call when it is concrete,
else when the step runs (on the XLA backend a host callback that fires only for a bad index; the error reaches the
caller wrapped in JAX's runtime error), never clamped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_neuronmm import decoder_math, lowering, shapes
from jax_neuronmm._compat import Primitive, ad, apply_primitive, batching
from jax_neuronmm.kernel_calls import KernelLaunches, kernel_fp8
from jax_neuronmm.svd_matmul import svd_matmul_ref
from jax_neuronmm.svd_mlp import svd_mlp_ref
from nki_kernels import dispatch
from nki_kernels.decode.contract import (
    FP8,
    DecodeOperands,
    DecodeSpec,
    Factored,
    Quantized,
    batch_axes,
    check_spec,
    check_write_index,
    expected_shapes,
    operand_fields,
)

for _cls in (DecodeOperands, Factored, Quantized):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])

decode_step_p = Primitive("decode_step")
decode_step_p.multiple_results = True
decode_step_p.def_impl(functools.partial(apply_primitive, decode_step_p))

OP = "decode_step"
MLP = ("gate", "up", "down")
ROW_OPERANDS = batch_axes()  # operand name -> its B axis


def decode_step(*operands, spec: DecodeSpec, **named):
    """One decode step over all layers; returns (logits [B, T, V] float32, k_cache, v_cache).

    operands: the DecodeOperands' fields in order (x, norms, qk_norms, q, k, v, o, gate, up, down, k_cache,
    v_cache, write_index, cos, sin, mask_bias, final_norm, head; see the module docstring), positional, by name, or
    one DecodeOperands; a stored weight as a Factored / Quantized or the tuple of its parts. Bad operands raise
    ValueError / TypeError naming the argument (a concrete write_index out of range included; an fp8 weight without
    its scales)."""
    check_spec(spec, OP)
    if len(operands) == 1 and isinstance(operands[0], DecodeOperands) and not named:
        ops = operands[0]
    else:
        fields = operand_fields()
        if len(operands) > len(fields):
            raise TypeError(f"{OP}: got {len(operands)} positional operands, expected at most {len(fields)} {fields}")
        values = dict(zip(fields, operands))
        for name, value in named.items():
            if name not in fields or name in values:
                raise TypeError(f"{OP}: unexpected or repeated operand {name!r}; the operands are {fields}")
            values[name] = value
        missing = [name for name in fields if name not in values]
        if missing:
            raise TypeError(f"{OP}: missing operands {missing}")
        ops = DecodeOperands.of([values[name] for name in fields], spec)
    ops = shapes.check_decode_operands(OP, spec, jax.tree_util.tree_map(jnp.asarray, ops))
    leaves, treedef = jax.tree_util.tree_flatten(ops)
    return tuple(decode_step_p.bind(*leaves, spec=spec, treedef=treedef))


def operand_treedef(spec: DecodeSpec):
    """The structure of the DecodeOperands `decode_step_p` binds for `spec` (which operands exist, which weights
    are factored)."""
    return jax.tree_util.tree_structure(expected_shapes(spec, 1, 1, 1), is_leaf=lambda a: isinstance(a, tuple))


def operand_names(spec: DecodeSpec) -> tuple[str, ...]:
    """Names of the flat operands `decode_step_p` binds, in order (a stored weight gives one per part: "name.u",
    "name.v" (, "name.u_scale", "name.v_scale"), or "name.w", "name.scale")."""
    return tuple(name for name, _ in expected_shapes(spec, 1, 1, 1).named_leaves())


def _operands(leaves, spec, treedef) -> DecodeOperands:
    """The bound leaves as DecodeOperands (treedef None: the spec's structure, for direct binds of the leaves)."""
    return jax.tree_util.tree_unflatten(operand_treedef(spec) if treedef is None else treedef, leaves)


@decode_step_p.def_abstract_eval
def _abstract_eval(*operands, spec, treedef=None):
    ops = shapes.check_decode_operands(OP, spec, _operands(operands, spec, treedef))
    x, k_cache, v_cache = ops.x, ops.k_cache, ops.v_cache
    logits = x.update(shape=x.shape[:2] + (spec.vocab,), dtype=jnp.dtype(jnp.float32), weak_type=False)
    return [logits, k_cache.update(weak_type=False), v_cache.update(weak_type=False)]


def _jvp(primals, tangents, *, spec, treedef=None):
    del primals, tangents, spec, treedef
    raise TypeError(
        f"{OP} is inference only: it has no derivative (differentiate the model's own forward, which "
        "computes the same step, instead)"
    )


def _batch(args, dims, *, spec, treedef=None):
    """vmap: batched row operands (x, caches, tables, mask) fold into B; anything else batched runs a lax.map."""
    bind = functools.partial(decode_step_p.bind, spec=spec, **({} if treedef is None else {"treedef": treedef}))
    names = [name for name, _ in _operands(list(range(len(args))), spec, treedef).named_leaves()]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if any(d is not None and name not in ROW_OPERANDS for name, d in zip(names, dims)):
        batched = [i for i, d in enumerate(dims) if d is not None]

        def one(sliced):
            full = list(args)
            for i, a in zip(batched, sliced):
                full[i] = a
            return bind(*full)

        sliced = [jnp.moveaxis(args[i], dims[i], 0) for i in batched]
        return lax.map(one, sliced), [0, 0, 0]
    folded = []
    for name, a, d in zip(names, args, dims):
        if name not in ROW_OPERANDS:
            folded.append(a)
            continue
        axis = ROW_OPERANDS[name]
        a = batching.bdim_at_front(a, d, size)  # [n, ...]; an unbatched row operand is broadcast
        a = jnp.moveaxis(a, 0, axis)  # [..., n, B, ...]
        folded.append(a.reshape(a.shape[:axis] + (size * a.shape[axis + 1],) + a.shape[axis + 2 :]))
    logits, k_cache, v_cache = bind(*folded)

    def unfold(a, axis):
        return a.reshape(a.shape[:axis] + (size, a.shape[axis] // size) + a.shape[axis + 1 :])

    return [unfold(logits, 0), unfold(k_cache, 1), unfold(v_cache, 1)], [0, 1, 1]


# --- Lowering: the XLA reference (a scan of the models' layer), the kernel launch -----------------------------


def _projection(weight):
    """x -> x·W for a layer slice: a dense [K, N], (x·w)·diag(scale) for a Quantized, or (x·u)·v for a Factored
    (as svd_matmul, with fp8 factors scaled)."""
    if isinstance(weight, Factored):
        return lambda h: svd_matmul_ref(h, *weight)
    if isinstance(weight, Quantized):
        return lambda h: decoder_math.scaled_linear(h, weight.w, weight.scale)
    return lambda h: decoder_math.linear(h, weight)


def decode_step_ref(*operands, spec: DecodeSpec, treedef=None):
    """The decode step in jnp (the XLA lowering): `lax.scan` over layers of `decoder_math.decoder_layer`.

    Factored projections are (x·u)·v over the zero-padded stacked factors (exact: the padding adds zeros); an MLP
    factored in all three projections (all fp8, or none) runs as `svd_mlp_ref`, the XLA lowering of the compressed
    models' SVDMLP. fp8 weights are scaled after their float32 sums (`_projection`).
    """
    ops = _operands(operands, spec, treedef)
    norm = functools.partial(decoder_math.rms_norm, eps=spec.norm_eps, unit_offset=spec.norm_unit_offset)
    write_index = ops.write_index[0, 0]
    slots, tokens = ops.k_cache.shape[2], ops.x.shape[1]
    # Out of range, dynamic_update_slice would clamp and write other slots: raise as the emulator's launch does
    # (the callback runs only for a bad index).
    check = functools.partial(check_write_index, OP, slots=slots, tokens=tokens)
    lax.cond(
        (write_index < 0) | (write_index > slots - tokens),
        lambda: jax.debug.callback(check, write_index),
        lambda: None,
    )
    layer_rope = jnp.asarray(spec.layer_rope, jnp.int32)
    layer_mask = jnp.asarray(spec.layer_mask, jnp.int32)
    xs = (ops.weights, ops.norms, ops.qk_norms, ops.k_cache, ops.v_cache, layer_rope, layer_mask)
    mlp_factored = all(spec.factored(name) for name in MLP) and len({spec.fp8(name) for name in MLP}) == 1

    def layer(x, xs):
        projections, norms, qk_norms, k_cache, v_cache, rope, mask = xs
        proj = {name: _projection(w) for name, w in projections.items()}
        if mlp_factored:
            # svd_mlp's order: the six factors, then (fp8) their six scales.
            factors = [f for name in MLP for f in (projections[name].u, projections[name].v)]
            scales = [
                s for name in MLP for s in (projections[name].u_scale, projections[name].v_scale) if s is not None
            ]
            mlp = lambda h: svd_mlp_ref(h, *factors, *scales, activation=spec.activation)  # noqa: E731
        else:
            mlp = functools.partial(
                decoder_math.gated_mlp,
                gate_proj=proj["gate"],
                up_proj=proj["up"],
                down_proj=proj["down"],
                activation=spec.activation,
            )
        attention = functools.partial(
            decoder_math.self_attention,
            q_proj=proj["q"],
            k_proj=proj["k"],
            v_proj=proj["v"],
            o_proj=proj["o"],
            q_norm=None if qk_norms is None else functools.partial(norm, weight=qk_norms[0]),
            k_norm=None if qk_norms is None else functools.partial(norm, weight=qk_norms[1]),
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            scaling=spec.query_scaling,
            logit_softcap=spec.attn_logit_softcap,
            cos=ops.cos[rope],
            sin=ops.sin[rope],
            bias=ops.mask_bias[mask],
            kv=(k_cache, v_cache),
            write_index=write_index,
        )
        return decoder_math.decoder_layer(
            x,
            norms=[functools.partial(norm, weight=norms[i]) for i in range(spec.num_norms)],
            attention=attention,
            mlp=mlp,
            sandwich=spec.sandwich,
        )

    x, (k_cache, v_cache) = lax.scan(layer, ops.x, xs)
    logits = _projection(ops.head)(norm(x, ops.final_norm))
    return decoder_math.soft_cap(logits, spec.final_logit_softcap).astype(jnp.float32), k_cache, v_cache


def _kernel_fp8(ops: DecodeOperands, convert) -> DecodeOperands:
    """ops with convert(a) for every fp8 weight leaf a (float8_e4m3fn storage, which the kernels take as
    Trainium's float8_e4m3: the same bits within ±240)."""
    return jax.tree_util.tree_map(lambda a: convert(a) if shapes.is_fp8(a.dtype) else a, ops)


def _plan(*operands, target, spec, treedef=None):
    """The looped kernel from nki_kernels.dispatch, once its operand checks pass (they also limit B·T to one
    partition tile and need bf16 / fp16 x beside fp8 weights)."""
    ops = _kernel_fp8(_operands(operands, spec, treedef), lambda a: jax.ShapeDtypeStruct(a.shape, FP8))
    return dispatch.decode_step_plan(ops, spec, target)


def _run(plan, *operands, spec, treedef=None):
    """One launch of the looped kernel for the whole step (on the emulator, once write_index's value is checked)."""
    kernel, kwargs = plan
    ops = _kernel_fp8(_operands(operands, spec, treedef), kernel_fp8)
    index = shapes.concrete_value(ops.write_index)
    if index is not None:
        check_write_index(OP, index, slots=ops.k_cache.shape[2], tokens=ops.x.shape[1])
    return kernel(ops.kernel_args(), spec=spec, **kwargs)


ad.primitive_jvps[decode_step_p] = _jvp
batching.primitive_batchers[decode_step_p] = _batch
lowering.register_whole(decode_step_p, reference=decode_step_ref, kernels=KernelLaunches(OP, _plan, _run))
