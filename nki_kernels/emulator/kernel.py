"""`@nki.jit` kernels on the emulator: numpy in, numpy out; SPMD grids; count-only traces; array frontends.

A kernel call turns numpy arguments into HBM tensors (copies), runs the Python body once per SPMD
program (loops unroll as plain Python), and returns copies of the HBM tensors the body returns.
Non-array arguments (ints, strings, tuples, ...) pass through as trace-time constants.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import operator
import threading

import numpy as np

from . import context, dtypes, trace
from .tensor import MemoryRegion, NkiTensor, Storage

try:  # optional: per-tile matmuls are small, and multithreaded BLAS on them loses badly on busy machines
    from threadpoolctl import threadpool_limits
except ImportError:
    threadpool_limits = None

_array_frontend = [None]
# Kernels may be launched from several threads at once (XLA runs independent host callbacks concurrently);
# the simulation state (kernel stack, BLAS thread limit) is process-wide, so launches run one at a time.
_launch_lock = threading.RLock()


def set_array_frontend(fn):
    """Install fn(kernel, grid, args, kwargs) to run kernels called with non-numpy arrays (None removes it).

    The JAX side installs one so that `@nki.jit` kernels called with jax Arrays run through a host
    callback, as the real nki.jit does with JAX arrays. nki_kernels never imports JAX itself.
    """
    if fn is not None and not callable(fn):
        raise TypeError(f"set_array_frontend: expected a callable or None, got {fn!r}")
    _array_frontend[0] = fn


def _is_foreign_array(value):
    return (
        not isinstance(value, (np.ndarray, np.generic, NkiTensor))
        and hasattr(value, "shape")
        and hasattr(value, "dtype")
    )


def _normalize_grid(grid):
    if grid is None or grid == ():
        return ()
    grid = grid if isinstance(grid, (tuple, list)) else (grid,)
    try:
        grid = tuple(operator.index(g) for g in grid)
    except TypeError:
        raise TypeError(f"grid: expected ints, got {grid!r}") from None
    if any(g < 1 for g in grid):
        raise ValueError(f"grid: sizes must be positive, got {grid}")
    return grid


class Kernel:
    """An `@nki.jit` kernel; `kernel[grid](...)` launches an SPMD grid."""

    def __init__(self, fn, grid=(), options=None):
        self.fn = fn
        self.grid = grid
        self.options = dict(options or {})
        functools.update_wrapper(self, fn)
        self._parameters = list(inspect.signature(fn).parameters)

    def __getitem__(self, grid):
        return Kernel(self.fn, _normalize_grid(grid), self.options)

    def __repr__(self):
        return f"<nki.jit kernel {self.fn.__qualname__} grid={self.grid}>"

    def with_schedule(self, schedule):
        """This kernel with extra dependency edges [(name, name or [names]), ...]: instruction `name` runs after
        the named ones. The emulator issues instructions in program order, so the edges are checked and kept."""
        edges = []
        for entry in schedule:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise ValueError(f"with_schedule: each entry must be a pair (name, name or [names]), got {entry!r}")
            consumer, producers = entry
            producers = [producers] if isinstance(producers, str) else list(producers)
            if not isinstance(consumer, str) or not all(isinstance(p, str) for p in producers):
                raise TypeError(f"with_schedule: instruction names must be strings, got {entry!r}")
            edges.append((consumer, tuple(producers)))
        options = dict(self.options)
        options["schedule"] = tuple(options.get("schedule", ())) + tuple(edges)
        return Kernel(self.fn, self.grid, options)

    def __call__(self, *args, **kwargs):
        if context.current_or_none() is not None:
            return self.fn(*args, **kwargs)  # a kernel called from inside a kernel is inlined
        values = list(args) + list(kwargs.values())
        foreign = [v for v in values if _is_foreign_array(v)]
        if foreign:
            frontend = _array_frontend[0]
            if frontend is None:
                raise TypeError(
                    f"kernel {self.fn.__qualname__} was called with a {type(foreign[0]).__name__}; the NKI emulator "
                    f"runs kernels on numpy arrays only (no array frontend installed: "
                    f"nki_kernels.emulator.set_array_frontend)"
                )
            return frontend(self, self.grid, args, kwargs)
        return run(self, args, kwargs)


def jit(fn=None, **options):
    """Decorator: `@nki.jit` or `@nki.jit(**options)`; options are accepted and kept, not interpreted, except
    platform_target, an error since NKI 0.3 (set NEURON_PLATFORM_TARGET_OVERRIDE, or use_target here)."""
    if "platform_target" in options:
        raise TypeError(
            f"nki.jit: platform_target={options['platform_target']!r} is no longer accepted (removed in "
            f"NKI 0.3); set the NEURON_PLATFORM_TARGET_OVERRIDE environment variable instead"
        )
    if fn is None:
        return lambda f: Kernel(f, (), options)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, (), options)


def simulate(kernel):
    """`nki.simulate(kernel)(*numpy_arrays)`: run kernel (jit-decorated or plain) on the emulator."""
    if not isinstance(kernel, Kernel):
        kernel = Kernel(kernel)

    @functools.wraps(kernel.fn)
    def simulated(*args, **kwargs):
        return run(kernel, args, kwargs)

    return simulated


def _input_tensor(ctx, name, value):
    dtype = dtypes.as_dtype(value.dtype, f"argument {name!r}")
    shape = tuple(value.shape)
    if not shape:
        raise ValueError(f"argument {name!r}: NKI tensors need at least one dimension, got a 0-d array")
    data = (
        np.array(value, dtype=dtype, copy=True, order="C") if ctx.numerics and isinstance(value, np.ndarray) else None
    )
    storage = Storage(ctx, shape, dtype, "hbm", name, data)
    if data is None and ctx.numerics:
        raise TypeError(f"argument {name!r}: expected a numpy array, got {type(value).__name__}")
    return NkiTensor(shape, dtype, storage, MemoryRegion.shared_hbm, name)


def _output(value, numerics, what="return value"):
    if value is None:
        return None
    if isinstance(value, NkiTensor):
        if value.is_on_chip:
            raise ValueError(f"kernel {what}: {value.describe()} is on chip; kernels return HBM tensors")
        if numerics:
            return np.array(value.array(), copy=True)
        return np.full(value.shape, dtypes.fill_value(value.dtype), dtype=value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_output(v, numerics, what) for v in value)
    if isinstance(value, dict):
        return {k: _output(v, numerics, what) for k, v in value.items()}
    raise TypeError(f"kernel {what}: expected NKI tensors (or tuples of them), got {type(value).__name__}")


def _is_spec(value):
    return isinstance(value, Spec)


class Spec:
    """A (shape, dtype) placeholder argument for count-only traces."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtypes.as_dtype(dtype)


def run(kernel, args, kwargs, numerics=None, keep_tensors=False, report=True):
    """Simulate kernel over its grid; returns numpy outputs (or the returned tensors with keep_tensors).

    report: hand the finished run to trace listeners (profiles); off for shape inference.
    """
    numerics = context.numerics_enabled() if numerics is None else numerics
    with launching(numerics):
        ctx = new_context(kernel, numerics)
        outputs = run_in_context(kernel, ctx, args, kwargs, keep_tensors)
        if report:
            trace.kernel_finished(ctx.run)
    return outputs


@contextlib.contextmanager
def launching(numerics):
    """One launch at a time (the launch lock), with single-threaded BLAS while numerics are on."""
    single_threaded_blas = (
        threadpool_limits(1, user_api="blas") if numerics and threadpool_limits else contextlib.nullcontext()
    )
    with _launch_lock, single_threaded_blas:
        yield


def new_context(kernel, numerics, target=None, rank=0, world=None):
    """The KernelContext of one launch of kernel (one rank of it under simulate_spmd)."""
    target = context.resolve_target() if target is None else target
    return context.KernelContext(kernel.fn.__qualname__, target, kernel.grid, numerics, rank=rank, world=world)


def run_in_context(kernel, ctx, args, kwargs, keep_tensors=False):
    """Run kernel's programs in ctx on this thread (the caller holds the launch lock); its outputs."""
    for value in list(args) + list(kwargs.values()):
        if _is_foreign_array(value) and not isinstance(value, Spec):
            raise TypeError(
                f"kernel {kernel.fn.__qualname__}: the emulator simulates numpy arrays only, got a "
                f"{type(value).__name__} argument"
            )
    names = kernel._parameters
    with context.running(ctx):

        def convert(name, value):
            if isinstance(value, (np.ndarray, Spec)):
                return _input_tensor(ctx, name, value)
            if isinstance(value, (list, tuple)) and any(isinstance(v, (np.ndarray, Spec)) for v in value):
                # lists of tensors (per-layer weights) are kernel arguments too
                return type(value)(convert(f"{name}[{i}]", v) for i, v in enumerate(value))
            return value

        tensor_args = [convert(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)]
        tensor_kwargs = {k: convert(k, v) for k, v in kwargs.items()}
        result = None
        for index in itertools.product(*(range(g) for g in kernel.grid)):
            ctx.program_index = index
            ctx.shared_hbm_cursor = 0
            ctx.body_frame = None
            result = kernel.fn(*tensor_args, **tensor_kwargs)
        return result if keep_tensors else _output(result, ctx.numerics)


def output_specs(kernel, arg_specs, kwargs=None, grid=None):
    """[(shape, numpy dtype), ...] of the tensors `kernel` returns, from a count-only trace.

    arg_specs: one entry per positional argument: a (shape, dtype) pair or anything with .shape and .dtype
    (numpy arrays, jax ShapeDtypeStructs) for tensors; other values pass through as constants.
    """
    if not isinstance(kernel, Kernel):
        kernel = Kernel(kernel)
    if grid is not None:
        kernel = kernel[grid]

    def spec(value):
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (tuple, list)):
            return Spec(value[0], value[1])
        if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.generic):
            return Spec(value.shape, value.dtype)
        return value

    args = [spec(a) for a in arg_specs]
    result = run(kernel, args, dict(kwargs or {}), numerics=False, keep_tensors=True, report=False)
    flat = [result] if isinstance(result, NkiTensor) else list(result or ())
    specs = []
    for t in flat:
        if not isinstance(t, NkiTensor):
            raise TypeError(f"output_specs: kernel returned {type(t).__name__}, expected NKI tensors")
        specs.append((tuple(t.shape), t.dtype))
    return specs
