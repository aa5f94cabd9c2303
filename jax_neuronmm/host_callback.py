"""Per-shard computations that run on the host: how the emulator backend runs NKI kernels inside a jit.

`lowering.local_impl` returns a `HostKernel` for the emulator backend; the lowering turns it into a traceable
per-shard function with `host_local_fn`, which the partitioner (`sharding.partitioned`) then runs on each
device's blocks like any other backend. `host_call` binds a numpy function with several results as one op of a
traced computation (the emulator's tensor-parallel decode step runs every rank through it).
"""

import numpy as np

from jax_neuronmm._compat import (
    Primitive,
    add_host_callback,
    cpu_host_callback_lowering,
    lowering_platform,
    register_lowering,
)
from jax_neuronmm.shapes import accumulation_dtype


class HostKernel:
    """A per-shard computation that runs on the host: `fn(*numpy operands, **params) -> numpy result`.

    check: None, or `check(*blocks, **params)` with the abstract values of one device's blocks, called when the
    computation is lowered (`lowering.py`, `sharding.partitioned`): it raises what can be known from shapes and
    dtypes (a ValueError naming the op, shape and target) before anything runs, instead of inside the host
    callback.

    `jax.pure_callback` cannot serve here: inside a partition it registers with a throwaway module and
    crashes at run time. `host_local_fn` registers the callback with the executable being lowered instead.
    """

    def __init__(self, fn, check=None):
        self.fn = fn
        self.check = check


host_block_call_p = Primitive("neuronmm_host_block_call")


@host_block_call_p.def_abstract_eval
def _host_block_call_abstract_eval(*operands, index, shape, dtype):
    del index
    return operands[0].update(shape=shape, dtype=dtype, weak_type=False)


def _host_block_call_lowering(ctx, *operands, index, shape, dtype):
    del shape, dtype
    if lowering_platform(ctx) != "cpu":
        raise NotImplementedError(f"host kernels run on the cpu platform, not {lowering_platform(ctx)!r}")
    return cpu_host_callback_lowering(ctx, operands, index)


register_lowering(host_block_call_p, _host_block_call_lowering)


def host_local_fn(ctx, kernel, params):
    """A traceable per-shard computation that calls `kernel.fn` on the host, on the blocks it is given.

    The host returns the result in float32 (float64 for float64 operands), the
    precision partial sums travel in; the cast to the requested dtype is traced.
    Result shape: x.shape[:-1] + last_operand.shape[-1:] (true of both primitives).
    """
    acc = np.dtype(np.promote_types(accumulation_dtype(ctx.avals_in[0].dtype), params["out_dtype"]))
    host_params = {**params, "out_dtype": acc}

    def on_host(*blocks):
        return (np.asarray(kernel.fn(*blocks, **host_params), dtype=acc),)

    index = add_host_callback(ctx, on_host)

    def local(*operands, out_dtype, **unused_params):
        shape = operands[0].shape[:-1] + operands[-1].shape[-1:]
        return host_block_call_p.bind(*operands, index=index, shape=shape, dtype=acc).astype(out_dtype)

    return local


host_call_p = Primitive("neuronmm_host_call")
host_call_p.multiple_results = True


def host_call(fn, results, *operands):
    """`fn(*operands as numpy arrays) -> arrays`, run on the host as one op of the computation being traced (CPU
    platform only), for a computation on one device or inside a `jax.shard_map` manual over every mesh axis (there
    on each device, with its blocks); it states no sharding for the automatic partitioner. results: one (shape,
    dtype) per result, which fn's results are cast to. fn gets the operands' buffers as numpy arrays, with no
    transfer through a JAX device (`jax.pure_callback` makes one, which can wait on the very device running the
    callback), and must be hashable (a function, or a functools.partial of one). The op has no derivative and no
    batching rule."""
    results = tuple((tuple(shape), np.dtype(dtype)) for shape, dtype in results)
    return host_call_p.bind(*operands, fn=fn, results=results)


@host_call_p.def_abstract_eval
def _host_call_abstract_eval(*operands, fn, results):
    del fn
    return [operands[0].update(shape=shape, dtype=dtype, weak_type=False) for shape, dtype in results]


def _host_call_lowering(ctx, *operands, fn, results):
    if lowering_platform(ctx) != "cpu":
        raise NotImplementedError(f"host calls run on the cpu platform, not {lowering_platform(ctx)!r}")
    dtypes = [dtype for _, dtype in results]

    def on_host(*arrays):
        return tuple(np.asarray(r, dtype=d) for r, d in zip(fn(*arrays), dtypes))

    return cpu_host_callback_lowering(ctx, operands, add_host_callback(ctx, on_host))


register_lowering(host_call_p, _host_call_lowering)
