"""`nki.isa` data movement inside SBUF: gathers, cross-partition shuffles and reductions, top-k, and the
index-building instructions (sequence_bounds, nonzero_with_count).

GpSimd Engine: eight cores, each wired to 16 consecutive partitions; local_gather, nonzero_with_count and topk work
per 16-partition group.
"""

from __future__ import annotations

import numpy as np

from . import context, dtypes, ops
from .isa_core import PSUM_BY_OTHER, _f32_2d, _fail, _free, _int_2d, _mark_psum, _on_chip, _record, _write

_GROUP = 16  # partitions per GpSimd core


def _values(t):
    """[P, F] elements: float32 for float tiles, exact integers otherwise."""
    return _f32_2d(t) if dtypes.is_float(t.dtype) else _int_2d(t).astype(np.int64)


_PARTITION_REDUCE = {
    "add": np.sum,
    "average": np.mean,
    "maximum": np.max,
    "bitwise_or": np.bitwise_or.reduce,
    "bitwise_and": np.bitwise_and.reduce,
}


def tensor_partition_reduce(dst, op, data, name=None):
    """dst [1, free...] = op reduced over the partitions of data (add, average, maximum, bitwise_or, bitwise_and;
    GpSimd, float32 math for arithmetic ops, bit patterns for bitvec ones)."""
    opcode = "tensor_partition_reduce"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst, kinds=("sbuf",))
    _on_chip(opcode, line, "data", data, kinds=("sbuf",))
    op_name = ops.op_name(op)
    if op_name not in _PARTITION_REDUCE:
        _fail(opcode, line, f"op {op_name} must be one of {sorted(_PARTITION_REDUCE)}")
    if dst.shape[0] != 1 or _free(dst) != _free(data):
        _fail(opcode, line, f"dst {dst.describe()} must be [1, {_free(data)}] for data {data.describe()}")
    bitvec = op_name.startswith("bitwise")
    if bitvec and (dtypes.is_float(data.dtype) or dtypes.is_float(dst.dtype)):
        _fail(opcode, line, f"op {op_name} is a bitvec operator: data and dst need integer dtypes")
    if ctx.numerics:
        values = _int_2d(data) if bitvec else _f32_2d(data)
        _write(dst, _PARTITION_REDUCE[op_name](values, axis=0)[None, :])
    _record(ctx, opcode, "gpsimd", line, dst, (data,), partitions=data.shape[0], free=_free(data))


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within each 32-partition quadrant, dst partition i = src partition shuffle_mask[i] (255: dst partition i
    unchanged); the same 32-entry mask for every quadrant; same dtype and elements per partition (VectorE)."""
    opcode = "nc_stream_shuffle"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst, compute_engine=False)
    _on_chip(opcode, line, "src", src, compute_engine=False)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        _fail(opcode, line, f"shuffle_mask must be 32 entries in 0..31 or 255, got {shuffle_mask!r}")
    if dst.dtype != src.dtype:
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must equal src dtype {src.dtype.name}")
    if _free(dst) != _free(src):
        _fail(opcode, line, f"dst {dst.describe()} and src {src.describe()} must have the same elements per partition")
    active = -(-max(src.shape[0], dst.shape[0]) // 32) * 32
    allowed = (0,) if active > 64 else (0, 64) if active > 32 else (0, 32, 64, 96)
    for label, t in (("src", src), ("dst", dst)):
        start = t.offset // t.part_stride
        if start not in allowed:
            _fail(
                opcode,
                line,
                f"{label} starts at partition {start}; with {active} active partitions it must start "
                f"at {' or '.join(map(str, allowed))}",
            )
    if ctx.numerics:
        source = src.array().reshape(src.shape[0], -1).copy()
        result = dst.array().reshape(dst.shape[0], -1).copy()
        for p in range(dst.shape[0]):
            quadrant, i = divmod(p, 32)
            if mask[i] == 255:
                continue
            q = quadrant * 32 + mask[i]
            if q >= source.shape[0]:
                _fail(
                    opcode, line, f"shuffle_mask[{i}] = {mask[i]} reads src partition {q}, beyond its {source.shape[0]}"
                )
            result[p] = source[q]
        _write(dst, result)
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, "vector", line, dst, (src,))


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Per 16-partition group g (GpSimd core): the group's uint16 `index` values flattened partition-first,
    first num_valid_indices of them; dst[p, j * e:(j + 1) * e] = src_buffer[p] (free dims flattened)
    [idx[j]:idx[j] + e], e = num_elem_per_idx. No dtype conversion."""
    opcode = "local_gather"
    ctx = context.current(opcode)
    line = context.caller_line()
    for label, t in (("dst", dst), ("src_buffer", src_buffer), ("index", index)):
        _on_chip(opcode, line, label, t, kinds=("sbuf",))
    partitions = src_buffer.shape[0]
    if index.shape[0] != partitions or partitions % _GROUP:
        _fail(
            opcode,
            line,
            f"src_buffer {src_buffer.describe()} and index {index.describe()} must have the same "
            f"partition count, a multiple of 16",
        )
    if index.dtype != dtypes.uint16:
        _fail(opcode, line, f"index {index.describe()} must be uint16")
    if num_elem_per_idx not in (1, 2, 4, 8, 16, 32):
        _fail(opcode, line, f"num_elem_per_idx {num_elem_per_idx} must be one of 1, 2, 4, 8, 16, 32")
    per_group = _free(index) * _GROUP
    valid = per_group if num_valid_indices is None else int(num_valid_indices)
    if not 1 <= valid <= min(per_group, 4096):
        _fail(opcode, line, f"num_valid_indices {valid} must be 1..{min(per_group, 4096)} (indices per core)")
    if dst.dtype != src_buffer.dtype:
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must equal src_buffer dtype {src_buffer.dtype.name}")
    if dst.shape[0] != partitions or _free(dst) != valid * num_elem_per_idx:
        _fail(
            opcode,
            line,
            f"dst {dst.describe()} must have {partitions} partitions and {valid * num_elem_per_idx} elements each",
        )
    if ctx.numerics:
        source = src_buffer.array().reshape(partitions, -1)
        indices = _int_2d(index).astype(np.int64)
        out = np.empty((partitions, valid, num_elem_per_idx), dtype=source.dtype)
        span = np.arange(num_elem_per_idx)
        for g in range(partitions // _GROUP):
            rows = slice(g * _GROUP, (g + 1) * _GROUP)
            flat = indices[rows].flatten(order="F")[:valid]
            positions = flat[:, None] + span[None, :]
            if positions.max() >= source.shape[1]:
                _fail(
                    opcode,
                    line,
                    f"an index reaches element {int(positions.max())}, beyond the "
                    f"{source.shape[1]} per partition of src_buffer (undefined on hardware)",
                )
            out[rows] = source[rows][:, positions]
        _write(dst, out.reshape(partitions, -1))
    _record(ctx, opcode, "gpsimd", line, dst, (src_buffer, index), free=valid * num_elem_per_idx)


def nc_n_gather(dst, data, indices, name=None):
    """dst[p, j] = data[p] (free dims flattened)[indices[p, j]]; indices uint32; all SBUF; dst dtype = data's
    (GpSimd)."""
    opcode = "nc_n_gather"
    ctx = context.current(opcode)
    line = context.caller_line()
    for label, t in (("dst", dst), ("data", data), ("indices", indices)):
        _on_chip(opcode, line, label, t, kinds=("sbuf",))
    if not dst.shape[0] == data.shape[0] == indices.shape[0]:
        _fail(opcode, line, "dst, data and indices must have the same partition count")
    if indices.dtype != dtypes.uint32:
        _fail(opcode, line, f"indices {indices.describe()} must be uint32")
    if dst.dtype != data.dtype:
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}")
    if _free(dst) != _free(indices):
        _fail(opcode, line, f"dst {dst.describe()} must have as many elements per partition as indices")
    if ctx.numerics:
        source = data.array().reshape(data.shape[0], -1)
        picks = _int_2d(indices).astype(np.int64)
        if picks.size and picks.max() >= source.shape[1]:
            _fail(opcode, line, f"index {int(picks.max())} outside [0, {source.shape[1]}) elements per partition")
        _write(dst, np.take_along_axis(source, picks, axis=1))
    _record(ctx, opcode, "gpsimd", line, dst, (data, indices), free=_free(indices))


def sequence_bounds(dst, segment_ids, name=None):
    """For segment ids [1, n] (0 = padding): dst [1, 2, n] holds for each element the start (first row) and end
    (exclusive, second row) of its run of equal ids; padding gets start n and end -1. float32 or int32 (GpSimd)."""
    opcode = "sequence_bounds"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst, kinds=("sbuf",))
    _on_chip(opcode, line, "segment_ids", segment_ids, kinds=("sbuf",))
    for label, t in (("dst", dst), ("segment_ids", segment_ids)):
        if t.dtype not in (dtypes.float32, dtypes.int32):
            _fail(opcode, line, f"{label} {t.describe()} must be float32 or int32")
        if t.shape[0] != 1:
            _fail(opcode, line, f"{label} {t.describe()}: the partition dimension must be 1")
    n = _free(segment_ids)
    if _free(dst) != 2 * n:
        _fail(opcode, line, f"dst {dst.describe()} must be [1, 2, {n}]")
    if ctx.numerics:
        ids = _values(segment_ids)[0]
        start = np.empty(n, dtype=np.int64)
        end = np.empty(n, dtype=np.int64)
        for i in range(n):
            start[i] = n if ids[i] == 0 else (start[i - 1] if i and ids[i] == ids[i - 1] else i)
        for i in reversed(range(n)):
            end[i] = -1 if ids[i] == 0 else (end[i + 1] if i < n - 1 and ids[i] == ids[i + 1] else i + 1)
        _write(dst, np.stack([start, end])[None].astype(np.float32 if dst.dtype == dtypes.float32 else np.int64))
    _record(ctx, opcode, "gpsimd", line, dst, (segment_ids,), free=n)


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """On partitions 0, 16, ..., 112 only (one per GpSimd core): dst[p] = the indices (+ index_offset) of src[p]'s
    nonzero elements, then padding_val, then their count (dst has one more element per partition; int32; trn2+).
    Other partitions of dst are left unchanged."""
    opcode = "nonzero_with_count"
    ctx = context.current(opcode)
    line = context.caller_line()
    if ctx.target == "trn1":
        _fail(opcode, line, "nonzero_with_count needs NeuronCore-v3 (trn2) or newer, not trn1")
    _on_chip(opcode, line, "dst", dst, kinds=("sbuf",))
    _on_chip(opcode, line, "src", src, kinds=("sbuf",))
    if src.dtype not in (dtypes.float32, dtypes.int32):
        _fail(opcode, line, f"src {src.describe()} must be float32 or int32")
    if dst.dtype != dtypes.int32:
        _fail(opcode, line, f"dst {dst.describe()} must be int32")
    n = _free(src)
    if dst.shape[0] != src.shape[0] or _free(dst) != n + 1:
        _fail(opcode, line, f"dst {dst.describe()} must be [{src.shape[0]}, {n + 1}] (one more than src)")
    if ctx.numerics:
        values = _values(src)
        result = _int_2d(dst).astype(np.int64).copy()
        for p in range(0, src.shape[0], _GROUP):
            found = np.flatnonzero(values[p] != 0)
            row = np.full(n + 1, int(padding_val), dtype=np.int64)
            row[: found.size] = found + int(index_offset)
            row[n] = found.size
            result[p] = row
        _write(dst, result)
    _record(ctx, opcode, "gpsimd", line, dst, (src,), free=n)


def topk(val_dst, idx_dst, src, n, name=None):
    """Top-K of each 16-partition group's snake: src element e of a group sits at partition e % 16, column
    e // 16 (the first n elements count). Every partition of the group receives the group's K largest values in
    ascending order (val_dst, bfloat16) and their snake indices (idx_dst, uint32); K = val_dst's free size.
    The documentation says both "each partition operates independently" and that the snake spans 16 partitions;
    the emulator follows the snake description."""
    opcode = "topk"
    ctx = context.current(opcode)
    line = context.caller_line()
    for label, t in (("val_dst", val_dst), ("idx_dst", idx_dst), ("src", src)):
        _on_chip(opcode, line, label, t, kinds=("sbuf",))
    partitions = src.shape[0]
    k = _free(val_dst)
    if src.dtype != dtypes.bfloat16 or val_dst.dtype != dtypes.bfloat16:
        _fail(opcode, line, "src and val_dst must be bfloat16")
    if idx_dst.dtype != dtypes.uint32:
        _fail(opcode, line, f"idx_dst {idx_dst.describe()} must be uint32")
    if partitions % _GROUP or val_dst.shape[0] != partitions or idx_dst.shape[0] != partitions:
        _fail(opcode, line, "src, val_dst and idx_dst need the same partition count, a multiple of 16")
    if _free(idx_dst) != k:
        _fail(opcode, line, f"idx_dst {idx_dst.describe()} must be [{partitions}, {k}]")
    n = int(n)
    if not 8 <= n < 65536 or not 1 <= k <= n or k >= 32768:
        _fail(opcode, line, f"n = {n} and K = {k} must satisfy 8 <= n < 65536, 1 <= K <= n, K < 32768")
    if _free(src) < -(-n // _GROUP):
        _fail(opcode, line, f"src {src.describe()} needs at least ceil(n / 16) = {-(-n // _GROUP)} columns")
    if ctx.numerics:
        values = _f32_2d(src)
        out_values = np.empty((partitions, k), dtype=np.float32)
        out_index = np.empty((partitions, k), dtype=np.int64)
        for g in range(partitions // _GROUP):
            rows = slice(g * _GROUP, (g + 1) * _GROUP)
            snake = values[rows].flatten(order="F")[:n]
            chosen = np.argsort(-snake, kind="stable")[:k][::-1]
            out_values[rows] = snake[chosen]
            out_index[rows] = chosen
        _write(val_dst, out_values)
        _write(idx_dst, out_index.astype(np.uint32))
    _record(ctx, opcode, "gpsimd", line, val_dst, (src,), free=n, extra_writes=(idx_dst,))
