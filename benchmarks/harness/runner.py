"""A decode step over all layers run on the emulator as one of the compositions: `run_decode_step(composition, ...)`.

looped is the library's kernel (nki_kernels.decode.runner); per_layer and per_op launch harness.compositions'
kernels in sequence, activations crossing HBM between launches as numpy arrays (each launch one row of
`emulator.profile()`). With numerics=False the launches are count-only traces and operands may be emulator `Spec`
placeholders (shape and dtype, no memory), so full-size models trace without their weights.

Tensor parallel (`run_sharded_decode_step`): every launch runs on P = spec.tensor_parallel emulated NeuronCores at
once (one profile row per rank), each on its own shard. per_op adds its collectives as launches of their own
(all_reduce_kernel after o and down, or between a factored one's u and v launches; gather_vocabulary_kernel after
the head); per_op_svd_mlp's fused MLP keeps down's (x·u)ᵀ on chip, so it all-reduces down's output.
"""

from __future__ import annotations

import numpy as np

from harness.compositions import (
    COMPOSITIONS,
    add_kernel,
    all_reduce_kernel,
    decoder_layer_kernel,
    gather_vocabulary_kernel,
    head_kernel,
    lm_head_kernel,
    norm_kernel,
    projection_kernel,
)
from nki_kernels.decode import attention
from nki_kernels.decode.contract import SPLIT_ROWS, kernel_arg
from nki_kernels.decode.runner import (
    PerRank,
    check_values,
    each,
    emulation,
    kernel_args,
    launch,
    rank_of,
    run_looped,
    sharded_operands,
    single_operands,
)
from nki_kernels.decode.step import MLP_PROJECTIONS
from nki_kernels.emulator.kernel import Spec
from nki_kernels.gated_activation import gated_activation_kernel
from nki_kernels.svd_mlp import svd_mlp_down_kernel, svd_mlp_gate_up_kernel

__all__ = ["COMPOSITIONS", "run_decode_step", "run_sharded_decode_step"]


def run_decode_step(composition, operands, spec, *, numerics=True, ring_block_bytes=None, ring_bytes=None):
    """Run one decode step as `composition` (one of COMPOSITIONS) on the emulator: (logits [B, T, V] float32,
    k_cache, v_cache). operands: numpy arrays as in the module docstring (lists for factors), or emulator
    `Spec` placeholders with numerics=False (a count-only trace: no weight memory, NaN-filled results)."""
    ops = single_operands("run_decode_step", operands, spec, "run_sharded_decode_step")
    ring = dict(ring_block_bytes=ring_block_bytes, ring_bytes=ring_bytes)
    return _run("run_decode_step", composition, ops, spec, numerics, ring)


def run_sharded_decode_step(composition, rank_operands, spec, *, numerics=True, ring_block_bytes=None, ring_bytes=None):
    """Run one tensor-parallel decode step as `composition` on P = spec.tensor_parallel emulated ranks, rank r on
    rank_operands[r] (its shard, nki_kernels.decode.sharding.shard_operands): as the library's
    run_sharded_looped_step returns (logits of the whole vocabulary, [k_cache of each rank], [v_cache of each
    rank])."""
    ops = sharded_operands("run_sharded_decode_step", rank_operands, spec)
    ring = dict(ring_block_bytes=ring_block_bytes, ring_bytes=ring_bytes)
    logits, k_cache, v_cache = _run("run_sharded_decode_step", composition, ops, spec, numerics, ring)
    return logits[0], list(k_cache), list(v_cache)


def _run(where, composition, ops, spec, numerics, ring):
    """The launches of `composition` on ops (each operand a value, or PerRank: one per tensor-parallel rank);
    errors start with `where`."""
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition: got {composition!r}, expected one of {COMPOSITIONS}")
    if composition == "looped":
        return run_looped(where, ops, spec, numerics, ring)
    check_values(where, ops, spec)
    if spec.paged and composition != "per_layer":
        raise ValueError(
            f"{where}: composition {composition!r} writes and reads a contiguous cache at write_index; a paged "
            f"cache (spec.block_size = {spec.block_size}) runs in the looped and per-layer kernels"
        )
    with emulation(numerics):
        if composition == "per_layer":
            x, k_cache, v_cache = ops.x, ops.k_cache, ops.v_cache
            for layer in range(spec.num_layers):
                layer_ops = ops.replace(x=x, k_cache=k_cache, v_cache=v_cache, final_norm=None, head=None)
                x, k_cache, v_cache = launch(
                    decoder_layer_kernel, kernel_args(layer_ops), spec=spec, layer=layer, **ring
                )
            head = each(kernel_arg, ops.head)
            return launch(lm_head_kernel, x, ops.final_norm, head, spec=spec, **ring), k_cache, v_cache
        if spec.packed_weights:
            raise ValueError(
                f"{where}: composition {composition!r} takes each weight on its own; spec.packed_weights "
                f"{spec.packed_weights} is the looped and per-layer kernels' layout (unpack with "
                "nki_kernels.decode.packing.unpack_weights and unpacked_spec)"
            )
        return _run_per_op(composition == "per_op_svd_mlp", ops, spec, ring)


def _factor_slice(tensor, layer, rank, axis):
    """Layer `layer` of stacked factor `tensor`, cut to `rank` along axis (1: u's columns, 0: v's rows or a rank
    scale's entries; None: whole), as a standalone array (or a count-only Spec placeholder) for kernels that take
    exact factors."""
    if isinstance(tensor, Spec):
        shape = list(tensor.shape[1:])
        if axis is not None:
            shape[axis] = rank
        return Spec(shape, tensor.dtype)
    part = tensor[layer]
    return np.ascontiguousarray(part if axis is None else part[:, :rank] if axis == 1 else part[:rank])


def _run_per_op(svd_mlp, ops, spec, ring):
    first = rank_of(ops, 0) if isinstance(ops.x, PerRank) else ops
    b, t, h_features = first.x.shape
    rows = b * t
    model = np.dtype(first.x.dtype).name
    ranks = spec.tensor_parallel
    x = each(
        lambda a: (
            np.asarray(a).reshape(rows, h_features) if isinstance(a, np.ndarray) else _spec_like(a, (rows, h_features))
        ),
        ops.x,
    )
    k_cache, v_cache = ops.k_cache, ops.v_cache
    weights = ops.weights

    def norm(src, layer, j, out_dtype):
        return launch(norm_kernel, src, ops.norms, index=(layer, j), spec=spec, out_dtype=out_dtype)

    def all_reduce(partial, out_dtype="float32"):
        return launch(all_reduce_kernel, partial, tensor_parallel=ranks, out_dtype=out_dtype)

    def projectionlaunch(src, name, layer, out_dtype):
        rank = spec.rank(name, layer)
        weight, at = each(kernel_arg, weights[name]), layer
        if rank is None and spec.factored(name):  # a layer left dense in a factored stack: W alone
            weight, at = each(lambda w: _dense_in_stack(w, spec, name, layer), weights[name]), 0
        if ranks == 1 or name not in SPLIT_ROWS:
            return launch(projection_kernel, src, weight, layer=at, rank=rank, out_dtype=out_dtype, **ring)
        if rank is None:
            return all_reduce(launch(projection_kernel, src, weight, layer=at, **ring))
        # A factored o or down: its (x·u) summed over the ranks between the launches of u and of v.
        u, v = (each(lambda w, f=f: _factor_stage(w, f, layer, rank), weights[name]) for f in ("u", "v"))
        xu = all_reduce(launch(projection_kernel, src, u, layer=0, **ring), model)
        return launch(projection_kernel, xu, v, layer=0, out_dtype=out_dtype, **ring)

    for layer in range(spec.num_layers):
        h = norm(x, layer, 0, model)
        q, k, v = (projectionlaunch(h, name, layer, model) for name in ("q", "k", "v"))
        q, k = launch(
            attention.rope_kernel,
            each(lambda a: a.reshape(b, t, -1), q),
            each(lambda a: a.reshape(b, t, -1), k),
            ops.cos,
            ops.sin,
            ops.qk_norms,
            layer=layer,
            spec=spec,
        )
        k_cache, v_cache = launch(
            attention.cache_write_kernel,
            k,
            each(lambda a: a.reshape(b, t, -1), v),
            k_cache,
            v_cache,
            ops.write_index,
            layer=layer,
        )
        attn = launch(
            attention.attention_kernel,
            q,
            k_cache,
            v_cache,
            ops.write_index,
            ops.mask_bias,
            layer=layer,
            spec=spec,
        )
        y = projectionlaunch(each(lambda a: a.reshape(rows, -1), attn), "o", layer, "float32")
        if spec.sandwich:
            y = norm(y, layer, 1, "float32")
        x = launch(add_kernel, x, y)
        h = norm(x, layer, 2 if spec.sandwich else 1, model)
        factored = all(spec.rank(name, layer) is not None for name in MLP_PROJECTIONS)
        if svd_mlp and factored:
            gate_up, down = _svd_mlp_args(weights, spec, layer)
            hT = launch(svd_mlp_gate_up_kernel, h, *gate_up, activation=spec.activation)
            m = launch(svd_mlp_down_kernel, hT, *down)
            if ranks > 1:
                m = all_reduce(m)  # the fused kernel keeps down's (x·u)ᵀ on chip: its output is summed
        else:
            gate, up = projectionlaunch(h, "gate", layer, model), projectionlaunch(h, "up", layer, model)
            hidden = launch(gated_activation_kernel, gate, up, activation=spec.activation)
            m = projectionlaunch(hidden, "down", layer, "float32")
        if spec.sandwich:
            m = norm(m, layer, 3, "float32")
        x = launch(add_kernel, x, m)
    h = launch(norm_kernel, x, ops.final_norm, index=(), spec=spec, out_dtype=model)
    logits = launch(head_kernel, h, each(kernel_arg, ops.head), spec=spec, **ring)
    if ranks > 1:
        logits = launch(gather_vocabulary_kernel, logits, tensor_parallel=ranks)
    return each(lambda a: a.reshape(b, t, spec.whole_vocab), logits), k_cache, v_cache


def _svd_mlp_args(weights, spec, layer):
    """(gate_up, down): the fused svd_mlp kernels' factor arguments for layer `layer`, each cut to its rank (u's
    columns, v's rows, u_scale's entries) and in the kernels' order: gate's and up's four factors, then (fp8) their
    scales; down's u, v (, u_scale, v_scale). Each a PerRank where the weights are."""
    cuts = {"u": 1, "v": 0, "u_scale": 0, "v_scale": None}

    def cut(weight, name):
        rank = spec.rank(name, layer)
        return {part: _factor_slice(tensor, layer, rank, cuts[part]) for part, tensor in weight.parts().items()}

    parts = {name: each(lambda w, name=name: cut(w, name), weights[name]) for name in MLP_PROJECTIONS}

    def pick(name, part):
        return each(lambda p: p[part], parts[name])

    gate_up = [pick(name, f) for name in ("gate", "up") for f in ("u", "v")]
    gate_up += [pick(name, f) for name in ("gate", "up") if spec.fp8(name) for f in ("u_scale", "v_scale")]
    down = [pick("down", f) for f in ("u", "v", "u_scale", "v_scale") if spec.fp8("down") or f in ("u", "v")]
    return gate_up, down


def _factor_stage(weight, factor, layer, rank):
    """Factor `factor` ("u" or "v") of layer `layer` of a stacked Factored, cut to `rank`, as projection_kernel's
    stacked weight of one layer (layer 0): [1, K, rank] / [1, rank, N], or with fp8 factors [values, scales]
    (a Quantized: u_scale's entries, or v_scale)."""
    values = _one_layer(_factor_slice(getattr(weight, factor), layer, rank, 1 if factor == "u" else 0))
    scale = getattr(weight, f"{factor}_scale")
    if scale is None:
        return values
    return [values, _one_layer(_factor_slice(scale, layer, rank, 0 if factor == "u" else None))]


def _dense_in_stack(weight, spec, name, layer):
    """Layer `layer` of a stacked Factored that the spec leaves dense there, as projection_kernel's stacked dense
    weight of one layer: W [1, K, N] from the factor that holds it (contract.dense_in_stack), or with fp8 factors
    [values, v_scale [1, N]]."""
    factor, width = spec.dense_factor(name)
    values = _one_layer(_factor_slice(getattr(weight, factor), layer, width, 1 if factor == "u" else 0))
    if weight.v_scale is None:
        return values
    return [values, _one_layer(_factor_slice(weight.v_scale, layer, None, None))]


def _one_layer(part):
    """A standalone part (or Spec placeholder) as a stack of one layer."""
    if isinstance(part, Spec):
        return Spec((1, *part.shape), part.dtype)
    return part[None]


def _spec_like(placeholder, shape):
    return Spec(shape, placeholder.dtype)
