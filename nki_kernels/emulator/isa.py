"""`nki.isa` on the CPU: dst-first ISA instructions over emulator tensors.

Every instruction checks the documented hardware rules (raising NkiHardwareError that names the
instruction and the kernel line), computes its result in float32 as the engines do (unless numerics are
off in count-only mode), rounds into the destination dtype, and appends one trace.InstructionRecord.
"""

from __future__ import annotations

import enum
import math

import numpy as np

from . import context
from . import dtypes
from . import ops
from .errors import NkiHardwareError
from .tensor import PSUM_BY_MATMUL, PSUM_BY_OTHER, PSUM_UNWRITTEN, NkiTensor
from .trace import DmaInfo, InstructionRecord, MatmulInfo


class engine(enum.Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


_ReduceCmd = reduce_cmd


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class nc_version(enum.Enum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


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


def _on_chip(opcode, line, name, t, kinds=("sbuf", "psum")):
    _tensor(opcode, line, name, t)
    if t.storage.kind not in kinds:
        _fail(opcode, line, f"{name} {t.describe()} must be in {' or '.join(kinds).upper()}")
    if t.shape[0] > context.PMAX:
        _fail(opcode, line, f"{name} {t.describe()} spans {t.shape[0]} partitions, over {context.PMAX}")


def _free(t):
    return math.prod(t.shape[1:])


def _same_layout(opcode, line, dst, src, src_name):
    if dst.shape[0] != src.shape[0] or _free(dst) != _free(src):
        _fail(opcode, line, f"dst {dst.describe()} and {src_name} {src.describe()} must have the same partition "
                            f"count and elements per partition")


def _f32_2d(t):
    a = t.array()
    return a.reshape(a.shape[0], -1).astype(np.float32)


def _write(dst, values):
    """Store float32 (or exact) values into dst, rounding to dst.dtype; integers round to nearest and saturate."""
    arr = dst.array()
    if values.shape != arr.shape:
        values = values.reshape(arr.shape)
    if not dtypes.is_float(dst.dtype) and dst.dtype != dtypes.bool_ and dtypes.is_float(values.dtype):
        info = np.iinfo(dst.dtype)
        with np.errstate(invalid="ignore"):
            values = np.clip(np.rint(np.nan_to_num(values)), info.min, info.max)
    with np.errstate(invalid="ignore", over="ignore"):
        arr[...] = values


def _mark_psum(dst, state):
    if dst.storage.kind == "psum":
        dst.psum_state()[...] = state


def _record(ctx, opcode, engine_name, line, dst, reads, matmul=None, dma=None, partitions=None, free=None):
    ctx.check_capacity(opcode, line)
    ctx.run.records.append(InstructionRecord(
        opcode, engine_name, line,
        dst.shape[0] if partitions is None else partitions,
        _free(dst) if free is None else free,
        dtypes.NAME[dst.dtype],
        tuple(r.access() for r in reads),
        (dst.access(),),
        matmul, dma))


def _engine_name(requested, default, opcode, line, allowed):
    if requested is None or requested is engine.unknown:
        return default
    if not isinstance(requested, engine) or requested.name not in allowed:
        _fail(opcode, line, f"engine {requested!r} cannot run {opcode}; expected one of {allowed}")
    return requested.name


def _gpsimd_psum(opcode, line, engine_name, *tensors):
    if engine_name == "gpsimd" and any(isinstance(t, NkiTensor) and t.storage.kind == "psum" for t in tensors):
        _fail(opcode, line, "GpSimd engine cannot access PSUM")


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


# -- data movement ---------------------------------------------------------------------------------

def _dma_info(dst, src, transpose=False):
    hbm_side = [t for t in (src, dst) if t.storage.kind == "hbm"] or [dst]
    return DmaInfo(nbytes=dst.size * dst.dtype.itemsize, src_buffer=src.storage.kind, dst_buffer=dst.storage.kind,
                   contiguous_bytes=min(t.contiguous_bytes() for t in hbm_side), transpose=transpose)


def _dma_partitions(dst, src):
    on_chip = dst if dst.storage.kind != "hbm" else src if src.storage.kind != "hbm" else None
    return (on_chip.shape[0], _free(on_chip)) if on_chip is not None else (1, dst.size)


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """dst = src by DMA (HBM/SBUF either side); dtypes convert through float32; element counts must match."""
    opcode = "dma_copy"
    ctx = context.current(opcode)
    line = context.caller_line()
    _tensor(opcode, line, "dst", dst)
    _tensor(opcode, line, "src", src)
    for label, t in (("dst", dst), ("src", src)):
        if t.storage.kind == "psum":
            _fail(opcode, line, f"{label} {t.describe()}: DMA cannot access PSUM (use nisa.tensor_copy)")
        if t.storage.kind == "sbuf" and t.shape[0] > context.PMAX:
            _fail(opcode, line, f"{label} {t.describe()} spans {t.shape[0]} partitions, over {context.PMAX}")
    if dst.size != src.size:
        _fail(opcode, line, f"element counts differ: dst {dst.describe()} has {dst.size}, "
                            f"src {src.describe()} has {src.size}")
    if ctx.numerics:
        values = src.array()
        if values.dtype != dst.dtype:
            values = values.astype(np.float32)
        _write(dst, values)
    partitions, free = _dma_partitions(dst, src)
    _record(ctx, opcode, "dma", line, dst, (src,), dma=_dma_info(dst, src), partitions=partitions, free=free)


_DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """dst = src permuted ((1,0), (2,1,0) or (3,1,2,0)) by DMA; dst in SBUF, src in HBM or SBUF, same dtype."""
    opcode = "dma_transpose"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst, kinds=("sbuf",))
    _tensor(opcode, line, "src", src)
    if src.storage.kind == "psum":
        _fail(opcode, line, f"src {src.describe()} must be in HBM or SBUF")
    default = _DMA_TRANSPOSE_AXES.get(src.ndim)
    if default is None:
        _fail(opcode, line, f"src {src.describe()} must be 2-D, 3-D or 4-D")
    axes = default if axes is None else tuple(axes)
    if axes != default:
        _fail(opcode, line, f"axes {axes} unsupported for a {src.ndim}-D src; expected {default}")
    if dst.dtype != src.dtype:
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must equal src dtype {src.dtype.name}")
    expected = tuple(src.shape[a] for a in axes)
    if dst.shape != expected:
        _fail(opcode, line, f"dst {dst.describe()} must have shape {list(expected)} (src {list(src.shape)} "
                            f"permuted by {axes})")
    if ctx.numerics:
        _write(dst, np.transpose(src.array(), axes))
    _record(ctx, opcode, "dma", line, dst, (src,), dma=_dma_info(dst, src, transpose=True))


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """dst = src between SBUF/PSUM tiles (same partitions and elements per partition), casting via float32."""
    opcode = "tensor_copy"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "src", src)
    _same_layout(opcode, line, dst, src, "src")
    engine_name = _engine_name(engine, "vector", opcode, line, ("vector", "scalar", "gpsimd"))
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
    if ctx.numerics:
        _write(dst, np.full(dst.shape, value, dtype=np.float32 if dtypes.is_float(dst.dtype) else dst.dtype))
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, engine_name, line, dst, ())


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, i...] = offset + p * channel_multiplier + sum(i_k * step_k) over the [[step, num], ...] pattern."""
    opcode = "iota"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst, kinds=("sbuf",))
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


# -- TensorE ---------------------------------------------------------------------------------------

def _psum_bank_check(opcode, line, dst):
    access = dst.access()
    if access.b_start // context.PSUM_BANK_BYTES != (access.b_stop - 1) // context.PSUM_BANK_BYTES:
        _fail(opcode, line, f"dst {dst.describe()} covers PSUM bytes {access.b_start}..{access.b_stop} of each "
                            f"partition, crossing a 2 KiB bank boundary (one output tile must fit one bank)")


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """dst[M, N] (PSUM, fp32) = stationary[K, M].T @ moving[K, N]; K <= 128, M <= 128, N <= 512.

    accumulate=False overwrites, True adds onto a location written by an earlier matmul, None decides per
    location (first matmul write overwrites, later ones add). Adding onto PSUM never written by a matmul, or
    written by another instruction (memset, tensor_copy, ...), is undefined on trn1/trn2 and raises.
    """
    opcode = "nc_matmul"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "stationary", stationary, kinds=("sbuf",))
    _on_chip(opcode, line, "moving", moving, kinds=("sbuf",))
    _on_chip(opcode, line, "dst", dst, kinds=("psum",))
    contraction = stationary.shape[0]
    if moving.shape[0] != contraction:
        _fail(opcode, line, f"stationary {stationary.describe()} and moving {moving.describe()} must have the same "
                            f"partition (contraction) size")
    stationary_free, moving_free = _free(stationary), _free(moving)
    row_limit, column_limit = (tuple(tile_size) if tile_size else (context.PMAX, context.PMAX))
    if contraction > row_limit:
        _fail(opcode, line, f"contraction (partition) size {contraction} exceeds {row_limit}")
    if stationary_free > column_limit:
        _fail(opcode, line, f"stationary free size {stationary_free} exceeds {column_limit} "
                            f"(nl.tile_size.gemm_stationary_fmax)")
    if moving_free > 512:
        _fail(opcode, line, f"moving free size {moving_free} exceeds 512 (nl.tile_size.gemm_moving_fmax)")
    if dst.shape[0] != stationary_free or _free(dst) != moving_free:
        _fail(opcode, line, f"dst {dst.describe()} must be [{stationary_free}, {moving_free}] "
                            f"(stationary free x moving free)")
    for label, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in dtypes.MATMUL_INPUT and not is_transpose:
            _fail(opcode, line, f"{label} dtype {t.dtype.name} is not a TensorE input type "
                                f"(float8_e4m3, float8_e5m2, bfloat16, float16, tfloat32, float32)")
    if (stationary.dtype == dtypes.float32) != (moving.dtype == dtypes.float32) and not is_transpose:
        _fail(opcode, line, f"stationary {stationary.dtype.name} and moving {moving.dtype.name}: if one operand is "
                            f"float32 the other must be too")
    if dst.dtype != dtypes.float32 and not (is_transpose and dst.dtype == stationary.dtype):
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must be float32 on trn1/trn2")
    _psum_bank_check(opcode, line, dst)
    state = dst.psum_state()
    if accumulate is None:
        written = state == PSUM_BY_MATMUL
        n_written = np.count_nonzero(written)
        accumulate_mask = None if n_written == 0 else (True if n_written == written.size else written)
        if n_written != written.size and np.count_nonzero(state == PSUM_BY_OTHER):
            _fail(opcode, line, f"dst {dst.describe()}: PSUM written by a non-matmul instruction (memset, "
                                f"tensor_copy, ...) cannot be accumulated onto (undefined on trn1/trn2); "
                                f"pass accumulate=False to overwrite")
    elif accumulate:
        if np.count_nonzero(state == PSUM_BY_MATMUL) != state.size:
            _fail(opcode, line, f"accumulate=True onto dst {dst.describe()} whose PSUM locations were not first "
                                f"written by nc_matmul (undefined on trn1/trn2)")
        accumulate_mask = True
    else:
        accumulate_mask = None
    if ctx.numerics:
        product = _f32_2d(stationary).T @ _f32_2d(moving)
        if accumulate_mask is not None:
            current = dst.array().reshape(product.shape).astype(np.float32)
            product = current + product if accumulate_mask is True else np.where(accumulate_mask.reshape(
                product.shape), current + product, product)
        _write(dst, product)
    state[...] = PSUM_BY_MATMUL
    info = MatmulInfo(contraction, stationary_free, moving_free, dtypes.NAME[moving.dtype], bool(is_transpose))
    _record(ctx, opcode, "tensor", line, dst, (stationary, moving), matmul=info, partitions=contraction,
            free=moving_free)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst[F, P] = data[P, F] (free dims flattened); TensorE: SBUF -> PSUM, <= 128x128; VectorE: <= 32x32."""
    opcode = "nc_transpose"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "data", data)
    _on_chip(opcode, line, "dst", dst)
    if engine is engine.unknown or engine is None:
        engine_name = "tensor" if (dst.storage.kind == "psum" and data.storage.kind == "sbuf") else "vector"
    else:
        engine_name = _engine_name(engine, "tensor", opcode, line, ("tensor", "vector"))
    rows, cols = data.shape[0], _free(data)
    limit = 128 if engine_name == "tensor" else 32
    if rows > limit or cols > limit:
        _fail(opcode, line, f"data {data.describe()} is {rows}x{cols}, over the {limit}x{limit} that "
                            f"{engine_name} engine transposes")
    if engine_name == "tensor" and (data.storage.kind != "sbuf" or dst.storage.kind != "psum"):
        _fail(opcode, line, "Tensor Engine transpose reads SBUF and writes PSUM")
    if dst.shape[0] != cols or _free(dst) != rows:
        _fail(opcode, line, f"dst {dst.describe()} must be [{cols}, {rows}] for data {data.describe()}")
    if dst.dtype != data.dtype:
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}")
    if engine_name == "tensor":
        _psum_bank_check(opcode, line, dst)
    if ctx.numerics:
        a = data.array()
        _write(dst, a.reshape(a.shape[0], -1).T)
    _mark_psum(dst, PSUM_BY_MATMUL if engine_name == "tensor" else PSUM_BY_OTHER)
    info = MatmulInfo(rows, rows, cols, dtypes.NAME[data.dtype], True) if engine_name == "tensor" else None
    _record(ctx, opcode, engine_name, line, dst, (data,), matmul=info)


# -- Vector / Scalar / GpSimd compute --------------------------------------------------------------

def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """dst = data1 <op> data2 element-wise in float32 (same partitions and elements per partition)."""
    opcode = "tensor_tensor"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "data1", data1)
    _on_chip(opcode, line, "data2", data2)
    _same_layout(opcode, line, dst, data1, "data1")
    _same_layout(opcode, line, dst, data2, "data2")
    if data1.storage.kind == "psum" and data2.storage.kind == "psum":
        _fail(opcode, line, "data1 and data2 cannot both be in PSUM")
    name_ = ops.op_name(op)
    fn = ops.binary(op)
    default = "gpsimd" if name_ == "power" else "vector"
    engine_name = _engine_name(engine, default, opcode, line, ("vector", "gpsimd"))
    _gpsimd_psum(opcode, line, engine_name, dst, data1, data2)
    if ctx.numerics:
        if name_ in ops.BITVEC:
            a, b = data1.array(), data2.array()
            result = fn(a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1))
        else:
            with np.errstate(all="ignore"):
                result = fn(_f32_2d(data1), _f32_2d(data2))
        _write(dst, result)
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, engine_name, line, dst, (data1, data2))


def _apply_scalar_op(op, values, operand, reverse):
    fn = ops.binary(op)
    operand = _operand_value(operand)
    return fn(operand, values) if reverse else fn(values, operand)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """dst = (data <op0> operand0) <op1> operand1; operands are scalars or [P, 1] float32 vectors."""
    opcode = "tensor_scalar"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "data", data)
    _same_layout(opcode, line, dst, data, "data")
    partitions = data.shape[0]
    _operand(opcode, line, "operand0", operand0, partitions, require_f32=True)
    if (op1 is None) != (operand1 is None):
        _fail(opcode, line, "op1 and operand1 must be given together")
    if op1 is not None:
        _operand(opcode, line, "operand1", operand1, partitions, require_f32=True)
    engine_name = _engine_name(engine, "vector", opcode, line, ("vector", "scalar", "gpsimd"))
    _gpsimd_psum(opcode, line, engine_name, dst, data, operand0, operand1)
    if ctx.numerics:
        with np.errstate(all="ignore"):
            result = _apply_scalar_op(op0, _f32_2d(data), operand0, reverse0)
            if op1 is not None:
                result = _apply_scalar_op(op1, result, operand1, reverse1)
        _write(dst, result)
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (data,) + tuple(o for o in (operand0, operand1) if isinstance(o, NkiTensor))
    _record(ctx, opcode, engine_name, line, dst, reads)


def _reduce_axes(opcode, line, data, axis):
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(int(a) % data.ndim for a in axes))
    if not axes or axes[0] == 0:
        _fail(opcode, line, f"axis {axis}: the partition dimension (0) cannot be reduced")
    if axes != tuple(range(axes[0], data.ndim)):
        _fail(opcode, line, f"axis {axis} must be the last contiguous free dimension(s) of {data.describe()}")
    return axes


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """dst = reduce(op) of data over its last free axes (float32 math), optionally negated."""
    opcode = "tensor_reduce"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "data", data)
    axes = _reduce_axes(opcode, line, data, axis)
    kept = math.prod(data.shape[1:axes[0]])
    if dst.shape[0] != data.shape[0] or _free(dst) != kept:
        _fail(opcode, line, f"dst {dst.describe()} must have {data.shape[0]} partitions and {kept} elements per "
                            f"partition after reducing axes {axes} of {data.describe()}")
    fn = ops.reduction(op)
    if ctx.numerics:
        values = data.array().astype(np.float32)
        with np.errstate(all="ignore"):
            result = fn(values, axis=axes)
        if negate:
            result = -result
        _write(dst, result)
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, "vector", line, dst, (data,), free=_free(data))


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None):
    """dst = op(data * scale + bias) on ScalarE in float32; bias a [P, 1] vector (or scalar), scale scalar or [P, 1].

    With reduce_res, the per-partition sum of the activated values is written to reduce_res [P, 1]
    (reduce_op must be nl.add), accumulated over the engine's reduce registers per reduce_cmd.
    """
    opcode = "activation"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "data", data)
    _same_layout(opcode, line, dst, data, "data")
    partitions = data.shape[0]
    fn = ops.unary(op)
    _operand(opcode, line, "scale", scale, partitions, require_f32=True)
    if bias is not None:
        _operand(opcode, line, "bias", bias, partitions)
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
    _record(ctx, opcode, "scalar", line, dst, reads)


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition along the (flattened) free axis: r[i] = (data0[i] <op0> r[i-1]) <op1> data1[i], r[-1] = initial."""
    opcode = "tensor_tensor_scan"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "data0", data0)
    _on_chip(opcode, line, "data1", data1)
    _same_layout(opcode, line, dst, data0, "data0")
    _same_layout(opcode, line, dst, data1, "data1")
    if data0.storage.kind == "psum" and data1.storage.kind == "psum":
        _fail(opcode, line, "data0 and data1 cannot both be in PSUM")
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
