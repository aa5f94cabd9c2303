"""The core of `nki.isa` on the CPU (copies, fills and the elementwise engines) and the checks and records every
instruction shares; `isa.py` is the public namespace that gathers it with the other instruction modules.

Every instruction checks the documented hardware rules (raising NkiHardwareError that names the
instruction and the kernel line), computes its result in float32 as the engines do (unless numerics are
off in count-only mode), rounds into the destination dtype, and appends one trace.InstructionRecord.
"""

from __future__ import annotations

import math

import numpy as np

from . import context, dtypes, ops
from .errors import NkiHardwareError
from .isa_constants import dge_mode, engine, nc_version, oob_mode, reduce_cmd
from .tensor import PSUM_BY_OTHER, PSUM_ZEROED, NkiTensor
from .trace import InstructionRecord

_Engine = engine  # instructions take a parameter named `engine`
_OobMode = oob_mode
_ReduceCmd = reduce_cmd
_DgeMode = dge_mode  # instructions take a parameter named `dge_mode`

tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown

NkiValidationError = NkiHardwareError


def get_nc_version():
    return nc_version.gen2 if context.resolve_target() == "trn1" else nc_version.gen3


# -- shared helpers --------------------------------------------------------------------------------


def _fail(opcode, line, message):
    raise NkiHardwareError(f"{opcode} at {line}: {message}")


def _tensor(opcode, line, name, value):
    if not isinstance(value, NkiTensor):
        raise TypeError(f"{opcode} at {line}: {name} must be an NKI tensor, got {type(value).__name__}")
    return value


def _on_chip(opcode, line, name, t, kinds=("sbuf", "psum"), compute_engine=True):
    """Checks that t is an on-chip tile of at most 128 partitions; a compute-engine operand (not a DMA one) must
    also be placed as the engines can stream it (_partition_placement)."""
    _tensor(opcode, line, name, t)
    if t.storage.kind not in kinds:
        _fail(opcode, line, f"{name} {t.describe()} must be in {' or '.join(kinds).upper()}")
    if t.shape[0] > context.PMAX:
        _fail(opcode, line, f"{name} {t.describe()} spans {t.shape[0]} partitions, over {context.PMAX}")
    if compute_engine:
        _partition_placement(opcode, line, name, t)


def _partition_placement(opcode, line, name, t):
    """Checks the partitions a compute engine (Tensor/Vector/Scalar/GpSimd) reads or writes of the on-chip tile t.

    Architecture guide (Trainium/Inferentia2), "Accessing SBUF/PSUM tensors using compute engines": no striding
    along the partition dimension, so a tile occupies consecutive partitions; and its start partition depends on
    how many it occupies: over 64 must start at 0, 33 to 64 at 0 or 64, 1 to 32 at 0, 32, 64 or 96 (the same
    rule as nki.isa.nc_stream_shuffle's start partitions). DMA engines are not bound by either.
    """
    part_stride = t.part_stride
    count = t.shape[0]
    if count > 1 and t.strides[0] != part_stride:
        _fail(
            opcode,
            line,
            f"{name} {t.describe()} steps {t.strides[0]} elements from one partition row to the "
            f"next, expected {part_stride}: compute engines access consecutive partitions (no "
            f"striding along the partition dimension)",
        )
    start = t.offset // part_stride
    alignment = 128 if count > 64 else 64 if count > 32 else 32
    if start % alignment:
        allowed = "0" if count > 64 else "0 or 64" if count > 32 else "0, 32, 64 or 96"
        _fail(
            opcode,
            line,
            f"{name} {t.describe()} starts at partition {start}; a tile of {count} partitions "
            f"must start at partition {allowed}",
        )


def _free(t):
    return math.prod(t.shape[1:])


def _same_layout(opcode, line, dst, src, src_name):
    if dst.shape[0] != src.shape[0] or _free(dst) != _free(src):
        _fail(
            opcode,
            line,
            f"dst {dst.describe()} and {src_name} {src.describe()} must have the same partition "
            f"count and elements per partition",
        )


def _elementwise_operands(opcode, line, dst, **inputs):
    """Checks an element-wise instruction's dst and inputs (name=tensor, in argument order): all on chip, each
    input laid out like dst, and two inputs not both in PSUM."""
    _on_chip(opcode, line, "dst", dst)
    for name, t in inputs.items():
        _on_chip(opcode, line, name, t)
    for name, t in inputs.items():
        _same_layout(opcode, line, dst, t, name)
    if len(inputs) == 2 and all(t.storage.kind == "psum" for t in inputs.values()):
        _fail(opcode, line, f"{' and '.join(inputs)} cannot both be in PSUM")


def _f32_2d(t):
    a = t.array()
    return a.reshape(a.shape[0], -1).astype(np.float32)


def _write(dst, values):
    """Store float32 (or exact) values into dst, rounding to dst.dtype; integers round to nearest and saturate."""
    if values.shape != dst.shape:
        values = values.reshape(dst.shape)
    if not dtypes.is_float(dst.dtype) and dst.dtype != dtypes.bool_ and dtypes.is_float(values.dtype):
        info = np.iinfo(dst.dtype)
        with np.errstate(invalid="ignore"):
            values = np.clip(np.rint(np.nan_to_num(values)), info.min, info.max)
    with np.errstate(invalid="ignore", over="ignore"):
        dst.write(values.astype(dst.dtype) if dst.gather is not None else values)


def _mark_psum(dst, state):
    if dst.storage.kind == "psum":
        dst.psum_state()[...] = state


def _inner_contiguous(t):
    return t.shape[-1] == 1 or t.strides[-1] == 1


def _record(
    ctx,
    opcode,
    engine_name,
    line,
    dst,
    reads,
    matmul=None,
    dma=None,
    partitions=None,
    free=None,
    inputs=None,
    extra_writes=(),
):
    """Append the instruction's record; `inputs` are its input data tensors (default: all of `reads`);
    `extra_writes` are tensors it writes besides dst (None entries skipped)."""
    ctx.check_capacity(opcode, line)
    inputs = reads if inputs is None else inputs
    ctx.run.records.append(
        InstructionRecord(
            opcode,
            engine_name,
            line,
            dst.shape[0] if partitions is None else partitions,
            _free(dst) if free is None else free,
            dtypes.NAME[dst.dtype],
            tuple(r.access() for r in reads),
            (dst.access(),) + tuple(t.access() for t in extra_writes if t is not None),
            matmul,
            dma,
            tuple(dtypes.NAME[t.dtype] for t in inputs),
            _inner_contiguous(dst) and all(_inner_contiguous(t) for t in inputs),
        )
    )


def _engine_name(requested, default, opcode, line, allowed):
    if requested is None or requested is engine.unknown:
        return default
    if not isinstance(requested, engine) or requested.name not in allowed:
        _fail(opcode, line, f"engine {requested!r} cannot run {opcode}; expected one of {allowed}")
    return requested.name


def _gpsimd_psum(opcode, line, engine_name, *tensors):
    if engine_name == "gpsimd" and any(isinstance(t, NkiTensor) and t.storage.kind == "psum" for t in tensors):
        _fail(opcode, line, "GpSimd engine cannot access PSUM")


def _integer(dtype):
    return not dtypes.is_float(dtype) and dtype != dtypes.bool_


def _require_integer(opcode, line, op_label, **tensors):
    """Bitvec operators treat elements as bit patterns: every tensor involved must have an integer dtype."""
    for label, t in tensors.items():
        if isinstance(t, NkiTensor) and not _integer(t.dtype):
            _fail(opcode, line, f"{op_label} is a bitvec operator: {label} {t.describe()} must have an integer dtype")


def _int_2d(t):
    a = t.array()
    return a.reshape(a.shape[0], -1)


def _operand(opcode, line, name, value, partitions, require_f32=False):
    """A scalar constant, or a [P, 1] on-chip vector, as something that broadcasts against [P, F]."""
    if isinstance(value, NkiTensor):
        _on_chip(opcode, line, name, value)
        if value.shape[0] != partitions or _free(value) != 1:
            _fail(opcode, line, f"{name} {value.describe()} must be a scalar or a [{partitions}, 1] vector")
        if require_f32 and value.dtype != dtypes.float32:
            _fail(opcode, line, f"{name} {value.describe()} must be float32")
        return value
    if isinstance(value, (bool, int, float, np.number)):
        return value
    raise TypeError(f"{opcode} at {line}: {name} must be a number or an NKI tensor, got {type(value).__name__}")


def _operand_value(value):
    if isinstance(value, NkiTensor):
        return _f32_2d(value)
    return np.float32(value)


# -- on-chip copies and fills ---------------------------------------------------------------------


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """dst = src between SBUF/PSUM tiles (same partitions and elements per partition), casting via float32."""
    opcode = "tensor_copy"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, src=src)
    engine_name = _engine_name(engine, "vector", opcode, line, ("vector", "scalar", "gpsimd"))
    if engine_name == "scalar" and ctx.target == "trn1":
        _fail(
            opcode, line, "NeuronCore-v2 (trn1) Scalar Engine has no tensor_copy; use nisa.activation with op=nl.copy"
        )
    _gpsimd_psum(opcode, line, engine_name, dst, src)
    if ctx.numerics:
        values = src.array()
        if values.dtype != dst.dtype:
            values = values.astype(np.float32)
        _write(dst, values)
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, engine_name, line, dst, (src,))


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill dst (SBUF or PSUM) with the constant `value`."""
    opcode = "memset"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    engine_name = _engine_name(engine, "vector", opcode, line, ("vector", "gpsimd"))
    _gpsimd_psum(opcode, line, engine_name, dst)
    if not isinstance(value, (bool, int, float, np.number)):
        raise TypeError(f"{opcode} at {line}: value must be a number, got {type(value).__name__}")
    if _integer(dst.dtype) and isinstance(value, (float, np.floating)):
        _fail(
            opcode,
            line,
            f"value {value!r} is a float but dst {dst.describe()} is an integer tile; pass an "
            f"integer literal (NKI 0.3+ matches types strictly)",
        )
    if ctx.numerics:
        _write(dst, np.full(dst.shape, value, dtype=np.float32 if dtypes.is_float(dst.dtype) else dst.dtype))
    _mark_psum(dst, PSUM_ZEROED if value == 0 else PSUM_BY_OTHER)
    _record(ctx, opcode, engine_name, line, dst, ())


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, i...] = offset + p * channel_multiplier + sum(i_k * step_k) over the [[step, num], ...] pattern."""
    opcode = "iota"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst, kinds=("sbuf",))
    if not 1 <= len(pattern) <= 4:
        _fail(opcode, line, f"pattern {pattern} must have 1 to 4 [step, num] pairs")
    counts = [int(n) for _, n in pattern]
    if math.prod(counts) != _free(dst):
        _fail(opcode, line, f"pattern {pattern} has {math.prod(counts)} elements, dst has {_free(dst)} per partition")
    if ctx.numerics:
        values = np.zeros(counts, dtype=np.int64)
        for axis, (step, n) in enumerate(pattern):
            shape = [1] * len(counts)
            shape[axis] = n
            values = values + np.arange(n, dtype=np.int64).reshape(shape) * int(step)
        channel = np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier)
        values = (int(offset) + channel + values.reshape(1, -1)).astype(np.int32)
        _write(dst, values if not dtypes.is_float(dst.dtype) else values.astype(np.float32))
    _record(ctx, opcode, "gpsimd", line, dst, ())


# -- Vector / Scalar / GpSimd compute --------------------------------------------------------------

_INT32 = (dtypes.int32, dtypes.uint32)
# Arithmetic that GpSimd does natively on 32-bit integers (exact, wrapping like the hardware's int32 ALU).
_NATIVE_INT = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "maximum": np.maximum,
    "minimum": np.minimum,
}


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """dst = data1 <op> data2 element-wise (same partitions and elements per partition).

    Arithmetic runs in float32, except that all-int32/uint32 operands default to GpSimd's native integer math
    (Vector Engine when a tile is in PSUM); bitvec operators need integer tiles and work on the bit patterns.
    """
    opcode = "tensor_tensor"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, data1=data1, data2=data2)
    name_ = ops.op_name(op)
    fn = ops.binary(op)
    bitvec = name_ in ops.BITVEC
    if bitvec:
        _require_integer(opcode, line, f"op {name_}", dst=dst, data1=data1, data2=data2)
    any_psum = "psum" in (dst.storage.kind, data1.storage.kind, data2.storage.kind)
    all_int32 = dst.dtype in _INT32 and data1.dtype in _INT32 and data2.dtype in _INT32
    default = "gpsimd" if name_ == "power" or (all_int32 and not bitvec and not any_psum) else "vector"
    engine_name = _engine_name(engine, default, opcode, line, ("vector", "gpsimd"))
    _gpsimd_psum(opcode, line, engine_name, dst, data1, data2)
    if ctx.numerics:
        if bitvec:
            result = fn(_int_2d(data1), _int_2d(data2))
        elif all_int32 and engine_name == "gpsimd" and name_ in _NATIVE_INT:
            result = _NATIVE_INT[name_](_int_2d(data1).astype(np.int64), _int_2d(data2).astype(np.int64))
            result = result.astype(dst.dtype)  # two's-complement wrap
        else:
            with np.errstate(all="ignore"):
                result = fn(_f32_2d(data1), _f32_2d(data2))
        _write(dst, result)
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, engine_name, line, dst, (data1, data2))


def _scalar_op_kind(opcode, line, label, op, operand):
    """'unary', 'bitvec' or 'arithmetic' for a tensor_scalar operator (and check its operand)."""
    name_ = ops.op_name(op, label)
    if name_ in ops.BINARY:
        return name_, ("bitvec" if name_ in ops.BITVEC else "arithmetic")
    ops.unary(op, label)  # raises for names that are neither
    if operand is not None and not (not isinstance(operand, NkiTensor) and operand == 0):
        _fail(opcode, line, f"{label} {name_} is unary: its operand must be None or 0, got {operand!r}")
    return name_, ("bitvec" if name_ in ops.BITVEC else "unary")


# Scalar Engine's tensor_scalar on NeuronCore-v3 supports only these (op0, op1) pairs.
_TRN2_SCALAR_PAIRS = {("multiply", "add"), ("multiply", None), ("add", None)}


def _apply_scalar_op(name_, kind, values, operand, reverse):
    if kind in ("unary", "bitvec") and name_ not in ops.BINARY:
        return ops.UNARY[name_](values)
    fn = ops.BINARY[name_]
    if kind == "bitvec":
        operand = _int_2d(operand) if isinstance(operand, NkiTensor) else np.asarray(operand, values.dtype)
    else:
        operand = _operand_value(operand)
    return fn(operand, values) if reverse else fn(values, operand)


def tensor_scalar(
    dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, engine=engine.unknown, name=None
):
    """dst = (data <op0> operand0) <op1> operand1; operands are scalars or [P, 1] vectors (SBUF or PSUM).

    reverse0/1 put the operand on the left. Arithmetic runs in float32 with float32 vector operands; bitvec
    operators (both ops must then be bitvec) need integer tiles, work on bit patterns and run on VectorE.
    A unary op0/op1 (nl.abs, ...) takes operand None or 0.
    """
    opcode = "tensor_scalar"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, data=data)
    partitions = data.shape[0]
    if op1 is None and operand1 is not None:
        _fail(opcode, line, "operand1 given without op1 (both must be None when unused)")
    steps = [(op0, operand0, reverse0, "op0", "operand0")]
    if op1 is not None:
        steps.append((op1, operand1, reverse1, "op1", "operand1"))
    kinds = []
    for op, operand, _, op_label, operand_label in steps:
        name_, kind = _scalar_op_kind(opcode, line, op_label, op, operand)
        if name_ in ops.BINARY:
            _operand(opcode, line, operand_label, operand, partitions, require_f32=kind == "arithmetic")
        kinds.append((name_, kind))
    bitvec = [kind == "bitvec" for _, kind in kinds]
    if any(bitvec) and not all(bitvec):
        _fail(opcode, line, f"op0 and op1 must both be bitvec or both arithmetic, got {[name_ for name_, _ in kinds]}")
    if any(bitvec):
        _require_integer(opcode, line, f"op {kinds[0][0]}", dst=dst, data=data, operand0=operand0, operand1=operand1)
    engine_name = _engine_name(engine, "vector", opcode, line, ("vector", "scalar", "gpsimd"))
    if any(bitvec) and engine_name != "vector":
        _fail(opcode, line, f"bitvec operators run on the Vector Engine only, not {engine_name}")
    if engine_name == "scalar" and ctx.target == "trn2":
        pair = (kinds[0][0], kinds[1][0] if len(kinds) > 1 else None)
        if pair not in _TRN2_SCALAR_PAIRS:
            _fail(
                opcode,
                line,
                f"Scalar Engine on trn2 supports op0/op1 = multiply/add, multiply/None or "
                f"add/None only, got {pair[0]}/{pair[1]}",
            )
    _gpsimd_psum(opcode, line, engine_name, dst, data, operand0, operand1)
    if ctx.numerics:
        result = _int_2d(data) if any(bitvec) else _f32_2d(data)
        with np.errstate(all="ignore"):
            for (op, operand, reverse, _, _), (name_, kind) in zip(steps, kinds):
                result = _apply_scalar_op(name_, kind, result, operand, reverse)
        _write(dst, result)
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (data,) + tuple(o for o in (operand0, operand1) if isinstance(o, NkiTensor))
    _record(ctx, opcode, engine_name, line, dst, reads, inputs=(data,))


def _reduce_axes(opcode, line, data, axis):
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(int(a) % data.ndim for a in axes))
    if not axes or axes[0] == 0:
        _fail(opcode, line, f"axis {axis}: the partition dimension (0) cannot be reduced")
    if axes != tuple(range(axes[0], data.ndim)):
        _fail(opcode, line, f"axis {axis} must be the last contiguous free dimension(s) of {data.describe()}")
    return axes


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """dst = reduce(op) of data over its last free axes, optionally negated (arithmetic ops only).

    Arithmetic reductions run in float32; bitvec reductions need integer tiles and work on bit patterns.
    keepdims=True leaves the reduced axes in dst as size 1 (dst may then be shaped either way: only the
    partition count and the elements per partition must agree).
    """
    opcode = "tensor_reduce"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "data", data)
    axes = _reduce_axes(opcode, line, data, axis)
    kept = math.prod(data.shape[1 : axes[0]])
    if dst.shape[0] != data.shape[0] or _free(dst) != kept:
        _fail(
            opcode,
            line,
            f"dst {dst.describe()} must have {data.shape[0]} partitions and {kept} elements per "
            f"partition after reducing axes {axes} of {data.describe()}",
        )
    fn = ops.reduction(op)
    bitvec = ops.op_name(op) in ops.BITVEC
    if bitvec:
        _require_integer(opcode, line, f"op {ops.op_name(op)}", dst=dst, data=data)
        if negate:
            _fail(opcode, line, f"negate=True applies to arithmetic reductions only, not {ops.op_name(op)}")
    if ctx.numerics:
        values = data.array() if bitvec else data.array().astype(np.float32)
        with np.errstate(all="ignore"):
            result = fn(values, axis=axes)
        if negate:
            result = -result
        _write(dst, result)
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, "vector", line, dst, (data,), free=_free(data))


# The functions ScalarE's activation evaluates: table "Supported Activation Functions by NKI ISA" (NKI ISA common
# fields). The table also lists nl.prelu, which the emulator does not implement (an activate2 function of
# NeuronCore-v4); other unary operators (nl.floor, nl.cos, nl.negative, ...) are not activations.
_ACTIVATION_FUNCTIONS = frozenset(
    (
        "copy",
        "square",
        "sigmoid",
        "relu",
        "gelu",
        "gelu_dx",
        "gelu_apprx_tanh",
        "gelu_apprx_sigmoid",
        "gelu_apprx_sigmoid_dx",
        "silu",
        "silu_dx",
        "tanh",
        "softplus",
        "mish",
        "erf",
        "erf_dx",
        "exp",
        "log",
        "sin",
        "arctan",
        "sqrt",
        "rsqrt",
        "reciprocal",
        "sign",
        "abs",
    )
)


def activation(
    dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None
):
    """dst = op(data * scale + bias) on ScalarE in float32; bias a [P, 1] vector (or scalar), scale scalar or [P, 1].

    With reduce_res, the per-partition sum of the activated values is written to reduce_res [P, 1]
    (reduce_op must be nl.add), accumulated over the engine's reduce registers per reduce_cmd.
    """
    opcode = "activation"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, data=data)
    partitions = data.shape[0]
    name_ = ops.op_name(op)
    if name_ not in _ACTIVATION_FUNCTIONS:
        _fail(
            opcode,
            line,
            f"op {name_} is not an activation function of the Scalar Engine; expected one of "
            f"{sorted(_ACTIVATION_FUNCTIONS)}",
        )
    fn = ops.unary(op)
    _operand(opcode, line, "scale", scale, partitions, require_f32=True)
    if bias is not None:
        _operand(opcode, line, "bias", bias, partitions)
        if not isinstance(bias, NkiTensor) and ctx.target == "trn1":
            _fail(
                opcode,
                line,
                f"bias={bias!r}: NeuronCore-v2 (trn1) needs bias as a [{partitions}, 1] vector; "
                f"a scalar bias needs NeuronCore-v3 or newer",
            )
    if reduce_op is not None and ops.op_name(reduce_op, "reduce_op") != "add":
        _fail(opcode, line, f"reduce_op must be nl.add, got {ops.op_name(reduce_op)}")
    if reduce_res is not None:
        _on_chip(opcode, line, "reduce_res", reduce_res)
        if reduce_res.shape[0] != partitions or _free(reduce_res) != 1:
            _fail(opcode, line, f"reduce_res {reduce_res.describe()} must be [{partitions}, 1]")
    if ctx.numerics:
        values = _f32_2d(data)
        with np.errstate(all="ignore"):
            values = values * _operand_value(scale)
            if bias is not None:
                values = values + _operand_value(bias)
            result = fn(values).astype(np.float32, copy=False)
        _write(dst, result)
        registers = ctx.activation_registers
        if reduce_cmd in (_ReduceCmd.reset, _ReduceCmd.reset_reduce):
            registers[...] = 0
        if reduce_op is not None and reduce_cmd in (_ReduceCmd.reduce, _ReduceCmd.reset_reduce):
            registers[:partitions] += result.sum(axis=1, keepdims=True)
        if reduce_res is not None:
            _write(reduce_res, registers[:partitions].copy())
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (data,) + tuple(o for o in (bias, scale) if isinstance(o, NkiTensor))
    _record(ctx, opcode, "scalar", line, dst, reads, inputs=(data,), extra_writes=(reduce_res,))


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition along the (flattened) free axis: r[i] = (data0[i] <op0> r[i-1]) <op1> data1[i], r[-1] = initial."""
    opcode = "tensor_tensor_scan"
    ctx = context.current(opcode)
    line = context.caller_line()
    _elementwise_operands(opcode, line, dst, data0=data0, data1=data1)
    _operand(opcode, line, "initial", initial, data0.shape[0])
    first, second = ops.binary(op0, "op0"), ops.binary(op1, "op1")
    if ctx.numerics:
        a, b = _f32_2d(data0), _f32_2d(data1)
        result = np.empty_like(a)
        state = np.broadcast_to(_operand_value(initial), (a.shape[0], 1))[:, 0].astype(np.float32)
        with np.errstate(all="ignore"):
            for i in range(a.shape[1]):
                state = first(state, a[:, i]) if reverse0 else first(a[:, i], state)
                state = second(b[:, i], state) if reverse1 else second(state, b[:, i])
                result[:, i] = state
        _write(dst, result)
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (data0, data1) + ((initial,) if isinstance(initial, NkiTensor) else ())
    _record(ctx, opcode, "vector", line, dst, reads)
