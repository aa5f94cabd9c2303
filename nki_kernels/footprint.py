"""How much SBUF and PSUM a fused kernel keeps live for a shape and block sizes (the tuner's filter).

Kinds of kernel (shape = (T, K, r, N) in each kind's own terms; see `block_table.KINDS`). The model follows the
emulator's liveness rule: a tensor lives until its last reference is dropped.
"""

from __future__ import annotations

from nki_kernels.hardware import MOVING_FMAX, PMAX, PSUM_BANKS, SBUF_BYTES_PER_PARTITION


def _tiles(n, size=PMAX):
    return -(-n // size)


def sbuf_bytes(kind, variant, shape, itemsize, blocks, weight_itemsize=None):
    """Peak SBUF bytes per partition the kernel keeps live for `shape` (T, K, r, N) in activations of `itemsize`
    bytes and `blocks` ({"block_t", "block_k", "block_n"}: the kernel's block-size keywords), by the emulator's
    liveness rule: a tensor lives until its last reference is dropped.

    Stage 1 holds the (XU)ᵀ strip(s), a float32 accumulator when K spans several blocks, and two K blocks
    (the current one and the next being loaded) of Xᵀ and full-width U rows, plus the next block's staged X
    rows. Stage 2 holds the strip(s), one V block per factor, and the output tiles.
    weight_itemsize: None (weights in the activations' dtype), or 1 for fp8 factors, which add their float32
    scales: U's per rank tile for the whole call, V's per block (repeated on every partition for "rows").
    """
    t, k, r, n = shape
    block_t, block_k, block_n = blocks["block_t"], blocks["block_k"], blocks["block_n"]
    tb = min(block_t, t)
    factors = 2 if kind == "svd_mlp_gate_up" else 1
    fp8 = weight_itemsize is not None
    w_itemsize = weight_itemsize if fp8 else itemsize
    kb = _tiles(min(block_k, k))
    xu = _tiles(r) * tb * itemsize
    total = _tiles(r) * tb * 4 if k > block_k else 0
    u_scales = factors * _tiles(r) * 4 if fp8 else 0
    k_block = kb * tb * itemsize + factors * kb * r * w_itemsize
    staged = 0 if (kind == "svd_mlp_down" and tb > 1) else _tiles(tb) * min(block_k, k) * itemsize
    stage1 = factors * (xu + total) + 2 * k_block + staged + u_scales
    v_block = _tiles(r) * min(block_n, n) * w_itemsize
    if not fp8:
        v_scales = 0
    elif variant == "rows":
        v_scales = 2 * min(block_n, n) * 4  # the row (on one partition) and its repetition on every partition
    else:
        v_scales = _tiles(min(block_n, n)) * 4
    if kind == "svd_mlp_gate_up":
        # hᵀ block (block_n features in the k_slots layout), the activation tile, a single token's row.
        out_tiles = (
            _tiles(min(block_n, n)) * tb * itemsize
            + min(tb, MOVING_FMAX) * 4
            + (min(block_n, n) * itemsize if tb == 1 else 0)
        )
    elif variant == "rows":
        out_tiles = min(block_n, n) * itemsize
    elif variant == "decode":
        out_tiles = _tiles(tb) * min(block_n, n) * itemsize + tb * itemsize
    else:
        out_tiles = tb * itemsize + (min(block_n, n) * itemsize if tb == 1 else 0)
    stage2 = factors * (xu + v_block + v_scales) + out_tiles + u_scales
    return max(stage1, stage2)


def psum_banks(kind, variant, shape, blocks):
    """Peak PSUM banks live at once for `shape` (T, K, r, N) and `blocks` (as sbuf_bytes'): stage 1 groups its rank
    tiles to fit beside one transpose tile; stage 2 holds one accumulator per 512 columns (rows) or per ≤512-token
    chunk and factor (cols)."""
    t, _, _, n = shape
    block_t, block_n = blocks["block_t"], blocks["block_n"]
    tb = min(block_t, t)
    chunks = _tiles(tb, MOVING_FMAX)
    stage1 = max(1, (PSUM_BANKS - 1) // chunks) * chunks + 1
    if kind == "svd_mlp_gate_up":
        return max(stage1, 2 * chunks + (1 if tb == 1 else 0))
    if variant == "rows":
        return max(stage1, _tiles(min(block_n, n), MOVING_FMAX))
    return max(stage1, chunks + 1)


def fits(kind, variant, shape, itemsize, blocks, target, weight_itemsize=None):
    """Whether `blocks` keep the kernel within `target`'s SBUF and PSUM for `shape` (T, K, r, N); weight_itemsize
    as in `sbuf_bytes`."""
    return (
        sbuf_bytes(kind, variant, shape, itemsize, blocks, weight_itemsize) <= SBUF_BYTES_PER_PARTITION[target]
        and psum_banks(kind, variant, shape, blocks) <= PSUM_BANKS
    )
