"""Lowering rules: one per primitive, for every platform, shardable.

Each rule traces the primitive's per-shard computation, `local_impl(primitive,
platform)`, wrapped by `sharding.partitioned`: on one device (or inside
shard_map) it runs on the operands as given; under a multi-device jit the SPMD
partitioner runs it on every device's blocks (see `sharding.py`). Backends (the
emulator host callback, NKI kernels on Trainium) plug in at `local_impl`, so
they are partitioned like the XLA reference and only ever see one device's blocks.
A host backend returns `sharding.HostKernel(numpy_fn)` from `local_impl`.

Backends (`backend.py`): "xla" runs the reference; "emulator" runs the NKI
kernels (`kernel_calls.py`) on numpy blocks in a host callback; on platform
"neuron" the same `kernel_calls` functions are traced with JAX arrays, and the
real `nki.jit` turns each kernel launch into its custom call. The "neuron" rule
is registered only once JAX knows that platform (`ensure_neuron_lowering`).
"""

from jax_neuronmm import explicit_sharding, kernel_calls, reference, sharding
from jax_neuronmm._compat import (is_known_platform, lower_fun, lowering_platform, register_lowering,
                                  require_devices_during_lowering)
from jax_neuronmm.backend import effective_backend
from jax_neuronmm.svd_matmul import svd_matmul_p
from jax_neuronmm.svd_mlp import svd_mlp_p

_REFERENCES = {svd_matmul_p: reference.svd_matmul_ref, svd_mlp_p: reference.svd_mlp_ref}
_FACTOR_RULES = {svd_matmul_p: sharding.svd_matmul_rule, svd_mlp_p: sharding.svd_mlp_rule}
_KERNEL_CALLS = {svd_matmul_p: kernel_calls.svd_matmul_kernels, svd_mlp_p: kernel_calls.svd_mlp_kernels}


def local_impl(primitive, platform):
    """The per-shard computation of `primitive` on `platform` ("cpu", "neuron", ...).

    Returns a jnp-traceable callable `(*operands, **params) -> result` with the
    primitive's operands (n_batch leading batch dims included) and params, or a
    `sharding.HostKernel` whose numpy function takes the same arguments.
    """
    backend = effective_backend(platform)
    if backend == "xla":
        return _REFERENCES[primitive]
    if backend == "emulator":
        return sharding.HostKernel(_KERNEL_CALLS[primitive])
    return _KERNEL_CALLS[primitive]


def _rule(primitive):
    def lower(ctx, *operands, **params):
        params = explicit_sharding.local_params(params)
        platform = lowering_platform(ctx)
        backend = effective_backend(platform)
        if backend != "xla":
            kernel_calls.check_kernel_dtype(backend, ctx.avals_in[0].dtype)
        factor_rule = _FACTOR_RULES[primitive](params["n_batch"], ctx.avals_in[0].ndim)
        local_fn = local_impl(primitive, platform)
        if isinstance(local_fn, sharding.HostKernel):
            local_fn = sharding.host_local_fn(ctx, local_fn, params)
        call = sharding.partitioned(local_fn, factor_rule, params)
        results = lower_fun(call, multiple_results=False)(explicit_sharding.local_context(ctx), *operands)
        return explicit_sharding.constrain_results(ctx, results)

    return lower


PRIMITIVES = (svd_matmul_p, svd_mlp_p)

for _primitive in PRIMITIVES:
    require_devices_during_lowering(_primitive)
    register_lowering(_primitive, _rule(_primitive))

_neuron_registered = []


def ensure_neuron_lowering():
    """Registers the kernel lowering for platform "neuron" once the Neuron PJRT plugin made it known.

    Called at import and again before every bind, so a plugin loaded after
    jax_neuronmm still gets the kernels. Returns whether the rule is registered.
    """
    if not is_known_platform("neuron"):
        _neuron_registered.clear()  # a stand-in platform (tests) may have come and gone
        return False
    if not _neuron_registered:
        for primitive in PRIMITIVES:
            register_lowering(primitive, _rule(primitive), platform="neuron")
        _neuron_registered.append(True)
    return True


ensure_neuron_lowering()
