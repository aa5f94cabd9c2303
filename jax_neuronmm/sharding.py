"""Tensor parallelism: how svd_matmul and svd_mlp split over a device mesh.

Under `jit` with shardings the lowering wraps the per-shard computation in `custom_partitioning` with an
einsum-like rule (`FactorRule`) naming the factor behind every dimension: batch, token and output factors split
for free, summed factors split with one float32 all-reduce of the output, and a sharded weight is never gathered.
Under `jax.shard_map` the primitives bind on the blocks; `match_varying_axes` makes reverse mode sum a replicated
weight's cotangent over the axes the activations vary on. docs/sharding.md has the rules in full.
"""

import math

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec, use_abstract_mesh

from jax_neuronmm._compat import varying_axes
from jax_neuronmm.shapes import accumulation_dtype


def match_varying_axes(*operands):
    """Casts operands to the union of their varying manual axes (inside shard_map).

    Outside shard_map, or with `check_vma=False`, no operand varies and this
    returns them unchanged.
    """
    axes = [varying_axes(jax.typeof(a)) for a in operands]
    union = frozenset().union(*axes)
    return tuple(
        jax.lax.pcast(a, tuple(union - own), to="varying") if union - own else a for a, own in zip(operands, axes)
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
    """Which factor each dimension of each operand and of the result belongs to.

    reduction: factors summed over (split: one all-reduce or reduce-scatter of the output); need_replication:
    factors never split (they feed a nonlinearity).
    """

    def __init__(self, operands, result, reduction=(), need_replication=()):
        self.operands = tuple(tuple(f) for f in operands)
        self.result = tuple(result)
        self.reduction = tuple(reduction)
        self.need_replication = tuple(need_replication)

    def sdy_rule(self):
        return ", ".join(" ".join(f) for f in self.operands) + " -> " + " ".join(self.result)


def leading_factors(n_batch, x_ndim):
    """Factor names of the leading dims of an op's activations x [*B, *T, F]: (batch names, token names)."""
    batch = tuple(f"b{i}" for i in range(n_batch))
    tokens = tuple(f"t{i}" for i in range(x_ndim - n_batch - 1))
    return batch, tokens


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
        if (
            axes
            and factor not in assigned
            and set(axes) <= free
            and result_shape.shape[dim] % math.prod(mesh.shape[a] for a in axes) == 0
        ):
            scatter[dim] = axes
            free -= set(axes)
    return scatter


def _check_blocks(check_blocks, arg_shapes, arg_shardings):
    if check_blocks is not None:
        check_blocks(
            *(
                jax.ShapeDtypeStruct(sharding.shard_shape(shape.shape), shape.dtype)
                for shape, sharding in zip(arg_shapes, arg_shardings)
            )
        )


def partitioned(local_fn, rule, params, check_blocks=None):
    """`local_fn(*operands, **params)` made shardable: a function of the operands.

    Under a multi-device jit the partitioner calls `local_fn` on each device's
    blocks; on one device or inside shard_map it calls it on the arrays as given.
    check_blocks: None, or a function of one device's block shapes (ShapeDtypeStructs) that raises for blocks
    `local_fn` cannot take; called when the partitioner has chosen the blocks, before `local_fn` is traced on
    them (on whole arrays the caller checks, see `_compat.lowers_whole_arrays`).
    """
    out_dtype = np.dtype(params["out_dtype"])

    @custom_partitioning
    def call(*operands):
        return local_fn(*operands, **params)

    def partition(mesh, arg_shapes, result_shape):
        arg_shapes = list(arg_shapes)
        if mesh.empty or not all(isinstance(a.sharding, NamedSharding) for a in arg_shapes):
            mesh, arg_shardings, result_sharding = _replicated_fallback(arg_shapes, result_shape)
            _check_blocks(check_blocks, arg_shapes, arg_shardings)
            return mesh, call.fun, result_sharding, arg_shardings
        assigned = _assign_factor_axes(rule, mesh, arg_shapes, result_shape)
        arg_shardings = tuple(NamedSharding(mesh, _spec(f, assigned)) for f in rule.operands)
        _check_blocks(check_blocks, arg_shapes, arg_shardings)
        summed_axes = tuple(a for factor in rule.reduction for a in assigned.get(factor, ()))
        scatter = _scatter_dims(rule, mesh, result_shape, assigned, summed_axes)
        result_axes = {**assigned, **{rule.result[d]: axes for d, axes in scatter.items()}}
        result_sharding = NamedSharding(mesh, _spec(rule.result, result_axes))
        if not summed_axes:
            return mesh, call.fun, result_sharding, arg_shardings
        scattered = {a for axes in scatter.values() for a in axes}
        all_reduced = tuple(a for a in summed_axes if a not in scattered)

        # The per-device body sees blocks, as a shard_map body does: lowered under the mesh with every axis
        # Manual, its ops (the collectives' reduction bodies too) carry no sharding annotations, which JAX 0.12
        # rejects inside a reduction when the mesh has Explicit axes.
        manual = mesh.abstract_mesh.update_axis_types({name: AxisType.Manual for name in mesh.axis_names})

        def per_shard(*blocks):
            with use_abstract_mesh(manual):
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
