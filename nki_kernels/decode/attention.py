"""Decode-step attention in NKI: q/k head-dim RMSNorm, RoPE, the in-place KV-cache write, GQA over the cache.

The stages live beside this file: attention_heads (layouts, q/k norm, RoPE), attention_cache (the cache write and the
window reads), attention_softmax (scores, softmax, weights·V). Here: `attention`, a subroutine for fused kernels (with
`prefetch`, which issues before the projections what waits for none of them: the window's row 0, the RoPE tables,
so their loads fill the engines' wait for the projections), and the per-op kernels `rope_kernel`,
`cache_write_kernel`, `attention_kernel` (rows [B, T, F] in HBM between kernels).

Operands: AttentionOperands (or a DecodeOperands, which has the same fields): k_cache, v_cache [L, B, S, kv_heads, D];
write_index [1, 1] int32; cos, sin [NR, B, T, D] float32 rotate-half tables (halves duplicated), table
spec.layer_rope[layer]; mask_bias [NM, B, T, S] float32, table spec.layer_mask[layer]; qk_norms [L, 2, D] (q_norm,
k_norm; 1 + w when spec.norm_unit_offset) or None.
"""

from __future__ import annotations

import dataclasses

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.decode import contract
from nki_kernels.decode.attention_cache import (
    CACHE_BLOCK_BYTES,
    CACHE_RUN_BYTES,
    FP8_CACHE_SPREAD_BYTES,
    MASKED_SCORE,
    CacheWindow,
    NewSlots,
    RowCache,
    WindowReader,
    cache_rows,
    cache_sbuf_bytes,
    cache_spread_bytes,
    keys_by_dma_transpose,
    load_mask_columns,
    load_window_start,
    load_write_index,
    plan_window,
    read_cache,
    score_chunks,
    slot_blocks,
    turn_keys,
    window_view,
    write_rows,
)
from nki_kernels.decode.attention_heads import (
    AttentionConstants,
    check_head_dim,
    head_tiles,
    kv_head_place,
    load_head_table,
    load_rope_tables,
    natural_runs,
    norm_rope,
    per_head,
    rms_norm_heads,
    rope_heads,
)
from nki_kernels.decode.attention_softmax import AttentionOutput, place_heads, prepare_queries, softmax_pass
from nki_kernels.decode.contract import DecodeSpec
from nki_kernels.decode.tiles import load_natural_columns, natural_tiles, store_natural_columns
from nki_kernels.svd_matmul import spans

# The stages' names, importable from here as before the split.
__all__ = [
    "CACHE_BLOCK_BYTES",
    "CACHE_RUN_BYTES",
    "FP8_CACHE_SPREAD_BYTES",
    "MASKED_SCORE",
    "AttentionConstants",
    "AttentionOperands",
    "AttentionOutput",
    "CacheWindow",
    "NewSlots",
    "Prefetched",
    "RowCache",
    "WindowReader",
    "attend",
    "attention",
    "attention_kernel",
    "cache_rows",
    "cache_sbuf_bytes",
    "cache_spread_bytes",
    "cache_write_kernel",
    "check_head_dim",
    "check_operands",
    "head_tiles",
    "keys_by_dma_transpose",
    "kv_head_place",
    "load_head_table",
    "load_mask_columns",
    "load_rope_tables",
    "load_window_start",
    "load_write_index",
    "natural_runs",
    "norm_rope",
    "per_head",
    "place_heads",
    "plan_window",
    "prefetch",
    "prepare_queries",
    "read_cache",
    "rms_norm_heads",
    "rope_heads",
    "rope_kernel",
    "score_chunks",
    "slot_blocks",
    "softmax_pass",
    "turn_keys",
    "window_view",
    "write_rows",
]


@dataclasses.dataclass(frozen=True)
class AttentionOperands:
    """The HBM operands attention reads, named as DecodeOperands names them (a DecodeOperands serves as well):
    k_cache, v_cache (a paged spec's pools), write_index (None when paged), cos, sin, mask_bias, qk_norms (None
    without spec.qk_norm). Shapes and dtypes: the module docstring."""

    k_cache: object
    v_cache: object
    write_index: object
    cos: object
    sin: object
    mask_bias: object
    qk_norms: object = None


@dataclasses.dataclass(frozen=True)
class Prefetched:
    """What attention() takes of one layer that does not depend on this step's projections (`prefetch`): the RoPE
    tables and head-norm weights (load_rope_tables) and the cache window's reader (this step's slots masked, their
    k and v from chip) with row 0 loaded."""

    tables: tuple
    reader: WindowReader


def prefetch(ops, layer, spec, rows, paged=None):
    """Prefetched for attention() of layer `layer` (ops: attention's AttentionOperands or DecodeOperands; rows:
    R = B·T): what a kernel issues before this step's projections, so that its loads, PE transposes and evictions
    fill the engines' wait for the norm and the projections instead of following them. paged: a paged spec's
    nki_kernels.decode.paged.PagedRows (ops.write_index then None), whose reader reads each row's window through
    its block table."""
    if paged is None:
        index = load_write_index(ops.write_index)
        reader = WindowReader(ops.k_cache, ops.v_cache, ops.mask_bias, layer, index, spec, rows, new_slots=True)
    else:
        reader = paged.reader(ops.k_cache, ops.v_cache, ops.mask_bias, layer, spec, rows)
    reader.load(0)
    return Prefetched(load_rope_tables(ops.cos, ops.sin, ops.qk_norms, layer, spec, rows), reader)


def attend(qT, reader, constants, *, new_kv=None):
    """attnT column tiles [128, ceil(heads·D/128), R] in the cache dtype: softmax(q·Kᵀ·scaling (softcapped) +
    mask)·V of each row's T queries over the window of the cache that `reader` (WindowReader) reads. qT: fp32
    column tiles of the rotated (and normed) queries.

    new_kv: with a reader of new_slots (the cache need not hold this step's k and v yet), (Kᵀ column tiles
    [min(F, 128), ceil(F/128), R], rows [R, F]) of them in the cache dtype (F = kv·D): they enter as one more score
    piece, their slots' copies in the window masked out, so the cache reads need not wait for this step's
    writes. None with a reader whose cache already holds them at [w, w + T)."""
    if (reader.new is None) != (new_kv is None):
        raise ValueError("attend: new_kv must be given exactly when the reader masks this step's slots (new_slots)")
    spec = reader.spec
    pmax = nl.tile_size.pmax
    batch, (kv, d) = reader.batch, reader.k_cache.shape[3:]
    dtype = reader.k_cache.dtype
    r = qT.shape[2]
    gt = spec.num_heads // kv * (r // batch)
    new = None if new_kv is None else dataclasses.replace(reader.new, keys=new_kv[0], values=new_kv[1])
    qs = prepare_queries(qT, spec, batch, dtype, constants)
    dp, _ = head_tiles(d)
    _, q_tiles = natural_tiles(spec.num_heads * d)
    out = AttentionOutput(
        nl.ndarray((pmax, q_tiles, r), dtype=dtype, buffer=nl.sbuf, name="attnT"),
        nl.ndarray((dp, spec.num_heads, r), dtype=nl.float32, buffer=nl.sbuf, name="attn_by_head")
        if d < pmax
        else None,
    )
    # Row by row; one softmax pass for as many of the row's kv heads as fit 128 query columns.
    for b in range(batch):
        rows = {b: reader.row(b)}
        for g0, gn in spans(kv, max(1, pmax // gt)):
            softmax_pass([(b, g) for g in range(g0, g0 + gn)], qs, rows, reader.plan, out, spec, constants, new)
        del rows
    if out.by_head is not None:
        place_heads(out, spec, constants)
    return out.attn


def check_operands(qT, kT, vT, ops, spec, layer):
    """attention()'s arguments: its HBM operands `ops` as the contract gives them (contract.check_named, B and S from
    k_cache, T from cos, the model's dtype k_cache's; a paged spec's pools and S from mask_bias, their block
    table checked by the kernel's contract.check), and what attention itself needs: a head dim it can tile
    (check_head_dim), a static layer, B·T rows and G·T queries per kv head within one partition tile, and qT, kT,
    vT natural column tiles of B·T rows."""
    pmax = nl.tile_size.pmax
    if not isinstance(spec, DecodeSpec):
        raise TypeError(f"attention: spec: got {type(spec).__name__}, expected a nki_kernels.decode.DecodeSpec")
    check_head_dim(spec.head_dim, spec.num_kv_heads)
    if not isinstance(layer, int) or not 0 <= layer < spec.num_layers:
        raise ValueError(f"attention: layer: got {layer!r}, expected a static int in [0, {spec.num_layers})")
    k_cache, cos, mask_bias = ops.k_cache, ops.cos, ops.mask_bias
    if len(k_cache.shape) != 5 or len(cos.shape) != 4:
        raise ValueError(
            f"attention: k_cache {tuple(k_cache.shape)}, cos {tuple(cos.shape)}: expected [L, B, S, kv_heads, D] "
            f"and [NR, B, T, D]"
        )
    _, batch, slots, _, _ = k_cache.shape
    t = cos.shape[2]
    hbm = {name: getattr(ops, name) for name in (field.name for field in dataclasses.fields(AttentionOperands))}
    if spec.paged:
        batch, slots = cos.shape[1], mask_bias.shape[3]
        for name in ("k_cache", "v_cache", "write_index"):
            del hbm[name]
    contract.check_named(spec, hbm, "attention", batch=batch, tokens=t, slots=slots, model_dtype=k_cache.dtype)
    r = batch * t
    g_size = spec.num_heads // spec.num_kv_heads
    if r > pmax or g_size * t > pmax:
        raise ValueError(
            f"attention: B·T = {r} rows and G·T = {g_size * t} queries per kv head must each be at most {pmax}"
        )
    d = spec.head_dim
    for name, x, features in (
        ("qT", qT, spec.num_heads * d),
        ("kT", kT, spec.num_kv_heads * d),
        ("vT", vT, spec.num_kv_heads * d),
    ):
        if x is None:
            continue
        expected = (pmax, -(-features // pmax), r)
        if tuple(x.shape) != expected:
            raise ValueError(
                f"attention: {name}: got shape {tuple(x.shape)}, expected column tiles {list(expected)} "
                f"({features} features, B·T = {r} rows)"
            )


def attention(qT, kT, vT, ops, layer, spec, *, constants=None, prefetched=None, writes=None, paged=None):
    """One layer's attention at decode, inside a kernel; returns attnT column tiles [128, ceil(heads·D/128), R]
    in the cache dtype (ready as the o projection's moving operand).

    qT [128, ceil(heads·D/128), R], kT and vT [128, ceil(kv·D/128), R]: SBUF column tiles (any float dtype) of
    this step's projections. ops: the HBM operands (AttentionOperands, or the step's DecodeOperands). layer: static
    int. Attends over the slots its mask can make visible (attend) with this step's k (normed, rotated) and v from
    chip, then writes them into the caches at [write_index, write_index + T) IN PLACE. constants:
    AttentionConstants(spec), built once per kernel when attention runs for several layers. prefetched:
    prefetch(...) of this layer, issued before the projections (None: issued here). writes: None (the cache writes
    are issued here, last), or a list that receives them as functions to call later (`write_rows` at a runtime slot
    orders every later read of the cache after it, so a kernel that reads another layer's window next issues them
    after that read). paged: a paged spec's nki_kernels.decode.paged.PagedRows (write_index None): the caches are
    pools, each row written at its own slot and its window read through its block table.
    """
    check_operands(qT, kT, vT, ops, spec, layer)
    constants = constants or AttentionConstants(spec)
    rows = qT.shape[2]
    early = prefetched or prefetch(ops, layer, spec, rows, paged)
    k_cache, v_cache = ops.k_cache, ops.v_cache
    features = spec.num_kv_heads * spec.head_dim
    kp, _ = natural_tiles(features)
    # k's element-wise chain on GpSimd, q's on VectorE: the two run side by side, not one after the other.
    k_rotated = norm_rope(kT, 1, early.tables, spec, constants, nisa.gpsimd_engine)
    # The new piece's Kᵀ, cast on GpSimd: VectorE carries the norm and RoPE chains.
    keys = nl.ndarray((kp, k_rotated.shape[1], rows), dtype=k_cache.dtype, buffer=nl.sbuf, name="new_keysT")
    for t0, count, size in natural_runs(features):
        tiles_of = (slice(0, size), slice(t0, t0 + count))
        nisa.tensor_copy(dst=keys[tiles_of], src=k_rotated[tiles_of], engine=nisa.gpsimd_engine)
    q_rotated = norm_rope(qT, 0, early.tables, spec, constants)
    values = cache_rows(vT, features, v_cache.dtype, "new_value_rows")
    attn = attend(q_rotated, early.reader, constants, new_kv=(keys, values))
    # Written last (or later, by the caller): the window was read without waiting for these writes (the same HBM
    # bytes). The k rows evict on ScalarE first: VectorE carries the o projection's inputs next.
    reader = early.reader
    key_rows = cache_rows(k_rotated, features, k_cache.dtype, "new_key_rows", turn=1)
    issue = [lambda: reader.write(values, v_cache, layer), lambda: reader.write(key_rows, k_cache, layer)]
    if writes is None:
        for write in issue:
            write()
    else:
        writes += issue
    return attn


# -- per-op kernels: HBM in, HBM out --------------------------------------------------------


def _rows_count(x, name, features):
    if len(x.shape) != 3 or x.shape[2] != features:
        raise ValueError(f"{name}: got shape {tuple(x.shape)}, expected rows [B, T, {features}]")
    return x.shape[0] * x.shape[1]


@nki.jit
def rope_kernel(q, k, cos, sin, qk_norms, *, layer, spec):
    """q/k head-dim RMSNorm and RoPE as one kernel.

    Dimensions: B, T (B·T <= 128), heads and kv_heads of D features, NR RoPE tables, L layers.
    Args:
        q: [B, T, heads·D] and k: [B, T, kv_heads·D] rows in HBM (any float dtype).
        cos, sin: [NR, B, T, D] float32 in HBM (layer `layer` reads table spec.layer_rope[layer]).
        qk_norms: [L, 2, D] in HBM (q_norm, k_norm), or None without spec.qk_norm.
        layer: static int. spec: DecodeSpec (static).
    Returns:
        (q', k'): new [B, T, heads·D] / [B, T, kv_heads·D] in HBM, in q's / k's dtype.
    """
    d = spec.head_dim
    _rows_count(q, "q", spec.num_heads * d)
    _rows_count(k, "k", spec.num_kv_heads * d)
    constants = AttentionConstants(spec)
    qT, kT = load_natural_columns(q, name="q_columns"), load_natural_columns(k, name="k_columns")
    tables = load_rope_tables(cos, sin, qk_norms, layer, spec, qT.shape[2])
    q_out, k_out = norm_rope(qT, 0, tables, spec, constants), norm_rope(kT, 1, tables, spec, constants)
    q_rows = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm, name="q_rope")
    k_rows = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm, name="k_rope")
    store_natural_columns(q_rows, q_out)
    store_natural_columns(k_rows, k_out)
    return q_rows, k_rows


@nki.jit
def cache_write_kernel(k, v, k_cache, v_cache, write_index, *, layer):
    """The KV-cache write as one kernel: k_cache[layer, b, w:w+T] = k[b], v_cache[layer, b, w:w+T] = v[b] IN PLACE.

    Dimensions: B, T (B·T <= 128), S slots, kv_heads of D features, L layers.
    Args:
        k, v: [B, T, kv_heads·D] rows in HBM (any float dtype; cast to the cache's).
        k_cache, v_cache: [L, B, S, kv_heads, D] in HBM.
        write_index: [1, 1] int32 in HBM, w (read at run time). layer: static int.
    Returns:
        (k_cache, v_cache), written in place.
    """
    features = k_cache.shape[3] * k_cache.shape[4]
    _rows_count(k, "k", features)
    _rows_count(v, "v", features)
    index = load_write_index(write_index)
    write_rows(
        cache_rows(load_natural_columns(k, name="k_columns"), features, k_cache.dtype, "k_rows"), k_cache, layer, index
    )
    write_rows(
        cache_rows(load_natural_columns(v, name="v_columns"), features, v_cache.dtype, "v_rows"), v_cache, layer, index
    )
    return k_cache, v_cache


@nki.jit
def attention_kernel(q, k_cache, v_cache, write_index, mask_bias, *, layer, spec):
    """Attention over the cache as one kernel: softmax(q·Kᵀ·scaling (softcapped) + mask)·V, as attend().

    Dimensions: B, T (B·T <= 128), S slots, heads and kv_heads of D features, NM mask tables, L layers.
    Args:
        q: [B, T, heads·D] rotated (and normed) query rows in HBM (any float dtype).
        k_cache, v_cache: [L, B, S, kv_heads, D] in HBM (this step's slots already written).
        write_index: [1, 1] int32 in HBM (this step's first slot: places a windowed mask's slots).
        mask_bias: [NM, B, T, S] float32 in HBM (layer `layer` reads table spec.layer_mask[layer]).
        layer: static int. spec: DecodeSpec (static).
    Returns:
        attn [B, T, heads·D] in HBM, in the cache dtype.
    """
    d = spec.head_dim
    _rows_count(q, "q", spec.num_heads * d)
    constants = AttentionConstants(spec)
    qT = load_natural_columns(q, dtype=nl.float32, name="q_columns")
    index = load_write_index(write_index)
    reader = WindowReader(k_cache, v_cache, mask_bias, layer, index, spec, qT.shape[2], new_slots=False)
    attn = attend(qT, reader, constants)
    out = nl.ndarray(q.shape, dtype=k_cache.dtype, buffer=nl.shared_hbm, name="attn")
    store_natural_columns(out, attn)
    return out
