"""The `decode_step` primitive: one decode step over every decoder layer, then the final norm and the LM head.

Operands are `nki_kernels.decode.DecodeOperands`' fields, bound as a pytree; the XLA lowering is in
`decode_step_xla`, the looped NKI kernel launch in `decode_step_kernels`, tensor parallelism in
`decode_step_parallel`. docs/decode_step.md describes the operands, backends and errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_neuronmm import decode_step_kernels, lowering, shapes
from jax_neuronmm._compat import Primitive, ad, apply_primitive, batching
from jax_neuronmm.decode_step_operands import OP, ROW_OPERANDS, axis_param, check_axis, operands_of, unflatten
from jax_neuronmm.decode_step_xla import decode_step_ref
from jax_neuronmm.kernel_calls import KernelLaunches
from nki_kernels.decode.contract import DecodeSpec, check_spec

decode_step_p = Primitive("decode_step")
decode_step_p.multiple_results = True
decode_step_p.def_impl(functools.partial(apply_primitive, decode_step_p))


def decode_step(*operands, spec: DecodeSpec, axis_name=None, **named):
    """One decode step over all layers; returns (logits [B, T, V] float32, k_cache, v_cache).

    operands: the DecodeOperands' fields in order (x, norms, qk_norms, q, k, v, o, gate, up, down, k_cache,
    v_cache, write_index, cos, sin, mask_bias, final_norm, head[, packed]; see docs/decode_step.md), positional, by
    name, or one DecodeOperands; a stored weight as a Factored / Quantized or the tuple of its parts. Bad operands raise
    ValueError / TypeError naming the argument (a concrete write_index out of range included; an fp8 weight without
    its scales).

    axis_name: inside `jax.shard_map`, the mesh axis (or tuple of axes) whose ranks hold the Megatron shards a spec
    with tensor_parallel = T > 1 describes (the operands are this rank's shard; the logits come back whole, every
    rank the same, the caches as this rank's KV heads); its size must be T. The XLA backend runs such per-device
    binds; the NKI-kernel backends refuse them (`per_device_tensor_parallel_unsupported`). Outside shard_map, with
    whole operands, use `tensor_parallel_decode_step` (which the emulator backend runs too)."""
    check_spec(spec, OP)
    ops = operands_of(operands, named, spec)
    check_axis(spec, axis_name)
    ops = shapes.checked_decode_operands(OP, spec, ops)
    leaves, treedef = jax.tree_util.tree_flatten(ops)
    return tuple(decode_step_p.bind(*leaves, spec=spec, treedef=treedef, **axis_param(axis_name)))


@decode_step_p.def_abstract_eval
def _abstract_eval(*operands, spec, treedef=None, axis_name=None):
    if spec.tensor_parallel != 1 and axis_name is None:
        raise ValueError(
            f"{OP}: spec.tensor_parallel is {spec.tensor_parallel} but the primitive was bound without axis_name "
            "(the mesh axis of the ranks): call decode_step(..., axis_name=...) inside jax.shard_map"
        )
    ops = shapes.check_decode_operands(OP, spec, unflatten(operands, spec, treedef))
    x, k_cache, v_cache = ops.x, ops.k_cache, ops.v_cache
    # A rank's logits are gathered over the ranks' vocabulary slices: every rank returns the whole vocabulary.
    logits = x.update(shape=x.shape[:2] + (spec.whole_vocab,), dtype=jnp.dtype(jnp.float32), weak_type=False)
    return [logits, k_cache.update(weak_type=False), v_cache.update(weak_type=False)]


def _jvp(primals, tangents, *, spec, treedef=None, axis_name=None):
    del primals, tangents, spec, treedef, axis_name
    raise TypeError(
        f"{OP} is inference only: it has no derivative (differentiate the model's own forward, which "
        "computes the same step, instead)"
    )


def _batch(args, dims, *, spec, treedef=None, axis_name=None):
    """vmap: batched row operands (x, caches, tables, mask) fold into B; anything else batched (for a paged step,
    whose pools the rows share, anything batched) runs a lax.map."""
    bind = functools.partial(
        decode_step_p.bind, spec=spec, **({} if treedef is None else {"treedef": treedef}), **axis_param(axis_name)
    )
    names = [name for name, _ in unflatten(list(range(len(args))), spec, treedef).named_leaves()]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    # A paged step's pools are shared by its rows: batched steps run one after another.
    if spec.paged or any(d is not None and name not in ROW_OPERANDS for name, d in zip(names, dims)):
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


ad.primitive_jvps[decode_step_p] = _jvp
batching.primitive_batchers[decode_step_p] = _batch
lowering.register_whole(
    decode_step_p,
    reference=decode_step_ref,
    kernels=KernelLaunches(OP, decode_step_kernels.plan, decode_step_kernels.run),
)
