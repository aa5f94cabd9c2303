"""The `decode_step` primitive: one decode step over every decoder layer, then the final norm and the LM head.

    logits, k_cache, v_cache = decode_step(x, norms, qk_norms, q, k, v, o, gate, up, down, k_cache, v_cache,
                                           write_index, cos, sin, mask_bias, final_norm, head, spec=spec)

The operands are `nki_kernels.decode.DecodeOperands`' fields, in order (their shapes and dtypes are described
there once; `spec` is a `nki_kernels.decode.DecodeSpec`), with L = spec.num_layers:
  x [B, T, H] (embedded tokens), norms [L, 2 or 4, H], qk_norms [L, 2, D] or None,
  q, k, v, o, gate, up, down: each a dense [L, K, N] or a factored pair (u [L, K, Rmax], v [L, Rmax, N]), layer l
    using the first spec.ranks[...][l] columns / rows (the rest zeros; a layer whose rank is None holds its dense
    W as exact factors, `nki_kernels.decode.contract.dense_in_stack`, which the kernels read alone),
  k_cache, v_cache [L, B, S, kv_heads, D] (this step's keys / values are written at slots
    [write_index, write_index + T)), write_index [1, 1] int32,
  cos, sin [NR, B, T, D] float32, mask_bias [NM, B, T, S] float32, final_norm [H], head: dense [H, V] or a pair
    (u [H, r], v [r, V]),
  packed [L, 128, E] or None (the last, may be left out): the values of the projections spec.packed_weights
    names (all fp8, or all factored in x's dtype), each layer's in the kernels' layout
    (`nki_kernels.decode.packing.pack_weights`), their stored weights then holding only their scales (fp8), or
    nothing (`Factored()`, or None).
Results: logits [B, T, V] float32 (final soft-cap applied), the updated k_cache and v_cache.

A paged KV cache (spec.block_size = BS, one new token per row, T = 1): k_cache, v_cache are pools
[L, num_blocks, BS, kv_heads, D] of blocks shared by every row, write_index is None, and the last two operands
block_table [B, MB] int32 (row b's i-th block of positions) and lengths [B] int32 (row b's cached tokens; -1: an
inactive row, which writes nothing) place each row: it writes its new k and v at position p = lengths[b] (block
block_table[b, p // BS], slot p % BS) and attends over its positions 0 .. MB·BS - 1 through the table (mask_bias
[NM, B, 1, MB·BS] over those positions, showing p and hiding what lies past it; cos, sin at p). Both backends
compute the same step: XLA gathers each row's blocks and scatters its new slot (`_paged_attention`, vectorized over
the rows), the looped kernel gathers them by DMA through the table (`nki_kernels.decode.paged`). Values out of range
(a length past the table, a table entry past the pool) raise as a bad write_index does. The pools split over their
KV heads under tensor_parallel_decode_step (rows not over a batch axis); vmap runs a paged step per instance.

fp8 weights: a weight named in spec.fp8_weights is given as float8_e4m3fn (or float8_e4m3: the same bits) values
within ±240 (`compress.quantize_fp8`) with float32 per-output-column scales (values known at call time beyond ±240
or NaN, and NaN / ±inf scales, are a ValueError; traced ones read as NaN on every backend, `shapes.fp8_read`): a
dense one as
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

Tensor parallel (the partitioning rule): `tensor_parallel_decode_step(*operands, spec=spec, mesh=mesh,
axis_name="model")` takes the whole model's operands and runs the step as Megatron shards over one mesh axis of T
ranks: a `jax.shard_map` over the mesh in which every device binds `decode_step_p` on its shard
(`tensor_parallel_partition_specs`: q/k/v/gate/up and the head split their output columns, o and down their
rows, the caches their KV heads; the rest replicated) with the per-rank spec (`tensor_parallel_spec`:
`DecodeSpec.tensor_parallel = T`, the contract's description of one rank's shard) and `axis_name`. The XLA
lowering then sums o's and down's partial products over the axis in float32 (`lax.psum`, once each per layer, of
x·u for a factored one) and all-gathers the logits along the vocabulary, so the step needs no other communication.
`models.generate` uses it when the parameters are split so (`models.decode.tensor_parallel_layout`).
Why shard_map and not `custom_partitioning` (which svd_matmul and svd_mlp use): the per-rank program is exactly
what the kernels' contract describes (a spec with tensor_parallel = T, collectives at fixed points inside the
layer loop), and shard_map states it directly with public JAX API, on Auto and Explicit meshes and across
processes. custom_partitioning could return the same per-device function from its partition callback, but its
sharding rule would have to name a factor for each of the ~30 operands (heads·D of q's columns, KV heads of the
caches, the vocabulary, ...), the callback would have to recover the Megatron layout from whatever Shardy
propagated to them (or reshard), and it relies on JAX internals (_compat) for devices and host callbacks during
lowering. The cost: a whole-operand call outside generate names its mesh and axis.

On the emulator backend the same call runs the kernels' own tensor-parallel program instead. Emulated
nki.collectives meet only between the ranks of one `simulate_spmd` launch, never across the host callbacks of
separate devices, so one host callback, on the mesh's first device, gets the whole operands, cuts them into the
same Megatron shards and runs every rank's looped kernel, its all-reduces and logits gather between the ranks, in
one launch (`nki_kernels.decode.runner.run_sharded_looped_step`; one per group of rows when batch_axis splits
them); the results come back with the shard_map's shardings (`_emulated_tensor_parallel_step`). `profile()` shows
one decode_step_kernel run per rank (and row group). On "neuron", and for `decode_step(..., axis_name=...)` bound
per device inside your own shard_map on either NKI-kernel backend, a tensor-parallel spec raises
NotImplementedError saying why (`_per_device_tensor_parallel_unsupported`): never silently a different
computation.

Bad operands raise a ValueError / TypeError naming the argument (`shapes.check_decode_operands`, i.e. the
contract's `check`). A write_index outside [0, S - T] is rejected on every backend: at the call when it is concrete,
else when the step runs (on the XLA backend a host callback that fires only for a bad index; the error reaches the
caller wrapped in JAX's runtime error), never clamped.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jax_neuronmm import decoder_math, explicit_sharding, lowering, shapes
from jax_neuronmm._compat import Primitive, ad, apply_primitive, batching
from jax_neuronmm.backend import get_backend
from jax_neuronmm.host_callback import host_call
from jax_neuronmm.kernel_calls import KernelLaunches, check_kernel_dtype, kernel_fp8
from jax_neuronmm.reference import jnp_activation
from jax_neuronmm.shapes import accumulation_dtype
from jax_neuronmm.svd_matmul import svd_matmul_ref
from jax_neuronmm.svd_mlp import svd_mlp_ref
from nki_kernels import dispatch
from nki_kernels.decode.contract import (
    FP8,
    OPTIONAL_LAST,
    SPLIT_ROWS,
    WEIGHTS,
    DecodeOperands,
    DecodeSpec,
    Factored,
    Quantized,
    batch_axes,
    check_lengths,
    check_spec,
    check_write_index,
    expected_shapes,
    operand_fields,
)
from nki_kernels.decode.packing import unpack_weights, unpacked_spec
from nki_kernels.decode.runner import run_sharded_looped_step
from nki_kernels.decode.sharding import gather_cache, shard_operands
from nki_kernels.decode.step import decode_step_plan

for _cls in (DecodeOperands, Factored, Quantized):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])

decode_step_p = Primitive("decode_step")
decode_step_p.multiple_results = True
decode_step_p.def_impl(functools.partial(apply_primitive, decode_step_p))

OP = "decode_step"
MLP = ("gate", "up", "down")
ROW_OPERANDS = batch_axes()  # operand name -> its B axis


def decode_step(*operands, spec: DecodeSpec, axis_name=None, **named):
    """One decode step over all layers; returns (logits [B, T, V] float32, k_cache, v_cache).

    operands: the DecodeOperands' fields in order (x, norms, qk_norms, q, k, v, o, gate, up, down, k_cache,
    v_cache, write_index, cos, sin, mask_bias, final_norm, head[, packed]; see the module docstring), positional, by
    name, or one DecodeOperands; a stored weight as a Factored / Quantized or the tuple of its parts. Bad operands raise
    ValueError / TypeError naming the argument (a concrete write_index out of range included; an fp8 weight without
    its scales).

    axis_name: inside `jax.shard_map`, the mesh axis (or tuple of axes) whose ranks hold the Megatron shards a spec
    with tensor_parallel = T > 1 describes (the operands are this rank's shard; the logits come back whole, every
    rank the same, the caches as this rank's KV heads); its size must be T. The XLA backend runs such per-device
    binds; the NKI-kernel backends refuse them (`_per_device_tensor_parallel_unsupported`). Outside shard_map, with
    whole operands, use `tensor_parallel_decode_step` (which the emulator backend runs too)."""
    check_spec(spec, OP)
    ops = _operands_of(operands, named, spec)
    _check_axis(spec, axis_name)
    ops = shapes.checked_decode_operands(OP, spec, ops)
    leaves, treedef = jax.tree_util.tree_flatten(ops)
    return tuple(decode_step_p.bind(*leaves, spec=spec, treedef=treedef, **_axis_param(axis_name)))


def _operands_of(operands, named, spec) -> DecodeOperands:
    """decode_step's operands (positional, by name, or one DecodeOperands) as DecodeOperands."""
    if len(operands) == 1 and isinstance(operands[0], DecodeOperands) and not named:
        return operands[0]
    fields = operand_fields()
    if len(operands) > len(fields):
        raise TypeError(f"{OP}: got {len(operands)} positional operands, expected at most {len(fields)} {fields}")
    values = dict(zip(fields, operands))
    for name, value in named.items():
        if name not in fields or name in values:
            raise TypeError(f"{OP}: unexpected or repeated operand {name!r}; the operands are {fields}")
        values[name] = value
    for name in OPTIONAL_LAST:  # the last operands, present only with spec.packed_weights / spec.block_size
        values.setdefault(name, None)
    missing = [name for name in fields if name not in values]
    if missing:
        raise TypeError(f"{OP}: missing operands {missing}")
    return DecodeOperands.of([values[name] for name in fields], spec)


def _axis_param(axis_name) -> dict:
    """The primitive's axis_name param, left out when None (direct binds without it stay valid)."""
    return {} if axis_name is None else {"axis_name": axis_name}


def _axis_names(axis_name) -> tuple:
    """axis_name (a mesh axis name or a tuple of them) as a tuple of names; TypeError naming it otherwise."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(name, str) for name in names):
        raise TypeError(f"{OP}: axis_name: got {axis_name!r}, expected a mesh axis name (str) or a tuple of them")
    return names


def _check_axis(spec: DecodeSpec, axis_name) -> None:
    """A tensor-parallel spec needs the axis its ranks are on, bound (inside shard_map) with spec.tensor_parallel
    ranks."""
    if axis_name is None:
        if spec.tensor_parallel != 1:
            raise ValueError(
                f"{OP}: spec.tensor_parallel is {spec.tensor_parallel}, so the operands are one rank's Megatron shard: "
                "expected axis_name, the mesh axis of the ranks (call it inside jax.shard_map over that axis), or "
                "use tensor_parallel_decode_step with the whole model's operands"
            )
        return
    _axis_names(axis_name)
    try:
        size = lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{OP}: axis_name {axis_name!r} is not a mesh axis bound here: expected a call inside jax.shard_map "
            "over it (or tensor_parallel_decode_step with the whole model's operands)"
        ) from None
    if size != spec.tensor_parallel:
        raise ValueError(
            f"{OP}: axis_name {axis_name!r} has {size} ranks but spec.tensor_parallel is {spec.tensor_parallel}; "
            "expected the spec of one rank's shard over that axis (tensor_parallel_spec(spec, ranks))"
        )


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
def _abstract_eval(*operands, spec, treedef=None, axis_name=None):
    if spec.tensor_parallel != 1 and axis_name is None:
        raise ValueError(
            f"{OP}: spec.tensor_parallel is {spec.tensor_parallel} but the primitive was bound without axis_name "
            "(the mesh axis of the ranks): call decode_step(..., axis_name=...) inside jax.shard_map"
        )
    ops = shapes.check_decode_operands(OP, spec, _operands(operands, spec, treedef))
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
        decode_step_p.bind, spec=spec, **({} if treedef is None else {"treedef": treedef}), **_axis_param(axis_name)
    )
    names = [name for name, _ in _operands(list(range(len(args))), spec, treedef).named_leaves()]
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


# --- Lowering: the XLA reference (a scan of the models' layer), the kernel launch -----------------------------


def _projection(weight):
    """x -> x·W for a layer slice: a dense [K, N], (x·w)·diag(scale) for a Quantized, or (x·u)·v for a Factored
    (as svd_matmul, with fp8 factors scaled)."""
    if isinstance(weight, Factored):
        return lambda h: svd_matmul_ref(h, *weight)
    if isinstance(weight, Quantized):
        return lambda h: decoder_math.scaled_linear(h, weight.w, weight.scale)
    return lambda h: decoder_math.linear(h, weight)


def _row_parallel(weight, axis_name):
    """x -> x·W for o or down on one rank of a tensor-parallel step, where W's rows (K) are this rank's slice and
    x's features the matching slice: the rank's product is a partial sum, summed in float32 over the ranks
    (`lax.psum` over axis_name) before it is scaled (fp8) and rounded to x's dtype. A Factored weight sums its
    rank-r product x·u (u's rows are split, v is whole), as the kernels all-reduce it, then multiplies by v."""

    def dot(a, b):
        acc = accumulation_dtype(a.dtype)
        return lax.dot_general(a, b.astype(a.dtype), (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=acc)

    def scaled(y, scale, dtype):
        return (y if scale is None else y * scale.astype(y.dtype)).astype(dtype)

    if isinstance(weight, Factored):

        def factored(h):
            xu = scaled(lax.psum(dot(h, weight.u), axis_name), weight.u_scale, h.dtype)
            return scaled(dot(xu, weight.v), weight.v_scale, h.dtype)

        return factored
    if isinstance(weight, Quantized):
        return lambda h: scaled(lax.psum(dot(h, weight.w), axis_name), weight.scale, h.dtype)
    return lambda h: lax.psum(dot(h, weight), axis_name).astype(h.dtype)


def decode_step_ref(*operands, spec: DecodeSpec, treedef=None, axis_name=None):
    """The decode step in jnp (the XLA lowering): `lax.scan` over layers of `decoder_math.decoder_layer`.

    Packed weights (spec.packed_weights) are unpacked first (`nki_kernels.decode.packing.unpack_weights`: slices
    and reshapes of the packed operand). Factored projections are (x·u)·v over the zero-padded stacked factors
    (exact: the padding adds zeros); an MLP
    factored in all three projections (all fp8, or none) runs as `svd_mlp_ref`, the XLA lowering of the compressed
    models' SVDMLP. fp8 weights are scaled after their float32 sums (`_projection`).

    Paged (spec.block_size): the layers' attention reads and writes the pools through the block table, each row
    at its own position (`_paged_attention`).

    Tensor parallel (axis_name set, inside shard_map; spec: one rank's shard): the operands are this rank's heads,
    KV heads, MLP features and vocabulary slice; o and down sum their partial products over the ranks
    (`_row_parallel`: one float32 psum each per layer, a factored one's of x·u), and the logits are all-gathered
    along the vocabulary in rank order. A factored MLP computes svd_mlp_ref's math with down's sum in the middle.
    """
    ops = unpack_weights(_operands(operands, spec, treedef), spec, jnp)
    ops = jax.tree_util.tree_map(shapes.fp8_read, ops)  # NaN beyond ±240, as Trainium reads fp8 (shapes.fp8_read)
    spec = unpacked_spec(spec)
    norm = functools.partial(decoder_math.rms_norm, eps=spec.norm_eps, unit_offset=spec.norm_unit_offset)
    write_index = None if spec.paged else _checked_write_index(ops)
    if spec.paged:
        _check_paged_values(ops, spec)
    layer_rope = jnp.asarray(spec.layer_rope, jnp.int32)
    layer_mask = jnp.asarray(spec.layer_mask, jnp.int32)
    xs = (ops.weights, ops.norms, ops.qk_norms, ops.k_cache, ops.v_cache, layer_rope, layer_mask)
    mlp_factored = all(spec.factored(name) for name in MLP) and len({spec.fp8(name) for name in MLP}) == 1

    def layer(x, xs):
        projections, norms, qk_norms, k_cache, v_cache, rope, mask = xs
        proj = {name: _projection(w) for name, w in projections.items()}
        if axis_name is not None:
            proj.update({name: _row_parallel(projections[name], axis_name) for name in SPLIT_ROWS})
        if mlp_factored and axis_name is not None:

            def mlp(h):  # svd_mlp_ref, down's x·u summed over the ranks
                acc = accumulation_dtype(h.dtype)
                gate = svd_matmul_ref(h, *projections["gate"], out_dtype=acc)
                up = svd_matmul_ref(h, *projections["up"], out_dtype=acc)
                return proj["down"]((jnp_activation(spec.activation)(gate) * up).astype(h.dtype))

        elif mlp_factored:
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
            decoder_math.self_attention if spec.contiguous else functools.partial(_paged_attention, ops, spec),
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
    logits = decoder_math.soft_cap(logits, spec.final_logit_softcap).astype(jnp.float32)
    if axis_name is not None:  # this rank's vocabulary slice -> every rank's, in rank order
        logits = lax.all_gather(logits, axis_name, axis=logits.ndim - 1, tiled=True)
    return logits, k_cache, v_cache


def _checked_write_index(ops):
    """write_index's value, raising (in a host callback, only for a bad index) when out of range: there
    dynamic_update_slice would clamp and write other slots, so the XLA backend raises as the emulator's launch."""
    write_index = ops.write_index[0, 0]
    slots, tokens = ops.k_cache.shape[2], ops.x.shape[1]
    check = functools.partial(check_write_index, OP, slots=slots, tokens=tokens)
    lax.cond(
        (write_index < 0) | (write_index > slots - tokens),
        lambda: jax.debug.callback(check, write_index),
        lambda: None,
    )
    return write_index


def _check_paged_values(ops, spec):
    """Raise (a host callback, only for bad values) when lengths or the block table are out of range
    (contract.check_lengths): the gathers would clamp and the scatters drop, silently reading and writing other
    blocks."""
    num_blocks, slots = ops.k_cache.shape[1], ops.block_table.shape[1] * spec.block_size
    check = functools.partial(check_lengths, OP, block_size=spec.block_size, num_blocks=num_blocks)
    bad = jnp.any((ops.lengths < -1) | (ops.lengths >= slots))
    bad |= jnp.any((ops.block_table < 0) | (ops.block_table >= num_blocks))
    lax.cond(bad, lambda: jax.debug.callback(check, ops.lengths, ops.block_table), lambda: None)


def _paged_attention(ops, spec, x, *, kv, write_index, cos, sin, bias, **attention):
    """decoder_math.self_attention over a paged cache (spec.block_size), each row at its own position p =
    lengths[b]: each row's cache gathered from the layer's pools kv = (k_pool, v_pool) [NB, BS, kv_heads, D]
    through block_table, the row's new k and v written at p (self_attention vectorized over the rows: one
    scatter, not a loop) and attended over, then scattered into the pools at block block_table[b, p // BS], slot
    p % BS (an inactive row, lengths[b] = -1, writes nothing). Returns (output, (k_pool, v_pool))."""
    del write_index  # None: each row's position comes from lengths
    table, bs = ops.block_table, spec.block_size
    batch, max_blocks = table.shape
    positions = jnp.maximum(ops.lengths, 0)

    def rows(pool):  # [B, MB·BS, kv_heads, D]
        return pool[table].reshape((batch, max_blocks * bs) + pool.shape[2:])

    def one_row(x_b, cos_b, sin_b, bias_b, k_b, v_b, p_b):
        out, (k_b, v_b) = decoder_math.self_attention(
            x_b[None],
            cos=cos_b[None],
            sin=sin_b[None],
            bias=bias_b[None],
            kv=(k_b[None], v_b[None]),
            write_index=p_b,
            **attention,
        )
        return out[0], k_b[0, p_b], v_b[0, p_b]

    out, k_new, v_new = jax.vmap(one_row)(x, cos, sin, bias, rows(kv[0]), rows(kv[1]), positions)
    block = jnp.where(ops.lengths >= 0, table[jnp.arange(batch), positions // bs], kv[0].shape[0])  # past: dropped
    pools = tuple(pool.at[block, positions % bs].set(new, mode="drop") for pool, new in zip(kv, (k_new, v_new)))
    return out, pools


def _kernel_fp8(ops: DecodeOperands, convert) -> DecodeOperands:
    """ops with convert(a) for every fp8 weight leaf a (float8_e4m3fn storage, which the kernels take as
    Trainium's float8_e4m3: the same bits within ±240)."""
    return jax.tree_util.tree_map(lambda a: convert(a) if shapes.is_fp8(a.dtype) else a, ops)


def _plan(*operands, target, spec, treedef=None, axis_name=None):
    """The looped kernel from nki_kernels.decode.step, once its operand checks pass (`_looped_plan`). A spec with
    tensor_parallel > 1 (one rank's shard, bound on each device inside shard_map) raises NotImplementedError
    (`_per_device_tensor_parallel_unsupported`)."""
    if spec.tensor_parallel != 1:
        raise NotImplementedError(_per_device_tensor_parallel_unsupported(spec, axis_name))
    return _looped_plan(_operands(operands, spec, treedef), spec, target)


def _looped_plan(ops: DecodeOperands, spec: DecodeSpec, target):
    """(kernel, kwargs) of the looped kernel for ops (arrays or abstract values; fp8 weights as float8_e4m3fn) from
    nki_kernels.decode.step.decode_step_plan, whose checks also limit B·T to one partition tile and need bf16 /
    fp16 x beside fp8 weights; ValueError when they fail."""
    ops = _kernel_fp8(ops, lambda a: jax.ShapeDtypeStruct(a.shape, FP8))
    return decode_step_plan(ops, spec, target)


def _run(plan, *operands, spec, treedef=None, axis_name=None):
    """One launch of the looped kernel for the whole step (on the emulator, once write_index's value is checked)."""
    del axis_name  # _plan refused tensor-parallel specs
    kernel, kwargs = plan
    ops = _kernel_fp8(_operands(operands, spec, treedef), kernel_fp8)
    index = shapes.concrete_value(ops.write_index)
    if index is not None:
        check_write_index(OP, index, slots=ops.k_cache.shape[2], tokens=ops.x.shape[1])
    lengths, table = shapes.concrete_value(ops.lengths), shapes.concrete_value(ops.block_table)
    if lengths is not None and table is not None:
        check_lengths(OP, lengths, table, block_size=spec.block_size, num_blocks=ops.k_cache.shape[1])
    return kernel(ops.kernel_args(), spec=spec, **kwargs)


def _per_device_tensor_parallel_unsupported(spec: DecodeSpec, axis_name) -> str:
    """Why an NKI-kernel backend refuses decode_step_p bound on one rank's shard on each device of a shard_map."""
    bound = (
        f"{OP}: a decode step bound on one rank's Megatron shard on each device of mesh axis {axis_name!r} "
        f"(spec.tensor_parallel = {spec.tensor_parallel}, inside jax.shard_map)"
    )
    if get_backend() == "emulator":
        return (
            f"{bound} cannot run on backend 'emulator': each device would run its own host callback, and the "
            "emulated nki.collectives meet only between the ranks of one simulate_spmd launch. Call "
            "tensor_parallel_decode_step with the whole model's operands (on the emulator it runs every rank in "
            "one simulate_spmd launch on the mesh's first device, as models.generate does), or use backend 'xla' "
            "inside your own shard_map"
        )
    return (
        f"{bound} is not supported on backend 'neuron': each NeuronCore would run the looped kernel on its shard "
        "with nki.collectives over the ranks of one replica group, and this package has neither made those ranks "
        "the devices of the shard_map axis in NKI's custom calls nor run such a program on Trainium (none is "
        "available to it); the emulator's way, one host callback running every rank, is no option there (host "
        "callbacks do not run on the neuron platform). Use jax_neuronmm.use_backend('xla') for tensor-parallel "
        "decode steps (the XLA lowering's psums and all-gather), or replicate the parameters to run the kernel on "
        "whole arrays"
    )


# --- Tensor parallel: the partitioning rule (Megatron shards over one mesh axis, run by shard_map) ------------


def tensor_parallel_spec(spec: DecodeSpec, ranks: int) -> DecodeSpec:
    """The spec of one rank's Megatron shard of the whole model `spec` over `ranks` ranks (spec.tensor_parallel =
    ranks: 1/ranks of the query heads, KV heads, MLP features and vocabulary; hidden, head_dim and the factor ranks
    whole). ValueError naming the size that does not split."""
    check_spec(spec, OP)
    if spec.tensor_parallel != 1:
        raise ValueError(f"{OP}: spec.tensor_parallel: got {spec.tensor_parallel}, expected 1 (the whole model's spec)")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"{OP}: ranks: got {ranks!r}, expected a positive int")
    if spec.packed_weights:
        raise ValueError(
            f"{OP}: spec.packed_weights: got {spec.packed_weights!r}; a packed operand is one rank's layout and does "
            "not split over the mesh (unpack with nki_kernels.decode.packing.unpack_weights and unpacked_spec)"
        )
    sizes = {name: getattr(spec, name) for name in ("num_heads", "num_kv_heads", "intermediate", "vocab")}
    for name, size in sizes.items():
        if size % ranks:
            raise ValueError(
                f"{OP}: spec.{name} = {size} does not split over {ranks} tensor-parallel ranks; expected a multiple "
                f"of {ranks} (each rank holds whole KV-head groups, 1/{ranks} of the MLP features and of the "
                "vocabulary)"
            )
    return spec.replace(**{name: size // ranks for name, size in sizes.items()}, tensor_parallel=ranks)


def _split_dim(name: str, ndim: int) -> int | None:
    """The dim of flat operand `name` ("q.u", "k_cache", ...) that Megatron shards split, or None (replicated):
    q / k / v / gate / up and the head split their output columns (a dense weight's, v's, an fp8 weight's and its
    column scales), o and down their rows (a dense weight's, u's); the caches their KV heads."""
    field, _, part = name.partition(".")
    if field in ("k_cache", "v_cache"):
        return 3
    if field not in WEIGHTS:
        return None
    if field in SPLIT_ROWS:
        return ndim - 2 if part in ("", "u", "w") else None
    return ndim - 1 if part in ("", "v", "w", "scale", "v_scale") else None


def _entry(names: tuple):
    """A PartitionSpec entry for mesh axes `names`: one name, or their tuple."""
    return names[0] if len(names) == 1 else names


def tensor_parallel_partition_specs(spec: DecodeSpec, axis_name, batch_axis=None) -> tuple:
    """One `PartitionSpec` per flat operand of `spec` (`operand_names` order): how the whole model's operands split
    into Megatron shards over mesh axis `axis_name` (see `_split_dim`); the activations, norms, tables and
    write_index are replicated, unless batch_axis (a mesh axis or a tuple of them) splits the rows: x, the caches,
    the RoPE tables and the mask biases along their B axis."""
    axis = _entry(_axis_names(axis_name))
    batch = None if batch_axis is None else _entry(_axis_names(batch_axis))
    specs = []
    for name, shape in expected_shapes(spec, 1, 1, 1).named_leaves():
        entries = [None] * len(shape)
        dim = _split_dim(name, len(shape))
        if dim is not None:
            entries[dim] = axis
        if batch is not None and name in ROW_OPERANDS:
            entries[ROW_OPERANDS[name]] = batch
        while entries and entries[-1] is None:
            entries.pop()
        specs.append(PartitionSpec(*entries))
    return tuple(specs)


def _mesh_axes(mesh, argument: str, axis_name) -> tuple:
    names = _axis_names(axis_name)
    missing = [name for name in names if name not in mesh.axis_names]
    if missing:
        raise ValueError(f"{OP}: {argument}: {missing} not among the mesh's axes {mesh.axis_names}")
    return names


def tensor_parallel_decode_step(*operands, spec: DecodeSpec, mesh, axis_name="model", batch_axis=None, **named):
    """decode_step over the whole model's operands (spec.tensor_parallel = 1), computed as Megatron shards on the
    ranks of mesh axis `axis_name` of `mesh` (a jax.sharding.Mesh): `jax.shard_map` over the mesh, each device
    binding decode_step_p on its shard (`tensor_parallel_partition_specs`) with the per-rank spec
    (`tensor_parallel_spec`) and axis_name, so the XLA lowering all-reduces o's and down's outputs in every layer
    and gathers the logits. Returns (logits [B, T, V] float32; k_cache, v_cache split over their KV heads).
    batch_axis: None (other mesh axes see the same computation: replicated), or mesh axes (not axis_name's) that
    split the rows B (which they must divide): each group of ranks then decodes its rows, and the logits and caches
    come back split over B too. A vocabulary that does not split is padded with zero columns of the head on every
    call (and the logits cut back); heads, KV heads and MLP features must split (ValueError naming them). On the
    emulator backend every rank's looped kernel runs in one emulated launch on the mesh's first device, with the
    same results' shardings (`_emulated_tensor_parallel_step`; not under vmap); on "neuron" it raises
    NotImplementedError when the step is lowered (see `_per_device_tensor_parallel_unsupported`)."""
    check_spec(spec, OP)
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"{OP}: mesh: got {type(mesh).__name__}, expected a jax.sharding.Mesh")
    names = _mesh_axes(mesh, "axis_name", axis_name)
    axis = _entry(names)
    ranks = math.prod(mesh.shape[name] for name in names)
    ops = _operands_of(operands, named, spec)
    ops = shapes.checked_decode_operands(OP, spec, ops)
    batch, groups = None, 1
    if batch_axis is not None and spec.paged:
        raise ValueError(
            f"{OP}: batch_axis: got {batch_axis!r} with a paged cache (spec.block_size = {spec.block_size}), whose "
            "pools every row shares: expected None (the rows of a paged step are not split over ranks)"
        )
    if batch_axis is not None:
        batch_names = _mesh_axes(mesh, "batch_axis", batch_axis)
        if set(batch_names) & set(names):
            raise ValueError(f"{OP}: batch_axis {batch_axis!r} shares mesh axes with axis_name {axis_name!r}")
        groups = math.prod(mesh.shape[name] for name in batch_names)
        if ops.x.shape[0] % groups:
            raise ValueError(
                f"{OP}: x: got B = {ops.x.shape[0]} rows, expected a multiple of the {groups} row groups of "
                f"batch_axis {batch_axis!r}"
            )
        batch = _entry(batch_names)
    vocab = spec.vocab
    padding = -vocab % ranks
    if padding:  # zero columns: logits 0 there, cut off below
        pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, padding)])  # noqa: E731
        head = ops.head
        if isinstance(head, Factored):
            head = dataclasses.replace(head, v=pad(head.v), v_scale=None if head.v_scale is None else pad(head.v_scale))
        elif isinstance(head, Quantized):
            head = Quantized(pad(head.w), pad(head.scale))
        else:
            head = pad(head)
        ops = ops.replace(head=head)
        spec = spec.replace(vocab=vocab + padding)
    rank_spec = tensor_parallel_spec(spec, ranks)
    leaves, treedef = jax.tree_util.tree_flatten(ops)
    cache = PartitionSpec(None, batch, None, axis)
    in_specs = tensor_parallel_partition_specs(spec, axis, batch)
    out_specs = (PartitionSpec() if batch is None else PartitionSpec(batch), cache, cache)
    if get_backend() == "emulator":
        logits, k_cache, v_cache = _emulated_tensor_parallel_step(
            leaves, treedef, spec, rank_spec, groups, mesh, in_specs, out_specs
        )
    else:

        def per_rank(*blocks):
            return tuple(decode_step_p.bind(*blocks, spec=rank_spec, treedef=treedef, axis_name=axis))

        leaves = [explicit_sharding.typed_as(a, NamedSharding(mesh, s)) for a, s in zip(leaves, in_specs)]
        logits, k_cache, v_cache = jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=False,  # the primitive states no varying-axes types; the body's collectives make these outputs
        )(*leaves)
    return (logits[..., :vocab] if padding else logits), k_cache, v_cache


def _emulated_tensor_parallel_step(leaves, treedef, spec, rank_spec, groups, mesh, in_specs, out_specs):
    """tensor_parallel_decode_step on the emulator backend: ONE emulated run of the step, by the mesh's first
    device, of every rank's looped kernel with its collectives (`_every_rank_on_the_emulator`: one simulate_spmd
    launch of rank_spec.tensor_parallel ranks per group of rows, `groups` being batch_axis's row groups, as each
    group of ranks decodes its rows on the mesh), on the whole operands; the results leave placed by out_specs, as
    the shard_map's. One rank's shard (in_specs' blocks) is checked against the kernel now, before anything runs.

    How: a `jax.shard_map` manual over every mesh axis gives each device the whole operands and a host call
    (`host_callback.host_call`, numpy in and out) in which only the first device runs the step and the others
    return zeros at once; a psum gives every device the first one's results (exactly: the rest adds zeros). The
    host call never raises: what fails (a bad write_index, a kernel error) comes back as text, and every device
    raises it once the psum is done (`_raise_failure`), so none is left waiting in a collective for a device that
    stopped (XLA's CPU runtime aborts the process after 40 s of that)."""
    ops = _operands(leaves, spec, treedef)
    check_kernel_dtype("emulator", ops.x.dtype)
    target = dispatch.launch_target(emulated=True)
    blocks = [
        jax.ShapeDtypeStruct(NamedSharding(mesh, s).shard_shape(a.shape), a.dtype) for a, s in zip(leaves, in_specs)
    ]
    try:
        _looped_plan(_operands(blocks, rank_spec, treedef), rank_spec, target)
    except ValueError as error:
        block_shapes = ", ".join(str(b.shape) for b in blocks)
        raise ValueError(
            f"{OP}: one rank's shard ({block_shapes}) of a step over {rank_spec.tensor_parallel} tensor-parallel "
            f"ranks cannot run as the looped NKI kernel on {target}: {error}"
        ) from None
    axes = tuple(mesh.axis_names)
    host = functools.partial(
        _every_rank_on_the_emulator, spec=spec, treedef=treedef, ranks=rank_spec.tensor_parallel, groups=groups
    )
    logits = (ops.x.shape[:2] + (spec.vocab,), np.float32)
    results = (logits, (ops.k_cache.shape, ops.k_cache.dtype), (ops.v_cache.shape, ops.v_cache.dtype))
    results += (((_FAILURE_BYTES,), np.uint8),)

    def on_every_device(*whole):
        computed = host_call(host, results, lax.axis_index(axes) == 0, *whole)
        # The first device's results on every device (the others' are zeros); the barrier holds the check below
        # until all of them arrived.
        step, failure = lax.optimization_barrier((lax.psum(computed[:3], axes), lax.psum(computed[3], axes)))
        (checked,) = host_call(_raise_failure, (logits,), failure, step[0])
        return lax.optimization_barrier((checked, *step[1:]))  # every result waits for the check

    replicated = PartitionSpec()
    whole = [explicit_sharding.typed_as(a, NamedSharding(mesh, replicated)) for a in leaves]
    outputs = jax.shard_map(on_every_device, mesh=mesh, in_specs=replicated, out_specs=replicated, check_vma=False)(
        *whole
    )
    return tuple(explicit_sharding.placed_as(r, NamedSharding(mesh, s)) for r, s in zip(outputs, out_specs))


_FAILURE_BYTES = 4096  # the longest error text the emulator's host call returns (longer ones are cut)


def _every_rank_on_the_emulator(first, *leaves, spec, treedef, ranks, groups):
    """Host side of `_emulated_tensor_parallel_step` on one device: zeros unless `first` (the mesh's first device).
    There, the whole model's operands (spec.tensor_parallel = 1) cut into `ranks` Megatron shards
    (`nki_kernels.decode.sharding.shard_operands`, the layout of `tensor_parallel_partition_specs`) and run as the
    looped kernel on that many emulated NeuronCores (`runner.run_sharded_looped_step`: one simulate_spmd launch, real
    data through nki.collectives), once for each of `groups` equal row groups; the ranks' caches put back together.
    Returns (logits, k_cache, v_cache, failure): failure zeros, or, when anything raised (write_index out of range
    included), the error's text (UTF-8, zero padded to _FAILURE_BYTES) and zero results."""
    ops = _kernel_fp8(_operands(leaves, spec, treedef), kernel_fp8)
    zeros = [np.zeros(ops.x.shape[:2] + (spec.vocab,), np.float32), np.zeros_like(ops.k_cache)]
    zeros += [np.zeros_like(ops.v_cache), np.zeros(_FAILURE_BYTES, np.uint8)]
    if not first:
        return zeros
    try:
        if spec.paged:
            check_lengths(OP, ops.lengths, ops.block_table, block_size=spec.block_size, num_blocks=ops.k_cache.shape[1])
        else:
            check_write_index(OP, ops.write_index, slots=ops.k_cache.shape[2], tokens=ops.x.shape[1])
        parts = []
        for group in range(groups):
            rows = ops.replace(
                **{
                    name: np.ascontiguousarray(np.split(getattr(ops, name), groups, axis)[group])
                    for name, axis in ROW_OPERANDS.items()
                    if getattr(ops, name) is not None  # a contiguous step has no block table nor lengths
                }
            )
            rank_spec, shards = shard_operands(spec, rows, ranks)
            logits, k_caches, v_caches = run_sharded_looped_step(shards, rank_spec)
            parts.append((logits, *(gather_cache(c, spec.num_kv_heads) for c in (k_caches, v_caches))))
    except Exception as error:  # every error, raised on every device by _raise_failure
        text = f"{type(error).__name__}: {error}".encode()[:_FAILURE_BYTES]
        zeros[3][: len(text)] = np.frombuffer(text, np.uint8)
        return zeros
    return [np.concatenate(p, axis) for p, axis in zip(zip(*parts), (0, 1, 1))] + [zeros[3]]


def _raise_failure(failure, logits):
    """Host side, on every device: RuntimeError with the emulator's failure text when there is one, else
    (logits,)."""
    text = bytes(failure).rstrip(b"\0").decode(errors="replace")
    if text:
        raise RuntimeError(f"{OP}: the tensor-parallel step on the emulator failed: {text}")
    return (logits,)


ad.primitive_jvps[decode_step_p] = _jvp
batching.primitive_batchers[decode_step_p] = _batch
lowering.register_whole(decode_step_p, reference=decode_step_ref, kernels=KernelLaunches(OP, _plan, _run))
