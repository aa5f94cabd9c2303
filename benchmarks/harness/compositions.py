"""The decode step's compositions other than the looped kernel (nki_kernels.decode.step), for the comparison.

per_layer       decoder_layer_kernel(..., layer=l) per layer (the hidden state in HBM, float32, between
                launches), then lm_head_kernel.
per_op          one kernel per op: norm_kernel, projection_kernel, attention.rope_kernel, cache_write_kernel and
                attention_kernel, add_kernel, gated_activation_kernel (act·mul), norm_kernel + head_kernel;
                activations in HBM between launches.
per_op_svd_mlp  per_op, except that a factored MLP runs the fused svd_mlp kernels (the prefill's kernels).

harness.runner launches them in sequence on the emulator. They are built from the same subroutines as the looped
kernel, so the comparison isolates what fusing the step saves. Tensor parallel: the per-layer kernels all-reduce
inside the layer as the looped one does; per_op runs its collectives as launches of their own (all_reduce_kernel,
gather_vocabulary_kernel).
"""

from __future__ import annotations

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.decode import contract, parallel, projections, tiles
from nki_kernels.decode.contract import as_weight, layer_weight
from nki_kernels.decode.ring import WeightRing
from nki_kernels.decode.step import (
    StepContext,
    check_fp8_activations,
    check_spec,
    decoder_layer,
    head_staging_bytes,
    logits_of,
    paged_rows,
    rows_of,
)

COMPOSITIONS = ("per_op", "per_layer", "looped", "per_op_svd_mlp")


@nki.jit
def decoder_layer_kernel(operands, *, spec, layer, ring_block_bytes=None, ring_bytes=None):
    """Decoder layer `layer` as one kernel; the hidden state crosses HBM in float32 between launches. With
    spec.tensor_parallel > 1, one rank's layer with its all-reduces (as decode_step_kernel's).

    Dimensions: B, T (B·T <= 128), H.
    Args:
        operands: DecodeOperands.kernel_args() with x [B, T, H] the layer's input (any float dtype) and
            final_norm, head None (unused); k_cache and v_cache are written IN PLACE. The model dtype is the
            norms' (x may be the previous layer's float32).
        spec: DecodeSpec (static). layer: the layer, a static int in [0, spec.num_layers).
        ring_block_bytes, ring_bytes: as decode_step_kernel's.
    Returns:
        (x' [B, T, H] float32 in HBM, k_cache, v_cache).
    """
    check_spec(spec)
    if not isinstance(layer, int) or not 0 <= layer < spec.num_layers:
        raise ValueError(f"decoder_layer_kernel: layer={layer!r}, expected an int in [0, {spec.num_layers})")
    ops = contract.DecodeOperands.of(operands, spec)
    b, t, _ = ops.x.shape
    rows = b * t
    check_fp8_activations("decoder_layer_kernel", spec, ops.norms.dtype)
    ctx = StepContext(
        spec, rows, ops.norms.dtype, ring_block_bytes, ring_bytes, ops.k_cache, paged=paged_rows(ops, spec)
    )
    hidden = tiles.column_tiles(ctx.layouts.hidden, rows, nl.float32, "hidden")
    tiles.load_columns(hidden, rows_of(ops.x, rows), ctx.layouts.hidden)
    decoder_layer(ctx, hidden, layer, ops)
    out = nl.ndarray((b, t, spec.hidden), dtype=nl.float32, buffer=nl.shared_hbm, name="hidden_out")
    tiles.store_columns(rows_of(out, rows), hidden, ctx.layouts.hidden)
    return out, ops.k_cache, ops.v_cache


@nki.jit
def lm_head_kernel(x, final_norm, head, *, spec, ring_block_bytes=None, ring_bytes=None):
    """Final norm and LM head as one kernel (the last launch of the per-layer composition). With
    spec.tensor_parallel > 1, one rank's vocabulary slice, the logits gathered from every rank.

    Dimensions: B, T (B·T <= 128), H, V (this rank's vocabulary).
    Args:
        x: [B, T, H] in HBM, the last layer's output (any float dtype).
        final_norm: [H] in HBM, in the model dtype. head: as the contract stores it (spec.head_rank,
            spec.fp8_weights), in HBM: dense [H, V], [w, scale], [u [H, r], v [r, V]] or [u, v, u_scale, v_scale].
        spec: DecodeSpec (static). ring_block_bytes, ring_bytes: as decode_step_kernel's.
    Returns:
        logits [B, T, V·spec.tensor_parallel] float32 in HBM, soft-capped when spec.final_logit_softcap is set.
    """
    check_spec(spec)
    b, t, _ = x.shape
    rows = b * t
    head = as_weight(head, spec.head_rank is not None)
    check_fp8_activations("lm_head_kernel", spec, final_norm.dtype)
    ctx = StepContext(spec, rows, final_norm.dtype, ring_block_bytes, ring_bytes, head=True)
    hidden = tiles.column_tiles(ctx.layouts.hidden, rows, nl.float32, "hidden")
    tiles.load_columns(hidden, rows_of(x, rows), ctx.layouts.hidden)
    return logits_of(ctx, hidden, final_norm, head, b, t)


# -- per-op kernels: rows [R, F] in HBM between launches ----------------------------------------------------


def _out_dtype(name):
    return {"float32": nl.float32, "bfloat16": nl.bfloat16, "float16": nl.float16}[name]


@nki.jit
def norm_kernel(x, weights, *, index, spec, out_dtype="float32"):
    """RMSNorm of rows as one kernel.

    Dimensions: R rows (<= 128), F features.
    Args:
        x: [R, F] rows in HBM (any float dtype).
        weights: a norm tensor in HBM whose entry `index` is [F] ([L, NN, F] with index (layer, j), or [F] with
            index ()); raw weights (1 + w is applied with spec.norm_unit_offset).
        index: static tuple. spec: DecodeSpec (static; eps, unit offset). out_dtype: "float32", "bfloat16" or
            "float16".
    Returns:
        [R, F] in HBM, out_dtype.
    """
    check_spec(spec)
    rows, features = x.shape
    layout = tiles.feature_layout(features)
    w = weights[index] if index else weights
    consts = projections.NormConstants(spec.norm_eps)
    xc = tiles.column_tiles(layout, rows, nl.float32, "x")
    tiles.load_columns(xc, x, layout)
    wc = projections.load_norm_weights(w.reshape((1, features)), layout, spec.norm_unit_offset)
    dtype = _out_dtype(out_dtype)
    h = tiles.column_tiles(layout, rows, dtype, "normed", zero=False)
    projections.rms_norm(h, xc, wc, layout, rows, consts)
    out = nl.ndarray((rows, features), dtype=dtype, buffer=nl.shared_hbm, name="normed_rows")
    tiles.store_columns(out, h, layout)
    return out


@nki.jit
def projection_kernel(x, weight, *, layer, rank=None, out_dtype="float32", ring_block_bytes=None, ring_bytes=None):
    """One layer's projection of rows as one kernel.

    Dimensions: R rows (<= 128), K input and N output features, L layers.
    Args:
        x: [R, K] rows in HBM, in the model dtype (the weight's, or bf16 / fp16 beside fp8 weights).
        weight: a stacked projection in HBM: dense [L, K, N], or [u [L, K, Rmax], v [L, Rmax, N]] when rank is
            set (layer `layer` uses the first `rank` columns of u / rows of v); fp8 with float32 scales as
            [w, scale [L, N]] or [u, v, u_scale [L, Rmax], v_scale [L, N]].
        layer, rank: static ints (rank None: dense). out_dtype: "float32", "bfloat16" or "float16".
        ring_block_bytes, ring_bytes: as decode_step_kernel's.
    Returns:
        [R, N] in HBM, out_dtype.
    """
    rows, k = x.shape
    weight = as_weight(weight, rank is not None)
    w = layer_weight(weight, layer)
    dtype = x.dtype
    n = (w.v if rank is not None else w.w if isinstance(w, contract.Quantized) else w).shape[-1]
    in_layout = tiles.feature_layout(k, tiles.choose_group(k, n if rank is None else rank))
    out_layout = tiles.feature_layout(n)
    ring = WeightRing(ring_block_bytes, ring_bytes)
    xc = tiles.column_tiles(in_layout, rows, dtype, "x", zero=False)
    tiles.load_columns(xc, x, in_layout)
    odt = _out_dtype(out_dtype)
    y = tiles.column_tiles(out_layout, rows, odt, "y", zero=False)
    projections.projection(xc, in_layout, w, rank, out_layout, rows, ring, projections.copy_into(y))
    # The ring's last block is read: its SBUF holds the staged [R, N] output rows instead (N up to the intermediate
    # size: 32 KiB in float32 for Llama-3.2-1B's gate / up at R = 1, beyond the reserve beside a full ring).
    del ring
    out = nl.ndarray((rows, n), dtype=odt, buffer=nl.shared_hbm, name="projected_rows")
    tiles.store_columns(out, y, out_layout)
    return out


@nki.jit
def add_kernel(x, y):
    """A residual add as one kernel.

    Dimensions: R rows (<= 128), F features.
    Args:
        x, y: [R, F] rows in HBM (any float dtypes).
    Returns:
        x + y, [R, F] float32 in HBM.
    """
    rows, features = x.shape
    layout = tiles.feature_layout(features)
    xc = tiles.column_tiles(layout, rows, nl.float32, "x", zero=False)
    yc = tiles.column_tiles(layout, rows, nl.float32, "y", zero=False)
    tiles.load_columns(xc, x, layout)
    tiles.load_columns(yc, y, layout)
    for s0, count, size in tiles.tile_runs(layout):
        view = xc[0:size, s0 : s0 + count, 0:rows]
        nisa.tensor_tensor(dst=view, data1=view, data2=yc[0:size, s0 : s0 + count, 0:rows], op=nl.add)
    out = nl.ndarray((rows, features), dtype=nl.float32, buffer=nl.shared_hbm, name="sum_rows")
    tiles.store_columns(out, xc, layout)
    return out


@nki.jit
def head_kernel(h, head, *, spec, ring_block_bytes=None, ring_bytes=None):
    """The LM head of normed rows as one kernel.

    Dimensions: R rows (<= 128), H, V.
    Args:
        h: [R, H] normed rows in HBM, in the model dtype.
        head: as lm_head_kernel's, in HBM.
        spec: DecodeSpec (static). ring_block_bytes, ring_bytes: as decode_step_kernel's.
    Returns:
        logits [R, V] float32 in HBM, soft-capped when spec.final_logit_softcap is set.
    """
    check_spec(spec)
    rows, features = h.shape
    head = as_weight(head, spec.head_rank is not None)
    check_fp8_activations("head_kernel", spec, h.dtype)
    layout = tiles.feature_layout(
        features, tiles.head_group(features) if spec.head_rank is None else tiles.choose_group(features, spec.head_rank)
    )
    ring = WeightRing(ring_block_bytes, ring_bytes, head_staging_bytes(spec, rows, h.dtype, ring_block_bytes))
    hc = tiles.column_tiles(layout, rows, h.dtype, "h", zero=False)
    tiles.load_columns(hc, h, layout)
    out = nl.ndarray((rows, spec.vocab), dtype=nl.float32, buffer=nl.shared_hbm, name="logits")
    projections.head_logits(hc, layout, head, spec.head_rank, rows, ring, out, spec.final_logit_softcap)
    return out


@nki.jit
def all_reduce_kernel(x, *, tensor_parallel, out_dtype="float32"):
    """A tensor-parallel all-reduce of rows as one kernel: the per-op composition's collective between the
    launches of o or down (or of a factored one's u and v) and what follows them.

    Dimensions: R rows, F features.
    Args:
        x: [R, F] float32 in HBM, this rank's partial sum.
        tensor_parallel: the ranks (static int; every rank launches the kernel). out_dtype: "float32", "bfloat16"
            or "float16".
    Returns:
        the sum of x over the ranks, [R, F] out_dtype in HBM.
    """
    summed = nl.ndarray(tuple(x.shape), dtype=nl.float32, buffer=nl.shared_hbm, name="summed_rows")
    nki.collectives.all_reduce([x], [summed], parallel.replica_group(tensor_parallel), nl.add)
    dtype = _out_dtype(out_dtype)
    if dtype == nl.float32:
        return summed
    out = nl.ndarray(tuple(x.shape), dtype=dtype, buffer=nl.shared_hbm, name="summed_rows_cast")
    nisa.dma_copy(dst=out, src=summed)
    return out


@nki.jit
def gather_vocabulary_kernel(x, *, tensor_parallel):
    """The per-op composition's logits gathered over the tensor-parallel ranks' vocabulary slices, as one kernel.

    Dimensions: R rows, V (one rank's vocabulary).
    Args:
        x: [R, V] float32 in HBM, this rank's logits. tensor_parallel: the ranks (static int).
    Returns:
        [R, V·tensor_parallel] float32 in HBM: every rank's slice in rank order.
    """
    rows, vocab = x.shape
    out = nl.ndarray((rows, vocab * tensor_parallel), dtype=nl.float32, buffer=nl.shared_hbm, name="logits")
    parallel.gather_vocabulary(out, x, tensor_parallel)
    return out
