"""One decode step over all decoder layers as NKI kernels, for three compositions (issue 15).

Operands (positional, nki_kernels/decode_spec.py's contract): x [B, T, H], norms [L, NN, H], qk_norms [L, 2, D] or
None, q, k, v, o, gate, up, down (each dense [L, K, N] or [u [L, K, Rmax], v [L, Rmax, N]]), k_cache, v_cache
[L, B, S, kv, D], write_index [1, 1] int32, cos, sin [NR, B, T, D], mask_bias [NM, B, T, S], final_norm [H], head
[H, V] or [u [H, r], v [r, V]]. Result: (logits [B, T, V] float32, k_cache, v_cache), the caches written in place
at slots [write_index, write_index + T).

(iii) decode_step_kernel: one kernel; an outer loop over layers with the hidden state (float32 column tiles) on
      chip throughout, weights streaming through one WeightRing whose cursor carries across layers (layer l+1's
      first blocks load while layer l computes), then the final norm and the LM head from the same ring.
(ii)  decoder_layer_kernel(..., layer=l) per layer (hidden state in HBM, float32, between launches), then
      lm_head_kernel.
(i)   one kernel per op: norm_kernel, projection_kernel, decode_attention's rope_kernel, cache_write_kernel and
      attention_kernel, add_kernel, gated_activation_kernel (act·mul), norm_kernel + head_kernel; activations
      in HBM between launches.
"today": (i), except a factored MLP runs the existing fused svd_mlp kernels.
nki_kernels.decode_step runs them in sequence (`run_decode_step`) and re-exports them. Layouts, the ring and the
subroutines: nki_kernels.decode_layer (the hidden state and the MLP intermediate are row-grouped column tiles, see
there; q, k, v and the attention output natural ones, decode_attention's contract).
Ragged per-layer ranks: factors are stacked to the largest rank, layer l reads only the first ranks[l] columns of
u / rows of v (trace-time slices), so padding costs HBM capacity, never bandwidth.
"""

from __future__ import annotations

from nki_kernels import decode_attention
from nki_kernels import decode_layer as dl
from nki_kernels.binding import nisa, nki, nl
from nki_kernels.decode_spec import PROJECTIONS, DecodeSpec
from nki_kernels.svd_mlp import activation_op

COMPOSITIONS = ("per_op", "per_layer", "looped", "today")
OPERAND_NAMES = (
    ("x", "norms", "qk_norms")
    + PROJECTIONS
    + ("k_cache", "v_cache", "write_index", "cos", "sin", "mask_bias", "final_norm", "head")
)
MLP_PROJECTIONS = ("gate", "up", "down")


def check_spec(spec):
    if not isinstance(spec, DecodeSpec):
        raise TypeError(f"spec: expected a nki_kernels.decode_spec.DecodeSpec, got {type(spec).__name__}")


def weight_dtype(weight):
    return weight.dtype if not isinstance(weight, (list, tuple)) else weight[0].dtype


def layer_weight(weight, layer, rank):
    """Layer `layer` of a stacked projection as HBM views: [K, N], or [u [K, Rmax], v [Rmax, N]]."""
    return weight[layer] if rank is None else [weight[0][layer], weight[1][layer]]


def _min_row_elements(spec, names):
    """The fewest columns any weight contracting over a vector has (dense N, or the smallest rank)."""
    widths = []
    for name in names:
        ranks = spec.ranks[PROJECTIONS.index(name)]
        widths.append(spec.out_features(name) if ranks is None else min(ranks))
    return min(widths)


class Layouts:
    """Feature layouts of one spec: hidden (grouped for q/k/v/gate/up rows), intermediate (for down), attention
    output (for o), and the natural layouts of q and k/v (decode_attention's contract)."""

    def __init__(self, spec):
        head_width = spec.vocab if spec.head_rank is None else spec.head_rank
        hidden_rows = min(_min_row_elements(spec, ("q", "k", "v", "gate", "up")), head_width)
        self.hidden = dl.feature_layout(spec.hidden, dl.choose_group(spec.hidden, hidden_rows))
        self.inter = dl.feature_layout(
            spec.intermediate, dl.choose_group(spec.intermediate, _min_row_elements(spec, ("down",)))
        )
        self.q = dl.feature_layout(spec.num_heads * spec.head_dim)
        # The attention output, regrouped on chip for o's weight rows (attention returns natural tiles).
        self.attn = dl.feature_layout(
            spec.num_heads * spec.head_dim,
            dl.choose_group(spec.num_heads * spec.head_dim, _min_row_elements(spec, ("o",))),
        )
        self.kv = dl.feature_layout(spec.num_kv_heads * spec.head_dim)


class StepContext:
    """What every layer of a kernel shares: spec, rows, model dtype, layouts, the weight ring, norm constants."""

    def __init__(self, spec, rows, dtype, ring_block_bytes, ring_bytes, k_cache=None):
        """k_cache: the step's cache when the kernel runs attention (its tiles are kept out of the ring's SBUF)."""
        self.spec = spec
        self.rows = rows
        self.dtype = dtype
        self.layouts = Layouts(spec)
        beside = 0 if k_cache is None else decode_attention.cache_sbuf_bytes(k_cache, spec, rows // k_cache.shape[1])
        self.ring = dl.WeightRing(dtype, ring_block_bytes, ring_bytes, beside)
        self.consts = dl.NormConstants(spec.norm_eps)
        self.act = activation_op(spec.activation)
        self.attention = decode_attention.AttentionConstants(spec)


def _rows(tensor, rows):
    """An HBM tensor [B, T, F] (or [R, F]) as its [R, F] view."""
    return tensor.reshape((rows, tensor.shape[-1]))


def _normed(ctx, x, weights, j, dtype, name):
    h = dl.column_tiles(ctx.layouts.hidden, ctx.rows, dtype, name, zero=dtype == nl.float32)
    dl.rms_norm(h, x, weights[:, :, j : j + 1], ctx.layouts.hidden, ctx.rows, ctx.consts)
    return h


def _add(dst, other):
    nisa.tensor_tensor(dst=dst, data1=dst, data2=other, op=nl.add)


def decoder_layer(ctx, x, layer, weights, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norms, norms):
    """One decoder layer on the hidden state x (float32 column tiles of ctx.layouts.hidden, updated in place).

    weights: dict projection name → stacked HBM operand. The k/v of this step go into the caches in place.
    """
    spec, rows, lay = ctx.spec, ctx.rows, ctx.layouts
    w_norm = dl.load_norm_weights(norms[layer], lay.hidden, spec.norm_unit_offset)

    def project(src, src_layout, name, out_layout, evict):
        rank = spec.rank(name, layer)
        dl.project(src, src_layout, layer_weight(weights[name], layer, rank), rank, out_layout, rows, ctx.ring, evict)

    h = _normed(ctx, x, w_norm, 0, ctx.dtype, "attn_in")
    qkv = {}
    for name, layout in (("q", lay.q), ("k", lay.kv), ("v", lay.kv)):
        qkv[name] = dl.column_tiles(layout, rows, ctx.dtype, f"{name}T", zero=False)
        project(h, lay.hidden, name, layout, dl.copy_into(qkv[name]))
    del h
    attn = decode_attention.attention(
        qkv["q"],
        qkv["k"],
        qkv["v"],
        k_cache,
        v_cache,
        layer,
        write_index,
        cos,
        sin,
        mask_bias,
        qk_norms,
        spec,
        constants=ctx.attention,
    )
    del qkv
    if attn.dtype != ctx.dtype:
        cast = dl.column_tiles(lay.q, rows, ctx.dtype, "attnT_cast", zero=False)
        nisa.tensor_copy(dst=cast[:, :, 0:rows], src=attn[:, :, 0:rows])
        attn = cast
    if lay.attn != lay.q:
        attn = dl.relayout(attn, lay.q, lay.attn, rows)
    ranks = tuple(spec.rank(name, layer) for name in MLP_PROJECTIONS)
    mlp = [layer_weight(weights[name], layer, rank) for name, rank in zip(MLP_PROJECTIONS, ranks)]
    if spec.sandwich:
        y = dl.column_tiles(lay.hidden, rows, nl.float32, "attn_out")
        project(attn, lay.attn, "o", lay.hidden, dl.copy_into(y))
        _add(x, _normed(ctx, y, w_norm, 1, nl.float32, "attn_out_normed"))
        h = _normed(ctx, x, w_norm, 2, ctx.dtype, "mlp_in")
        m = dl.column_tiles(lay.hidden, rows, nl.float32, "mlp_out")
        dl.gated_mlp(h, lay.hidden, *mlp, ranks, lay.inter, rows, ctx.ring, ctx.act, dl.copy_into(m))
        _add(x, _normed(ctx, m, w_norm, 3, nl.float32, "mlp_out_normed"))
    else:
        project(attn, lay.attn, "o", lay.hidden, dl.add_into(x))
        h = _normed(ctx, x, w_norm, 1, ctx.dtype, "mlp_in")
        dl.gated_mlp(h, lay.hidden, *mlp, ranks, lay.inter, rows, ctx.ring, ctx.act, dl.add_into(x))


def check_operands(kernel, operands, spec):
    """ValueError/TypeError naming the operand unless `operands` match the contract for `spec`."""
    check_spec(spec)
    if len(operands) != len(OPERAND_NAMES):
        raise ValueError(f"{kernel}: got {len(operands)} operands, expected {len(OPERAND_NAMES)} {OPERAND_NAMES}")
    ops = dict(zip(OPERAND_NAMES, operands))
    x = ops["x"]
    if len(x.shape) != 3 or x.shape[2] != spec.hidden or x.shape[0] * x.shape[1] > nl.tile_size.pmax:
        raise ValueError(
            f"{kernel}: x has shape {tuple(x.shape)}, expected [B, T, {spec.hidden}] with B·T <= {nl.tile_size.pmax}"
        )
    b, t = x.shape[0], x.shape[1]
    L, H, D = spec.num_layers, spec.hidden, spec.head_dim
    expect = {"norms": (L, spec.num_norms, H), "final_norm": (H,), "write_index": (1, 1)}
    if spec.qk_norm:
        expect["qk_norms"] = (L, 2, D)
    elif ops["qk_norms"] is not None:
        raise ValueError(f"{kernel}: qk_norms must be None when spec.qk_norm is False")
    for name in PROJECTIONS:
        k, n = spec.in_features(name), spec.out_features(name)
        weight, ranks = ops[name], spec.ranks[PROJECTIONS.index(name)]
        if ranks is None:
            expect[name] = (L, k, n)
        elif not isinstance(weight, (list, tuple)) or len(weight) != 2:
            raise TypeError(f"{kernel}: {name} must be a 2-list [u, v] (spec.ranks[{name!r}] is set)")
        else:
            rmax = weight[0].shape[-1]
            if rmax < max(ranks) or tuple(weight[0].shape) != (L, k, rmax) or tuple(weight[1].shape) != (L, rmax, n):
                raise ValueError(
                    f"{kernel}: {name} factors have shapes {tuple(weight[0].shape)}, "
                    f"{tuple(weight[1].shape)}, expected [{L}, {k}, Rmax], [{L}, Rmax, {n}] with Rmax >= "
                    f"{max(ranks)}"
                )
    if spec.head_rank is None:
        expect["head"] = (H, spec.vocab)
    elif (
        not isinstance(ops["head"], (list, tuple))
        or tuple(ops["head"][0].shape) != (H, spec.head_rank)
        or tuple(ops["head"][1].shape) != (spec.head_rank, spec.vocab)
    ):
        raise ValueError(f"{kernel}: head must be [u [{H}, {spec.head_rank}], v [{spec.head_rank}, {spec.vocab}]]")
    cache = ops["k_cache"].shape
    if len(cache) != 5 or tuple(cache[:2]) != (L, b) or tuple(cache[3:]) != (spec.num_kv_heads, D):
        raise ValueError(
            f"{kernel}: k_cache has shape {tuple(cache)}, expected [{L}, {b}, S, {spec.num_kv_heads}, {D}]"
        )
    s = cache[2]
    expect.update(
        {
            "v_cache": tuple(cache),
            "cos": (spec.num_rope_tables, b, t, D),
            "sin": (spec.num_rope_tables, b, t, D),
            "mask_bias": (spec.num_masks, b, t, s),
        }
    )
    for name, shape in expect.items():
        if isinstance(ops[name], (list, tuple)) or tuple(ops[name].shape) != shape:
            got = type(ops[name]).__name__ if isinstance(ops[name], (list, tuple)) else tuple(ops[name].shape)
            raise ValueError(f"{kernel}: {name} has shape {got}, expected {list(shape)}")
    return ops


@nki.jit
def decode_step_kernel(
    x,
    norms,
    qk_norms,
    q,
    k,
    v,
    o,
    gate,
    up,
    down,
    k_cache,
    v_cache,
    write_index,
    cos,
    sin,
    mask_bias,
    final_norm,
    head,
    *,
    spec,
    ring_block_bytes=None,
    ring_bytes=None,
):
    """(iii) The whole decode step in one kernel: logits [B, T, V] float32, and the caches (written in place).

    ring_block_bytes / ring_bytes: weight ring geometry per partition (default: blocks of up to 32 KiB in a ring
    filling the target's SBUF less decode_layer.SBUF_RESERVED_BYTES).
    """
    operands = (
        x,
        norms,
        qk_norms,
        q,
        k,
        v,
        o,
        gate,
        up,
        down,
        k_cache,
        v_cache,
        write_index,
        cos,
        sin,
        mask_bias,
        final_norm,
        head,
    )
    ops = check_operands("decode_step_kernel", operands, spec)
    b, t, _ = x.shape
    rows = b * t
    ctx = StepContext(spec, rows, weight_dtype(q), ring_block_bytes, ring_bytes, k_cache)
    hidden = dl.column_tiles(ctx.layouts.hidden, rows, nl.float32, "hidden")
    dl.load_columns(hidden, _rows(x, rows), ctx.layouts.hidden)
    weights = {name: ops[name] for name in PROJECTIONS}
    for layer in range(spec.num_layers):
        decoder_layer(ctx, hidden, layer, weights, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norms, norms)
    logits = nl.ndarray((b, t, spec.vocab), dtype=nl.float32, buffer=nl.shared_hbm, name="logits")
    _head(ctx, hidden, final_norm, head, _rows(logits, rows))
    return logits, k_cache, v_cache


def _head(ctx, hidden, final_norm, head, out_rows):
    spec = ctx.spec
    final_w = dl.load_norm_weights(final_norm.reshape((1, spec.hidden)), ctx.layouts.hidden, spec.norm_unit_offset)
    dl.lm_head(
        hidden,
        ctx.layouts.hidden,
        final_w,
        head,
        spec.head_rank,
        ctx.rows,
        ctx.ring,
        ctx.consts,
        out_rows,
        spec.final_logit_softcap,
    )


@nki.jit
def decoder_layer_kernel(
    x,
    norms,
    qk_norms,
    q,
    k,
    v,
    o,
    gate,
    up,
    down,
    k_cache,
    v_cache,
    write_index,
    cos,
    sin,
    mask_bias,
    *,
    spec,
    layer,
    ring_block_bytes=None,
    ring_bytes=None,
):
    """(ii) Decoder layer `layer`: x [B, T, H] (any float dtype) → (x' [B, T, H] float32, k_cache, v_cache)."""
    check_spec(spec)
    if not isinstance(layer, int) or not 0 <= layer < spec.num_layers:
        raise ValueError(f"decoder_layer_kernel: layer={layer!r}, expected an int in [0, {spec.num_layers})")
    b, t, _ = x.shape
    rows = b * t
    ctx = StepContext(spec, rows, weight_dtype(q), ring_block_bytes, ring_bytes, k_cache)
    hidden = dl.column_tiles(ctx.layouts.hidden, rows, nl.float32, "hidden")
    dl.load_columns(hidden, _rows(x, rows), ctx.layouts.hidden)
    weights = dict(zip(PROJECTIONS, (q, k, v, o, gate, up, down)))
    decoder_layer(ctx, hidden, layer, weights, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norms, norms)
    out = nl.ndarray((b, t, spec.hidden), dtype=nl.float32, buffer=nl.shared_hbm, name="hidden_out")
    dl.store_columns(_rows(out, rows), hidden, ctx.layouts.hidden)
    return out, k_cache, v_cache


@nki.jit
def lm_head_kernel(x, final_norm, head, *, spec, ring_block_bytes=None, ring_bytes=None):
    """(ii) Final norm and LM head: x [B, T, H] → logits [B, T, V] float32 (final softcap applied)."""
    check_spec(spec)
    b, t, _ = x.shape
    rows = b * t
    ctx = StepContext(spec, rows, weight_dtype(head), ring_block_bytes, ring_bytes)
    hidden = dl.column_tiles(ctx.layouts.hidden, rows, nl.float32, "hidden")
    dl.load_columns(hidden, _rows(x, rows), ctx.layouts.hidden)
    logits = nl.ndarray((b, t, spec.vocab), dtype=nl.float32, buffer=nl.shared_hbm, name="logits")
    _head(ctx, hidden, final_norm, head, _rows(logits, rows))
    return logits


# -- (i) per-op kernels: rows [R, F] in HBM between launches ----------------------------------------------------


def _out_dtype(name):
    return {"float32": nl.float32, "bfloat16": nl.bfloat16, "float16": nl.float16}[name]


@nki.jit
def norm_kernel(x, weights, *, index, spec, out_dtype="float32"):
    """RMSNorm of x [R, F] rows by weights[index] ([F]; index selects a row of a stacked norm tensor, () for a
    plain [F] one) → [R, F] in out_dtype."""
    check_spec(spec)
    rows, features = x.shape
    layout = dl.feature_layout(features)
    w = weights[index] if index else weights
    consts = dl.NormConstants(spec.norm_eps)
    xc = dl.column_tiles(layout, rows, nl.float32, "x")
    dl.load_columns(xc, x, layout)
    wc = dl.load_norm_weights(w.reshape((1, features)), layout, spec.norm_unit_offset)
    dtype = _out_dtype(out_dtype)
    h = dl.column_tiles(layout, rows, dtype, "normed", zero=False)
    dl.rms_norm(h, xc, wc, layout, rows, consts)
    out = nl.ndarray((rows, features), dtype=dtype, buffer=nl.shared_hbm, name="normed_rows")
    dl.store_columns(out, h, layout)
    return out


@nki.jit
def projection_kernel(x, weight, *, layer, rank=None, out_dtype="float32", ring_block_bytes=None, ring_bytes=None):
    """x [R, K] rows @ layer `layer` of a stacked projection (dense [L, K, N], or [u, v] at `rank`) → [R, N]."""
    rows, k = x.shape
    w = layer_weight(weight, layer, rank)
    dtype = weight_dtype(weight)
    n = (w if rank is None else w[1]).shape[-1]
    in_layout = dl.feature_layout(k, dl.choose_group(k, n if rank is None else rank))
    out_layout = dl.feature_layout(n)
    ring = dl.WeightRing(dtype, ring_block_bytes, ring_bytes)
    xc = dl.column_tiles(in_layout, rows, dtype, "x", zero=False)
    dl.load_columns(xc, x, in_layout)
    odt = _out_dtype(out_dtype)
    y = dl.column_tiles(out_layout, rows, odt, "y", zero=False)
    dl.project(xc, in_layout, w, rank, out_layout, rows, ring, dl.copy_into(y))
    out = nl.ndarray((rows, n), dtype=odt, buffer=nl.shared_hbm, name="projected_rows")
    dl.store_columns(out, y, out_layout)
    return out


@nki.jit
def add_kernel(x, y):
    """x + y for rows [R, F] (float32 out): a residual add as its own launch."""
    rows, features = x.shape
    layout = dl.feature_layout(features)
    xc = dl.column_tiles(layout, rows, nl.float32, "x", zero=False)
    yc = dl.column_tiles(layout, rows, nl.float32, "y", zero=False)
    dl.load_columns(xc, x, layout)
    dl.load_columns(yc, y, layout)
    for s0, count, size in dl.slot_runs(layout):
        view = xc[0:size, s0 : s0 + count, 0:rows]
        nisa.tensor_tensor(dst=view, data1=view, data2=yc[0:size, s0 : s0 + count, 0:rows], op=nl.add)
    out = nl.ndarray((rows, features), dtype=nl.float32, buffer=nl.shared_hbm, name="sum_rows")
    dl.store_columns(out, xc, layout)
    return out


@nki.jit
def head_kernel(h, head, *, spec, ring_block_bytes=None, ring_bytes=None):
    """h [R, H] (normed rows) @ head (dense [H, V] or [u, v] at spec.head_rank) → logits [R, V] float32 with the
    final softcap."""
    check_spec(spec)
    rows, features = h.shape
    dtype = weight_dtype(head)
    layout = dl.feature_layout(
        features, dl.head_group(features) if spec.head_rank is None else dl.choose_group(features, spec.head_rank)
    )
    ring = dl.WeightRing(dtype, ring_block_bytes, ring_bytes)
    hc = dl.column_tiles(layout, rows, dtype, "h", zero=False)
    dl.load_columns(hc, h, layout)
    out = nl.ndarray((rows, spec.vocab), dtype=nl.float32, buffer=nl.shared_hbm, name="logits")
    if spec.head_rank is None:
        dl.head_projection(hc, layout, head, rows, ring, out, spec.final_logit_softcap)
    else:
        rank_layout = dl.feature_layout(spec.head_rank, dl.choose_group(spec.head_rank, dl.HEAD_COLUMNS))
        xu = dl.column_tiles(rank_layout, rows, dtype, "head_xuT", zero=False)
        dl.projection(hc, layout, head[0], rank_layout, rows, ring, dl.copy_into(xu))
        dl.head_projection(xu, rank_layout, head[1], rows, ring, out, spec.final_logit_softcap)
    return out
