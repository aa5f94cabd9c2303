"""Decode attention's KV cache: the in-place write of this step's rows and the reads of a layer's window.

HBM operands (nki_kernels.decode.contract): k_cache, v_cache [L, B, S, kv_heads, D] (model dtype); write_index [1, 1]
int32 (the first slot of this step, a runtime value); mask_bias [NM, B, T, S] float32 (0 or float32 min).

At decode the cache read dominates, and the cost model charges DMAs by their contiguous run per partition: the cache
is read in blocks whose partition p holds slots s0 + p·q .. s0 + p·q + q - 1 (one long run per partition). A score
"piece" is one slot column i of a block: slots s0 + p·q + i on partitions p. Kᵀ (all kv heads' features as column
tiles) comes straight from HBM by a transposing DMA for 2-byte dtypes when it carries CACHE_RUN_BYTES per partition,
else from PE transposes of the K blocks (short windows). The mask row is one DMA, put in piece order by PE transposes.

A mask with a window (spec.mask_windows) makes only the last window_slots slots up to the last query's slot visible:
only those are read, from a first slot computed on chip from write_index and applied as a runtime DMA offset, so one
compiled kernel serves every step. A fused kernel reads the window before this step's k and v are written (the same
HBM bytes, no wait): the window's copies of those slots are masked out and the new k and v enter from chip (NewSlots).
"""

from __future__ import annotations

import dataclasses

from nki_kernels.binding import nisa, nl
from nki_kernels.decode.tiles import (
    evict_alternating,
    fp32_per_psum_bank,
    natural_columns_to_rows,
    natural_tiles,
    transpose_to_tiles,
)
from nki_kernels.svd_matmul import spans

# Per-partition bytes of one cache block (K or V, one DMA each): long contiguous runs, a few blocks per row.
CACHE_BLOCK_BYTES = 16384
# Per-partition bytes each cache DMA should reach at least: the DMA efficiency curve is nearly flat from 4 KiB
# on (nki-dma-bandwidth-guide), while 512 B (one Gemma 3 slot per partition) runs at a fifth of the peak.
CACHE_RUN_BYTES = 4096
# Fewest bytes per partition a cache block spreads its slots to before it takes fewer partitions, with fp8 weights
# and several rows: their layers leave the DMA engines idle part of the time, and attention waits for the rows after
# the first (read as it reaches them), so their latency counts more than their bytes: a window on all 128
# partitions (16 DMA engines) at 2 KiB each (81% of the peak rate per engine) arrives sooner than on 32 partitions
# at 8 KiB (4 engines at 97%). One row is read before the projections (prefetch), off the critical path, so its
# DMA time counts: CACHE_RUN_BYTES runs (cache_spread_bytes). With 2-byte weights the DMA engines are the
# bottleneck throughout and the cache keeps the efficient runs of two CACHE_RUN_BYTES DMAs.
FP8_CACHE_SPREAD_BYTES = 2048
# Fills the partitions a ragged score piece leaves empty: below any real score, exp() of it is 0.
MASKED_SCORE = -3.0e38


def load_write_index(write_index):
    """The [1, 1] int32 write slot in SBUF, for DMA offsets read at run time."""
    index = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="write_index")
    nisa.dma_copy(dst=index, src=write_index)
    return index


def cache_rows(columns, features, dtype, name, turn=0):
    """Rows [R, F] in `dtype` (the cache's) of column tiles [128, ceil(F/128), R] of F features (any float dtype):
    what write_rows writes. turn: natural_columns_to_rows' first eviction turn (1: ScalarE first)."""
    rows = nl.ndarray((columns.shape[2], features), dtype=dtype, buffer=nl.sbuf, name=name)
    natural_columns_to_rows(rows, columns, turn)
    return rows


def write_rows(rows, cache, layer, index):
    """cache[layer, b, w:w+T] = rows [R, kv_heads·D] (SBUF, the cache dtype) IN PLACE, w = index[0, 0]
    (load_write_index) read at run time: one DMA, since every row's T slots of kv_heads·D values are one
    contiguous run in HBM."""
    _, batch, s, kv, d = cache.shape
    r = rows.shape[0]
    slots = cache.ap(
        [[s * kv * d, batch], [kv * d, r // batch], [1, kv * d]],
        offset=layer * batch * s * kv * d,
        scalar_offset=index,
        indirect_dim=2,
    )
    nisa.dma_copy(dst=slots, src=rows)


def cache_spread_bytes(spec, batch):
    """The per-partition bytes `slot_blocks` spreads a cache window's slots to, for `spec`'s weights and B = batch
    rows (see FP8_CACHE_SPREAD_BYTES)."""
    if not spec.fp8_weights:
        return 2 * CACHE_RUN_BYTES
    return CACHE_RUN_BYTES if batch == 1 else FP8_CACHE_SPREAD_BYTES


def slot_blocks(s, slot_bytes, spread_bytes):
    """[(s0, np, q)]: cache blocks covering slots 0..S-1; block slot s0 + p·q + i lives at partition p < np,
    slot column i < q. A block holds at least q_min slots per partition (spread_bytes of them) and at most
    CACHE_BLOCK_BYTES: on all 128 partitions while the slots last, then on fewer partitions (a short cache: fewer
    DMA engines, but each at a high rate); what is left below q_min slots, one slot per partition."""
    pmax = nl.tile_size.pmax
    q_max = max(1, CACHE_BLOCK_BYTES // slot_bytes)
    q_min = min(q_max, -(-spread_bytes // slot_bytes))
    blocks, s0 = [], 0
    while s - s0 >= pmax * q_min:
        q = min(q_max, (s - s0) // pmax)
        blocks.append((s0, pmax, q))
        s0 += pmax * q
    if s - s0 >= q_min:
        np_ = (s - s0) // q_min
        blocks.append((s0, np_, q_min))
        s0 += np_ * q_min
    if s0 < s:
        blocks.append((s0, s - s0, 1))
    return blocks


def keys_by_dma_transpose(blocks, features, dtype):
    """Whether Kᵀ comes from transposing DMAs of the cache (2-byte dtypes, when they carry at least
    CACHE_RUN_BYTES per partition: kv·D/128 tiles × the window's slots) rather than PE transposes of K blocks."""
    _, kt = natural_tiles(features)
    slots = sum(np_ * q for _, np_, q in blocks)
    return dtype.itemsize == 2 and kt * slots * dtype.itemsize >= CACHE_RUN_BYTES


def score_chunks(blocks):
    """[(block, i0, ni, c0)]: ≤512-column pieces of the permuted slot order (block by block, slot column i
    major), c0 the first column; each piece holds whole slot columns of one block."""
    chunks, c0 = [], 0
    for index, (_, np_, q) in enumerate(blocks):
        per_chunk = max(1, nl.tile_size.gemm_moving_fmax // np_)
        for i0, ni in spans(q, per_chunk):
            chunks.append((index, i0, ni, c0))
            c0 += ni * np_
    return chunks


def load_window_start(index, span, slots, tokens):
    """The first slot of the window of `span` slots a row's `tokens` queries can see (DecodeSpec.window_slots):
    the window ends at the last query's slot, write_index + T - 1, clamped into [0, S - span]; an SBUF [1, 1]
    int32 computed at run time from the write slot tile (load_write_index), or None when span = S (a static 0).
    On GpSimd, which attention leaves idle: the window's reads wait for no other engine's work."""
    if span == slots:
        return None
    start = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="window_start")
    gpsimd = nisa.gpsimd_engine
    nisa.tensor_scalar(
        dst=start, data=index, op0=nl.add, operand0=tokens - span, op1=nl.maximum, operand1=0, engine=gpsimd
    )
    nisa.tensor_scalar(dst=start, data=start, op0=nl.minimum, operand0=slots - span, engine=gpsimd)
    return start


def window_view(tensor, first, pattern, start, slot_axis):
    """The HBM view `pattern` of `tensor` from element `first`, moved by start (load_window_start) slots along
    axis slot_axis at run time, or static when start is None."""
    if start is None:
        return tensor.ap(pattern, offset=first)
    return tensor.ap(pattern, offset=first, scalar_offset=start, indirect_dim=slot_axis)


def load_mask_columns(mask_bias, mask, b, blocks, pieces, start, new=None):
    """fp32 [128, pieces, T]: element [p, n, t] = mask_bias[mask, b, t, start + slot] for the window slot at
    partition p of score piece n (slot s0 + p·q + i of piece (block, i)). The row's [T, window] bias is one DMA
    (T contiguous runs); the permutation is done by PE transposes of strided columns.

    With `new` (NewSlots: the window was read before this step's slots were written), those slots' biases in the
    window become MASKED_SCORE, and one more piece, the new tokens' (NewSlots.partitions of them), holds
    mask_bias[mask, b, t, w + t'] at partition b·T + t' (the other rows' tokens MASKED_SCORE)."""
    pmax = nl.tile_size.pmax
    _, batch, t, s = mask_bias.shape
    span = sum(np_ * q for _, np_, q in blocks)
    first = (mask * batch + b) * t * s
    rows = nl.ndarray((t, span), dtype=nl.float32, buffer=nl.sbuf, name="mask_rows")
    nisa.dma_copy(dst=rows, src=window_view(mask_bias, first, [[s, t], [1, span]], start, 3))
    columns = nl.ndarray(
        (pmax, len(pieces) + (new is not None), t), dtype=nl.float32, buffer=nl.sbuf, name="mask_columns"
    )
    if new is not None:
        # Slots [w, w + T) of the window: a DMA at the runtime offset, since only the index says where they are.
        hidden = rows.ap([[span, t], [1, t]], offset=0, scalar_offset=new.window_offset, indirect_dim=1)
        nisa.dma_copy(dst=hidden, src=new.masked[0:t, 0:t])
        piece = columns[:, len(pieces), :]
        nisa.memset(dst=piece[0 : new.partitions], value=MASKED_SCORE, engine=nisa.gpsimd_engine)
        own = mask_bias.ap([[1, t], [s, t]], offset=first, scalar_offset=new.index, indirect_dim=3)
        nisa.dma_copy(dst=piece[b * t : (b + 1) * t], src=own)
    per_bank = max(1, fp32_per_psum_bank(t))
    groups = []  # runs of pieces of one block, at most a PSUM bank each
    for n, (index, i) in enumerate(pieces):
        if groups and groups[-1][0] == index and len(groups[-1][1]) < per_bank:
            groups[-1][1].append((n, i))
        else:
            groups.append((index, [(n, i)]))
    for index, members in groups:
        s0, np_, q = blocks[index]
        first = members[0][0]
        transpose_to_tiles(
            columns[0:np_, first : first + len(members), :],
            [rows[0:t, s0 + i : s0 + np_ * q : q] for _, i in members],
            "mask_psum",
        )
    return columns


def turn_keys(k_blocks, blocks, chunks, features, dtype):
    """Kᵀ column tiles [min(F, 128), ceil(F/128), S] of all kv heads (F = kv_heads·D features) in score order
    (score_chunks) from cache blocks, by PE transposes; PSUM evictions alternate between VectorE and ScalarE."""
    kp, kt = natural_tiles(features)
    s = sum(np_ * q for _, np_, q in blocks)
    keys = nl.ndarray((kp, kt, s), dtype=dtype, buffer=nl.sbuf, name="keysT")
    for n, (index, i0, ni, c0) in enumerate(chunks):
        np_ = blocks[index][1]
        width = ni * np_
        # The last tile is ragged when F is not a multiple of 128 (e.g. 3 kv heads of 64): its partitions past F
        # are left unwritten, and no score reads them (kv_head_place).
        for k, (f0, fs) in enumerate(spans(features, kp)):
            turned = nl.ndarray((fs, width), dtype=dtype, buffer=nl.psum, name="keysT_psum")
            for j in range(ni):
                nisa.nc_transpose(
                    dst=turned[0:fs, j * np_ : (j + 1) * np_],
                    data=k_blocks[index][0:np_, i0 + j, f0 : f0 + fs],
                )
            evict_alternating(keys[0:fs, k, c0 : c0 + width], turned, n + k)
    return keys


def cache_sbuf_bytes(k_cache, spec, tokens):
    """SBUF bytes per partition that `attend` holds for one row's cache tiles (Kᵀ column tiles and V blocks, plus
    the K blocks when they are turned on the PE, keys_by_dma_transpose), for a k_cache [L, B, S, kv_heads, D],
    T = tokens, at the window of any layer that needs the most."""
    _, batch, slots, kv, d = k_cache.shape
    itemsize = k_cache.dtype.itemsize
    _, kt = natural_tiles(kv * d)
    largest = 0
    for s in {spec.window_slots(mask, slots, tokens) for mask in spec.layer_mask}:
        blocks = slot_blocks(s, kv * d * itemsize, cache_spread_bytes(spec, batch))
        values = sum(q for _, _, q in blocks) * kv * d * itemsize
        k_blocks = 0 if keys_by_dma_transpose(blocks, kv * d, k_cache.dtype) else values
        largest = max(largest, kt * s * itemsize + values + k_blocks)
    return largest


def read_cache(k_cache, v_cache, layer, b, blocks, chunks, start):
    """(Kᵀ, V blocks) of row b's window (slots start + 0 .. start + span - 1, `blocks` over the span; start from
    load_window_start, None: slot 0): Kᵀ column tiles [min(F, 128), ceil(F/128), span] of all kv heads' F = kv·D
    features (keys_by_dma_transpose: slots in cache order, by a transposing DMA per block; else in score order, K
    blocks turned on the PE), V blocks [np, q, F] (window slot s0 + p·q + i at [p, i])."""
    _, batch, slots, kv, d = k_cache.shape
    dtype = k_cache.dtype
    f = kv * d
    kp, kt = natural_tiles(f)
    s = sum(np_ * q for _, np_, q in blocks)
    row = (layer * batch + b) * slots * f  # element of the row's slot 0
    keys, k_blocks, v_blocks = None, [], []
    for which in ("k", "v"):
        cache = k_cache if which == "k" else v_cache
        if which == "k" and keys_by_dma_transpose(blocks, f, dtype):
            keys = nl.ndarray((kp, kt, s), dtype=dtype, buffer=nl.sbuf, name="keysT")
            full, rest = divmod(f, kp)
            for s0, np_, q in blocks:  # a DMA per block (whole slot rows: long contiguous runs)
                n = np_ * q
                if full:
                    source = window_view(cache, row + s0 * f, [[f, n], [kp, full], [1, kp]], start, 2)
                    nisa.dma_transpose(dst=keys[:, 0:full, s0 : s0 + n], src=source)
                if rest:  # a ragged last tile (F not a multiple of 128): its own DMA, not reading past a slot
                    source = window_view(cache, row + s0 * f + full * kp, [[f, n], [1, rest]], start, 2)
                    nisa.dma_transpose(dst=keys[0:rest, full, s0 : s0 + n], src=source)
            continue
        for s0, np_, q in blocks:
            tile = nl.ndarray((np_, q, f), dtype=dtype, buffer=nl.sbuf, name="cache_block")
            # Two DMAs per block where each still moves CACHE_RUN_BYTES per partition: work on the first slot
            # columns starts while the rest arrives.
            halves = 2 if q * f * dtype.itemsize >= 2 * CACHE_RUN_BYTES else 1
            for i0, ni in spans(q, -(-q // halves)):
                source = window_view(cache, row + (s0 + i0) * f, [[q * f, np_], [f, ni], [1, f]], start, 2)
                nisa.dma_copy(dst=tile[:, i0 : i0 + ni, :], src=source)
            (k_blocks if which == "k" else v_blocks).append(tile)
    if keys is None:
        keys = turn_keys(k_blocks, blocks, chunks, kv * d, dtype)
    return keys, v_blocks


@dataclasses.dataclass(frozen=True)
class CacheWindow:
    """How `attend` reads one layer's window of `span` cache slots (all of them without a sliding window).

    blocks: slot_blocks' [(s0, np, q)]; chunks: score_chunks' pieces of the permuted slot order; pieces: one score
    piece per slot column of a block, (block, i) in score order ([np ≤ 128 slots on partitions, G·T]);
    keys_by_dma: whether Kᵀ comes from transposing DMAs (keys_by_dma_transpose); key_columns: per piece, its Kᵀ
    columns (slots s0 + i, s0 + i + q, ... in cache order by DMA, or the piece's np consecutive columns in score
    order by PE transposes).
    """

    span: int
    blocks: tuple
    chunks: tuple
    pieces: tuple
    keys_by_dma: bool
    key_columns: tuple


def plan_window(span, features, dtype, spread_bytes, blocks=None, keys_by_dma=None):
    """The CacheWindow of `span` slots of a cache whose slots hold `features` values (kv_heads·D) in `dtype`,
    blocks spread to spread_bytes per partition (cache_spread_bytes), or `blocks` given (a paged cache's). Kᵀ by
    transposing DMAs as keys_by_dma_transpose says, or as keys_by_dma says when given (a paged cache's choice)."""
    paged = blocks is not None
    blocks = blocks if paged else slot_blocks(span, features * dtype.itemsize, spread_bytes)
    chunks = score_chunks(blocks)
    pieces = [(index, i) for index, (_, _, q) in enumerate(blocks) for i in range(q)]
    if keys_by_dma is None:
        keys_by_dma = not paged and keys_by_dma_transpose(blocks, features, dtype)
    key_columns = []
    for index, (s0, np_, q) in enumerate(blocks):
        column0 = next(c0 for (n, _, _, c0) in chunks if n == index)
        for i in range(q):
            key_columns.append(
                slice(s0 + i, s0 + np_ * q, q) if keys_by_dma else slice(column0 + i * np_, column0 + (i + 1) * np_)
            )
    return CacheWindow(span, tuple(blocks), tuple(chunks), tuple(pieces), keys_by_dma, tuple(key_columns))


@dataclasses.dataclass(frozen=True)
class RowCache:
    """One row's window on chip: Kᵀ column tiles (read_cache), V blocks and the mask columns (load_mask_columns)."""

    keys: object
    values: list
    mask: object


@dataclasses.dataclass(frozen=True)
class NewSlots:
    """This step's tokens for a window read before their slots [w, w + T) were written (WindowReader's new_slots):
    one more score piece of `partitions` = R = B·T, row b's T tokens on partitions b·T .. b·T + T - 1 (for row b,
    load_mask_columns masks the other rows' there), with keys (Kᵀ column tiles [min(F, 128), ceil(F/128), R]) and
    values (rows [R, F]) from chip in the cache dtype, given at attend; the window's stale copies of those slots
    are masked out. index: the write slot tile (load_write_index); window_offset: w less the window's first slot
    (SBUF [1, 1] int32); masked: fp32 [T, T] of MASKED_SCORE, what those copies' mask biases become."""

    index: object
    window_offset: object
    masked: object
    partitions: int
    keys: object = None
    values: object = None

    @classmethod
    def of(cls, index, start, rows, tokens):
        """NewSlots of the write slot tile `index`, the window's first slot `start` (load_window_start: None for
        slot 0) and R = rows, T = tokens. On GpSimd, which nothing else keeps busy here: issued before the
        projections, these wait for none of their work."""
        offset = index
        if start is not None:
            offset = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="window_write_offset")
            nisa.tensor_tensor(dst=offset, data1=index, data2=start, op=nl.subtract, engine=nisa.gpsimd_engine)
        masked = nl.ndarray((tokens, tokens), dtype=nl.float32, buffer=nl.sbuf, name="masked_slots")
        nisa.memset(dst=masked, value=MASKED_SCORE, engine=nisa.gpsimd_engine)
        return cls(index, offset, masked, rows)


class WindowReader:
    """One layer's cache window as `attend` reads it, row by row: the plan (CacheWindow) of the slots its mask can
    make visible (all S, or with spec.mask_windows the window of spec.window_slots(...) slots ending at the last
    query's slot), the window's first slot at run time (load_window_start, from the write slot tile `index`), and
    with new_slots the masking of this step's slots for a window read before they are written (NewSlots).

    Nothing here waits for this step's q, k or v: a kernel opens the reader and loads row 0 (`load`) before its
    projections, so the row's DMAs, PE transposes and evictions fill the engines' wait for the norm and the
    projections instead of following them; later rows load as attend reaches them (their reads overlap the
    previous row's softmax).
    """

    def __init__(self, k_cache, v_cache, mask_bias, layer, index, spec, rows, *, new_slots):
        _, batch, s, kv, d = k_cache.shape
        t = rows // batch
        self.k_cache, self.v_cache, self.mask_bias = k_cache, v_cache, mask_bias
        self.layer, self.index, self.spec, self.batch = layer, index, spec, batch
        self.mask = spec.layer_mask[layer]
        spread = cache_spread_bytes(spec, batch)
        self.plan = plan_window(spec.window_slots(self.mask, s, t), kv * d, k_cache.dtype, spread)
        self.start = load_window_start(index, self.plan.span, s, t)
        self.new = NewSlots.of(index, self.start, rows, t) if new_slots else None
        self._loaded = {}

    def load(self, b):
        """Issue row b's reads now: its mask columns, Kᵀ and V blocks (`row` hands them out)."""
        plan = self.plan
        visible = load_mask_columns(self.mask_bias, self.mask, b, plan.blocks, plan.pieces, self.start, self.new)
        keys, values = read_cache(self.k_cache, self.v_cache, self.layer, b, plan.blocks, plan.chunks, self.start)
        self._loaded[b] = RowCache(keys, values, visible)

    def row(self, b):
        """Row b's RowCache, loaded now unless `load` was called for it."""
        if b not in self._loaded:
            self.load(b)
        return self._loaded.pop(b)

    def write(self, rows, cache, layer):
        """This step's rows [R, kv_heads·D] (SBUF, the cache dtype) into `cache` at the write slot (write_rows)."""
        write_rows(rows, cache, layer, self.index)
