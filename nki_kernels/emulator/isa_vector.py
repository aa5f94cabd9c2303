"""`nki.isa` arithmetic beyond the basic element-wise instructions: fused scalar/tensor forms, instructions that
also reduce into the engines' accumulation registers, statistics (bn_stats / bn_aggr) and reciprocal.

Vector Engine accumulation registers (one float32 per partition, shared by tensor_scalar_reduce,
tensor_scalar_cumulative, select_reduce and range_select): `reduce_cmd` resets them to the reduction's identity
(reset_reduce), loads them (load_reduce), keeps them (reduce) or leaves them alone (idle).
"""

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
    _mark_psum,
    _on_chip,
    _operand,
    _operand_value,
    _record,
    _write,
    activation,
)
from .tensor import NkiTensor

# Identity of each reduction the accumulation registers support.
_IDENTITY = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}
_ALU = (
    "add",
    "subtract",
    "multiply",
    "divide",
    "maximum",
    "minimum",
    "power",
    "abs_max",
    "abs_min",
    "fmod",
    "mod",
    "equal",
    "not_equal",
    "less",
    "less_equal",
    "greater",
    "greater_equal",
    "logical_and",
    "logical_or",
    "logical_xor",
)


def _arith(opcode, line, label, op):
    """The name of an arithmetic (non-bitvec) binary ALU operator."""
    name = ops.op_name(op, label)
    if name in ops.BITVEC or name not in ops.BINARY:
        _fail(opcode, line, f"{label} {name} must be an arithmetic ALU operator, one of {list(_ALU)}")
    return name


def _reduction_result(opcode, line, reduce_res, partitions):
    if reduce_res is not None:
        _on_chip(opcode, line, "reduce_res", reduce_res)
        if reduce_res.shape[0] != partitions or _free(reduce_res) != 1:
            _fail(opcode, line, f"reduce_res {reduce_res.describe()} must be [{partitions}, 1]")


def accumulate(ctx, command, reduce_name, values, init=None):
    """Apply reduce_cmd to the Vector Engine registers and fold values [P, F] into them with reduce_name (add,
    multiply, maximum or minimum; float32); returns the registers of values' partitions."""
    registers = ctx.vector_registers[: values.shape[0]]
    if command in (_ReduceCmd.reset, _ReduceCmd.reset_reduce):
        registers[...] = _IDENTITY[reduce_name]
    elif command is _ReduceCmd.load_reduce:
        registers[...] = np.broadcast_to(_operand_value(init), registers.shape)
    if command in (_ReduceCmd.reduce, _ReduceCmd.reset_reduce, _ReduceCmd.load_reduce):
        with np.errstate(all="ignore"):
            folded = ops.REDUCE[reduce_name](values, axis=1, keepdims=True)
            registers[...] = ops.BINARY[reduce_name](registers, folded)
    return registers


def _command(opcode, line, value):
    if not isinstance(value, _ReduceCmd):
        _fail(opcode, line, f"reduce_cmd {value!r} must be a nisa.reduce_cmd")
    return value


def reciprocal(dst, data, name=None):
    """dst = 1 / data element-wise on VectorE (float32 math); SBUF or PSUM, same layout."""
    opcode = "reciprocal"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, data=data)
    if ctx.numerics:
        with np.errstate(all="ignore"):
            _write(dst, np.float32(1) / _f32_2d(data))
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, "vector", line, dst, (data,))


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """dst = (data <op0> operand0) <op1> operand1 on VectorE: operand0 a scalar or [P, 1] vector, operand1 a tile
    shaped like data (data and operand1 not both in PSUM); float32 math, arithmetic operators only."""
    opcode = "scalar_tensor_tensor"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, data=data, operand1=operand1)
    first, second = _arith(opcode, line, "op0", op0), _arith(opcode, line, "op1", op1)
    _operand(opcode, line, "operand0", operand0, data.shape[0])
    if ctx.numerics:
        with np.errstate(all="ignore"):
            a, b = _f32_2d(data), _operand_value(operand0)
            temp = ops.BINARY[first](b, a) if reverse0 else ops.BINARY[first](a, b)
            c = _f32_2d(operand1)
            _write(dst, ops.BINARY[second](c, temp) if reverse1 else ops.BINARY[second](temp, c))
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (data, operand1) + ((operand0,) if isinstance(operand0, NkiTensor) else ())
    _record(ctx, opcode, "vector", line, dst, reads, inputs=(data, operand1))


def tensor_scalar_reduce(
    dst,
    data,
    op0,
    operand0,
    reduce_op,
    reduce_res=None,
    reverse0=False,
    reduce_cmd=_ReduceCmd.reset_reduce,
    reduce_init=None,
    reduce_res_negate=False,
    name=None,
):
    """dst = data <op0> operand0 (VectorE, float32); the registers fold reduce_op (add, multiply, maximum,
    minimum) of each partition's results per reduce_cmd, and reduce_res [P, 1] (negated with
    reduce_res_negate) receives them. A unary op0 takes operand0 None or 0."""
    opcode = "tensor_scalar_reduce"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, data=data)
    partitions = data.shape[0]
    reduce_cmd = _command(opcode, line, reduce_cmd)
    name0 = ops.op_name(op0, "op0")
    if name0 in ops.BITVEC:
        _fail(opcode, line, f"op0 {name0}: bitvec operators are not supported")
    unary = name0 not in ops.BINARY
    if unary:
        ops.unary(op0, "op0")
        if operand0 is not None and not (not isinstance(operand0, NkiTensor) and operand0 == 0):
            _fail(opcode, line, f"op0 {name0} is unary: operand0 must be None or 0, got {operand0!r}")
    else:
        _operand(opcode, line, "operand0", operand0, partitions)
    reduce_name = ops.op_name(reduce_op, "reduce_op")
    if reduce_name not in ("add", "multiply", "maximum", "minimum"):
        _fail(opcode, line, f"reduce_op {reduce_name} must be nl.add, nl.multiply, nl.maximum or nl.minimum")
    if reduce_cmd is _ReduceCmd.load_reduce and reduce_init is None:
        _fail(opcode, line, "reduce_cmd=load_reduce needs reduce_init")
    if reduce_init is not None and reduce_cmd is not _ReduceCmd.load_reduce:
        _fail(opcode, line, "reduce_init is only valid with reduce_cmd=load_reduce")
    if reverse0:
        _fail(opcode, line, "reverse0=True is documented as not supported yet")
    _reduction_result(opcode, line, reduce_res, partitions)
    if ctx.numerics:
        with np.errstate(all="ignore"):
            values = _f32_2d(data)
            result = ops.UNARY[name0](values) if unary else ops.BINARY[name0](values, _operand_value(operand0))
            result = result.astype(np.float32, copy=False)
        _write(dst, result)
        registers = accumulate(ctx, reduce_cmd, reduce_name, result, reduce_init)
        if reduce_res is not None:
            _write(reduce_res, -registers if reduce_res_negate else registers.copy())
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (data,) + tuple(t for t in (operand0, reduce_init) if isinstance(t, NkiTensor))
    _record(ctx, opcode, "vector", line, dst, reads, inputs=(data,), extra_writes=(reduce_res,))


_CUMULATIVE_DTYPES = (
    dtypes.bfloat16,
    dtypes.float16,
    dtypes.float32,
    dtypes.float8_e4m3,
    dtypes.float8_e5m2,
    dtypes.float8_e4m3fn,
    dtypes.uint8,
    dtypes.uint16,
    dtypes.int8,
    dtypes.int16,
)


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=_ReduceCmd.reset_reduce, name=None):
    """Per partition along the flattened free axis: reg = op1(op0(src[i], imm0), reg); dst[i] = reg (VectorE,
    float32). reduce_cmd: reset_reduce starts reg at op1's identity, load_reduce at imm1, reduce continues."""
    opcode = "tensor_scalar_cumulative"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, src=src)
    reduce_cmd = _command(opcode, line, reduce_cmd)
    first = _arith(opcode, line, "op0", op0)
    second = ops.op_name(op1, "op1")
    if second not in _IDENTITY:
        _fail(opcode, line, f"op1 {second} must be add, subtract, multiply, maximum or minimum")
    for label, t in (("dst", dst), ("src", src)):
        if t.dtype not in _CUMULATIVE_DTYPES:
            _fail(opcode, line, f"{label} dtype {t.dtype.name} unsupported (int32/uint32 are not ISA types here)")
    partitions = src.shape[0]
    _operand(opcode, line, "imm0", imm0, partitions, require_f32=True)
    if reduce_cmd is _ReduceCmd.load_reduce:
        if imm1 is None:
            _fail(opcode, line, "reduce_cmd=load_reduce needs imm1 (the accumulator's initial value)")
        _operand(opcode, line, "imm1", imm1, partitions, require_f32=True)
    if ctx.numerics:
        values = _f32_2d(src)
        registers = ctx.vector_registers[:partitions]
        if reduce_cmd in (_ReduceCmd.reset, _ReduceCmd.reset_reduce):
            registers[...] = _IDENTITY[second]
        elif reduce_cmd is _ReduceCmd.load_reduce:
            registers[...] = np.broadcast_to(_operand_value(imm1), registers.shape)
        operand = np.broadcast_to(_operand_value(imm0), (partitions, 1))[:, 0]
        fold = ops.BINARY[second]
        result = np.empty_like(values)
        state = registers[:, 0].copy()
        with np.errstate(all="ignore"):
            scaled = ops.BINARY[first](values, operand[:, None])
            for i in range(values.shape[1]):
                state = fold(scaled[:, i], state)
                result[:, i] = state
        registers[:, 0] = state
        _write(dst, result)
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (src,) + tuple(t for t in (imm0, imm1) if isinstance(t, NkiTensor))
    _record(ctx, opcode, "vector", line, dst, reads, inputs=(src,))


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """nisa.activation with reduce_cmd=reset_reduce: dst = op(data * scale + bias), reduce_res [P, 1] = the
    per-partition sum of dst's values (ScalarE registers)."""
    activation(
        dst,
        op,
        data,
        bias=bias,
        scale=scale,
        reduce_op=reduce_op,
        reduce_res=reduce_res,
        reduce_cmd=_ReduceCmd.reset_reduce,
        name=name,
    )


def bn_stats(dst, data, name=None):
    """Per partition (float32): [count, mean, variance * count] of the even-indexed and of the odd-indexed
    elements of data's flattened free axis (<= 512 = nl.tile_size.bn_stats_fmax); dst has 6 elements each."""
    opcode = "bn_stats"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "data", data)
    n = _free(data)
    if n > 512:
        _fail(opcode, line, f"data {data.describe()} has {n} elements per partition, over bn_stats_fmax (512)")
    if dst.shape[0] != data.shape[0] or _free(dst) != 6:
        _fail(opcode, line, f"dst {dst.describe()} must be [{data.shape[0]}, 6]")
    if ctx.numerics:
        values = _f32_2d(data).astype(np.float64)
        stats = []
        for half in (values[:, 0::2], values[:, 1::2]):
            count = half.shape[1]
            mean = half.mean(axis=1) if count else np.zeros(half.shape[0])
            m2 = ((half - mean[:, None]) ** 2).sum(axis=1) if count else np.zeros(half.shape[0])
            stats += [np.full(half.shape[0], count, dtype=np.float64), mean, m2]
        _write(dst, np.stack(stats, axis=1).astype(np.float32))
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, "vector", line, dst, (data,), free=n)


def bn_aggr(dst, data, name=None):
    """Per partition: the mean and variance (population) combined from data's (count, mean, variance * count)
    triples (bn_stats outputs; elements per partition a multiple of 3); dst has 2 elements each."""
    opcode = "bn_aggr"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "data", data)
    n = _free(data)
    if n % 3:
        _fail(
            opcode,
            line,
            f"data {data.describe()} must hold (count, mean, variance*count) triples: elements per "
            f"partition a multiple of 3, got {n}",
        )
    if dst.shape[0] != data.shape[0] or _free(dst) != 2:
        _fail(opcode, line, f"dst {dst.describe()} must be [{data.shape[0]}, 2]")
    if ctx.numerics:
        triples = _f32_2d(data).astype(np.float64).reshape(data.shape[0], -1, 3)
        count, mean, m2 = triples[..., 0], triples[..., 1], triples[..., 2]
        total = count.sum(axis=1)
        with np.errstate(all="ignore"):
            grand = (count * mean).sum(axis=1) / total
            variance = (m2 + count * (mean - grand[:, None]) ** 2).sum(axis=1) / total
        _write(dst, np.stack([grand, variance], axis=1).astype(np.float32))
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, "vector", line, dst, (data,), free=n)
