"""`nki.isa` selection instructions: predicated copies, select with reduction, affine / range masks, and the
top-8 family (max8, nc_find_index8, nc_match_replace8)."""

from __future__ import annotations

import numpy as np

from . import context, dtypes, ops
from .isa_constants import reduce_cmd as _ReduceCmd
from .isa_core import (
    PSUM_BY_OTHER,
    _elementwise_operands,
    _f32_2d,
    _fail,
    _free,
    _int_2d,
    _mark_psum,
    _on_chip,
    _operand,
    _operand_value,
    _record,
    _write,
)
from .isa_vector import _command, _reduction_result, accumulate
from .tensor import NkiTensor

_UNSIGNED_PREDICATE = (dtypes.uint8, dtypes.uint16, dtypes.uint32)
_COMPARISONS = ("equal", "less", "less_equal", "greater", "greater_equal")
FP32_MIN = float(np.finfo(np.float32).min)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """dst[i] = src[i] (or the number src) where predicate[i] != 0 (== 0 with reverse_pred); elsewhere dst keeps its
    value. predicate uint8/16/32; src and dst the same dtype; src and predicate not both in PSUM (VectorE)."""
    opcode = "tensor_copy_predicated"
    ctx = context.current(opcode)
    line = context.caller_line()
    inputs = {"predicate": predicate} if not isinstance(src, NkiTensor) else {"src": src, "predicate": predicate}
    _elementwise_operands(opcode, line, dst, **inputs)
    if predicate.dtype not in _UNSIGNED_PREDICATE:
        _fail(opcode, line, f"predicate {predicate.describe()} must be uint8, uint16 or uint32")
    if isinstance(src, NkiTensor) and src.dtype != dst.dtype:
        _fail(opcode, line, f"src dtype {src.dtype.name} must equal dst dtype {dst.dtype.name}")
    if ctx.numerics:
        mask = _int_2d(predicate) != 0
        if reverse_pred:
            mask = ~mask
        current = dst.array().reshape(mask.shape)
        new = src.array().reshape(mask.shape) if isinstance(src, NkiTensor) else np.asarray(src).astype(dst.dtype)
        _write(dst, np.where(mask, new, current))
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (predicate, dst) + ((src,) if isinstance(src, NkiTensor) else ())
    _record(ctx, opcode, "vector", line, dst, reads, inputs=tuple(inputs.values()))


def select_reduce(
    dst,
    predicate,
    on_true,
    on_false,
    reduce_res=None,
    reduce_cmd=_ReduceCmd.idle,
    reduce_op="maximum",
    reverse_pred=False,
    name=None,
):
    """dst = where(predicate, on_true, on_false) (VectorE, float32); on_false a float scalar or [P, 1] vector;
    predicate an 8/16-bit integer tile. With reduce_cmd, the registers fold the per-partition max of dst."""
    opcode = "select_reduce"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, predicate=predicate, on_true=on_true)
    reduce_cmd = _command(opcode, line, reduce_cmd)
    if predicate.dtype not in (dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16):
        _fail(opcode, line, f"predicate {predicate.describe()} must be int8, uint8, int16 or uint16")
    if on_true.dtype in (dtypes.int32, dtypes.uint32):
        _fail(opcode, line, f"on_true {on_true.describe()}: int32/uint32 are not supported")
    if ops.op_name(reduce_op, "reduce_op") != "maximum":
        _fail(opcode, line, "reduce_op must be nl.maximum")
    partitions = on_true.shape[0]
    _operand(opcode, line, "on_false", on_false, partitions)
    _reduction_result(opcode, line, reduce_res, partitions)
    if reduce_res is not None and not dtypes.is_float(reduce_res.dtype):
        _fail(opcode, line, f"reduce_res {reduce_res.describe()} must have a float dtype")
    if ctx.numerics:
        mask = _int_2d(predicate) != 0
        if reverse_pred:
            mask = ~mask
        result = np.where(mask, _f32_2d(on_true), _operand_value(on_false)).astype(np.float32)
        _write(dst, result)
        registers = accumulate(ctx, reduce_cmd, "maximum", result)
        if reduce_res is not None:
            _write(reduce_res, registers.copy())
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (predicate, on_true) + ((on_false,) if isinstance(on_false, NkiTensor) else ())
    _record(ctx, opcode, "vector", line, dst, reads, inputs=(predicate, on_true), extra_writes=(reduce_res,))


def range_select(
    dst,
    on_true_tile,
    comp_op0,
    comp_op1,
    bound0,
    bound1,
    reduce_cmd=_ReduceCmd.reset_reduce,
    reduce_res=None,
    reduce_op="maximum",
    range_start=0,
    on_false_value=FP32_MIN,
    name=None,
):
    """dst[p, i] = on_true_tile[p, i] where comp_op0(range_start + i, bound0[p]) and comp_op1(range_start + i,
    bound1[p]), else on_false_value (which must be FP32_MIN); the registers fold the per-partition max (trn2+)."""
    opcode = "range_select"
    ctx = context.current(opcode)
    line = context.caller_line()
    if ctx.target == "trn1":
        _fail(opcode, line, "range_select needs NeuronCore-v3 (trn2) or newer, not trn1")
    _elementwise_operands(opcode, line, dst, on_true_tile=on_true_tile)
    reduce_cmd = _command(opcode, line, reduce_cmd)
    names = [ops.op_name(op, label) for op, label in ((comp_op0, "comp_op0"), (comp_op1, "comp_op1"))]
    for label, op_name in zip(("comp_op0", "comp_op1"), names):
        if op_name not in _COMPARISONS:
            _fail(opcode, line, f"{label} {op_name} must be one of {list(_COMPARISONS)}")
    if ops.op_name(reduce_op, "reduce_op") != "maximum":
        _fail(opcode, line, "reduce_op must be nl.maximum")
    if not dtypes.is_float(on_true_tile.dtype):
        _fail(opcode, line, f"on_true_tile {on_true_tile.describe()} must have a float dtype")
    if np.float32(on_false_value) != np.float32(FP32_MIN):
        _fail(opcode, line, f"on_false_value must be FP32_MIN ({FP32_MIN}), got {on_false_value!r}")
    partitions = on_true_tile.shape[0]
    for label, bound in (("bound0", bound0), ("bound1", bound1)):
        if not isinstance(bound, NkiTensor):
            raise TypeError(f"{opcode} at {line}: {label} must be an NKI tensor [{partitions}, 1]")
        _operand(opcode, line, label, bound, partitions, require_f32=True)
    _reduction_result(opcode, line, reduce_res, partitions)
    if ctx.numerics:
        n = _free(on_true_tile)
        index = (np.float32(range_start) + np.arange(n, dtype=np.float32))[None, :]
        mask = (ops.BINARY[names[0]](index, _f32_2d(bound0)) != 0) & (ops.BINARY[names[1]](index, _f32_2d(bound1)) != 0)
        result = np.where(mask, _f32_2d(on_true_tile), np.float32(FP32_MIN)).astype(np.float32)
        _write(dst, result)
        registers = accumulate(ctx, reduce_cmd, "maximum", result)
        if reduce_res is not None:
            _write(reduce_res, registers.copy())
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(
        ctx,
        opcode,
        "vector",
        line,
        dst,
        (on_true_tile, bound0, bound1),
        inputs=(on_true_tile,),
        extra_writes=(reduce_res,),
    )


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op="equal", offset=0, name=None):
    """dst[p, i] = on_true_tile[p, i] where cmp_op(offset + p * channel_multiplier + sum(i_k * step_k), 0) over the
    [[step, num], ...] pattern (up to 4-D, its elements = dst's elements per partition), else on_false_value
    (GpSimd; SBUF only)."""
    opcode = "affine_select"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst, kinds=("sbuf",))
    _on_chip(opcode, line, "on_true_tile", on_true_tile, kinds=("sbuf",))
    if dst.shape[0] != on_true_tile.shape[0] or _free(dst) != _free(on_true_tile):
        _fail(
            opcode,
            line,
            f"dst {dst.describe()} and on_true_tile {on_true_tile.describe()} must have the same "
            f"partitions and elements per partition",
        )
    if not 1 <= len(pattern) <= 4:
        _fail(opcode, line, f"pattern {pattern} must have 1 to 4 [step, num] pairs")
    counts = [int(n) for _, n in pattern]
    if int(np.prod(counts)) != _free(dst):
        _fail(
            opcode, line, f"pattern {pattern} has {int(np.prod(counts))} elements, dst has {_free(dst)} per partition"
        )
    cmp_name = ops.op_name(cmp_op, "cmp_op")
    if cmp_name not in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal"):
        _fail(opcode, line, f"cmp_op {cmp_name} must be a comparison operator")
    if ctx.numerics:
        affine = np.zeros(counts, dtype=np.int64)
        for axis, (step, n) in enumerate(pattern):
            shape = [1] * len(counts)
            shape[axis] = int(n)
            affine = affine + np.arange(int(n), dtype=np.int64).reshape(shape) * int(step)
        channel = np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier)
        affine = int(offset) + channel + affine.reshape(1, -1)
        mask = ops.BINARY[cmp_name](affine, 0) != 0
        _write(dst, np.where(mask, _f32_2d(on_true_tile), np.float32(on_false_value)))
    _record(ctx, opcode, "gpsimd", line, dst, (on_true_tile,))


def _top8_source(opcode, line, src, label="src"):
    _on_chip(opcode, line, label, src)
    n = _free(src)
    if src.ndim > 3:
        _fail(opcode, line, f"{label} {src.describe()} must be at most 3-D")
    if not 8 <= n <= 16384:
        _fail(opcode, line, f"{label} {src.describe()} must have 8 to 16384 elements per partition, got {n}")
    return n


def _eight(opcode, line, label, t, partitions):
    _on_chip(opcode, line, label, t)
    if t.shape[0] != partitions or _free(t) != 8:
        _fail(opcode, line, f"{label} {t.describe()} must be [{partitions}, 8]")


def max8(dst, src, name=None):
    """dst [P, 8] = the 8 largest values of each partition of src (8 to 16384 elements), descending (VectorE)."""
    opcode = "max8"
    ctx = context.current(opcode)
    line = context.caller_line()
    n = _top8_source(opcode, line, src)
    _eight(opcode, line, "dst", dst, src.shape[0])
    if dst.ndim != 2:
        _fail(opcode, line, f"dst {dst.describe()} must be 2-D")
    if ctx.numerics:
        values = _f32_2d(src)
        _write(dst, -np.sort(-values, axis=1, kind="stable")[:, :8])
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, "vector", line, dst, (src,), free=n)


def _index_dtype(opcode, line, dst):
    if dst.dtype not in (dtypes.uint16, dtypes.uint32):
        _fail(opcode, line, f"dst {dst.describe()} must be uint16 or uint32 (indices)")


def nc_find_index8(dst, data, vals, name=None):
    """dst [P, 8] (uint16/uint32) = the index of the first occurrence in each partition of data of each of the 8
    vals; repeated vals take successive occurrences, in ascending order; absent ones the all-ones sentinel."""
    opcode = "nc_find_index8"
    ctx = context.current(opcode)
    line = context.caller_line()
    n = _top8_source(opcode, line, data, "data")
    _eight(opcode, line, "vals", vals, data.shape[0])
    _eight(opcode, line, "dst", dst, data.shape[0])
    _index_dtype(opcode, line, dst)
    if ctx.numerics:
        values, targets = _f32_2d(data), _f32_2d(vals)
        sentinel = np.iinfo(dst.dtype).max
        out = np.full(targets.shape, sentinel, dtype=np.int64)
        for p in range(values.shape[0]):
            used = set()
            for k in range(8):
                hits = np.flatnonzero(values[p] == targets[p, k])
                free = [int(h) for h in hits if int(h) not in used]
                if free:
                    out[p, k] = free[0]
                    used.add(free[0])
        _write(dst, out.astype(dst.dtype))
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, "vector", line, dst, (data, vals), free=n)


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """dst = data with the first occurrence of each of the 8 vals per partition replaced by imm (VectorE); vals are
    matched in reverse order (7 .. 0), so repeated vals pair with successive occurrences in descending slots.
    dst_idx [P, 8] (optional, uint16/uint32) receives the matched positions."""
    opcode = "nc_match_replace8"
    ctx = context.current(opcode)
    line = context.caller_line()
    n = _top8_source(opcode, line, data, "data")
    _elementwise_operands(opcode, line, dst, data=data)
    _eight(opcode, line, "vals", vals, data.shape[0])
    if dst_idx is not None:
        _eight(opcode, line, "dst_idx", dst_idx, data.shape[0])
        _index_dtype(opcode, line, dst_idx)
    if ctx.numerics:
        values, targets = _f32_2d(data), _f32_2d(vals)
        result = values.copy()
        sentinel = np.iinfo(dst_idx.dtype).max if dst_idx is not None else 0
        positions = np.full(targets.shape, sentinel, dtype=np.int64)
        for p in range(values.shape[0]):
            used = set()
            for k in reversed(range(8)):
                hits = [int(h) for h in np.flatnonzero(values[p] == targets[p, k]) if int(h) not in used]
                if hits:
                    used.add(hits[0])
                    positions[p, k] = hits[0]
                    result[p, hits[0]] = np.float32(imm)
        _write(dst, result)
        if dst_idx is not None:
            _write(dst_idx, positions.astype(dst_idx.dtype))
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, "vector", line, dst, (data, vals), free=n, extra_writes=(dst_idx,))
