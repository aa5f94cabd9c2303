"""`nki.isa` beyond tile math: virtual registers, random numbers, DMA-engine compute, multi-core
synchronization on one core, instruction handles, and the NeuronCore-v4 (trn3) instructions, which raise.

Random bits come from the kernel's numpy generator (context.KernelContext.random): deterministic per seed, not the
hardware's XORWOW sequence.
"""

from __future__ import annotations

import numpy as np

from . import context, dtypes, ops
from .isa_constants import engine as _Engine
from .isa_constants import oob_mode as _OobMode
from .isa_core import (
    PSUM_BY_OTHER,
    _f32_2d,
    _fail,
    _free,
    _mark_psum,
    _on_chip,
    _operand,
    _record,
    _tensor,
    _write,
)
from .isa_dma import _dma_info, _dma_partitions, dma_copy
from .tensor import NKIObject, NkiTensor


class NkiInstruction(NKIObject):
    """Handle of an issued instruction; `depends_on` orders scheduling only (the emulator runs in program
    order, so it records nothing)."""

    def __init__(self, handle=None):
        self.handle = handle

    def depends_on(self, *producers):
        for producer in producers:
            if not isinstance(producer, NkiInstruction):
                raise TypeError(f"depends_on: expected NkiInstruction handles, got {type(producer).__name__}")
        return self


class VirtualRegister(NKIObject):
    """A 32-bit engine register (`register_alloc`): an integer known while the kernel runs on the emulator, so it
    can bound `nl.fori_loop` / `nl.dynamic_range`, drive `nl.while_loop` and serve as a `scalar_offset`."""

    def __init__(self, state=None, frozen=False):
        self.value = None if state is None else int(state)
        self.frozen = frozen

    def get(self, what="register"):
        if self.value is None:
            raise ValueError(f"{what}: the register was allocated without a value and never loaded")
        return self.value

    def __index__(self):
        return self.get()

    def __int__(self):
        return self.get()

    def __bool__(self):
        return self.get() != 0

    def __repr__(self):
        return f"VirtualRegister({self.value})"


def register_alloc(x=None):
    """A new virtual register, initialized to the integer x (or uninitialized)."""
    if x is not None and (isinstance(x, bool) or not isinstance(x, (int, np.integer))):
        raise TypeError(f"register_alloc: x must be an int or None, got {x!r}")
    return VirtualRegister(x)


def _register(what, reg):
    if not isinstance(reg, VirtualRegister):
        raise TypeError(f"{what}: expected a VirtualRegister (nisa.register_alloc), got {type(reg).__name__}")
    if reg.frozen:
        raise ValueError(f"{what}: this register is read-only (a loop variable)")
    return reg


def register_move(dst, src):
    """dst = src (an int constant or another register)."""
    _register("register_move dst", dst)
    dst.value = src.get("register_move src") if isinstance(src, VirtualRegister) else int(src)


def _scalar_tensor(opcode, line, label, t):
    _tensor(opcode, line, label, t)
    if t.size != 1:
        _fail(opcode, line, f"{label} {t.describe()} must hold exactly one element")
    if t.dtype.itemsize > 4:
        _fail(opcode, line, f"{label} {t.describe()}: registers hold 32-bit values")


def register_load(dst, src):
    """dst = the single (up to 32-bit) value of src (HBM or SBUF)."""
    opcode = "register_load"
    ctx = context.current(opcode)
    line = context.caller_line()
    _register(opcode, dst)
    _scalar_tensor(opcode, line, "src", src)
    if src.storage.kind == "psum":
        _fail(opcode, line, f"src {src.describe()} must be in HBM or SBUF")
    dst.value = int(np.asarray(src.array()).reshape(-1)[0]) if ctx.numerics else 0


def register_store(dst, src):
    """The register's value into the single element of dst (HBM or SBUF)."""
    opcode = "register_store"
    ctx = context.current(opcode)
    line = context.caller_line()
    _scalar_tensor(opcode, line, "dst", dst)
    if not isinstance(src, VirtualRegister):
        raise TypeError(f"{opcode}: src must be a VirtualRegister, got {type(src).__name__}")
    if dst.storage.kind == "psum":
        _fail(opcode, line, f"dst {dst.describe()} must be in HBM or SBUF")
    if ctx.numerics:
        _write(dst, np.full(dst.shape, src.get(opcode), dtype=np.int64))


# -- random numbers ---------------------------------------------------------------------------------

_RNG_DTYPES = (dtypes.int8, dtypes.int16, dtypes.int32, dtypes.uint8, dtypes.uint16, dtypes.uint32)


def random_bits(ctx, shape):
    """32 random bits per element (uint32) from the kernel's generator."""
    return ctx.random.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)


def rng(dst, engine=_Engine.vector, name=None):
    """dst = 32 random bits per element, truncated to dst's integer dtype (least significant bits); VectorE, or
    GpSimd on trn2 (SBUF only)."""
    opcode = "rng"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    if dst.dtype not in _RNG_DTYPES:
        _fail(opcode, line, f"dst {dst.describe()} must be an integer type (int8/16/32, uint8/16/32)")
    if engine not in (_Engine.vector, _Engine.gpsimd):
        _fail(opcode, line, f"engine {engine!r} must be engine.vector or engine.gpsimd")
    if engine is _Engine.gpsimd:
        if ctx.target == "trn1":
            _fail(opcode, line, "engine.gpsimd needs NeuronCore-v3 (trn2) or newer; trn1 has rng on VectorE only")
        if dst.storage.kind == "psum":
            _fail(opcode, line, "GpSimd Engine cannot access PSUM")
    if ctx.numerics:
        size = dst.dtype.itemsize
        bits = random_bits(ctx, dst.shape) & np.uint32(2 ** (8 * size) - 1)  # the least significant bits
        dst.write(bits.astype(np.dtype(f"u{size}")).view(dst.dtype))
    _mark_psum(dst, PSUM_BY_OTHER)
    _record(ctx, opcode, engine.name, line, dst, ())


def _seed_from(opcode, line, ctx, seeds):
    _on_chip(opcode, line, "src_seeds", seeds)
    if ctx.numerics:
        ctx.random = np.random.default_rng(np.asarray(seeds.array()).astype(np.uint64).reshape(-1).tolist())


def set_rng_seed(src_seeds, name=None):
    """Seed the Vector Engine's generator from a [1, 1] 32-bit tile (SBUF or PSUM)."""
    opcode = "set_rng_seed"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "src_seeds", src_seeds)
    if src_seeds.shape[0] != 1 or _free(src_seeds) != 1 or src_seeds.dtype.itemsize != 4:
        _fail(opcode, line, f"src_seeds {src_seeds.describe()} must be a [1, 1] 32-bit tile")
    _seed_from(opcode, line, ctx, src_seeds)


def rand_set_state(src_seeds, engine=_Engine.gpsimd, name=None):
    """Seed the generator from per-lane uint32 XORWOW states (6 per partition on GpSimd; trn2+)."""
    opcode = "rand_set_state"
    ctx = context.current(opcode)
    line = context.caller_line()
    _rand_state_checks(opcode, line, ctx, src_seeds, engine, "src_seeds")
    _seed_from(opcode, line, ctx, src_seeds)


def rand_get_state(dst, engine=_Engine.gpsimd, name=None):
    """dst = per-lane uint32 generator states (6 per partition on GpSimd; trn2+); the emulator's state words are
    drawn from its generator, so restoring them with rand_set_state reseeds deterministically."""
    opcode = "rand_get_state"
    ctx = context.current(opcode)
    line = context.caller_line()
    _rand_state_checks(opcode, line, ctx, dst, engine, "dst")
    if ctx.numerics:
        dst.write(random_bits(ctx, dst.shape))
    _record(ctx, opcode, "gpsimd", line, dst, ())


def _rand_state_checks(opcode, line, ctx, t, engine, label):
    if ctx.target == "trn1":
        _fail(opcode, line, f"{opcode} needs NeuronCore-v3 (trn2) or newer, not trn1")
    if engine is not _Engine.gpsimd:
        _fail(opcode, line, f"engine {engine!r}: only engine.gpsimd on trn2 (engine.vector is NeuronCore-v4+)")
    _on_chip(opcode, line, label, t, kinds=("sbuf",))
    if t.dtype != dtypes.uint32 or _free(t) != 6:
        _fail(opcode, line, f"{label} {t.describe()} must be uint32 with 6 XORWOW state words per partition")


def dropout(dst, data, prob, name=None):
    """dst = data with each element replaced by 0 with probability prob (a scalar or [P, 1] vector; float32 when
    data is an integer tile); kept elements are not rescaled (VectorE). dst dtype = data dtype."""
    opcode = "dropout"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst)
    _on_chip(opcode, line, "data", data)
    if dst.shape[0] != data.shape[0] or _free(dst) != _free(data):
        _fail(opcode, line, f"dst {dst.describe()} and data {data.describe()} must have the same layout")
    if dst.dtype != data.dtype:
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}")
    _operand(opcode, line, "prob", prob, data.shape[0])
    if isinstance(prob, NkiTensor):
        if not dtypes.is_float(prob.dtype) or (not dtypes.is_float(data.dtype) and prob.dtype != dtypes.float32):
            _fail(opcode, line, f"prob {prob.describe()} must be float (float32 for integer data)")
    if ctx.numerics:
        p = _f32_2d(prob) if isinstance(prob, NkiTensor) else np.float32(prob)
        draw = ctx.random.random(size=(data.shape[0], _free(data)), dtype=np.float32)
        values = data.array().reshape(draw.shape)
        _write(dst, np.where(draw < p, np.zeros((), dtype=values.dtype), values))
    _mark_psum(dst, PSUM_BY_OTHER)
    reads = (data,) + ((prob,) if isinstance(prob, NkiTensor) else ())
    _record(ctx, opcode, "vector", line, dst, reads, inputs=(data,))


# -- DMA compute, multi-core -------------------------------------------------------------------------


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=_OobMode.error, name=None):
    """dst = srcs[0] + srcs[1] + ... (float32 inside the DMA engines, cast to dst); up to 16 sources of dst's
    element count, HBM or SBUF; scales all 1.0 (or None); with an indirect source this is the documented
    read-modify-write gather / scatter (unique indices only)."""
    opcode = "dma_compute"
    ctx = context.current(opcode)
    line = context.caller_line()
    _tensor(opcode, line, "dst", dst)
    srcs = list(srcs)
    if not 1 <= len(srcs) <= 16:
        _fail(opcode, line, f"{len(srcs)} srcs: between 1 and 16 are supported")
    if ops.op_name(reduce_op, "reduce_op") != "add":
        _fail(opcode, line, "reduce_op must be nl.add (the only one supported)")
    if scales is not None and (len(scales) != len(srcs) or any(float(s) != 1.0 for s in scales)):
        _fail(opcode, line, f"scales {scales!r} must be one 1.0 per source (or None)")
    if not unique_indices:
        _fail(opcode, line, "unique_indices=False is not supported yet")
    for i, src in enumerate(srcs):
        _tensor(opcode, line, f"srcs[{i}]", src)
        if src.size != dst.size:
            _fail(opcode, line, f"srcs[{i}] {src.describe()} has {src.size} elements, dst {dst.size}")
    for label, t in [("dst", dst)] + [(f"srcs[{i}]", s) for i, s in enumerate(srcs)]:
        if t.storage.kind == "psum":
            _fail(opcode, line, f"{label} {t.describe()}: DMA cannot access PSUM")
    if ctx.numerics:
        total = np.zeros(dst.size, dtype=np.float32)
        for src in srcs:
            total += np.asarray(src.array(), dtype=np.float32).reshape(-1)
        _write(dst, total.reshape(dst.shape))
    partitions, free = _dma_partitions(dst, srcs[0])
    _record(ctx, opcode, "dma", line, dst, tuple(srcs), dma=_dma_info(dst, srcs[0]), partitions=partitions, free=free)


def core_barrier(data, cores, engine=_Engine.gpsimd, name=None):
    """Barrier between the cores of a logical NeuronCore (trn2+; cores=(0, 1)); with one core it only checks."""
    opcode = "core_barrier"
    ctx = context.current(opcode)
    line = context.caller_line()
    if ctx.target == "trn1":
        _fail(opcode, line, "core_barrier needs NeuronCore-v3 (trn2) or newer, not trn1")
    _tensor(opcode, line, "data", data)
    if data.storage.kind != "hbm":
        _fail(opcode, line, f"data {data.describe()} must be in shared HBM")
    if tuple(cores) != (0, 1):
        _fail(opcode, line, f"cores {cores!r}: only (0, 1) is supported")


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=None, name=None):
    """Exchange tiles between the two cores of a logical NeuronCore (trn2+). The emulator runs one core, so only
    an exchange with itself (rank 0 to rank 0, a copy) can run."""
    opcode = "sendrecv"
    ctx = context.current(opcode)
    line = context.caller_line()
    if ctx.target == "trn1":
        _fail(opcode, line, "sendrecv needs NeuronCore-v3 (trn2) or newer, not trn1")
    if send_to_rank not in (0, 1) or recv_from_rank not in (0, 1):
        _fail(opcode, line, "send_to_rank and recv_from_rank must be 0 or 1")
    if send_to_rank != 0 or recv_from_rank != 0:
        raise NotImplementedError(
            f"{opcode} at {line}: exchanging with rank {send_to_rank}/{recv_from_rank} needs a "
            f"second core; the emulator runs one"
        )
    dma_copy(dst, src)


def get_nc_sub_version():
    """The silicon revision within the target's generation (0: first)."""
    return 0


# -- NeuronCore-v4 (trn3) only ---------------------------------------------------------------------------


def _trn3_only(opcode):
    def instruction(*args, **kwargs):
        ctx = context.current(opcode)
        raise NotImplementedError(
            f"nisa.{opcode} at {context.caller_line()}: available only on NeuronCore-v4 "
            f"(trn3) and newer; this kernel targets {ctx.target}"
        )

    instruction.__name__ = instruction.__qualname__ = opcode
    instruction.__doc__ = f"nisa.{opcode}: NeuronCore-v4 (trn3) only; raises on the trn1/trn2 targets."
    return instruction


nc_matmul_mx = _trn3_only("nc_matmul_mx")
activate2 = _trn3_only("activate2")
rand2 = _trn3_only("rand2")
exponential = _trn3_only("exponential")
quantize_mx = _trn3_only("quantize_mx")

__all__ = [
    "NkiInstruction",
    "VirtualRegister",
    "activate2",
    "core_barrier",
    "dma_compute",
    "dropout",
    "exponential",
    "get_nc_sub_version",
    "nc_matmul_mx",
    "quantize_mx",
    "rand2",
    "rand_get_state",
    "rand_set_state",
    "register_alloc",
    "register_load",
    "register_move",
    "register_store",
    "rng",
    "sendrecv",
    "set_rng_seed",
]
