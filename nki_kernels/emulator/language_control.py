"""`nki.language` control flow and constants: register-driven loops (fori_loop, while_loop, dynamic_range),
no_reorder blocks, and constant tensors (shared_constant, shared_identity_matrix).

The emulator runs kernels in program order, so no_reorder changes nothing it computes; it checks the documented
rule that register loops cannot sit inside one. Register loops run on the register values the emulator knows.
"""

from __future__ import annotations

import contextlib
import operator
import os

import numpy as np

from . import context
from . import dtypes as _dtypes
from . import isa_core as _core
from .isa_control import VirtualRegister
from .tensor import NkiTensor, allocate

# A while_loop whose condition never clears would hang the simulation: stop it here with an error instead.
MAX_WHILE_ITERATIONS = 1_000_000


def _bound(what, value):
    if isinstance(value, VirtualRegister):
        return value.get(what)
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: expected an int or a VirtualRegister, got {value!r}") from None


def _step(what, step):
    if isinstance(step, VirtualRegister) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{what}: step must be a compile-time positive integer, got {step!r}")
    return step


def _not_in_no_reorder(what):
    ctx = context.current(what)
    if getattr(ctx, "no_reorder_depth", 0):
        raise ValueError(f"{what}: register-based dynamic loops cannot sit inside an nl.no_reorder() block")


@contextlib.contextmanager
def no_reorder():
    """`with nl.no_reorder():` keep the block's instructions in program order (the emulator's order anyway)."""
    ctx = context.current("nl.no_reorder")
    ctx.no_reorder_depth = getattr(ctx, "no_reorder_depth", 0) + 1
    try:
        yield
    finally:
        ctx.no_reorder_depth -= 1


def dynamic_range(start, stop=None, step=1):
    """range(start, stop, step) whose bounds may be VirtualRegisters (deprecated in NKI 0.6 for fori_loop)."""
    _not_in_no_reorder("nl.dynamic_range")
    if stop is None:
        start, stop = 0, start
    return range(
        _bound("nl.dynamic_range start", start), _bound("nl.dynamic_range stop", stop), _step("nl.dynamic_range", step)
    )


def fori_loop(lower, upper, body_fun, step=1):
    """body_fun(i) for i in range(lower, upper, step); i is a read-only VirtualRegister; the body returns None."""
    _not_in_no_reorder("nl.fori_loop")
    if not callable(body_fun):
        raise TypeError(f"nl.fori_loop: body_fun must be callable, got {body_fun!r}")
    for i in range(
        _bound("nl.fori_loop lower", lower), _bound("nl.fori_loop upper", upper), _step("nl.fori_loop", step)
    ):
        if body_fun(VirtualRegister(i, frozen=True)) is not None:
            raise ValueError("nl.fori_loop: the body function cannot return a value (carry state in SBUF/HBM)")


def while_loop(init, body_fun):
    """r = init; while r != 0: r = body_fun(r) -- the body returns the next condition register."""
    _not_in_no_reorder("nl.while_loop")
    if not isinstance(init, VirtualRegister):
        raise TypeError(f"nl.while_loop: init must be a VirtualRegister, got {type(init).__name__}")
    register = init
    for _ in range(MAX_WHILE_ITERATIONS):
        if register.get("nl.while_loop condition") == 0:
            return
        register = body_fun(VirtualRegister(register.value))
        if not isinstance(register, VirtualRegister):
            raise TypeError(
                f"nl.while_loop: the body must return the next condition register, got {type(register).__name__}"
            )
    raise RuntimeError(f"nl.while_loop: the condition was still nonzero after {MAX_WHILE_ITERATIONS} iterations")


def shared_constant(constant):
    """A shared-HBM tensor holding `constant` (a numpy array, or the path of a .npy file)."""
    context.current("nl.shared_constant")
    if isinstance(constant, (str, os.PathLike)):
        array = np.load(os.fspath(constant), allow_pickle=False)
    else:
        array = np.asarray(constant)
    dtype = _dtypes.as_dtype(array.dtype, "constant")
    data = np.array(array, dtype=dtype, copy=True, order="C")
    return allocate(
        data.shape if data.ndim else (1,), dtype, "shared_hbm", data=data.reshape(-1) if data.ndim == 0 else data
    )


def shared_identity_matrix(n, dtype=_dtypes.uint8, dst=None):
    """An [n, n] identity matrix in SBUF (into dst when given, which must be [n, n] in SBUF)."""
    ctx = context.current("nl.shared_identity_matrix")
    line = context.caller_line()
    n = operator.index(n)
    if dst is None:
        dst = allocate((n, n), dtype, "sbuf")
    elif not isinstance(dst, NkiTensor) or dst.storage.kind != "sbuf" or dst.shape[0] != n or _core._free(dst) != n:
        raise ValueError(f"nl.shared_identity_matrix: dst must be an [{n}, {n}] SBUF tile, got {dst!r}")
    if ctx.numerics:
        _core._write(dst, np.eye(n, dtype=np.float32))
    _core._record(ctx, "affine_select", "gpsimd", line, dst, ())
    return dst
