"""decode_step's XLA lowering: a `lax.scan` over the layers of `decoder_math.decoder_layer`, the function the models'
own layers call, so the primitive computes what the model's forward computes (contiguous or paged cache, fp8
weights scaled after their float32 sums, and the per-rank program of a tensor-parallel step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_neuronmm import decoder_math, shapes
from jax_neuronmm.decode_step_operands import OP, unflatten
from jax_neuronmm.reference import jnp_activation
from jax_neuronmm.shapes import accumulation_dtype
from jax_neuronmm.svd_matmul import svd_matmul_ref
from jax_neuronmm.svd_mlp import svd_mlp_ref
from jax_neuronmm.weights import Factored, Quantized
from nki_kernels.decode.contract import SPLIT_ROWS, DecodeSpec, check_lengths, check_write_index
from nki_kernels.decode.packing import unpack_weights, unpacked_spec

MLP = ("gate", "up", "down")


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
    ops = unpack_weights(unflatten(operands, spec, treedef), spec, jnp)
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
        attention_projections = decoder_math.AttentionProjections(
            proj["q"],
            proj["k"],
            proj["v"],
            proj["o"],
            q_norm=None if qk_norms is None else functools.partial(norm, weight=qk_norms[0]),
            k_norm=None if qk_norms is None else functools.partial(norm, weight=qk_norms[1]),
        )
        attention = functools.partial(
            decoder_math.self_attention if spec.contiguous else functools.partial(_paged_attention, ops, spec),
            projections=attention_projections,
            geometry=_geometry(spec),
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


def _geometry(spec: DecodeSpec) -> decoder_math.AttentionGeometry:
    """The attention geometry of one layer of `spec` (one rank's heads under tensor parallelism)."""
    return decoder_math.AttentionGeometry(
        spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.query_scaling, logit_softcap=spec.attn_logit_softcap
    )


def _paged_attention(ops, spec, x, *, projections, geometry, kv, write_index, cos, sin, bias):
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
            projections,
            geometry,
            cos=cos_b[None],
            sin=sin_b[None],
            bias=bias_b[None],
            kv=(k_b[None], v_b[None]),
            write_index=p_b,
        )
        return out[0], k_b[0, p_b], v_b[0, p_b]

    out, k_new, v_new = jax.vmap(one_row)(x, cos, sin, bias, rows(kv[0]), rows(kv[1]), positions)
    block = jnp.where(ops.lengths >= 0, table[jnp.arange(batch), positions // bs], kv[0].shape[0])  # past: dropped
    pools = tuple(pool.at[block, positions % bs].set(new, mode="drop") for pool, new in zip(kv, (k_new, v_new)))
    return out, pools
