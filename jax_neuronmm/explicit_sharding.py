"""JAX's sharding in types (Explicit mesh axes) for svd_matmul and svd_mlp.

The result's sharding follows `lax.dot_general`'s rules: `out_sharding` when given, else each result dim takes the
split of the operand dim it comes from; partial sums of a dimension split on both sides of its contraction raise
`ShardingTypeError` asking for `out_sharding`, as `jnp.matmul` does. Under Auto or Manual axes this is a no-op.
docs/sharding.md has the rules in full.
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jax_neuronmm._compat import ShardingTypeError, canonicalize_sharding, lower_with_sharding_in_types


def _entries(aval):
    """One tuple of mesh axis names per dim of `aval` (empty: not split)."""
    spec = tuple(aval.sharding.spec) + (None,) * (aval.ndim - len(aval.sharding.spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec)


def _spec(entries):
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


def _has_explicit_axes(mesh):
    return not mesh.empty and bool(mesh.explicit_axes)


def _common_mesh(op, names, avals):
    meshes = {name: a.sharding.mesh for name, a in zip(names, avals) if not a.sharding.mesh.empty}
    if len(set(meshes.values())) > 1:
        listing = ", ".join(f"{n}: {m}" for n, m in meshes.items())
        raise ShardingTypeError(f"{op}: operands are typed on different meshes ({listing}); expected one mesh")
    return next(iter(meshes.values()), avals[0].sharding.mesh)


def check_out_sharding(op, out_sharding, ndim):
    """The public `out_sharding` argument -> a NamedSharding on an abstract mesh, or None.

    Accepts what `jnp.matmul` accepts: None, a NamedSharding, or a PartitionSpec of the mesh set with
    `jax.set_mesh`, naming Explicit axes only. `ndim` is the result's number of dims.
    """
    if out_sharding is None:
        return None
    if not isinstance(out_sharding, (NamedSharding, PartitionSpec)):
        raise TypeError(
            f"{op}: out_sharding has type {type(out_sharding).__name__}; expected a "
            "jax.sharding.NamedSharding, a jax.sharding.PartitionSpec or None"
        )
    try:
        sharding = canonicalize_sharding(out_sharding, op)
    except ValueError as err:
        raise ValueError(f"{op}: out_sharding={out_sharding} is not usable here: {err}") from None
    if sharding is None:  # a NamedSharding of an empty mesh: nothing to say
        return None
    spec = sharding.spec
    if spec.unreduced or spec.reduced:
        raise ValueError(
            f"{op}: out_sharding={spec} has unreduced/reduced axes; expected a plain split (the op "
            "completes its own sums)"
        )
    if len(spec) > ndim:
        raise ValueError(f"{op}: out_sharding={spec} has {len(spec)} entries; the result has {ndim} dims")
    return NamedSharding(sharding.mesh, PartitionSpec(*spec, *(None,) * (ndim - len(spec))))


def result_sharding(op, rule, names, avals, out_sharding):
    """Abstract eval: the sharding of the result of an op with factor rule `rule` (docs/sharding.md).

    `names` and `avals` are the operands' names and abstract values, `out_sharding` the primitive's param.
    """
    mesh = _common_mesh(op, names, avals)
    if out_sharding is not None:
        if not mesh.empty and out_sharding.mesh != mesh:
            raise ShardingTypeError(
                f"{op}: out_sharding is on mesh {out_sharding.mesh}; the operands are typed on {mesh}"
            )
        return out_sharding
    split = {}  # factor -> (operand name, dim, axes)
    sides = {}  # summed factor -> {"left"/"right": (operand name, dim)}
    for name, factors, aval in zip(names, rule.operands, avals):
        for dim, (factor, axes) in enumerate(zip(factors, _entries(aval))):
            if not axes:
                continue
            seen = split.setdefault(factor, (name, dim, axes))
            if seen[2] != axes:
                raise ShardingTypeError(
                    f"{op}: {seen[0]} (dim {seen[1]}) is split over {seen[2]} but {name} (dim {dim}) over "
                    f"{axes}; both are the same dimension {factor!r} and must be split over the same mesh axes"
                )
            if factor not in rule.result:
                side = "left" if dim == len(factors) - 1 else "right"
                sides.setdefault(factor, {}).setdefault(side, (name, dim))
    entries = tuple(split[f][2] if f in split else () for f in rule.result)
    partial = {f: s for f, s in sides.items() if len(s) == 2}
    if partial:
        summed = "; ".join(
            f"{s['left'][0]} dim {s['left'][1]} and {s['right'][0]} dim {s['right'][1]} over {split[f][2]}"
            for f, s in partial.items()
        )
        raise ShardingTypeError(
            f"{op}: summed dimensions are split on both sides of their contraction ({summed}), so the result is "
            f"partial sums and it is ambiguous how it should be sharded. Pass out_sharding, e.g. "
            f"out_sharding={_spec(entries)} for an all-reduce into that layout, or split one more result dim "
            "over the summed axes for a reduce-scatter"
        )
    owners = {}
    for factor, axes in zip(rule.result, entries):
        for axis in axes:
            if axis in owners:
                raise ShardingTypeError(
                    f"{op}: the result would split two dims ({owners[axis]!r} from {split[owners[axis]][0]}, "
                    f"{factor!r} from {split[factor][0]}) over mesh axis {axis!r}; pass out_sharding"
                )
            owners[axis] = factor
    return NamedSharding(mesh, _spec(entries))


def sharding_of(aval):
    """`aval`'s sharding where its mesh has Explicit axes (to type a cotangent like its primal), else None."""
    return aval.sharding if _has_explicit_axes(aval.sharding.mesh) else None


def features_unsplit(x):
    """Under Explicit mesh axes: `x`'s sharding with its last dim whole (e.g. a residual-stream result), else None."""
    aval = jax.typeof(x)
    if not _has_explicit_axes(aval.sharding.mesh):
        return None
    return NamedSharding(aval.sharding.mesh, _spec(_entries(aval)[:-1] + ((),)))


def typed_alike(operand, update):
    """(operand, update) typed with one split, for ops that need that (dynamic_update_slice).

    Where either is typed on a mesh with Explicit axes, one typed without a mesh (made outside any mesh, such as
    a freshly allocated cache or a host array) is placed unsplit on that mesh, and `update` takes `operand`'s
    split. Without Explicit axes both come back unchanged.
    """
    meshes = [jax.typeof(a).sharding.mesh for a in (update, operand)]
    mesh = next((m for m in meshes if _has_explicit_axes(m)), None)
    if mesh is None:
        return operand, update
    operand, update = (
        a if m == mesh else jax.sharding.reshard(a, NamedSharding(mesh, PartitionSpec()))
        for a, m in zip((operand, update), meshes[::-1])
    )
    if _entries(jax.typeof(update)) != _entries(jax.typeof(operand)):
        update = jax.sharding.reshard(update, NamedSharding(mesh, _spec(_entries(jax.typeof(operand)))))
    return operand, update


def reshape(x, shape):
    """`x.reshape(shape)`; where JAX cannot type that reshape on Explicit mesh axes (a split dim cut into heads the
    split does not divide, or merged behind a dim before it), `x` made whole on its mesh first, so any layout of the
    projections runs the model's attention."""
    try:
        return x.reshape(shape)
    except ShardingTypeError:
        mesh = jax.typeof(x).sharding.mesh
        if not _has_explicit_axes(mesh):
            raise
        return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec())).reshape(shape)


def split_alike(x, dims, like, like_dims):
    """`x` with its dims `dims` split as `like`'s dims `like_dims`, for dots whose batch dims must split alike.

    Where `like` is typed on a mesh with Explicit axes, `x` is resharded so: its other dims keep their split unless
    it uses a mesh axis those dims now take (one typed without a mesh starts unsplit). Otherwise `x` comes back
    unchanged. Attention needs it for the queries against a cache that keeps its own split: how a reshape carries
    a split dim into the new ones differs between JAX releases.
    """
    like_aval = jax.typeof(like)
    mesh = like_aval.sharding.mesh
    if not _has_explicit_axes(mesh):
        return x
    aval = jax.typeof(x)
    entries = list(_entries(aval)) if aval.sharding.mesh == mesh else [()] * aval.ndim
    wanted = {d: _entries(like_aval)[ld] for d, ld in zip(dims, like_dims)}
    taken = {a for e in wanted.values() for a in e}
    split = [wanted.get(d, () if set(e) & taken else e) for d, e in enumerate(entries)]
    if aval.sharding.mesh == mesh and split == list(_entries(aval)):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, _spec(split)))


def _typed_on_explicit_axes(x, sharding: NamedSharding) -> bool:
    return _has_explicit_axes(jax.typeof(x).sharding.mesh) or _has_explicit_axes(sharding.mesh.abstract_mesh)


def typed_as(x, sharding: NamedSharding):
    """`x` resharded to `sharding` where its type or `sharding` is on a mesh with Explicit axes (shard_map there
    takes operands only when typed as its in_specs say; an operand typed without a mesh is placed on it), else `x`
    unchanged (Auto axes reshard at the shard_map)."""
    if not _typed_on_explicit_axes(x, sharding):
        return x
    return jax.sharding.reshard(x, sharding)


def placed_as(x, sharding: NamedSharding):
    """`x` placed as `sharding` says on any mesh: resharded where its type or `sharding` is on Explicit axes
    (`typed_as`), else constrained to it (`jax.lax.with_sharding_constraint`: the partitioner moves it there)."""
    if _typed_on_explicit_axes(x, sharding):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def rank_intermediate_sharding(tokens_aval, rank_aval, rank_dim):
    """Type of an [*B, *T, r] intermediate of a transpose rule, or None without Explicit axes.

    Batch and token dims split as `tokens_aval`'s leading dims, r as `rank_aval`'s dim `rank_dim` (the
    factor the cotangent is for); a mesh axis already used by the leading dims leaves r whole.
    """
    mesh = _common_mesh("svd_matmul transpose", ("tokens", "rank"), (tokens_aval, rank_aval))
    if not _has_explicit_axes(mesh):
        return None
    leading = _entries(tokens_aval)[:-1]
    rank = _entries(rank_aval)[rank_dim]
    if {a for e in leading for a in e} & set(rank):
        rank = ()
    return NamedSharding(mesh, _spec(leading + (rank,)))


def batched_out_sharding(out_sharding, dim, batched, batched_dim):
    """vmap: `out_sharding` with a new result dim at `dim`, split like dim `batched_dim` of `batched`."""
    if out_sharding is None:
        return None
    new = _entries(jax.typeof(batched))[batched_dim]
    spec_entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in out_sharding.spec]
    if {a for e in spec_entries for a in e} & set(new):
        new = ()
    spec_entries.insert(dim, new)
    return NamedSharding(out_sharding.mesh, _spec(spec_entries))


# --- Lowering ---------------------------------------------------------------------------------------------------


def local_params(params):
    """The primitive's params for its per-shard computation: blocks are local, out_sharding does not apply."""
    return {k: v for k, v in params.items() if k != "out_sharding"}


def _unsplit(aval):
    mesh = aval.sharding.mesh
    if not _has_explicit_axes(mesh):
        return aval
    return aval.update(sharding=NamedSharding(mesh, PartitionSpec(*(None,) * aval.ndim)))


def local_context(ctx):
    """The lowering context with Explicit splits dropped from the operand and result types.

    The lowering traces the op's computation inside custom_partitioning, where the partitioner, not the
    types, decides each device's blocks (sharding.py); traced on split types its dots would ask for
    out_sharding themselves.
    """
    return ctx.replace(avals_in=tuple(map(_unsplit, ctx.avals_in)), avals_out=tuple(map(_unsplit, ctx.avals_out)))


def constrain_results(ctx, results):
    """Pins the lowered results to the shardings their types carry (as lax ops do), so the partitioner
    all-reduces or reduce-scatters into what abstract eval said."""
    return [lower_with_sharding_in_types(ctx, r, aval) for r, aval in zip(results, ctx.avals_out)]
