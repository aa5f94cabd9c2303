"""Tensor parallelism: how svd_matmul and svd_mlp split over a device mesh.

Two ways of writing SPMD programs in JAX, two mechanisms here:

* `jit` with shardings (the automatic partitioner, Shardy). The lowering wraps the
  per-shard computation in `jax.experimental.custom_partitioning` with an
  einsum-like sharding rule that names the factor behind every dimension:

      svd_matmul  x [*B, *T, k], u [*B, k, r], v [*B, r, n] -> [*B, *T, n]
      svd_mlp     x [*B, *T, h], gate_u [*B, h, rg], gate_v [*B, rg, i],
                  up_u [*B, h, ru], up_v [*B, ru, i], down_u [*B, i, rd],
                  down_v [*B, rd, o] -> [*B, *T, o]

  Batch, token and output factors split for free. Summed factors (k and r of
  svd_matmul; i and rd of svd_mlp, the Megatron layout) split too: each device
  runs the per-shard computation on its blocks and one all-reduce of the output
  (in float32) completes the sum. h, rg and ru of svd_mlp feed the activation, so
  they are never split. Operand blocks always come from the operands' own
  shardings (a replicated operand is sliced, which is free), weights first, so a
  sharded weight is never gathered. The per-shard computation is whatever
  `lowering.local_impl` returns: the XLA reference, the emulator callback or the
  NKI kernel, so a host callback sees only its device's blocks (`HostKernel`).

* `jax.shard_map`. The user has already split the arrays; the primitives bind on
  the blocks. `match_varying_axes` casts every operand to the union of the
  operands' varying manual axes before binding, so that reverse mode sums the
  cotangent of a replicated weight over the axes the activations vary on.
"""

import math

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_neuronmm._compat import (Primitive, add_host_callback, cpu_host_callback_lowering, lowering_platform,
                                  register_lowering, varying_axes)
from jax_neuronmm.shapes import accumulation_dtype


def match_varying_axes(*operands):
    """Casts operands to the union of their varying manual axes (inside shard_map).

    Outside shard_map, or with `check_vma=False`, no operand varies and this
    returns them unchanged.
    """
    axes = [varying_axes(jax.typeof(a)) for a in operands]
    union = frozenset().union(*axes)
    return tuple(
        jax.lax.pcast(a, tuple(union - own), to="varying") if union - own else a
        for a, own in zip(operands, axes)
    )


def check_varying_axes(op, names, avals):
    """Abstract eval: every operand must vary over the same manual axes.

    The public entry points reconcile them; a direct bind that does not would get
    wrong cotangents for the invariant operands, so it fails here instead.
    """
    axes = {name: varying_axes(a) for name, a in zip(names, avals)}
    if len(set(axes.values())) > 1:
        listing = ", ".join(f"{n}={sorted(map(str, a))}" for n, a in axes.items())
        raise ValueError(
            f"{op}: operands vary over different manual mesh axes ({listing}); expected the same axes "
            f"for all of them: call the public function, which casts them with jax.lax.pcast"
        )


class FactorRule:
    """Which factor each dimension of each operand and of the result belongs to."""

    def __init__(self, operands, result, reduction=(), need_replication=()):
        self.operands = tuple(tuple(f) for f in operands)
        self.result = tuple(result)
        self.reduction = tuple(reduction)
        self.need_replication = tuple(need_replication)

    def sdy_rule(self):
        return ", ".join(" ".join(f) for f in self.operands) + " -> " + " ".join(self.result)


def _leading_factors(n_batch, x_ndim):
    batch = tuple(f"b{i}" for i in range(n_batch))
    tokens = tuple(f"t{i}" for i in range(x_ndim - n_batch - 1))
    return batch, tokens


def svd_matmul_rule(n_batch, x_ndim):
    batch, tokens = _leading_factors(n_batch, x_ndim)
    return FactorRule(
        operands=(batch + tokens + ("k",), batch + ("k", "r"), batch + ("r", "n")),
        result=batch + tokens + ("n",),
        reduction=("k", "r"),
    )


def svd_mlp_rule(n_batch, x_ndim):
    batch, tokens = _leading_factors(n_batch, x_ndim)
    return FactorRule(
        operands=(batch + tokens + ("h",), batch + ("h", "rg"), batch + ("rg", "i"), batch + ("h", "ru"),
                  batch + ("ru", "i"), batch + ("i", "rd"), batch + ("rd", "o")),
        result=batch + tokens + ("o",),
        reduction=("i", "rd"),
        need_replication=("h", "rg", "ru"),
    )


def _spec_axes(spec, ndim):
    """PartitionSpec -> one tuple of mesh axis names per dimension (empty: not split)."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return [() if e is None else (e if isinstance(e, tuple) else (e,)) for e in entries]


def _assign_factor_axes(rule, mesh, arg_shapes, result_shape):
    """Mesh axes of every factor, read from the operands' shardings.

    Weights are read first, then the activations, then the result, so a weight
    keeps the layout it has; an axis serves at most one factor. A summed factor is
    split only when its size divides evenly (padding would enter the sum).
    """
    sizes, found = {}, []
    for factors, shape in zip(rule.operands + (rule.result,), arg_shapes + [result_shape]):
        for factor, dim in zip(factors, shape.shape):
            sizes[factor] = dim
    ordered = list(range(1, len(rule.operands))) + [0]
    for index in ordered:
        found.append((rule.operands[index], arg_shapes[index].sharding))
    found.append((rule.result, result_shape.sharding))
    assigned, used = {}, set()
    for factors, sharding in found:
        if not isinstance(sharding, NamedSharding):
            continue
        for factor, axes in zip(factors, _spec_axes(sharding.spec, len(factors))):
            if not axes or factor in assigned or factor in rule.need_replication or used & set(axes):
                continue
            if factor in rule.reduction and sizes[factor] % math.prod(mesh.shape[a] for a in axes):
                continue
            assigned[factor] = axes
            used.update(axes)
    return assigned


def _spec(factors, assigned):
    entries = []
    for factor in factors:
        axes = assigned.get(factor, ())
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def _replicated_fallback(arg_shapes, result_shape):
    """Shardings without a mesh (GSPMD): run the whole computation on every device."""
    devices = sorted(arg_shapes[0].sharding.device_set, key=lambda d: d.id)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("devices",))
    replicated = NamedSharding(mesh, PartitionSpec())
    return mesh, tuple(replicated for _ in arg_shapes), replicated


def _scatter_dims(rule, mesh, result_shape, assigned, summed_axes):
    """Result dims to reduce-scatter: the caller wants them split over summed axes.

    Returns {result dim: axes}. The remaining summed axes are all-reduced.
    """
    requested = result_shape.sharding
    if not isinstance(requested, NamedSharding):
        return {}
    scatter, free = {}, set(summed_axes)
    for dim, (factor, axes) in enumerate(zip(rule.result, _spec_axes(requested.spec, len(rule.result)))):
        if (axes and factor not in assigned and set(axes) <= free
                and result_shape.shape[dim] % math.prod(mesh.shape[a] for a in axes) == 0):
            scatter[dim] = axes
            free -= set(axes)
    return scatter


def partitioned(local_fn, rule, params):
    """`local_fn(*operands, **params)` made shardable: a function of the operands.

    Under a multi-device jit the partitioner calls `local_fn` on each device's
    blocks; on one device or inside shard_map it calls it on the arrays as given.
    """
    out_dtype = np.dtype(params["out_dtype"])

    @custom_partitioning
    def call(*operands):
        return local_fn(*operands, **params)

    def partition(mesh, arg_shapes, result_shape):
        arg_shapes = list(arg_shapes)
        if mesh.empty or not all(isinstance(a.sharding, NamedSharding) for a in arg_shapes):
            mesh, arg_shardings, result_sharding = _replicated_fallback(arg_shapes, result_shape)
            return mesh, call.fun, result_sharding, arg_shardings
        assigned = _assign_factor_axes(rule, mesh, arg_shapes, result_shape)
        arg_shardings = tuple(NamedSharding(mesh, _spec(f, assigned)) for f in rule.operands)
        summed_axes = tuple(a for factor in rule.reduction for a in assigned.get(factor, ()))
        scatter = _scatter_dims(rule, mesh, result_shape, assigned, summed_axes)
        result_axes = {**assigned, **{rule.result[d]: axes for d, axes in scatter.items()}}
        result_sharding = NamedSharding(mesh, _spec(rule.result, result_axes))
        if not summed_axes:
            return mesh, call.fun, result_sharding, arg_shardings
        scattered = {a for axes in scatter.values() for a in axes}
        all_reduced = tuple(a for a in summed_axes if a not in scattered)

        def per_shard(*blocks):
            # Partial sums leave the device in float32 (PSUM precision), rounded once after the sum.
            acc = np.promote_types(accumulation_dtype(blocks[0].dtype), out_dtype)
            partial_sum = local_fn(*blocks, **{**params, "out_dtype": acc})
            for dim, axes in scatter.items():
                partial_sum = jax.lax.psum_scatter(partial_sum, axes, scatter_dimension=dim, tiled=True)
            if all_reduced:
                partial_sum = jax.lax.psum(partial_sum, all_reduced)
            return partial_sum.astype(out_dtype)

        return mesh, per_shard, result_sharding, arg_shardings

    call.def_partition(
        partition,
        sharding_rule=rule.sdy_rule(),
        reduction_factors=rule.reduction,
        need_replication_factors=rule.need_replication,
    )
    return call


class HostKernel:
    """A per-shard computation that runs on the host: `fn(*numpy operands, **params) -> numpy result`.

    What `lowering.local_impl` returns for a backend that is not traceable (the
    NKI emulator). `jax.pure_callback` cannot serve here: inside a partition it
    registers with a throwaway module and crashes at run time. `host_local_fn`
    registers the callback with the executable being lowered instead.
    """

    def __init__(self, fn):
        self.fn = fn


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
