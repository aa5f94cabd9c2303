"""Every import of JAX internals lives here, so a JAX upgrade touches one file.

Supported: JAX 0.10, 0.11 and 0.12 (README: Versions).
"""

from jax._src.dispatch import apply_primitive  # eager execution of a primitive
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["Primitive", "ad", "apply_primitive", "batching", "mlir", "register_lowering", "lower_fun"]


def register_lowering(primitive, rule, platform=None):
    """Registers `rule` for `primitive`, for every platform or for one."""
    mlir.register_lowering(primitive, rule, platform=platform)


def lower_fun(fun, multiple_results):
    """Turns a jnp-level function into an MLIR lowering rule."""
    return mlir.lower_fun(fun, multiple_results=multiple_results)


# --- Sharding support (jax_neuronmm/sharding.py, host_callback.py, lowering.py) ---------------------------------
from jax._src import dispatch as _dispatch  # noqa: E402
from jax._src import sharding_impls as _sharding_impls  # noqa: E402


def varying_axes(aval):
    """The manual mesh axes an abstract value varies over inside shard_map (empty outside)."""
    manual_axis_type = getattr(aval, "mat", None)  # JAX 0.10
    if manual_axis_type is not None:
        return frozenset(manual_axis_type.varying)
    return frozenset(getattr(aval, "vma", frozenset()))  # the spelling before and maybe after


def require_devices_during_lowering(primitive):
    """Lowering `primitive` emits custom_partitioning, which needs the concrete device assignment."""
    _dispatch.prim_requires_devices_during_lowering.add(primitive)


def add_host_callback(ctx, host_fn):
    """Registers `host_fn` with the executable `ctx` lowers into; returns its callback index.

    jax.pure_callback registers with the module being built, which inside a
    custom_partitioning partition is a throwaway module: its index then points
    into the outer executable's (empty) list. Registering with the outer module
    and emitting the call with this index makes per-shard host callbacks work.
    """
    ctx.module_context.add_host_callback(host_fn)
    return len(ctx.module_context.host_callbacks) - 1


def lowers_whole_arrays(ctx):
    """True when a custom_partitioning call lowered in `ctx` runs its function on the operands as given (one
    device, or inside a shard_map manual over every mesh axis); False when the SPMD partitioner calls its
    partition callback for each device's blocks. Mirrors JAX's custom_partitioning lowering rule."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        if set(axis_context.manual_axes) == set(axis_context.mesh.axis_names):
            return True
        devices = axis_context.mesh._flat_devices_tuple
    elif isinstance(axis_context, _sharding_impls.ShardingContext):
        devices = axis_context.device_assignment
    else:
        devices = None
    return not devices or len(devices) == 1


def partially_manual(ctx):
    """True when `ctx` lowers inside a shard_map that is Manual over some mesh axes but not all of them."""
    axis_context = ctx.module_context.axis_context
    if not isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        return False
    manual = set(axis_context.manual_axes)
    return bool(manual) and manual != set(axis_context.mesh.axis_names)


__all__ += [
    "add_host_callback",
    "lowers_whole_arrays",
    "partially_manual",
    "require_devices_during_lowering",
    "varying_axes",
]


# --- Backends (jax_neuronmm/backend.py) -----------------------------------------------------------
from jax._src import config as _config  # noqa: E402
from jax._src import xla_bridge as _xla_bridge  # noqa: E402


def define_string_enum_state(name, values, default, help_text):
    """A JAX config option whose value is part of the jit cache key (so changing it re-lowers)."""
    return _config.enum_state(name, values, default, help_text, include_in_jit_key=True, include_in_trace_context=True)


def is_known_platform(platform):
    """True when some PJRT plugin or built-in backend registered `platform` with JAX."""
    return _xla_bridge.is_known_platform(platform)


__all__ += ["define_string_enum_state", "is_known_platform"]


# --- Lowering rules and the emulator's host callbacks (jax_neuronmm/lowering.py, host_callback.py) ---------
import numpy as _np  # noqa: E402
from jax import ffi as _jax_ffi  # noqa: E402


def lowering_platform(ctx):
    """The platform a lowering rule is emitting code for ("cpu", "neuron", ...)."""
    return ctx.module_context.platforms[0]


def cpu_host_callback_lowering(ctx, operands, index):
    """Emits a call of the host callback registered at `index` (see add_host_callback) on the CPU."""
    rule = _jax_ffi.ffi_lowering("xla_ffi_python_cpu_callback", has_side_effect=False)
    return rule(ctx, *operands, index=_np.uint64(index))


__all__ += ["cpu_host_callback_lowering", "lowering_platform"]


# --- Sharding in types: Explicit mesh axes (jax_neuronmm/explicit_sharding.py) -------------------
from jax._src.core import ShardingTypeError  # noqa: E402
from jax._src.interpreters.mlir import lower_with_sharding_in_types  # noqa: E402
from jax._src.sharding_impls import canonicalize_sharding  # noqa: E402

__all__ += ["ShardingTypeError", "canonicalize_sharding", "lower_with_sharding_in_types"]


# --- Checks of concrete values before binding (jax_neuronmm/shapes.py) ---------------------------------------
from jax._src.core import Tracer as _Tracer  # noqa: E402


def is_tracer(x):
    """True when `x` is a JAX tracer (its value is not known at trace time)."""
    return isinstance(x, _Tracer)


__all__ += ["is_tracer"]
