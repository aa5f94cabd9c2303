"""The LM head of the decode kernels: the final norm and the logits of column tiles into rows [R, V] in HBM.

The vocabulary streams through the weight ring in column ranges (long DMA runs of each head row); bf16 heads keep x
stationary and put logits rows in PSUM (`_LogitRows`), fp8 heads keep their weight tiles stationary so the vocabulary
and its per-column scales lie on the partitions (`_LogitColumns`), and turn the scaled logits into rows on the PE. A
factored head's stage 1 is a projection (nki_kernels.decode.matmul), stage 2 the dense head from the on-chip (x·u)ᵀ.
"""

from __future__ import annotations

import dataclasses

from nki_kernels.binding import nisa, nl
from nki_kernels.decode.contract import Quantized
from nki_kernels.decode.layouts import grouped_layout
from nki_kernels.decode.matmul import PROJECTION_PSUM_BANKS, copy_into, dense_projection, load_scales
from nki_kernels.decode.norm import rms_norm
from nki_kernels.decode.tiles import (
    column_tiles,
    evict_alternating,
    fp32_per_psum_bank,
    layout_blocks,
    padded_rows,
    tile_runs,
)
from nki_kernels.svd_matmul import spans

# Logits columns one LM-head PSUM chunk accumulates: 4 banks of float32.
HEAD_COLUMNS = 4 * nl.tile_size.psum_bank_fmax
# Widest head column range: 8 KiB runs of each head row per DMA (the DMA curve's flat part: 4 KiB runs move at
# 96.5% of its rate, 8 KiB at 98.3%), 4096 bf16 or 8192 fp8 columns, where a ring block allows and the range's
# blocks fit a third of the ring (see head_projection).
HEAD_RUN_BYTES = 8192
# Widest head range whose logits are staged as float32 rows until stored (bf16 weights, or more than HEAD_TURN_ROWS
# rows): 16 KiB per partition a range, HEAD_STORE_DELAY ranges at once (head_staging_bytes).
HEAD_STAGED_COLUMNS = 4096
# Narrowest range the head's last full range is halved down to: what TensorE and the logits' turning and stores do
# after the last weight block arrives is one range's work, so the step ends sooner after its last byte (2 KiB fp8
# runs move at 81.5% of the DMA rate, for 1/128 of a 262,144-column head's bytes).
HEAD_TAIL_COLUMNS = 2048
# Column ranges an LM-head range's logits stores wait for: DMAs are queued in program order, so a store issued
# right after its range's matmuls (it waits for them) would sit ahead of the next ranges' weight blocks and leave
# the DMA engines idle until its logits are ready; issued after the blocks of the next HEAD_STORE_DELAY ranges, it
# queues behind a stream that is already busy. Its logits rows stay in SBUF that long (a few fp32 rows).
HEAD_STORE_DELAY = 1
# Most rows for which the fp8 head's logit columns gather over ranges into buffers of 128 groups that are turned
# into rows one row at a time (`_LogitColumns._flush`: R·m transposes per 128 groups, m = HEAD_COLUMNS / 128, where
# turning per range a group at a time takes 128 whatever R; each row's staged logits hold HEAD_COLUMNS float32 per
# partition until stored). More rows turn per range.
HEAD_TURN_ROWS = 4


@dataclasses.dataclass(frozen=True)
class LmHead:
    """The LM head as lm_head takes it: its weight (a dense [H, V] HBM array, a Quantized, or a Factored u [H, r],
    v [r, V] with fp8 factors' scales), its rank (None: dense or Quantized) and the final logit softcap (None: none)."""

    weight: object
    rank: int | None = None
    softcap: float | None = None


def head_projection(x, layout, w, rows, ring, out_rows, softcap=None, scale=None):
    """out_rows [R, V] (HBM, float32) = (x · w [K, V])·diag(scale), softcap·tanh(·/softcap) when softcap is set.

    w in the model dtype (scale None) or fp8 with float32 scales [V] (HBM); x: column tiles of `layout` in the
    model dtype. Head blocks (one per 128-row K tile) stream through the ring column range by column range,
    and each range's logits accumulate in PSUM chunks (`_LogitRows`: bf16 weights, HEAD_COLUMNS a chunk;
    `_LogitColumns`: fp8, as many 128-column groups as PROJECTION_PSUM_BANKS hold). A range whose logits fit one
    chunk multiplies each block as soon as it loads, which frees it, so only the ring's prefetch is in flight,
    whatever the ring's size; a range over several chunks, each accumulating over all its blocks, keeps its blocks
    live together. Ranges hold HEAD_RUN_BYTES of each weight row (one DMA run) where a ring block and the staged
    logits (HEAD_STAGED_COLUMNS) allow, halved while a range's blocks take over a third of the ring (the rest
    prefetches the next ranges), else HEAD_COLUMNS columns; the last one is halved down to HEAD_TAIL_COLUMNS
    (`head_ranges`). A range's logits are stored once the blocks of the next HEAD_STORE_DELAY ranges are queued.
    """
    k, v = w.shape
    in_blocks = layout_blocks(layout)
    moving = nl.tile_size.gemm_moving_fmax
    block_elements = ring.block_elements(w.dtype)
    out = _LogitRows(x, rows, out_rows, softcap) if scale is None else _LogitColumns(x, rows, out_rows, softcap, scale)
    columns = _widest_columns(w.dtype, out.widest_range, block_elements)
    blocks_elements = sum(count for _, _, _, count, _ in in_blocks)
    while columns > HEAD_COLUMNS and blocks_elements * columns > ring.ring_elements(w.dtype) // 3:
        # e.g. a head of rank 576 in fp8 on trn1: 4096-column ranges where 8192 take over a third of the ring
        columns = max(HEAD_COLUMNS, columns // 2)
    if blocks_elements * columns > ring.ring_elements(w.dtype) // 3:
        # e.g. a factored head of rank ~1600, or attention's cache tiles shrinking the ring: streamed ranges.
        columns = min(HEAD_COLUMNS, block_elements)
    if columns >= moving:
        columns -= columns % moving  # whole moving tiles per block
    columns = max(1, columns)

    # (first row, rows, first x tile, tiles, partitions of the layout block; the K tile in it)
    k_tiles = [(*block, i) for block in in_blocks for i in range(block[3])]

    def load(v0, vc, k0, ks, _, count, partitions, i):
        """K tile i of the layout block at row k0, columns [v0, v0 + vc): a ring block [partitions, 1, vc]. One
        load a tile, not a layout block: a tile's matmuls wait for its bytes only, so when the last weights land
        one tile's matmuls are left, not a block's."""
        rows_of_block = w[k0 : k0 + ks, v0 : v0 + vc].reshape_dim(0, (partitions, count))
        return ring.load(rows_of_block[:, i : i + 1, :], partitions, 1, vc)

    def issue(stores):
        for dst, src in stores:
            nisa.dma_copy(dst=dst, src=src)

    pending = []  # per range, its logits stores (dst in HBM, src in SBUF) not issued yet
    for v0, vc in head_ranges(v, columns):
        chunks = out.start(v0, vc)
        stores = []
        if len(chunks) == 1:
            acc = out.accumulator(chunks[0])
            for b, tile in enumerate(k_tiles):
                block = load(v0, vc, *tile)
                if b == len(k_tiles) - 1 and len(pending) == HEAD_STORE_DELAY:
                    issue(pending.pop(0))
                _, _, s0, _, partitions, i = tile
                out.multiply(acc, chunks[0], block, b, s0 + i, 1, partitions)
                del block
            stores += out.store(acc, chunks[0])
        else:
            blocks = [load(v0, vc, *tile) for tile in k_tiles]
            if len(pending) == HEAD_STORE_DELAY:
                issue(pending.pop(0))
            for chunk in chunks:
                acc = out.accumulator(chunk)
                for b, (block, (_, _, s0, _, partitions, i)) in enumerate(zip(blocks, k_tiles)):
                    out.multiply(acc, chunk, block, b, s0 + i, 1, partitions)
                stores += out.store(acc, chunk)
            del blocks
        pending.append(stores)
    for stores in pending:
        issue(stores)


def _widest_columns(dtype, widest_range, block_elements):
    """A head range's widest width before head_projection narrows it to a third of the ring: a ring block holds one
    K tile's row of the range (head_projection loads a block per tile)."""
    return min(HEAD_RUN_BYTES // dtype.itemsize, widest_range, block_elements)


def head_staging_bytes(dtype, fp8, rows, vocab, block_bytes):
    """SBUF bytes per partition at most that head_projection's staged logits hold at once, for a head of weights in
    `dtype` (fp8: with scales), R = rows, V = vocab, ring blocks of block_bytes: what the kernel keeps beside the
    weight ring in the head (where attention's cache tiles are no longer live). A range's logits are allocated once
    the oldest pending range's stores are issued, so HEAD_STORE_DELAY ranges' float32 rows are live at most (the fp8
    head's: its 128-group column buffer and the rows of its flushes, beside its scales for the whole vocabulary)."""
    pmax, ranges = nl.tile_size.pmax, max(1, HEAD_STORE_DELAY)
    if not fp8:
        columns = _widest_columns(dtype, HEAD_STAGED_COLUMNS, block_bytes // dtype.itemsize)
        if columns >= nl.tile_size.gemm_moving_fmax:
            columns -= columns % nl.tile_size.gemm_moving_fmax
        return ranges * min(max(columns, 1), vocab) * nl.float32.itemsize
    if rows <= HEAD_TURN_ROWS:  # a buffer of 128 groups; a flush stages HEAD_COLUMNS of each row
        staged = (pmax * rows + ranges * rows * HEAD_COLUMNS) * nl.float32.itemsize
    else:
        groups = -(-HEAD_STAGED_COLUMNS // pmax)  # a range's column tiles and its rows
        staged = ranges * (groups * rows + HEAD_STAGED_COLUMNS) * nl.float32.itemsize
    # The scales ([128, Q·m, 1]) stay live through the whole head; the rows they are read as (Q of 128·m columns)
    # are freed before any logits stage.
    count, m = _scale_rows(vocab)
    return count * m * nl.float32.itemsize + max(pmax * m * nl.float32.itemsize, staged)


def head_ranges(v, columns):
    """The head's column ranges [(first column, columns)]: `columns` wide, the last full-width one (with the
    narrower remainder after it, if any, when `columns` exceeds HEAD_TAIL_COLUMNS: then every piece is at most
    `columns` wide) split into halves, quarters, ... (in whole 128-column groups) down to HEAD_TAIL_COLUMNS."""
    pmax = nl.tile_size.pmax
    ranges = spans(v, columns)
    v0, vc = ranges.pop()
    if ranges and vc < columns and HEAD_TAIL_COLUMNS < columns:
        # A remainder alone at the end would leave the full range before it ending late: the step's last DMAs
        # need not land in issue order, and that range's whole work would follow its last bytes.
        v0, vc = ranges.pop()[0], vc + columns
    while vc > HEAD_TAIL_COLUMNS and vc >= 2 * pmax:
        half = vc // 2 - vc // 2 % pmax
        ranges.append((v0, half))
        v0, vc = v0 + half, vc - half
    return ranges + [(v0, vc)]


class _LogitRows:
    """The LM head with x STATIONARY ([≤128 of K, R]) and head tiles moving ([≤128 of K, ≤512 of V]): PSUM holds
    logits rows [R, ≤512] directly, a chunk being HEAD_COLUMNS columns. TensorE takes 128 weights a cycle this way
    (a 512-column moving tile in 512 cycles), more than DMA brings of bf16 weights on trn1 or trn2."""

    def __init__(self, x, rows, out_rows, softcap):
        self.x, self.rows, self.out_rows, self.softcap = x, rows, out_rows, softcap
        self.widest_range = HEAD_STAGED_COLUMNS

    def start(self, v0, vc):
        """The chunks of the range [v0, v0 + vc): (first column in the range, columns)."""
        self.v0 = v0
        return spans(vc, HEAD_COLUMNS)

    def accumulator(self, chunk):
        return nl.ndarray((self.rows, chunk[1]), dtype=nl.float32, buffer=nl.psum, name="logits_psum")

    def multiply(self, acc, chunk, block, b, s0, count, partitions):
        c0, cw = chunk
        moving = nl.tile_size.gemm_moving_fmax
        for i in range(count):
            for m0, ms in spans(cw, moving):
                nisa.nc_matmul(
                    dst=acc[0 : self.rows, m0 : m0 + ms],
                    stationary=self.x[0:partitions, s0 + i, 0 : self.rows],
                    moving=block[0:partitions, i, c0 + m0 : c0 + m0 + ms],
                    accumulate=b > 0 or i > 0,
                )

    def store(self, acc, chunk):
        """[(out's columns, SBUF rows)] to store: acc (soft-capped when softcap is set) through an SBUF row."""
        c0, cw = chunk
        logits = nl.ndarray(tuple(acc.shape), dtype=nl.float32, buffer=nl.sbuf, name="logits_rows")
        if self.softcap is None:
            # A PSUM bank at a time, VectorE and ScalarE in turn: a row of a chunk is cw elements on one partition,
            # whose copy on one engine (cw cycles) follows the step's last matmuls.
            for k, (b0, bw) in enumerate(spans(cw, nl.tile_size.psum_bank_fmax)):
                evict_alternating(logits[:, b0 : b0 + bw], acc[:, b0 : b0 + bw], k)
        else:
            nisa.activation(dst=logits, op=nl.tanh, data=acc, scale=1.0 / self.softcap)
            nisa.tensor_scalar(dst=logits, data=logits, op0=nl.multiply, operand0=float(self.softcap))
        return [(self.out_rows[0 : self.rows, self.v0 + c0 : self.v0 + c0 + cw], logits)]


class _LogitColumns:
    """The LM head of fp8 weights with head tiles STATIONARY ([≤128 of K, ≤128 of V]) and x moving ([≤128 of K,
    R]): PSUM holds logits column tiles [≤128 of V, R], vocabulary on the partitions, one per 128-column group.
    TensorE takes 256 weights a cycle this way (64 cycles a tile) where the rows orientation takes 128, fewer than
    DMA brings of fp8 weights on trn2 (151 bytes a cycle). Turning the logits back into rows one PE transpose
    (128 cycles) per group would make a group of a rank-448 factored head cost 384 cycles, as long as DMA takes for
    its bytes on trn2; with up to HEAD_TURN_ROWS rows the logit columns of 128 groups are turned m = HEAD_COLUMNS
    / 128 at a time (`_flush`), so a group costs the matmuls' 256 cycles plus 16 per row. The scales lie on the
    partitions too, so PSUM is scaled on the way out with one VectorE multiply per run of groups, then soft-capped;
    they are loaded once for the whole vocabulary (`_scale_groups`)."""

    def __init__(self, x, rows, out_rows, softcap, scale):
        self.x, self.rows, self.out_rows, self.softcap = x, rows, out_rows, softcap
        self.per_acc = PROJECTION_PSUM_BANKS * fp32_per_psum_bank(padded_rows(rows))  # groups an accumulator holds
        # Up to HEAD_TURN_ROWS rows, logits gather in buffers of 128 groups whatever a range's width; more rows
        # stage each range's logits rows.
        self.widest_range = out_rows.shape[1] if rows <= HEAD_TURN_ROWS else HEAD_STAGED_COLUMNS
        self.scales = _scale_groups(scale)
        self.buffer, self.buffer_column, self.buffered = None, 0, []  # see store: the groups not yet turned
        # The first buffer holds fewer groups so that the last holds m = HEAD_COLUMNS / 128 (one transpose per
        # row): turning the last buffer is work after the last weight block arrives.
        pmax, groups = nl.tile_size.pmax, -(-out_rows.shape[1] // nl.tile_size.pmax)
        self.capacity = (groups - HEAD_COLUMNS // pmax) % pmax or pmax

    def start(self, v0, vc):
        """The chunks of the range [v0, v0 + vc): (the range's first group in the vocabulary, [(column in the
        range, columns) of each 128-column group])."""
        pmax = nl.tile_size.pmax
        self.v0 = v0
        groups = spans(vc, pmax)
        return [(v0 // pmax + j0, groups[j0 : j0 + self.per_acc]) for j0 in range(0, len(groups), self.per_acc)]

    def accumulator(self, chunk):
        shape = (nl.tile_size.pmax, len(chunk[1]), padded_rows(self.rows))
        return nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum, name="logits_psum")

    def multiply(self, acc, chunk, block, b, s0, count, partitions):
        for j, (c0, cs) in enumerate(chunk[1]):
            for i in range(count):
                nisa.nc_matmul(
                    dst=acc[0:cs, j, 0 : self.rows],
                    stationary=block[0:partitions, i, c0 : c0 + cs],
                    moving=self.x[0:partitions, s0 + i, 0 : self.rows],
                    accumulate=b > 0 or i > 0,
                )

    def store(self, acc, chunk):
        """[(out's columns, SBUF rows)] to store: acc·scale (soft-capped when softcap is set) as scaled column tiles
        in an SBUF buffer of up to 128 consecutive groups (the first fewer) that spans ranges (`_flush` turns a
        full one into rows); with more than HEAD_TURN_ROWS rows, per range (`_store_range`)."""
        if self.rows > HEAD_TURN_ROWS:
            return self._store_range(acc, chunk)
        first_group, groups = chunk
        rows = self.rows
        stores = []
        j = 0
        while j < len(groups):
            if self.buffer is None:
                shape = (nl.tile_size.pmax, nl.tile_size.pmax, rows)
                self.buffer = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf, name="logit_cols")
                self.buffer_column, self.buffered = self.v0 + groups[j][0], []
            # a run of equal-size groups that fits the buffer
            size, n = groups[j][1], 1
            room = self.capacity - len(self.buffered)
            while n < room and j + n < len(groups) and groups[j + n][1] == size:
                n += 1
            b0 = len(self.buffered)
            self._scaled(self.buffer[0:size, b0 : b0 + n, 0:rows], acc[0:size, j : j + n, 0:rows], first_group + j)
            self.buffered += [size] * n
            j += n
            end = self.buffer_column + sum(self.buffered)
            last = end == self.out_rows.shape[1]
            if len(self.buffered) == self.capacity or size < nl.tile_size.pmax or last:
                stores += self._flush(1 if last else HEAD_COLUMNS // nl.tile_size.pmax)
                self.capacity = nl.tile_size.pmax
        return stores

    def _scaled(self, dst, psum, group):
        """dst [size, n, R] = psum [size, n, R] (groups group .. group+n-1) times their scales, soft-capped when
        softcap is set."""
        size, n, rows = dst.shape
        scale = self.scales[0:size, group : group + n, 0:1].broadcast(2, rows)
        nisa.tensor_tensor(dst=dst, data1=psum, data2=scale, op=nl.multiply)
        if self.softcap is not None:
            nisa.activation(dst=dst, op=nl.tanh, data=dst, scale=1.0 / self.softcap)
            nisa.tensor_scalar(dst=dst, data=dst, op0=nl.multiply, operand0=float(self.softcap))

    def _store_range(self, acc, chunk):
        """`store` of more than HEAD_TURN_ROWS rows: acc·scale (soft-capped when softcap is set) as scaled column
        tiles in SBUF, turned into rows on the PE one group at a time (a transpose turns all R rows of a group), side
        by side in a PSUM row of up to HEAD_COLUMNS, so each DMA writes whole rows of logits (long runs, one engine
        per 8 rows)."""
        first_group, groups = chunk
        rows = self.rows
        logits = nl.ndarray((nl.tile_size.pmax, len(groups), rows), dtype=nl.float32, buffer=nl.sbuf, name="logit_cols")
        for g0, count, size in tile_runs(tuple((cs, None) for _, cs in groups)):
            self._scaled(
                logits[0:size, g0 : g0 + count, 0:rows], acc[0:size, g0 : g0 + count, 0:rows], first_group + g0
            )
        pmax = nl.tile_size.pmax
        per_row = HEAD_COLUMNS // pmax
        stores = []
        for j0 in range(0, len(groups), per_row):
            part = groups[j0 : j0 + per_row]
            first, width = part[0][0], part[-1][0] + part[-1][1] - part[0][0]
            turned = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.psum, name="logits_turned")
            for j, (c0, cs) in enumerate(part):
                nisa.nc_transpose(dst=turned[0:rows, c0 - first : c0 - first + cs], data=logits[0:cs, j0 + j, 0:rows])
            staged = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf, name="logits_rows")
            nisa.tensor_copy(dst=staged, src=turned)
            del turned
            stores.append((self.out_rows[0:rows, self.v0 + first : self.v0 + first + width], staged))
        return stores

    def _flush(self, m):
        """The buffered groups as rows of logits, per row: PE transposes of [128, n] column tiles, each turning n
        groups at once (max(128, min(64, n)) cycles however many it turns, where one per group took 128 cycles a
        group: on trn2 the head's TensorE time was its matmuls' plus half again, and its VectorE evictions one
        per 16 groups). Transpose j takes groups j, j + m, j + 2m, ... to PSUM columns [128·j, 128·(j+1)), so
        partition q holds m consecutive groups, evicted by one VectorE copy (128·m elements a partition) and stored
        a partition per DMA (spread over the DMA engines as the per-range rows were): m = HEAD_COLUMNS / 128 gives
        8 KiB runs of logits; the last buffer, turned after the last weights arrive, takes m = 1 (the shortest
        copy). The groups left over (fewer than m, the last maybe partial) turn one at a time into one row."""
        pmax = nl.tile_size.pmax
        buffered, column = self.buffered, self.buffer_column
        full = len(buffered) if buffered[-1] == pmax else len(buffered) - 1
        nq = full // m
        by_row = self.buffer.reshape_dim(1, (pmax // m, m))  # [128, 128 / m, m, R]: group q·m + j
        stores = []
        for r in range(self.rows):
            if nq:
                turned = nl.ndarray((nq, m * pmax), dtype=nl.float32, buffer=nl.psum, name="logits_turned")
                for j in range(m):
                    nisa.nc_transpose(dst=turned[0:nq, j * pmax : (j + 1) * pmax], data=by_row[0:pmax, 0:nq, j, r])
                staged = nl.ndarray((nq, m * pmax), dtype=nl.float32, buffer=nl.sbuf, name="logits_rows")
                nisa.tensor_copy(dst=staged, src=turned)
                del turned
                for q in range(nq):  # a DMA per partition: the stores of a flush spread over nq engines
                    c0 = column + q * m * pmax
                    stores.append((self.out_rows[r : r + 1, c0 : c0 + m * pmax], staged[q : q + 1, :]))
            rest = buffered[nq * m :]
            if rest:
                width = sum(rest)
                turned = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.psum, name="logits_turned")
                for i, cs in enumerate(rest):
                    g = nq * m + i
                    nisa.nc_transpose(dst=turned[0:1, i * pmax : i * pmax + cs], data=self.buffer[0:cs, g, r : r + 1])
                staged = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.sbuf, name="logits_rows")
                nisa.tensor_copy(dst=staged, src=turned)
                del turned
                c0 = column + nq * m * pmax
                stores.append((self.out_rows[r : r + 1, c0 : c0 + width], staged))
        self.buffer, self.buffered = None, []
        return stores


def _scale_rows(vocab):
    """(Q, m): `_scale_groups` reads a scale [V = vocab] as Q rows of 128·m columns (m = ⌈G/128⌉, G = ⌈V/128⌉)."""
    pmax = nl.tile_size.pmax
    groups = -(-vocab // pmax)
    m = -(-groups // pmax)
    return -(-vocab // (pmax * m)), m


def _scale_groups(scale):
    """scale [V] (HBM, float32) as [128, G, 1] SBUF (G = ⌈V/128⌉ groups of 128 columns, column g·128 + p on
    partition p of group g). One DMA reads it as Q ≤ 128 contiguous rows of B = 128·m columns (m = ⌈G/128⌉; 8 KiB
    a row for a 262144-token vocabulary), and m PE transposes of [Q, 128] slices lay it out: slice j of row q is
    group q·m + j. A ragged last row is zeroed first (an unwritten element would spoil a transpose on trn1)."""
    pmax = nl.tile_size.pmax
    v = scale.shape[0]
    count, m = _scale_rows(v)
    width = pmax * m
    full = v // width
    staged = nl.ndarray((count, width), dtype=nl.float32, buffer=nl.sbuf, name="head_scale_rows")
    if full < count:
        nisa.memset(dst=staged, value=0.0)
    if full:
        nisa.dma_copy(dst=staged[0:full, :], src=scale[0 : full * width].reshape((full, width)))
    if full < count:
        rest = v - full * width
        nisa.dma_copy(dst=staged[full:count, 0:rest], src=scale[full * width : v].reshape((1, rest)))
    out = nl.ndarray((pmax, count * m, 1), dtype=nl.float32, buffer=nl.sbuf, name="head_scales")
    by_row = out.reshape_dim(1, (count, m))  # [128, Q, m, 1]: group q·m + j
    for j in range(m):
        turned = nl.ndarray((pmax, count), dtype=nl.float32, buffer=nl.psum, name="head_scale_psum")
        nisa.nc_transpose(dst=turned, data=staged[0:count, j * pmax : (j + 1) * pmax])
        nisa.tensor_copy(dst=by_row[0:pmax, 0:count, j, 0], src=turned)
        del turned
    del staged
    return out


def head_logits(h, layout, head, head_rank, rows, ring, out_rows, softcap=None):
    """The LM head of normed column tiles h (model dtype, `layout`) into out_rows [R, V] (HBM, float32): a dense head
    [H, V] or a Quantized (head_rank None), or a Factored u [H, r], v [r, V] (with fp8 factors, their scales; stage 1
    as a projection, stage 2 as the dense head from the on-chip (x·u)ᵀ); softcap·tanh(·/softcap) when softcap is set."""
    if head_rank is None:
        w, scale = (head.w, head.scale) if isinstance(head, Quantized) else (head, None)
        head_projection(h, layout, w, rows, ring, out_rows, softcap, scale)
        return
    xu_layout = grouped_layout(head_rank, HEAD_COLUMNS)
    u_scales = None if head.u_scale is None else load_scales(head.u_scale[0:head_rank], xu_layout)
    xu = column_tiles(xu_layout, rows, h.dtype, "head_xuT", zero=False)
    dense_projection(h, layout, head.u[:, 0:head_rank], xu_layout, rows, ring, copy_into(xu), u_scales)
    head_projection(xu, xu_layout, head.v[0:head_rank, :], rows, ring, out_rows, softcap, head.v_scale)


def lm_head(x, layout, final_norm_w, head, rows, ring, consts, out_rows, dtype):
    """Final norm of the hidden state x (float32 column tiles) into the model dtype `dtype` and the LM head `head`
    (LmHead) into out_rows [R, V] (HBM, float32), as head_logits computes it."""
    h = column_tiles(layout, rows, dtype, "final_normed", zero=False)
    rms_norm(h, x, final_norm_w, layout, rows, consts)
    head_logits(h, layout, head.weight, head.rank, rows, ring, out_rows, head.softcap)
