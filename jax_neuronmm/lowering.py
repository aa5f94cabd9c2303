"""Lowering machinery every op file calls once, at its bottom (`register(primitive, reference=, kernels=,
partitioning=)`): one rule per primitive for every platform, wrapped by `sharding.partitioned` so the SPMD
partitioner runs it on each device's blocks. Backends plug in per shard: "xla" runs the op's jnp `reference`,
"emulator" its `kernels` (`kernel_calls.KernelLaunches`) on numpy blocks in a host callback, "neuron" the same
kernels traced with JAX arrays (the real `nki.jit` emits the custom calls). The rule is registered for all
platforms at once, so a Neuron plugin loaded later gets the kernels too. `register_whole` serves ops that run on
whole arrays on one device (the decode step, which partitions by shard_map in `decode_step_parallel`).
"""

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from jax_neuronmm import explicit_sharding, host_callback, kernel_calls, sharding
from jax_neuronmm._compat import (
    add_host_callback,
    cpu_host_callback_lowering,
    lower_fun,
    lowering_platform,
    lowers_whole_arrays,
    partially_manual,
    register_lowering,
    require_devices_during_lowering,
)
from jax_neuronmm.backend import effective_backend
from nki_kernels.dispatch import launch_target


@dataclasses.dataclass(frozen=True)
class Rules:
    """What `register` was given for one primitive."""

    reference: Callable
    kernels: kernel_calls.KernelLaunches
    partitioning: Callable | None


_rules = {}  # primitive -> Rules, filled by register()


def register(primitive, *, reference, kernels, partitioning):
    """Registers the lowering of `primitive` on every platform.

    reference: jnp function `(*operands, **params) -> result`, the XLA backend and the numerics the kernels mirror.
    kernels: `kernel_calls.KernelLaunches`, the emulator and Trainium backends.
    partitioning: `(n_batch, x_ndim, n_operands) -> sharding.FactorRule`, how the operands split over a mesh
      (n_operands: ops with optional operands, such as fp8 scales, bind a varying number).
    """
    _rules[primitive] = Rules(reference, kernels, partitioning)
    require_devices_during_lowering(primitive)
    register_lowering(primitive, functools.partial(_lower, primitive))


def local_impl(primitive, platform):
    """The per-shard computation of `primitive` on `platform` ("cpu", "neuron", ...).

    Returns a jnp-traceable callable `(*operands, **params) -> result` with the
    primitive's operands (n_batch leading batch dims included) and params, or a
    `host_callback.HostKernel` whose numpy function takes the same arguments.
    """
    rules = _rules[primitive]
    backend = effective_backend(platform)
    if backend == "xla":
        return rules.reference
    if backend == "emulator":
        # The emulator's target is read when the kernels run (as `emulator.use_target` around the call says)
        # and, for the shape check, when lowering.
        kernels = rules.kernels
        return host_callback.HostKernel(
            lambda *blocks, **params: kernels(*blocks, target=launch_target(emulated=True), **params),
            check=lambda *operands, **params: kernels.checked_plan(
                *operands, target=launch_target(emulated=True), **params
            ),
        )
    return functools.partial(rules.kernels, target=launch_target(emulated=False))


def _lower(primitive, ctx, *operands, **params):
    params = explicit_sharding.local_params(params)
    platform = lowering_platform(ctx)
    backend = effective_backend(platform)
    if backend != "xla":
        kernel_calls.check_kernel_dtype(backend, ctx.avals_in[0].dtype)
    factor_rule = _rules[primitive].partitioning(params["n_batch"], ctx.avals_in[0].ndim, len(ctx.avals_in))
    local_fn = local_impl(primitive, platform)
    if backend == "xla" and partially_manual(ctx):
        # The reference's jnp ops on the blocks shard_map gives, left for XLA to partition over the axes that are
        # not Manual: custom_partitioning there leaves a Sharding custom call that JAX 0.11 cannot compile.
        reference = lower_fun(functools.partial(local_fn, **params), multiple_results=False)
        return explicit_sharding.constrain_results(ctx, reference(explicit_sharding.local_context(ctx), *operands))
    check_blocks = None
    if isinstance(local_fn, host_callback.HostKernel):
        # Shapes no kernel fits fail here, with the reason, rather than in the host callback at run time:
        # checked on the operands when they are what the kernels get, else on each device's blocks.
        if local_fn.check is not None:
            check_blocks = functools.partial(local_fn.check, **params)
            if lowers_whole_arrays(ctx):
                check_blocks(*ctx.avals_in)
                check_blocks = None
        local_fn = host_callback.host_local_fn(ctx, local_fn, params)
    call = sharding.partitioned(local_fn, factor_rule, params, check_blocks=check_blocks)
    results = lower_fun(call, multiple_results=False)(explicit_sharding.local_context(ctx), *operands)
    return explicit_sharding.constrain_results(ctx, results)


def register_whole(primitive, *, reference, kernels):
    """Registers the lowering of a multiple-result `primitive` whose kernels take whole arrays on one device.

    reference: jnp function `(*operands, **params) -> results`, the XLA backend.
    kernels: `kernel_calls.KernelLaunches` whose run returns the results; "emulator" runs it in one host
    callback (results cast to the primitive's result dtypes), "neuron" traces it with JAX arrays.
    """
    _rules[primitive] = Rules(reference, kernels, None)
    register_lowering(primitive, functools.partial(_lower_whole, primitive))


def _lower_whole(primitive, ctx, *operands, **params):
    rules = _rules[primitive]
    backend = effective_backend(lowering_platform(ctx))
    if backend == "xla":
        # Traced on unsplit types (under Explicit mesh axes the reference's dots would ask for out_sharding),
        # results pinned to the types abstract eval gave.
        reference = lower_fun(functools.partial(rules.reference, **params), multiple_results=True)
        return explicit_sharding.constrain_results(ctx, reference(explicit_sharding.local_context(ctx), *operands))
    kernel_calls.check_kernel_dtype(backend, ctx.avals_in[0].dtype)
    target = launch_target(emulated=backend == "emulator")
    if backend == "neuron":
        return lower_fun(functools.partial(rules.kernels, target=target, **params), multiple_results=True)(
            ctx, *operands
        )
    rules.kernels.checked_plan(*ctx.avals_in, target=target, **params)  # fails here, not inside the callback
    dtypes = [np.dtype(aval.dtype) for aval in ctx.avals_out]

    def on_host(*arrays):
        # The emulator's target is read when the kernels run (as `emulator.use_target` around the call says).
        results = rules.kernels(*arrays, target=launch_target(emulated=True), **params)
        return tuple(np.asarray(r, dtype=d) for r, d in zip(results, dtypes))

    return cpu_host_callback_lowering(ctx, operands, add_host_callback(ctx, on_host))
