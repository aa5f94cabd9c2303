"""`nki.language` tile functions built from several engine steps (softmax, rms_norm, where, all), random tiles,
gathers, and nl.rsqrt (GpSimd since NKI 0.5, so not on PSUM). Each returns a new SBUF tile and records the
instructions the compiler would issue for it."""

from __future__ import annotations

import numpy as np

from . import context
from . import dtypes as _dtypes
from . import isa as _isa
from . import isa_core as _core
from .errors import NkiHardwareError
from .tensor import NkiTensor, allocate


def _tile(opname, line, label, x):
    if not isinstance(x, NkiTensor):
        raise TypeError(f"nl.{opname}: {label} must be an NKI tensor, got {type(x).__name__}")
    if not x.is_on_chip:
        raise NkiHardwareError(f"nl.{opname} at {line}: {label} {x.describe()} must be in SBUF or PSUM (load it)")
    _core._partition_placement(f"nl.{opname}", line, label, x)
    return x


def _out(shape, like, dtype):
    return allocate(shape, like.dtype if dtype is None else dtype, "sbuf")


def _values(x):
    return x.array().astype(np.float32) if isinstance(x, NkiTensor) else np.float32(x)


def where(condition, x, y, dtype=None):
    """condition (1.0 true / 0.0 false) ? x : y element-wise (tiles or numbers, broadcasting; VectorE)."""
    ctx = context.current("nl.where")
    line = context.caller_line()
    _tile("where", line, "condition", condition)
    tensors = [condition] + [
        _tile("where", line, label, t) for label, t in (("x", x), ("y", y)) if isinstance(t, NkiTensor)
    ]
    shape = tuple(np.broadcast_shapes(*(t.shape for t in tensors)))
    like = x if isinstance(x, NkiTensor) else y if isinstance(y, NkiTensor) else condition
    out = _out(shape, like, dtype)
    if ctx.numerics:
        _core._write(out, np.broadcast_to(np.where(_values(condition) != 0, _values(x), _values(y)), shape))
    _core._record(ctx, "select_reduce", "vector", line, out, tuple(tensors))
    return out


def _axes(opname, line, x, axis):
    return _core._reduce_axes(f"nl.{opname}", line, x, axis)


def softmax(x, axis=-1, dtype=None):
    """exp(x - max) / sum(exp(x - max)) over the last free axes `axis` (float32 math): a max reduction (VectorE),
    an exponential with the sum in the ScalarE registers, and a scaling (VectorE)."""
    ctx = context.current("nl.softmax")
    line = context.caller_line()
    _tile("softmax", line, "x", x)
    axes = _axes("softmax", line, x, axis)
    out = _out(x.shape, x, dtype)
    if ctx.numerics:
        values = _values(x)
        with np.errstate(all="ignore"):
            shifted = np.exp(values - values.max(axis=axes, keepdims=True))
            _core._write(out, shifted / shifted.sum(axis=axes, keepdims=True))
    _core._record(ctx, "tensor_reduce", "vector", line, out, (x,), free=_core._free(x))
    _core._record(ctx, "activation", "scalar", line, out, (x,))
    _core._record(ctx, "tensor_scalar", "vector", line, out, (out,))
    return out


def rms_norm(x, w, axis, n, epsilon=1e-06, dtype=None, compute_dtype=None):
    """x / sqrt(sum(x^2 over axis) / n + epsilon) * w (w broadcast against x; float32 math unless compute_dtype
    rounds the intermediate sum of squares)."""
    ctx = context.current("nl.rms_norm")
    line = context.caller_line()
    _tile("rms_norm", line, "x", x)
    _tile("rms_norm", line, "w", w)
    axes = _axes("rms_norm", line, x, axis)
    if int(n) < 1:
        raise ValueError(f"nl.rms_norm: n must be a positive element count, got {n!r}")
    try:
        np.broadcast_shapes(x.shape, w.shape)
    except ValueError:
        raise ValueError(f"nl.rms_norm: w {list(w.shape)} does not broadcast against x {list(x.shape)}") from None
    out = _out(x.shape, x, dtype)
    if ctx.numerics:
        values = _values(x)
        squares = np.sum(values * values, axis=axes, keepdims=True)
        if compute_dtype is not None:
            squares = squares.astype(_dtypes.as_dtype(compute_dtype)).astype(np.float32)
        with np.errstate(all="ignore"):
            _core._write(out, values / np.sqrt(squares / np.float32(n) + np.float32(epsilon)) * _values(w))
    _core._record(ctx, "activation", "scalar", line, out, (x,))
    _core._record(ctx, "tensor_tensor", "vector", line, out, (x, w))
    return out


def all(x, axis, dtype=None):
    """1 where every element along the last free axes `axis` is nonzero, else 0 (VectorE)."""
    ctx = context.current("nl.all")
    line = context.caller_line()
    _tile("all", line, "x", x)
    axes = _axes("all", line, x, axis)
    shape = tuple(n for d, n in enumerate(x.shape) if d not in axes)
    shape = shape + (1,) * (2 - len(shape)) if len(shape) < 2 else shape
    out = _out(shape, x, dtype)
    if ctx.numerics:
        _core._write(out, np.all(_values(x) != 0, axis=axes).astype(np.float32))
    _core._record(ctx, "tensor_reduce", "vector", line, out, (x,), free=_core._free(x))
    return out


def dropout(x, rate, dtype=None):
    """x with each element zeroed with probability `rate` (a number or a [P, 1] tile); kept ones unscaled."""
    context.current("nl.dropout")
    out = _out(x.shape, x, None)
    _isa.dropout(out, x, rate)
    if dtype is not None and _dtypes.as_dtype(dtype) != x.dtype:
        cast = allocate(x.shape, dtype, "sbuf")
        _isa.tensor_copy(cast, out)
        return cast
    return out


def random_seed(seed):
    """Seed the generator behind nl.rand / nisa.rng / dropout from a [1, 1] 32-bit tile."""
    _isa.set_rng_seed(seed)


def rand(shape, dtype, buffer="sbuf", name=""):
    """A new tensor of uniform [0, 1) values (on chip via the Vector Engine's generator)."""
    ctx = context.current("nl.rand")
    line = context.caller_line()
    out = allocate(shape, dtype, buffer, name)
    if ctx.numerics:
        _core._write(out, ctx.random.random(size=out.shape, dtype=np.float32))
    if out.is_on_chip:
        _core._record(ctx, "rng", "vector", line, out, ())
    return out


def gather_flattened(data, indices, axis=0, dtype=None):
    """out[p, j...] = data[p] (free dims flattened)[indices[p, j...]] (GpSimd; integer indices)."""
    ctx = context.current("nl.gather_flattened")
    line = context.caller_line()
    _tile("gather_flattened", line, "data", data)
    _tile("gather_flattened", line, "indices", indices)
    if _dtypes.is_float(indices.dtype):
        raise TypeError(f"nl.gather_flattened: indices {indices.describe()} must have an integer dtype")
    if axis != 0:
        raise ValueError(f"nl.gather_flattened: only axis=0 (per partition) is documented, got {axis}")
    if indices.shape[0] != data.shape[0]:
        raise ValueError(
            f"nl.gather_flattened: indices {indices.describe()} and data {data.describe()} need the "
            f"same partition count"
        )
    out = _out(indices.shape, data, dtype)
    if ctx.numerics:
        source = data.array().reshape(data.shape[0], -1)
        picks = _core._int_2d(indices).astype(np.int64)
        if picks.size and (picks.min() < 0 or picks.max() >= source.shape[1]):
            raise NkiHardwareError(f"nl.gather_flattened at {line}: index outside [0, {source.shape[1]})")
        _core._write(
            out,
            np.take_along_axis(source, picks, axis=1).astype(np.float32)
            if _dtypes.is_float(out.dtype)
            else np.take_along_axis(source, picks, axis=1),
        )
    _core._record(ctx, "nc_n_gather", "gpsimd", line, out, (data, indices), free=_core._free(indices))
    return out


def load_transpose2d(src, dtype=None):
    """A new SBUF tile holding the 2-D HBM tensor src transposed (a transposing DMA)."""
    if not isinstance(src, NkiTensor) or src.is_on_chip or src.ndim != 2:
        raise ValueError(f"nl.load_transpose2d: src must be a 2-D HBM tensor, got {src!r}")
    tile = allocate((src.shape[1], src.shape[0]), src.dtype, "sbuf")
    _isa.dma_transpose(tile, src)
    if dtype is not None and _dtypes.as_dtype(dtype) != src.dtype:
        cast = allocate(tile.shape, dtype, "sbuf")
        _isa.tensor_copy(cast, tile)
        return cast
    return tile


def rsqrt(x, dtype=None):
    """1 / sqrt(x) element-wise on GpSimd (higher precision than ScalarE's); PSUM inputs are not accepted since
    NKI 0.5 (use nisa.activation with nl.rsqrt for them). Also the `op` nl.rsqrt of nisa.activation."""
    ctx = context.current("nl.rsqrt")
    line = context.caller_line()
    _tile("rsqrt", line, "x", x)
    if x.storage.kind == "psum":
        raise NkiHardwareError(
            f"nl.rsqrt at {line}: x {x.describe()} is in PSUM; nl.rsqrt runs on GpSimd, which "
            f"cannot read PSUM (use nisa.activation(op=nl.rsqrt) or copy to SBUF first)"
        )
    out = _out(x.shape, x, dtype)
    if ctx.numerics:
        with np.errstate(all="ignore"):
            _core._write(out, (1.0 / np.sqrt(x.array().astype(np.float64))).astype(np.float32))
    _core._record(ctx, "activation", "gpsimd", line, out, (x,))
    return out


rsqrt.nki_op = "rsqrt"
