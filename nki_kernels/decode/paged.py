"""A paged KV cache in the decode kernels: each row's blocks read and its new token written through a block table.

Layout (nki_kernels.decode.contract, spec.block_size = BS): k_cache and v_cache are pools [L, NB, BS, kv_heads, D]
of blocks shared by the rows; block_table [B, MB] int32 names row b's i-th block of positions, lengths [B] int32
its cached tokens (the new token goes to position p = lengths[b]; -1 marks an inactive row). A row's logical
slots 0 .. MB·BS - 1 are its positions; mask_bias [NM, B, 1, MB·BS] covers them.

How the kernels use it, with the contiguous cache's machinery unchanged downstream (attention.py):
- `PagedRows` (once per kernel launch) loads lengths and turns them into run-time index tiles: each row's
  position (one partition, for scalar DMA offsets), its write slot in the pool (one partition per row, for one
  scattering DMA per cache and layer; out of the pool for an inactive row, which that DMA then skips), and per
  sliding window the first block and slot of the window each row reads.
- A row's window is read in blocks of the attention layout (partition p holds q consecutive slots): q divides BS,
  so each partition's slots lie in one block of the pool, and one gathering DMA (a per-partition vector offset:
  the block's table entry·BS + the partition's place in its block) reads np·q slots for K, one for V. The table
  entries come with one small DMA per row, block group and window span, once per launch (they depend on no
  layer), repeated m = BS / q times over the partitions by a zero-stride access pattern, so the offsets are
  entry·BS + (p mod m)·q, one VectorE instruction. A row's gathers are issued as attention takes the row before.
- Kᵀ comes from gathering transposes (`nisa.dma_transpose` of a vector_offset src: one slot per index, 16..128
  slots a DMA) on NeuronCore-v3+ when the window's blocks group into multiples of 16 slots and the cache dtype has
  2 bytes (gather_groups, keys_by_gather), so the PE, busy with the step's weights, does no transposes for it;
  else the K blocks are gathered like V and turned on the PE. Their index tiles ([128, M], read column-major) come
  once per launch per row and window span; with BS < 128 the row's table entries are repeated over their blocks'
  partitions by a one-hot matmul (column_entries).
- The new token's k and v enter attention from chip (attention.NewSlots, one partition per row); the window's copy
  of the row's own slot is masked out at the row's runtime offset, as for the contiguous cache.
"""

from __future__ import annotations

import dataclasses

from nki_kernels.binding import nisa, nl
from nki_kernels.decode.attention_cache import (
    CACHE_BLOCK_BYTES,
    MASKED_SCORE,
    NewSlots,
    RowCache,
    WindowReader,
    cache_spread_bytes,
    load_mask_columns,
    plan_window,
    turn_keys,
)
from nki_kernels.decode.tiles import natural_tiles
from nki_kernels.svd_matmul import spans

# An indirect (gathering) transpose reads a multiple of 16 rows, 16..128 per index tile (nki.isa.dma_transpose).
GATHER_TRANSPOSE_ROWS = 16


def check_block_size(block_size, slot_bytes):
    """ValueError unless a block's slots split into partitions the attention layout can read: a divisor q of
    block_size within CACHE_BLOCK_BYTES per partition and block_size / q <= 128 partitions per block."""
    q = slots_per_partition(block_size, slot_bytes)
    if block_size // q > nl.tile_size.pmax:
        raise ValueError(
            f"DecodeSpec.block_size: got {block_size}, expected a block whose slots fit {nl.tile_size.pmax} "
            f"partitions of at most {CACHE_BLOCK_BYTES} bytes ({slot_bytes}-byte slots: q = {q} per partition)"
        )


def slots_per_partition(block_size, slot_bytes):
    """q: the most slots of one block a partition holds, a divisor of block_size of at most CACHE_BLOCK_BYTES."""
    limit = max(1, CACHE_BLOCK_BYTES // slot_bytes)
    return max(q for q in range(1, min(block_size, limit) + 1) if block_size % q == 0)


def gather_groups(blocks, block_size):
    """[(s0, n, m)]: the slots of `blocks` consecutive pool blocks of a window in gathering transposes, each
    gathering n slots from s0 by an index tile [n / m, m]: the first 128·M slots with [128, M] (read column-major),
    the rest (< 128 slots, a multiple of 16) with [n, 1]. None when the blocks do not tile so: their slots are no
    multiple of 16, or a block size neither divides 128 nor is a multiple of it (a column of 128 slots would not
    be whole blocks or within one)."""
    pmax = nl.tile_size.pmax
    span = blocks * block_size
    if span % GATHER_TRANSPOSE_ROWS or (pmax % block_size and block_size % pmax):
        return None
    columns = span // pmax
    groups = [(0, columns * pmax, columns)] if columns else []
    if span > columns * pmax:
        groups.append((columns * pmax, span - columns * pmax, 1))
    return groups


def keys_by_gather(groups, features, dtype, spread_bytes):
    """Whether a paged window's Kᵀ comes from gathering transposes: on NeuronCore-v3+ (trn2) only, for 2-byte
    cache dtypes and blocks that tile (gather_groups), when every transpose writes at least spread_bytes per
    partition (cache_spread_bytes: less with fp8 weights, whose step keeps the PE busier than the DMA engines,
    so that turning K there costs more than a transposing DMA of a short window)."""
    if groups is None or dtype.itemsize != 2 or nisa.get_nc_version() < nisa.nc_version.gen3:
        return False
    _, kt = natural_tiles(features)
    return kt * min(n for _, n, _ in groups) * dtype.itemsize >= spread_bytes


def window_blocks(span, block_size, max_blocks):
    """How many consecutive blocks of a row's table hold every window of `span` positions ending at any
    position p: ceil((span - 1) / BS) + 1, at most the table's MB; span = MB·BS (no window) reads them all."""
    if span >= max_blocks * block_size:
        return max_blocks
    return min(max_blocks, -(-(span - 1) // block_size) + 1)


def paged_blocks(blocks, block_size, slot_bytes, spread_bytes):
    """[(s0, np, q)]: the attention layout's cache blocks over `blocks` pool blocks of a row's window (window slot
    s0 + p·q + i at partition p, slot column i), each tuple whole pool blocks (s0 a multiple of BS, np = m·(its
    blocks), m = BS / q partitions per block, q a divisor of BS of at most CACHE_BLOCK_BYTES). q aims where
    attention.slot_blocks puts a contiguous window of as many slots: spread over all 128 partitions (every DMA
    engine), at least spread_bytes per partition. When the blocks fit one tuple, one tuple, at the smallest q
    that reaches that aim (else the largest that fits): one DMA per cache, and no ragged tuple whose every slot
    column is a score piece of its own; else tuples of 128 partitions at the largest q up to the aim."""
    pmax = nl.tile_size.pmax
    q_max = max(1, CACHE_BLOCK_BYTES // slot_bytes)
    want = min(q_max, max(-(-spread_bytes // slot_bytes), blocks * block_size // pmax))
    divisors = [d for d in range(1, min(block_size, q_max) + 1) if block_size % d == 0 and block_size // d <= pmax]
    single = [d for d in divisors if block_size // d * blocks <= pmax]
    if single:
        q = min((d for d in single if d >= want), default=single[-1])
        return [(0, blocks * (block_size // q), q)]
    q = max((d for d in divisors if d <= want), default=divisors[0])
    m = block_size // q
    per_tuple = pmax // m
    return [(first * block_size, min(per_tuple, blocks - first) * m, q) for first in range(0, blocks, per_tuple)]


@dataclasses.dataclass
class RowWindow:
    """Runtime tiles [1, B] int32 of each row's window of one span: its first block in the row's table (None: the
    table's block 0, a static offset) and first logical slot (None: 0), and the row's position less that slot
    (where the window holds the row's own, stale slot)."""

    first_block: object
    first_slot: object
    own_offset: object


class PagedRows:
    """One kernel launch's run-time indices of a paged cache: built once, shared by every layer."""

    def __init__(self, block_table, lengths, k_cache, spec):
        batch, self.max_blocks = block_table.shape
        _, self.num_blocks, self.block_size, kv, d = k_cache.shape
        self.block_table, self.batch, self.layers = block_table, batch, k_cache.shape[0]
        self.slots = self.max_blocks * self.block_size
        self.features = kv * d
        check_block_size(self.block_size, self.features * k_cache.dtype.itemsize)
        i32, gpsimd = nl.int32, nisa.gpsimd_engine
        # Positions, one partition: scalar DMA offsets of row b are [0:1, b:b+1] views.
        self.positions = nl.ndarray((1, batch), dtype=i32, buffer=nl.sbuf, name="paged_positions")
        nisa.dma_copy(dst=self.positions, src=lengths.ap([[batch, 1], [1, batch]], offset=0))
        nisa.tensor_scalar(dst=self.positions, data=self.positions, op0=nl.maximum, operand0=0, engine=gpsimd)
        self.write_slots = self._write_slots(lengths)
        self._windows = {}
        self._within = {}
        self._offsets = {}
        self._indices = {}
        self._columns = {}
        self._owners = None

    def _write_slots(self, lengths):
        """[B, 1] int32: row b's new slot in a layer's pool, table[b, p // BS]·BS + p mod BS (p = max(lengths[b],
        0)), pushed past every layer's pool when lengths[b] < 0 so that the writing DMA skips it."""
        b, bs, i32 = self.batch, self.block_size, nl.int32
        length = nl.ndarray((b, 1), dtype=i32, buffer=nl.sbuf, name="paged_lengths")
        nisa.dma_copy(dst=length, src=lengths.ap([[1, b], [1, 1]], offset=0))
        position = nl.ndarray((b, 1), dtype=i32, buffer=nl.sbuf, name="paged_row_positions")
        nisa.tensor_scalar(dst=position, data=length, op0=nl.maximum, operand0=0)
        within = nl.ndarray((b, 1), dtype=i32, buffer=nl.sbuf, name="paged_within_block")
        nisa.tensor_scalar(dst=within, data=position, op0=nl.mod, operand0=bs)
        # The table entry of row b's block p // BS: element b·MB + (p - p mod BS) / BS of the table.
        entry_index = nl.ndarray((b, 1), dtype=i32, buffer=nl.sbuf, name="paged_entry_index")
        nisa.tensor_tensor(dst=entry_index, data1=position, data2=within, op=nl.subtract)
        nisa.tensor_scalar(dst=entry_index, data=entry_index, op0=nl.divide, operand0=float(bs))
        rows = nl.ndarray((b, 1), dtype=i32, buffer=nl.sbuf, name="paged_row_starts")
        nisa.iota(dst=rows, pattern=[[0, 1]], offset=0, channel_multiplier=self.max_blocks)
        nisa.tensor_tensor(dst=entry_index, data1=entry_index, data2=rows, op=nl.add)
        entry = nl.ndarray((b, 1), dtype=i32, buffer=nl.sbuf, name="paged_write_block")
        table = self.block_table
        nisa.dma_copy(dst=entry, src=table.ap([[0, b], [1, 1]], offset=0, vector_offset=entry_index, indirect_dim=1))
        slots = nl.ndarray((b, 1), dtype=i32, buffer=nl.sbuf, name="paged_write_slots")
        nisa.scalar_tensor_tensor(dst=slots, data=entry, op0=nl.multiply, operand0=bs, op1=nl.add, operand1=within)
        inactive = nl.ndarray((b, 1), dtype=i32, buffer=nl.sbuf, name="paged_inactive")
        nisa.tensor_scalar(dst=inactive, data=length, op0=nl.less, operand0=0)
        beyond = self.layers * self.num_blocks * bs  # past the last layer's pool from any layer's first slot
        nisa.scalar_tensor_tensor(
            dst=slots, data=inactive, op0=nl.multiply, operand0=beyond, op1=nl.add, operand1=slots
        )
        return slots

    def window(self, span):
        """RowWindow of the windows of `span` positions ending at each row's position (all MB blocks when they
        hold every such window): first slot max(p - span + 1, 0) rounded down to a block, at most the table's
        last window_blocks blocks."""
        if span in self._windows:
            return self._windows[span]
        bs, i32, gpsimd = self.block_size, nl.int32, nisa.gpsimd_engine
        blocks = window_blocks(span, bs, self.max_blocks)
        if blocks == self.max_blocks:
            window = RowWindow(None, None, self.positions)
        else:
            shape = (1, self.batch)
            first = nl.ndarray(shape, dtype=i32, buffer=nl.sbuf, name="paged_window_slot")
            nisa.tensor_scalar(
                dst=first,
                data=self.positions,
                op0=nl.add,
                operand0=1 - span,
                op1=nl.maximum,
                operand1=0,
                engine=gpsimd,
            )
            within = nl.ndarray(shape, dtype=i32, buffer=nl.sbuf, name="paged_window_within")
            nisa.tensor_scalar(dst=within, data=first, op0=nl.mod, operand0=bs, engine=gpsimd)
            nisa.tensor_tensor(dst=first, data1=first, data2=within, op=nl.subtract, engine=gpsimd)
            last = (self.max_blocks - blocks) * bs
            nisa.tensor_scalar(dst=first, data=first, op0=nl.minimum, operand0=last, engine=gpsimd)
            block = nl.ndarray(shape, dtype=i32, buffer=nl.sbuf, name="paged_window_block")
            nisa.tensor_scalar(dst=block, data=first, op0=nl.divide, operand0=float(bs), engine=gpsimd)
            own = nl.ndarray(shape, dtype=i32, buffer=nl.sbuf, name="paged_window_own")
            nisa.tensor_tensor(dst=own, data1=self.positions, data2=first, op=nl.subtract, engine=gpsimd)
            window = RowWindow(block, first, own)
        self._windows[span] = window
        return window

    def within_block(self, q):
        """[128, 1] int32: (p mod m)·q, partition p's first slot in its pool block (m = BS / q)."""
        if q not in self._within:
            pmax = nl.tile_size.pmax
            within = nl.ndarray((pmax, 1), dtype=nl.int32, buffer=nl.sbuf, name="paged_partition_slots")
            nisa.iota(dst=within, pattern=[[0, 1]], offset=0, channel_multiplier=1)
            nisa.tensor_scalar(
                dst=within, data=within, op0=nl.mod, operand0=self.block_size // q, op1=nl.multiply, operand1=q
            )
            self._within[q] = within
        return self._within[q]

    def slot_offsets(self, b, block, first_block, dtype=nl.int32):
        """[np, 1] pool slots (`dtype`) of one attention block (s0, np, q) of row b's window: partition p's first
        slot, table[b, first + s0 / BS + p // m]·BS + (p mod m)·q. first_block: the window's (a [1, 1] view of
        RowWindow.first_block) or None (block 0)."""
        s0, np_, q = block
        m = self.block_size // q
        entries = nl.ndarray((np_, 1), dtype=nl.int32, buffer=nl.sbuf, name="paged_entries")
        pattern = [[1, np_ // m], [0, m]]  # each entry repeated over its block's m partitions
        offset = b * self.max_blocks + s0 // self.block_size
        if first_block is None:
            source = self.block_table.ap(pattern, offset=offset)
        else:
            source = self.block_table.ap(pattern, offset=offset, scalar_offset=first_block, indirect_dim=1)
        nisa.dma_copy(dst=entries, src=source)
        offsets = nl.ndarray((np_, 1), dtype=dtype, buffer=nl.sbuf, name="paged_slot_offsets")
        nisa.scalar_tensor_tensor(
            dst=offsets,
            data=entries,
            op0=nl.multiply,
            operand0=self.block_size,
            op1=nl.add,
            operand1=self.within_block(q)[0:np_],
        )
        return offsets

    def window_offsets(self, span, blocks):
        """[[offsets of each attention block] of each row]: slot_offsets of the window of `span` positions read as
        `blocks` (paged_blocks), for every row; computed once per span, with the first layer that reads such a
        window (before its projections), and shared by every later layer: they depend on no layer."""
        if span not in self._offsets:
            window = self.window(span)
            self._offsets[span] = [
                [
                    self.slot_offsets(
                        b, block, None if window.first_block is None else window.first_block[0:1, b : b + 1]
                    )
                    for block in blocks
                ]
                for b in range(self.batch)
            ]
        return self._offsets[span]

    def column_slots(self, columns):
        """[128, M] int32: (c·128 + p) mod BS, the place in its pool block of window slot c·128 + p."""
        if columns not in self._columns:
            pmax = nl.tile_size.pmax
            within = nl.ndarray((pmax, columns), dtype=nl.int32, buffer=nl.sbuf, name="paged_column_slots")
            nisa.iota(dst=within, pattern=[[pmax, columns]], offset=0, channel_multiplier=1)
            nisa.tensor_scalar(dst=within, data=within, op0=nl.mod, operand0=self.block_size)
            self._columns[columns] = within
        return self._columns[columns]

    def block_owners(self):
        """fp32 [128 / BS, 128] one-hot: [k, p] = 1 where partition p lies in block k of a 128-slot column."""
        if self._owners is None:
            pmax, bs = nl.tile_size.pmax, self.block_size
            shape = (pmax // bs, pmax)
            place = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf, name="paged_owner_place")
            nisa.iota(dst=place, pattern=[[1, pmax]], offset=0, channel_multiplier=-bs)  # p - k·BS
            low = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf, name="paged_owner_low")
            nisa.tensor_scalar(dst=low, data=place, op0=nl.greater_equal, operand0=0)
            self._owners = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf, name="paged_block_owners")
            nisa.tensor_scalar(dst=self._owners, data=place, op0=nl.less, operand0=bs)
            nisa.tensor_tensor(dst=self._owners, data1=self._owners, data2=low, op=nl.multiply)
        return self._owners

    def column_entries(self, b, columns, first_block):
        """[128, M] table entries of row b's window slots c·128 + p: table[b, first + (c·128 + p) // BS]. For
        BS < 128 the row's M·128/BS entries come in one small DMA and a one-hot matmul repeats each over its
        block's BS partitions (a DMA straight into [128, M] would move 128·M four-byte pieces)."""
        pmax, bs = nl.tile_size.pmax, self.block_size
        offset = b * self.max_blocks
        m = pmax // bs if pmax % bs == 0 else 1
        if m == 1:  # BS a multiple of 128: a block spans BS / 128 columns, the same entry on every partition
            shape, pattern = (pmax, columns), [[0, pmax], [1, columns // (bs // pmax)], [0, bs // pmax]]
        else:  # entry (k, c) of block k of column c
            shape, pattern = (m, columns), [[1, m], [m, columns]]
        entries = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf, name="paged_column_entries")
        if first_block is None:
            source = self.block_table.ap(pattern, offset=offset)
        else:
            source = self.block_table.ap(pattern, offset=offset, scalar_offset=first_block, indirect_dim=1)
        nisa.dma_copy(dst=entries, src=source)
        if m == 1:
            return entries
        values = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf, name="paged_entry_values")
        nisa.tensor_copy(dst=values, src=entries)
        spread = nl.ndarray((pmax, columns), dtype=nl.float32, buffer=nl.psum, name="paged_entries_psum")
        for c0, cn in spans(columns, nl.tile_size.gemm_moving_fmax):
            # Block indices stay below 2^24: exact in fp32.
            nisa.nc_matmul(dst=spread[:, c0 : c0 + cn], stationary=self.block_owners(), moving=values[:, c0 : c0 + cn])
        return spread

    def column_indices(self, b, columns, first_block):
        """[128, M] uint32 pool slots of row b's window slots c·128 + p (column c, partition p): table[b, first +
        (c·128 + p) // BS]·BS + (c·128 + p) mod BS, the index tile of a [128, M] gathering transpose."""
        pmax, bs = nl.tile_size.pmax, self.block_size
        indices = nl.ndarray((pmax, columns), dtype=nl.uint32, buffer=nl.sbuf, name="paged_column_indices")
        nisa.scalar_tensor_tensor(
            dst=indices,
            data=self.column_entries(b, columns, first_block),
            op0=nl.multiply,
            operand0=bs,
            op1=nl.add,
            operand1=self.column_slots(columns),
        )
        return indices

    def window_indices(self, span, groups):
        """[[uint32 index tile of each group] of each row]: the pool slots of the window of `span` positions for
        the gathering transposes of groups (s0, n, m) (gather_groups); once per span, shared by every later
        layer, like window_offsets."""
        if span not in self._indices:
            window = self.window(span)
            rows = []
            for b in range(self.batch):
                first = None if window.first_block is None else window.first_block[0:1, b : b + 1]
                rows.append(
                    [
                        self.column_indices(b, m, first)
                        if n == m * nl.tile_size.pmax
                        else self.slot_offsets(b, (s0, n, 1), first, dtype=nl.uint32)
                        for s0, n, m in groups
                    ]
                )
            self._indices[span] = rows
        return self._indices[span]

    def reader(self, k_cache, v_cache, mask_bias, layer, spec, rows):
        """The PagedWindowReader of layer `layer`'s window (attention.prefetch's reader for a paged spec)."""
        return PagedWindowReader(k_cache, v_cache, mask_bias, layer, self, spec, rows)

    def row_new_slots(self, new, window, b):
        """NewSlots `new` for row b: its position as the index of its own mask column, its window offset."""
        own = window.own_offset[0:1, b : b + 1]
        return dataclasses.replace(new, index=self.positions[0:1, b : b + 1], window_offset=own)


def read_blocks(pools, layer, blocks, offsets, paged):
    """(K blocks, V blocks) [np, q, F] of one row's window (`blocks`: paged_blocks) from the pools (k, v)
    [L, NB, BS, kv_heads, D], gathered by one DMA per block and cache at the row's per-partition pool slots
    `offsets` (PagedRows.window_offsets)."""
    out = tuple([] for _ in pools)
    f = paged.features
    first = layer * paged.num_blocks * paged.block_size * f
    for (_, np_, q), slots in zip(blocks, offsets):
        for pool, tiles in zip(pools, out):
            tile = nl.ndarray((np_, q, f), dtype=pool.dtype, buffer=nl.sbuf, name="cache_block")
            source = pool.ap([[f, np_], [f, q], [1, f]], offset=first, vector_offset=slots, indirect_dim=2)
            nisa.dma_copy(dst=tile, src=source)
            tiles.append(tile)
    return out


def gather_keys(pool, layer, groups, indices, paged):
    """Kᵀ column tiles [min(F, 128), ceil(F/128), span] of one row's window in window-slot order, from the K pool
    [L, NB, BS, kv_heads, D]: one gathering transpose a group (gather_groups) at its pool slots `indices`
    (PagedRows.window_indices)."""
    f = paged.features
    kp, kt = natural_tiles(f)
    s0, n, _ = groups[-1]
    keys = nl.ndarray((kp, kt, s0 + n), dtype=pool.dtype, buffer=nl.sbuf, name="keysT")
    first = layer * paged.num_blocks * paged.block_size * f
    for (s0, n, _), slots in zip(groups, indices):
        source = pool.ap([[f, n], [kp, kt], [1, kp]], offset=first, vector_offset=slots, indirect_dim=2)
        nisa.dma_transpose(dst=keys[:, :, s0 : s0 + n], src=source)
    return keys


def write_new_rows(rows, pool, layer, paged):
    """pool[layer] slot PagedRows.write_slots[b] = rows[b] (SBUF [B, F], the cache dtype) IN PLACE: one scattering
    DMA; an inactive row's slot lies past the pool, which the DMA skips."""
    f = paged.features
    first = layer * paged.num_blocks * paged.block_size * f
    slots = pool.ap([[f, paged.batch], [1, f]], offset=first, vector_offset=paged.write_slots, indirect_dim=2)
    nisa.dma_copy(dst=slots, src=rows, oob_mode=nisa.oob_mode.skip)


def shared_new_slots(rows):
    """The NewSlots fields every row of a paged window shares (R = rows new tokens on as many partitions, one per
    row); index and window_offset are each row's (PagedRows.row_new_slots)."""
    masked = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf, name="masked_slots")
    nisa.memset(dst=masked, value=MASKED_SCORE, engine=nisa.gpsimd_engine)
    return NewSlots(None, None, masked, rows)


def window_plan(spec, mask, slots, slot_bytes, batch):
    """(span, blocks) of a paged window under mask table `mask`: the logical slots a row reads (whole blocks of
    its table) and their attention blocks (paged_blocks), for S = slots logical slots per row of B = batch."""
    bs = spec.block_size
    blocks = window_blocks(spec.window_slots(mask, slots, 1), bs, slots // bs)
    return blocks * bs, paged_blocks(blocks, bs, slot_bytes, cache_spread_bytes(spec, batch))


class PagedWindowReader(WindowReader):
    """attention.WindowReader of a paged cache: row b's window is its blocks from the table entry its window
    starts at (PagedRows.window), gathered by DMA (read_blocks), Kᵀ gathered transposed (gather_keys) or turned
    on the PE; this step's slot of each
    row masked out at the row's own offset, its k and v from chip; the writes scatter to each row's slot.

    As attend takes row b (`row`), the gathers of row b + 1 are issued (`fetch`): its blocks arrive while row b's
    softmax runs, so its PE transposes need not wait for its DMAs' latency (they come later in TensorE's program
    order, when attend takes that row)."""

    def __init__(self, k_cache, v_cache, mask_bias, layer, paged, spec, rows):
        self.k_cache, self.v_cache, self.mask_bias = k_cache, v_cache, mask_bias
        self.layer, self.spec, self.paged, self.batch = layer, spec, paged, paged.batch
        self.index = self.start = None
        self.mask = spec.layer_mask[layer]
        slot_bytes = paged.features * k_cache.dtype.itemsize
        span, blocks = window_plan(spec, self.mask, paged.slots, slot_bytes, paged.batch)
        window_span = spec.window_slots(self.mask, paged.slots, 1)
        self.window = paged.window(window_span)
        self.offsets = paged.window_offsets(window_span, blocks)
        self.groups = gather_groups(span // paged.block_size, paged.block_size)
        spread = cache_spread_bytes(spec, paged.batch)
        by_gather = keys_by_gather(self.groups, paged.features, k_cache.dtype, spread)
        self.indices = paged.window_indices(window_span, self.groups) if by_gather else None
        self.plan = plan_window(span, paged.features, k_cache.dtype, None, blocks, keys_by_dma=by_gather)
        self.new = shared_new_slots(rows)
        self._loaded = {}
        self._fetched = {}

    def fetch(self, b):
        """Issue row b's gathers now: Kᵀ by gathering transposes (plan.keys_by_dma) or its K blocks (`load` turns
        them), and its V blocks."""
        if b in self._fetched:
            return
        blocks, offsets = self.plan.blocks, self.offsets[b]
        if self.plan.keys_by_dma:
            keys = gather_keys(self.k_cache, self.layer, self.groups, self.indices[b], self.paged)
            (values,) = read_blocks((self.v_cache,), self.layer, blocks, offsets, self.paged)
            self._fetched[b] = (keys, values)
        else:
            self._fetched[b] = read_blocks((self.k_cache, self.v_cache), self.layer, blocks, offsets, self.paged)

    def load(self, b):
        """Issue row b's reads now: its mask columns, its gathers (unless fetched), Kᵀ turned on the PE unless
        gathered transposed (`row` hands them out)."""
        plan, window = self.plan, self.window
        start = None if window.first_slot is None else window.first_slot[0:1, b : b + 1]
        new = self.paged.row_new_slots(self.new, window, b)
        visible = load_mask_columns(self.mask_bias, self.mask, b, plan.blocks, plan.pieces, start, new)
        self.fetch(b)
        keys, v_blocks = self._fetched.pop(b)
        if not plan.keys_by_dma:
            keys = turn_keys(keys, plan.blocks, plan.chunks, self.paged.features, self.k_cache.dtype)
        self._loaded[b] = RowCache(keys, v_blocks, visible)

    def row(self, b):
        """Row b's RowCache (loaded now unless `load` was), row b + 1's gathers issued."""
        cache = super().row(b)
        if b + 1 < self.batch:
            self.fetch(b + 1)
        return cache

    def write(self, rows, cache, layer):
        """Each row's new k or v (rows [B, F]) into its slot of the pool (write_new_rows)."""
        write_new_rows(rows, cache, layer, self.paged)


def cache_sbuf_bytes(k_cache, spec, batch, slots):
    """attention.cache_sbuf_bytes for a paged spec: a pool k_cache [L, NB, BS, kv_heads, D], B = batch rows of
    S = slots logical slots: per partition, one row's Kᵀ column tiles, its K and V blocks and the next row's
    (PagedWindowReader.fetch), at the largest window."""
    kv, d = k_cache.shape[3:]
    itemsize = k_cache.dtype.itemsize
    _, kt = natural_tiles(kv * d)
    largest = 0
    for mask in set(spec.layer_mask):
        span, blocks = window_plan(spec, mask, slots, kv * d * itemsize, batch)
        values = sum(q for _, _, q in blocks) * kv * d * itemsize
        largest = max(largest, kt * span * itemsize + 4 * values)
    return largest
