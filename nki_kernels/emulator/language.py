"""`nki.language` on the CPU: dtypes, buffers, tensor creation, tile_size, loads/stores, tile math.

The math functions (nl.add, nl.exp, nl.sum, ...) return new SBUF tiles and record the instruction that
computes them; the same objects are the `op` arguments of ISA instructions.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from . import context
from . import dtypes as _dtypes
from . import isa as _isa
from . import isa_core as _core
from . import ops as _ops
from .errors import NkiHardwareError
from .tensor import DynSlice, MemoryRegion, NKIObject, NkiTensor, allocate
from .trace import MatmulInfo

# -- dtypes ------------------------------------------------------------------------------------------
bool_ = _dtypes.bool_
int8, int16, int32 = _dtypes.int8, _dtypes.int16, _dtypes.int32
uint8, uint16, uint32 = _dtypes.uint8, _dtypes.uint16, _dtypes.uint32
float16, float32, tfloat32, bfloat16 = _dtypes.float16, _dtypes.float32, _dtypes.tfloat32, _dtypes.bfloat16
float8_e4m3, float8_e4m3fn, float8_e5m2 = _dtypes.float8_e4m3, _dtypes.float8_e4m3fn, _dtypes.float8_e5m2
float8_e8m0fnu = _dtypes.float8_e8m0fnu
float8_e5m2_x4, float8_e4m3fn_x4 = _dtypes.float8_e5m2_x4, _dtypes.float8_e4m3fn_x4
float4_e2m1fn_x4 = _dtypes.float4_e2m1fn_x4

DType = np.dtype  # the type of nl dtypes (annotations)

# -- buffers -----------------------------------------------------------------------------------------
sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
hbm = MemoryRegion.private_hbm  # documented alias of private_hbm
shared_hbm = MemoryRegion.shared_hbm


def is_hbm(buffer):
    return buffer in (private_hbm, shared_hbm)


def is_on_chip(buffer):
    return buffer in (sbuf, psum)


def is_psum(buffer):
    return buffer is psum


def is_sbuf(buffer):
    return buffer is sbuf


# -- tile sizes ----------------------------------------------------------------------------------------
class _TileSize:
    """Hardware tile limits of the current target (see context.resolve_target)."""

    pmax = 128
    psum_fmax = 512
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1

    @staticmethod
    def _target():
        ctx = context.current_or_none()
        return ctx.target if ctx is not None else context.resolve_target()

    @property
    def psum_num_banks(self):
        return context.PSUM_BANKS

    @property
    def sbuf_fmax_bytes(self):
        return context.SBUF_BYTES_PER_PARTITION[self._target()]

    @property
    def sbuf_fmax(self):
        return self.sbuf_fmax_bytes // 4

    @property
    def sbuf_size_bytes(self):
        return self.sbuf_fmax_bytes * self.pmax

    @property
    def total_available_sbuf_size(self):
        return self.sbuf_fmax_bytes


tile_size = _TileSize()


# -- loops, slices, SPMD ----------------------------------------------------------------------------
affine_range = range
sequential_range = range
static_range = range


def ds(start, size):
    return DynSlice(start, size)


def _launch_grid(ctx):
    # A kernel launched without a grid is one program: axis 0 of size 1.
    return ctx.grid or (1,)


def program_id(axis=0):
    ctx = context.current("nl.program_id")
    grid = _launch_grid(ctx)
    if not 0 <= axis < len(grid):
        raise ValueError(f"program_id: axis {axis} out of range for launch grid {ctx.grid}")
    return ctx.program_index[axis] if ctx.grid else 0


def num_programs(axes=0):
    """Programs along `axes` (an int or a sequence of ints; None: the whole grid) of the launch grid."""
    ctx = context.current("nl.num_programs")
    grid = _launch_grid(ctx)
    if axes is None:
        return math.prod(grid)
    if isinstance(axes, int):
        axes = (axes,)
    for a in axes:
        if not 0 <= a < len(grid):
            raise ValueError(f"num_programs: axis {a} out of range for launch grid {ctx.grid}")
    return math.prod(grid[a] for a in axes)


def program_ndim():
    return len(context.current("nl.program_ndim").grid)


def device_print(print_prefix, tensor):
    array = tensor.array() if isinstance(tensor, NkiTensor) else tensor
    print(print_prefix, array)


# -- creation ---------------------------------------------------------------------------------------
def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    """A new, uninitialized tensor (floats NaN, integers their max value, so unwritten reads show)."""
    return allocate(shape, dtype, buffer, name)


def _filled(shape, value, dtype, buffer, name):
    t = allocate(shape, dtype, buffer, name)
    if _core._integer(t.dtype) and isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)  # nl.full's value is converted to the tensor's dtype; memset itself matches strictly
    if t.is_on_chip:
        _isa.memset(t, value)
    elif t.array() is not None:
        t.array()[...] = value
    return t


def zeros(shape, dtype, buffer=sbuf, name=""):
    return _filled(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name=""):
    return _filled(shape, 1, dtype, buffer, name)


def full(shape, fill_value, dtype, buffer=sbuf, name=""):
    return _filled(shape, fill_value, dtype, buffer, name)


def empty_like(x, dtype=None, buffer=None, name=""):
    return ndarray(x.shape, x.dtype if dtype is None else dtype, x.buffer if buffer is None else buffer, name)


def zeros_like(x, dtype=None, buffer=None, name=""):
    return zeros(x.shape, x.dtype if dtype is None else dtype, x.buffer if buffer is None else buffer, name)


# -- loads and stores ---------------------------------------------------------------------------------
def load(src, dtype=None):
    """A new SBUF tile holding src (an HBM tensor with the partition dim first), by DMA."""
    if not isinstance(src, NkiTensor):
        raise TypeError(f"nl.load: src must be an NKI tensor, got {type(src).__name__}")
    if src.is_on_chip:
        raise NkiHardwareError(
            f"nl.load at {context.caller_line()}: src {src.describe()} must be in HBM "
            f"(copy on-chip tiles with nisa.tensor_copy)"
        )
    shape = src.shape if src.ndim >= 2 else (1,) + src.shape
    tile = allocate(shape, src.dtype if dtype is None else dtype, sbuf)
    _isa.dma_copy(tile, src)
    return tile


def store(dst, value):
    """Write the on-chip tile `value` into dst (HBM) by DMA."""
    if not isinstance(value, NkiTensor):
        raise TypeError(f"nl.store: value must be an NKI tensor, got {type(value).__name__}")
    if not isinstance(dst, NkiTensor):
        raise TypeError(f"nl.store: dst must be an NKI tensor, got {type(dst).__name__}")
    if dst.is_on_chip or value.storage.kind != "sbuf":
        raise NkiHardwareError(
            f"nl.store at {context.caller_line()}: stores an SBUF tile into HBM; got dst "
            f"{dst.describe()} and value {value.describe()}"
        )
    _isa.dma_copy(dst, value)


# -- tile math --------------------------------------------------------------------------------------
def _broadcast_shape(opname, tensors):
    try:
        return tuple(np.broadcast_shapes(*(t.shape for t in tensors)))
    except ValueError:
        raise ValueError(f"nl.{opname}: shapes {[list(t.shape) for t in tensors]} do not broadcast") from None


def _elementwise(opname, fn, args, dtype, engine_name, opcode):
    ctx = context.current(f"nl.{opname}")
    line = context.caller_line()
    tensors = [a for a in args if isinstance(a, NkiTensor)]
    if not tensors:
        raise TypeError(f"nl.{opname}: at least one argument must be an NKI tensor")
    for t in tensors:
        if not t.is_on_chip:
            raise NkiHardwareError(f"nl.{opname} at {line}: {t.describe()} must be in SBUF or PSUM (nl.load it)")
        _core._partition_placement(f"nl.{opname}", line, "operand", t)
    shape = _broadcast_shape(opname, tensors)
    out = allocate(shape, tensors[0].dtype if dtype is None else dtype, sbuf)
    if ctx.numerics:
        values = [a.array().astype(np.float32) if isinstance(a, NkiTensor) else np.float32(a) for a in args]
        with np.errstate(all="ignore"):
            result = np.broadcast_to(fn(*values), shape)
        _core._write(out, result)
    _core._record(ctx, opcode, engine_name, line, out, tuple(tensors))
    return out


def _make_unary(name):
    fn = _ops.UNARY[name]

    def unary(x, dtype=None):
        return _elementwise(name, fn, (x,), dtype, "scalar", "activation")

    unary.__name__ = unary.__qualname__ = name
    unary.nki_op = name
    unary.__doc__ = f"nl.{name}: element-wise on a tile (ScalarE, float32 math); also an `op` for nisa calls."
    return unary


def _make_binary(name):
    fn = _ops.BINARY[name]

    def binary(x, y, dtype=None):
        both = isinstance(x, NkiTensor) and isinstance(y, NkiTensor) and x.shape == y.shape
        return _elementwise(name, fn, (x, y), dtype, "vector", "tensor_tensor" if both else "tensor_scalar")

    binary.__name__ = binary.__qualname__ = name
    binary.nki_op = name
    binary.__doc__ = f"nl.{name}: element-wise on tiles or a tile and a scalar (VectorE, float32 math)."
    return binary


for _name in _ops.UNARY:
    globals()[_name] = _make_unary(_name)
for _name in _ops.BINARY:
    globals()[_name] = _make_binary(_name)
del _name


class _Operator:
    """An operator name with no tile function of its own (nl.average, nl.prelu, nl.bypass): an `op` argument."""

    def __init__(self, name):
        self.nki_op = name

    def __repr__(self):
        return f"nl.{self.nki_op}"


average = _Operator("average")  # tensor_partition_reduce
prelu = _Operator("prelu")  # activation functions of NeuronCore-v4 (activate2)
bypass = _Operator("bypass")


def _reduce(opname, reducer, x, axis, dtype, keepdims):
    ctx = context.current(f"nl.{opname}")
    line = context.caller_line()
    if not isinstance(x, NkiTensor) or not x.is_on_chip:
        raise NkiHardwareError(f"nl.{opname} at {line}: x must be an on-chip (SBUF/PSUM) tile")
    _core._partition_placement(f"nl.{opname}", line, "x", x)
    axes = _core._reduce_axes(f"nl.{opname}", line, x, axis)
    if keepdims:
        shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    else:
        shape = tuple(n for d, n in enumerate(x.shape) if d not in axes)
        if len(shape) < 2:
            shape = shape + (1,)
    out = allocate(shape, x.dtype if dtype is None else dtype, sbuf)
    if ctx.numerics:
        with np.errstate(all="ignore"):
            _core._write(out, reducer(x.array().astype(np.float32), axis=axes))
    _core._record(ctx, "tensor_reduce", "vector", line, out, (x,), free=_core._free(x))
    return out


def sum(x, axis, dtype=None, keepdims=False):
    return _reduce("sum", np.sum, x, axis, dtype, keepdims)


def max(x, axis, dtype=None, keepdims=False):
    return _reduce("max", np.max, x, axis, dtype, keepdims)


def min(x, axis, dtype=None, keepdims=False):
    return _reduce("min", np.min, x, axis, dtype, keepdims)


def mean(x, axis, dtype=None, keepdims=False):
    return _reduce("mean", np.mean, x, axis, dtype, keepdims)


def prod(x, axis, dtype=None, keepdims=False):
    return _reduce("prod", np.prod, x, axis, dtype, keepdims)


def var(x, axis, dtype=None, keepdims=False):
    return _reduce("var", np.var, x, axis, dtype, keepdims)


def transpose(x, dtype=None):
    """A new PSUM tile holding the 2-D transpose of the SBUF tile x (TensorE)."""
    out = allocate((_core._free(x), x.shape[0]), x.dtype, psum)
    _isa.nc_transpose(out, x)
    return out if dtype is None or _dtypes.as_dtype(dtype) == x.dtype else copy(out, dtype=dtype)


def matmul(x, y, transpose_x=False):
    """x @ y (x [M, K]) or, with transpose_x, x.T @ y (x [K, M]) into a new fp32 PSUM tile, via nisa.nc_matmul.

    Without transpose_x, x is first transposed on the Tensor Engine (PSUM) and copied back to SBUF, as the
    compiler inserts that transpose.
    """
    if not transpose_x:
        x_t = transpose(x)
        staged = allocate(x_t.shape, x.dtype, sbuf)
        _isa.tensor_copy(staged, x_t)
        x = staged
    out = allocate((_core._free(x), _core._free(y)), float32, psum)
    _isa.nc_matmul(out, x, y)
    return out


def broadcast_to(x, shape, dtype=None):
    """A new tile of `shape` (same rank as x; size-1 dims, the partition dim included, are repeated): a partition
    broadcast is a TensorE matmul into PSUM (SBUF when over one bank), a free-dim one a VectorE copy into SBUF."""
    shape = tuple(shape)
    if not isinstance(x, NkiTensor) or len(shape) != x.ndim:
        raise ValueError(f"nl.broadcast_to: expected a tile of rank {len(shape)}, got {x!r}")
    if x.shape == shape and (dtype is None or _dtypes.as_dtype(dtype) == x.dtype):
        return x
    if any(n != m and n != 1 for n, m in zip(x.shape, shape)):
        raise ValueError(f"nl.broadcast_to: cannot broadcast {list(x.shape)} to {list(shape)}")
    ctx = context.current("nl.broadcast_to")
    line = context.caller_line()
    _core._partition_placement("nl.broadcast_to", line, "x", x)
    out_dtype = x.dtype if dtype is None else _dtypes.as_dtype(dtype)
    free = math.prod(shape[1:])
    # A partition broadcast runs on TensorE: NKI issues nc_matmul(ones[1, M], x) under the hood (arch guide,
    # TensorE "Alternative Use Case"), so the tile lands in PSUM when it fits one bank and a bank is free.
    on_tensor = x.shape[0] == 1 and shape[0] > 1
    in_psum = (
        on_tensor and free * out_dtype.itemsize <= context.PSUM_BANK_BYTES and ctx.psum_banks_live < context.PSUM_BANKS
    )
    out = allocate(shape, out_dtype, psum if in_psum else sbuf)
    if ctx.numerics:
        _core._write(out, np.broadcast_to(x.array().astype(np.float32), shape))
    if on_tensor:
        info = MatmulInfo(1, shape[0], free, _dtypes.NAME[x.dtype])
        _core._record(ctx, "nc_matmul", "tensor", line, out, (x,), matmul=info)
    else:
        _core._record(ctx, "tensor_copy", "vector", line, out, (x,))
    return out


def expand_dims(x, axis):
    return x.expand_dim(operator.index(axis))


# Multi-step tile functions, random tiles, control flow and constants (nl.rsqrt there replaces the generated one).
from .language_control import (
    dynamic_range,
    fori_loop,
    no_reorder,
    shared_constant,  # noqa: E402
    shared_identity_matrix,
    while_loop,
)
from .language_math import (
    all,
    dropout,
    gather_flattened,
    load_transpose2d,
    rand,
    random_seed,  # noqa: E402
    rms_norm,
    rsqrt,
    softmax,
    where,
)

__all__ = [
    "DType",
    "NKIObject",
    "NkiTensor",
    "affine_range",
    "all",
    "average",
    "bfloat16",
    "bool_",
    "broadcast_to",
    "bypass",
    "device_print",
    "dropout",
    "ds",
    "dynamic_range",
    "empty_like",
    "expand_dims",
    "float16",
    "float32",
    "float4_e2m1fn_x4",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e4m3fn_x4",
    "float8_e5m2",
    "float8_e5m2_x4",
    "float8_e8m0fnu",
    "fori_loop",
    "full",
    "gather_flattened",
    "hbm",
    "int16",
    "int32",
    "int8",
    "is_hbm",
    "is_on_chip",
    "is_psum",
    "is_sbuf",
    "load",
    "load_transpose2d",
    "matmul",
    "max",
    "mean",
    "min",
    "ndarray",
    "no_reorder",
    "num_programs",
    "ones",
    "prelu",
    "private_hbm",
    "prod",
    "program_id",
    "program_ndim",
    "psum",
    "rand",
    "random_seed",
    "rms_norm",
    "rsqrt",
    "sbuf",
    "sequential_range",
    "shared_constant",
    "shared_hbm",
    "shared_identity_matrix",
    "softmax",
    "static_range",
    "store",
    "sum",
    "tfloat32",
    "tile_size",
    "transpose",
    "uint16",
    "uint32",
    "uint8",
    "var",
    "where",
    "while_loop",
    "zeros",
    "zeros_like",
]
__all__ += [name for name in (*_ops.UNARY, *_ops.BINARY) if name not in __all__]  # the generated tile functions
