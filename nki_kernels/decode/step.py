"""The decode step as one looped kernel, and the layer code it shares with other compositions of the step.

decode_step_kernel: one kernel; an outer loop over the layers with the hidden state (float32 column tiles) on chip
throughout, weights streaming through one WeightRing whose cursor carries across layers (layer l+1's first blocks
load while layer l computes), then the final norm and the LM head from the same ring. `decode_step_plan` is what
the JAX side asks for it; nki_kernels.decode.runner runs it on the emulator. `decoder_layer`, `StepContext` and
`logits_of` are the layer and the head the kernel loops over (benchmarks/harness builds the per-layer and per-op
compositions the comparison measures from them).

Tensor parallel (spec.tensor_parallel > 1, nki_kernels.decode.sharding): the kernel is one rank's, on its shard;
it all-reduces o's and down's partial products inside the layer and gathers the logits after the head
(nki_kernels.decode.parallel).

Operands: nki_kernels.decode.contract (DecodeOperands; the kernel takes them as one list argument,
DecodeOperands.kernel_args()). Layouts: the hidden state and the MLP intermediate are row-grouped column
tiles (nki_kernels.decode.tiles); q, k, v and the attention output natural ones (what attention takes and returns).
Ragged per-layer ranks: factors are stacked to the largest rank, layer l multiplies only the first ranks[l] columns
of u / rows of v (trace-time slices). It reads only those, except where u's stored rows are short
(projections.whole_rows): then whole stored rows, padding included, since ranks[l] values of each row alone would
be short DMA runs at a fraction of the DMA rate, while whole rows are one run per partition of a block.
fp8 weights (spec.fp8_weights) cross HBM as fp8 and are scaled as their PSUM sums are evicted
(nki_kernels.decode.projections); activations stay in the model dtype (x's), which must then be bfloat16 or float16
(TensorE takes fp8 beside 2-byte floats only).

Dimensions in the kernels' docstrings: B rows of T new tokens (R = B·T <= 128), H hidden, V vocabulary, L layers,
K / N a projection's input / output features.
"""

from __future__ import annotations

import dataclasses

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.decode import attention, contract, parallel, projections, tiles
from nki_kernels.decode import paged as paged_cache
from nki_kernels.decode.contract import PROJECTIONS, DecodeSpec, layer_weight
from nki_kernels.decode.layouts import Layouts
from nki_kernels.decode.packing import load_packed
from nki_kernels.decode.ring import RING_BLOCK_BYTES, SMALL_TILE_BYTES, WeightRing
from nki_kernels.hardware import check_target
from nki_kernels.svd_mlp import activation_op

MLP_PROJECTIONS = ("gate", "up", "down")
FP8_ACTIVATIONS = (nl.bfloat16, nl.float16)  # what TensorE takes beside fp8 weights
# SBUF per partition a looped kernel may give every layer's fp8 scales (projections.LayerScales), of the ring's:
# Gemma 3 270M in fp8 needs 3.9 KiB, Llama-3.2-1B 11.8 KiB.
PRELOAD_SBUF_BYTES = 16 * 1024


def check_spec(spec):
    if not isinstance(spec, DecodeSpec):
        raise TypeError(f"spec: expected a nki_kernels.decode.DecodeSpec, got {type(spec).__name__}")


class StepContext:
    """What every layer of a kernel shares: spec, rows, model dtype (the activations' matmul dtype), layouts, the
    weight ring, norm constants, and (a looped kernel's) every layer's fp8 scales."""

    def __init__(
        self, spec, rows, dtype, ring_block_bytes, ring_bytes, k_cache=None, weights=None, head=False, paged=None
    ):
        """k_cache: the step's cache when the kernel runs attention (its tiles are kept out of the ring's SBUF).
        paged: a paged spec's PagedRows (nki_kernels.decode.paged; k_cache its pool), for every layer's attention.
        weights: {projection: stacked weight (HBM)} of a looped kernel, whose every layer's fp8 scales are then
        loaded at once where `scales_fit` (their tiles kept out of the ring's SBUF too); None: each layer loads
        its own. head: the kernel runs the LM head (its staged logits are kept out of the ring's SBUF; the cache
        tiles and the scales are dropped by then, so the larger of the two counts)."""
        self.spec = spec
        self.rows = rows
        self.dtype = dtype
        self.layouts = Layouts(spec)
        out_layouts = {name: self.layouts.output(name) for name in PROJECTIONS}
        preload = weights is not None and scales_fit(spec, out_layouts)
        self.paged = paged
        if k_cache is None:
            beside = 0
        elif paged is not None:
            beside = paged_cache.cache_sbuf_bytes(k_cache, spec, paged.batch, paged.slots)
        else:
            beside = attention.cache_sbuf_bytes(k_cache, spec, rows // k_cache.shape[1])
        beside += projections.LayerScales.sbuf_bytes(spec, out_layouts) if preload else 0
        if head:
            beside = max(beside, head_staging_bytes(spec, rows, dtype, ring_block_bytes))
        beside += activation_bytes(self.layouts, rows)
        self.ring = WeightRing(ring_block_bytes, ring_bytes, beside, reserved_bytes(spec))
        self.consts = projections.NormConstants(spec.norm_eps)
        self.act = activation_op(spec.activation)
        self.attention = attention.AttentionConstants(spec)
        self.scales = projections.LayerScales(weights, spec, out_layouts) if preload else None

    def layer_scales(self, name, layer):
        """What projections.projection takes as `scales` for `name` in `layer` (None: it loads them itself)."""
        return None if self.scales is None else self.scales.of(name, layer, self.spec.rank(name, layer))


def activation_bytes(layouts, rows):
    """SBUF bytes per partition at most that a layer's activation column tiles hold at once beside the ring, R =
    rows (a bound, counted as float32: the hidden state and a few float32 copies of it, q and attention's working
    copies of it (normed, rotated, the rotation's products), k and v, the MLP's intermediate and its product),
    beside reserved_bytes (constants, the input rows): they grow with R."""
    tiles_live = 4 * len(layouts.hidden) + 6 * len(layouts.q) + 2 * len(layouts.kv) + 2 * len(layouts.inter)
    return rows * tiles_live * nl.float32.itemsize


def reserved_bytes(spec):
    """SBUF bytes per partition a decode-step kernel keeps beside its weight ring for the small tiles
    (SMALL_TILE_BYTES) and a staged [R, hidden] float32 row block (tiles.load_columns, e.g. a layer's norm weights):
    it grows with the hidden size, so small models keep a deeper ring than a fixed reserve would leave."""
    return SMALL_TILE_BYTES + spec.hidden * nl.float32.itemsize


def head_staging_bytes(spec, rows, dtype, ring_block_bytes=None):
    """projections.head_staging_bytes of spec's LM head (stage 2 of a factored one) for R = rows in the model dtype
    `dtype`, in a ring of ring_block_bytes blocks (None: ring.RING_BLOCK_BYTES)."""
    fp8 = spec.fp8("head")
    block = RING_BLOCK_BYTES if ring_block_bytes is None else ring_block_bytes
    return projections.head_staging_bytes(nl.float8_e4m3 if fp8 else dtype, fp8, rows, spec.vocab, block)


def scales_fit(spec, out_layouts):
    """Whether a looped kernel loads every layer's fp8 scales at once: some projection is fp8, one partition per
    layer, and their tiles within PRELOAD_SBUF_BYTES (larger models load them layer by layer)."""
    return (
        any(name != "head" for name in spec.fp8_weights)
        and spec.num_layers <= nl.tile_size.pmax
        and projections.LayerScales.sbuf_bytes(spec, out_layouts) <= PRELOAD_SBUF_BYTES
    )


def rows_of(tensor, rows):
    """An HBM tensor [B, T, F] (or [R, F]) as its [R, F] view."""
    return tensor.reshape((rows, tensor.shape[-1]))


def _normed(ctx, x, weights, j, dtype, name):
    h = tiles.column_tiles(ctx.layouts.hidden, ctx.rows, dtype, name, zero=dtype == nl.float32)
    projections.rms_norm(h, x, weights[:, :, j : j + 1], ctx.layouts.hidden, ctx.rows, ctx.consts)
    return h


def _add(dst, other):
    nisa.tensor_tensor(dst=dst, data1=dst, data2=other, op=nl.add)


def _add_normed(ctx, x, y, weights, j, name):
    """x += norm j of y (float32): fused into one VectorE instruction after the norm's sum for one row."""
    if ctx.rows == 1:
        projections.rms_norm_add(x, y, weights[:, :, j : j + 1], ctx.layouts.hidden, ctx.consts)
    else:
        _add(x, _normed(ctx, y, weights, j, nl.float32, name))


def _prefetch(ctx, ops, layer):
    """attention.prefetch of `layer`: what its attention needs that waits for no projection."""
    return attention.prefetch(ops, layer, ctx.spec, ctx.rows, ctx.paged)


def paged_rows(ops, spec):
    """A paged spec's PagedRows of this launch (the rows' run-time indices, shared by every layer), else None."""
    return paged_cache.PagedRows(ops.block_table, ops.lengths, ops.k_cache, spec) if spec.paged else None


def decoder_layer(ctx, x, layer, ops, early=None, prefetch_next=False):
    """One decoder layer on the hidden state x (float32 column tiles of ctx.layouts.hidden, updated in place).

    ops: DecodeOperands in HBM (x, final_norm and head unused). The k/v of this step go into the caches in place.
    early: this layer's attention prefetch (_prefetch) when an earlier layer issued it, else None (issued here:
    before the projections, or by attention after them where the layer's weights are packed).
    prefetch_next: issue layer + 1's prefetch once the MLP's matmuls are issued and return it: its PE transposes
    and evictions then run while this layer waits for its down all-reduce and its last norms, which TensorE idles
    through, instead of between the next layer's first norm and its q/k/v matmuls (on the step's serial chain).
    Layer + 1's cache tiles are allocated after this layer's attention last reads its own, so the two need not be
    live at once (one layer's in StepContext's beside bytes).
    With prefetch_next, this layer's cache writes are issued after that prefetch (else by attention, as it ends):
    a write at the step's runtime slot orders every later read of the cache after it, so layer + 1's window reads,
    issued before it, wait for no write of this layer (they would start only once it lands, mid-layer, and claim
    DMA engines at that moment, between weight blocks that then cannot fill the engines' time before them).
    """
    spec, rows, lay = ctx.spec, ctx.rows, ctx.layouts
    weights = ops.weights
    w_norm = projections.load_norm_weights(ops.norms[layer], lay.hidden, spec.norm_unit_offset)
    # o and down split their rows over tensor-parallel ranks: their partial products are summed over the ranks.
    reduce = parallel.all_reduce_columns(spec.tensor_parallel)

    packed = {}  # this layer's packed weights (spec.packed_weights), loaded when the first of them is used
    last_packed = max(spec.packed_weights, key=PROJECTIONS.index, default=None)  # in the layer's order

    def stored(name):
        """This layer's weight of projection `name`: HBM views, a packed one's values on chip; a layer left dense
        in a factored stack as its dense weight (contract.dense_in_stack: W alone is read, not the identity)."""
        weight = layer_weight(weights[name], layer)
        dense_layer = isinstance(weight, contract.Factored) and spec.rank(name, layer) is None
        if name not in spec.packed_weights:
            return contract.dense_in_stack(spec, name, weight) if dense_layer else weight
        if not packed:
            packed.update(load_packed(ops.packed, layer, spec, ctx.ring))
        if isinstance(weight, contract.Dense):  # dense in the model's dtype: its values are all there is
            return packed[name]["w"]
        if dense_layer:
            return contract.dense_in_stack(spec, name, weight, packed[name]["w"])
        return dataclasses.replace(weight, **packed[name])

    def release(*names):
        """Unpin this layer's packed blocks once `names`, the projections just issued, include its last packed one:
        later loads (the rest of the layer's, the next layer's, the LM head's) may then take their ring bytes, each
        waiting for the matmuls that read them (the last layer's would otherwise stay pinned through the head, a
        shallower ring for its prefetch)."""
        if packed and last_packed in names:
            ctx.ring.pinned = []

    def layer_projection(src, src_layout, name, out_layout, evict):
        rank = spec.rank(name, layer)
        weight = stored(name)
        projections.projection(
            src,
            src_layout,
            weight,
            rank,
            out_layout,
            rows,
            ctx.ring,
            evict,
            ctx.layer_scales(name, layer),
            reduce if name in contract.SPLIT_ROWS else None,
        )
        release(name)

    h = _normed(ctx, x, w_norm, 0, ctx.dtype, "attn_in")
    # Attention's inputs that wait for no projection (its tables, the cache window's row 0) go first, unless the
    # layer's weights are packed: q, k and v's matmuls then wait for the packed block's DMA, and TensorE would take
    # the prefetch's transposes (the mask columns, the window's keys) before them in program order, so the window's
    # DMAs, queued behind the packed block, would delay q too; attention issues them after the projections instead.
    if early is None and not spec.packed_weights:
        early = _prefetch(ctx, ops, layer)
    writes = [] if prefetch_next else None  # this layer's cache writes, issued after layer + 1's prefetch
    qkv = {}
    for name, layout in (("q", lay.q), ("k", lay.kv), ("v", lay.kv)):
        qkv[name] = tiles.column_tiles(layout, rows, ctx.dtype, f"{name}T", zero=False)
        layer_projection(h, lay.hidden, name, layout, projections.copy_into(qkv[name]))
    del h
    attn = attention.attention(
        qkv["q"],
        qkv["k"],
        qkv["v"],
        ops,
        layer,
        spec,
        constants=ctx.attention,
        prefetched=early,
        writes=writes,
        paged=ctx.paged,
    )
    del qkv
    if attn.dtype != ctx.dtype:
        cast = tiles.column_tiles(lay.q, rows, ctx.dtype, "attnT_cast", zero=False)
        nisa.tensor_copy(dst=cast[:, :, 0:rows], src=attn[:, :, 0:rows])
        attn = cast
    if lay.attn != lay.q:
        attn = tiles.relayout(attn, lay.q, lay.attn, rows)
    ranks = tuple(spec.rank(name, layer) for name in MLP_PROJECTIONS)
    scales = tuple(ctx.layer_scales(name, layer) for name in MLP_PROJECTIONS)
    mlp = projections.GatedMlp(*(stored(name) for name in MLP_PROJECTIONS), ctx.act, ranks, scales)
    if spec.sandwich:
        y = tiles.column_tiles(lay.hidden, rows, nl.float32, "attn_out")
        layer_projection(attn, lay.attn, "o", lay.hidden, projections.copy_into(y))
        _add_normed(ctx, x, y, w_norm, 1, "attn_out_normed")
        h = _normed(ctx, x, w_norm, 2, ctx.dtype, "mlp_in")
        m = tiles.column_tiles(lay.hidden, rows, nl.float32, "mlp_out")
        projections.gated_mlp(h, lay.hidden, lay.inter, mlp, rows, ctx.ring, projections.copy_into(m), reduce)
        release(*MLP_PROJECTIONS)
        following = _prefetch(ctx, ops, layer + 1) if prefetch_next else None
        for write in writes or ():
            write()
        _add_normed(ctx, x, m, w_norm, 3, "mlp_out_normed")
    else:
        layer_projection(attn, lay.attn, "o", lay.hidden, projections.add_into(x))
        h = _normed(ctx, x, w_norm, 1, ctx.dtype, "mlp_in")
        projections.gated_mlp(h, lay.hidden, lay.inter, mlp, rows, ctx.ring, projections.add_into(x), reduce)
        release(*MLP_PROJECTIONS)
        following = _prefetch(ctx, ops, layer + 1) if prefetch_next else None
        for write in writes or ():
            write()
    return following


def check_fp8_activations(kernel, spec, dtype):
    """A TypeError unless the model dtype `dtype` can meet the spec's fp8 weights on TensorE (bf16 / fp16)."""
    if spec.fp8_weights and dtype not in FP8_ACTIVATIONS:
        raise TypeError(
            f"{kernel}: x has dtype {dtype.name} with fp8 weights {spec.fp8_weights}; the kernels take fp8 weights "
            f"beside {' or '.join(d.name for d in FP8_ACTIVATIONS)} activations only (TensorE does not mix fp8 "
            f"with float32)"
        )


def check_operands(kernel, operands, spec):
    """`operands` as DecodeOperands once they follow the contract (factors may be stacked past their largest rank)
    and fit one kernel launch (B·T rows on one partition tile; bf16 / fp16 x with fp8 weights; a head_dim whose
    heads tile the partitions, attention.check_head_dim); else a ValueError / TypeError naming the operand or the
    spec's field."""
    attention.check_head_dim(spec.head_dim, spec.num_kv_heads)
    ops = contract.check(spec, operands, kernel, padded_ranks=True)
    b, t, _ = ops.x.shape
    if b * t > nl.tile_size.pmax:
        raise ValueError(
            f"{kernel}: x has shape {tuple(ops.x.shape)}, expected B·T <= {nl.tile_size.pmax} rows (one partition tile)"
        )
    check_fp8_activations(kernel, spec, ops.x.dtype)
    return ops


@nki.jit
def decode_step_kernel(operands, *, spec, ring_block_bytes=None, ring_bytes=None):
    """The whole decode step in one kernel: an outer loop over the layers, the hidden state on chip throughout.

    With spec.tensor_parallel > 1 the kernel is one rank's step on its shard (nki_kernels.decode.sharding;
    every rank runs it), all-reducing o's and down's partial products inside the loop and gathering the logits
    (nki_kernels.decode.parallel).

    Dimensions: B, T (B·T <= 128), H, V (this rank's vocabulary), L.
    Args:
        operands: DecodeOperands.kernel_args() (nki_kernels.decode.contract: every operand in HBM, a stored
            weight as the list of its parts: [u, v], [u, v, u_scale, v_scale] or [w, scale]); k_cache and v_cache
            are written IN PLACE at this step's slots.
        spec: DecodeSpec (static).
        ring_block_bytes, ring_bytes: the weight ring's geometry per partition (default: blocks of up to
            ring.RING_BLOCK_BYTES in a ring filling the target's SBUF less reserved_bytes and the larger of
            attention's cache tiles (with fp8 scales) and the head's staged logits).
    Returns:
        (logits [B, T, V·spec.tensor_parallel] float32 in HBM, k_cache, v_cache).
    """
    ops = check_operands("decode_step_kernel", operands, spec)
    b, t, _ = ops.x.shape
    rows = b * t
    ctx = StepContext(
        spec, rows, ops.x.dtype, ring_block_bytes, ring_bytes, ops.k_cache, ops.weights, True, paged_rows(ops, spec)
    )
    hidden = tiles.column_tiles(ctx.layouts.hidden, rows, nl.float32, "hidden")
    tiles.load_columns(hidden, rows_of(ops.x, rows), ctx.layouts.hidden)
    early = None
    for layer in range(spec.num_layers):
        early = decoder_layer(ctx, hidden, layer, ops, early, prefetch_next=layer + 1 < spec.num_layers)
    ctx.scales = None  # the layers' fp8 scales: their SBUF is the head's (StepContext counts the larger of the two)
    logits = logits_of(ctx, hidden, ops.final_norm, ops.head, b, t)
    return logits, ops.k_cache, ops.v_cache


def logits_of(ctx, hidden, final_norm, head, b, t):
    """Final norm and LM head of the hidden state: logits [B, T, V·spec.tensor_parallel] float32 in HBM (each
    rank's vocabulary slice gathered from the ranks, in rank order, when there are several)."""
    spec = ctx.spec
    logits = nl.ndarray((b, t, spec.whole_vocab), dtype=nl.float32, buffer=nl.shared_hbm, name="logits")
    # This rank's vocabulary slice: the logits themselves on one rank, else scratch the ranks gather from.
    local = rows_of(logits, ctx.rows)
    if spec.tensor_parallel > 1:
        local = nl.ndarray((ctx.rows, spec.vocab), dtype=nl.float32, buffer=nl.hbm, name="rank_logits")
    final_w = projections.load_norm_weights(
        final_norm.reshape((1, spec.hidden)), ctx.layouts.hidden, spec.norm_unit_offset
    )
    lm = projections.LmHead(head, spec.head_rank, spec.final_logit_softcap)
    projections.lm_head(hidden, ctx.layouts.hidden, final_w, lm, ctx.rows, ctx.ring, ctx.consts, local, ctx.dtype)
    if spec.tensor_parallel > 1:
        parallel.gather_vocabulary(rows_of(logits, ctx.rows), local, spec.tensor_parallel)
    return logits


def decode_step_plan(operands, spec, target="trn1"):
    """(kernel, kwargs) for one decode step as the looped kernel:

    logits, k_cache, v_cache = kernel(operands.kernel_args(), spec=spec, **kwargs)

    operands: DecodeOperands of arrays or shape/dtype stand-ins, checked against the contract and the kernel's
    limits (B·T rows on one partition tile). One kernel serves trn1 and trn2.
    """
    check_target(target)
    check_operands("decode_step_kernel", operands, spec)
    return decode_step_kernel, {}
