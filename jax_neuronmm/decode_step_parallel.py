"""Tensor-parallel decode steps: the whole model's operands split into Megatron shards over one mesh axis, each
device binding `decode_step_p` on its shard inside `jax.shard_map` (the XLA lowering's psums and all-gather do
the communication); on the emulator every rank's looped kernel runs in one launch instead, so the emulated
collectives meet. docs/decode_step.md says why shard_map and not custom_partitioning.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jax_neuronmm import explicit_sharding, shapes
from jax_neuronmm.backend import get_backend
from jax_neuronmm.decode_step import decode_step_p
from jax_neuronmm.decode_step_kernels import looped_plan
from jax_neuronmm.decode_step_operands import OP, ROW_OPERANDS, axis_names, operands_of, unflatten, with_fp8_leaves
from jax_neuronmm.host_callback import host_call
from jax_neuronmm.kernel_calls import check_kernel_dtype, kernel_fp8
from jax_neuronmm.weights import Factored, Quantized
from nki_kernels import dispatch
from nki_kernels.decode.contract import (
    SPLIT_ROWS,
    WEIGHTS,
    DecodeSpec,
    check_lengths,
    check_spec,
    check_write_index,
    expected_shapes,
)
from nki_kernels.decode.runner import run_sharded_looped_step
from nki_kernels.decode.sharding import gather_cache, shard_operands


def tensor_parallel_spec(spec: DecodeSpec, ranks: int) -> DecodeSpec:
    """The spec of one rank's Megatron shard of the whole model `spec` over `ranks` ranks (spec.tensor_parallel =
    ranks: 1/ranks of the query heads, KV heads, MLP features and vocabulary; hidden, head_dim and the factor ranks
    whole). ValueError naming the size that does not split."""
    check_spec(spec, OP)
    if spec.tensor_parallel != 1:
        raise ValueError(f"{OP}: spec.tensor_parallel: got {spec.tensor_parallel}, expected 1 (the whole model's spec)")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"{OP}: ranks: got {ranks!r}, expected a positive int")
    if spec.packed_weights:
        raise ValueError(
            f"{OP}: spec.packed_weights: got {spec.packed_weights!r}; a packed operand is one rank's layout and does "
            "not split over the mesh (unpack with nki_kernels.decode.packing.unpack_weights and unpacked_spec)"
        )
    sizes = {name: getattr(spec, name) for name in ("num_heads", "num_kv_heads", "intermediate", "vocab")}
    for name, size in sizes.items():
        if size % ranks:
            raise ValueError(
                f"{OP}: spec.{name} = {size} does not split over {ranks} tensor-parallel ranks; expected a multiple "
                f"of {ranks} (each rank holds whole KV-head groups, 1/{ranks} of the MLP features and of the "
                "vocabulary)"
            )
    return spec.replace(**{name: size // ranks for name, size in sizes.items()}, tensor_parallel=ranks)


def _split_dim(name: str, ndim: int) -> int | None:
    """The dim of flat operand `name` ("q.u", "k_cache", ...) that Megatron shards split, or None (replicated):
    q / k / v / gate / up and the head split their output columns (a dense weight's, v's, an fp8 weight's and its
    column scales), o and down their rows (a dense weight's, u's); the caches their KV heads."""
    field, _, part = name.partition(".")
    if field in ("k_cache", "v_cache"):
        return 3
    if field not in WEIGHTS:
        return None
    if field in SPLIT_ROWS:
        return ndim - 2 if part in ("", "u", "w") else None
    return ndim - 1 if part in ("", "v", "w", "scale", "v_scale") else None


def _entry(names: tuple):
    """A PartitionSpec entry for mesh axes `names`: one name, or their tuple."""
    return names[0] if len(names) == 1 else names


def tensor_parallel_partition_specs(spec: DecodeSpec, axis_name, batch_axis=None) -> tuple:
    """One `PartitionSpec` per flat operand of `spec` (`operand_names` order): how the whole model's operands split
    into Megatron shards over mesh axis `axis_name` (see `_split_dim`); the activations, norms, tables and
    write_index are replicated, unless batch_axis (a mesh axis or a tuple of them) splits the rows: x, the caches,
    the RoPE tables and the mask biases along their B axis."""
    axis = _entry(axis_names(axis_name))
    batch = None if batch_axis is None else _entry(axis_names(batch_axis))
    specs = []
    for name, shape in expected_shapes(spec, 1, 1, 1).named_leaves():
        entries = [None] * len(shape)
        dim = _split_dim(name, len(shape))
        if dim is not None:
            entries[dim] = axis
        if batch is not None and name in ROW_OPERANDS:
            entries[ROW_OPERANDS[name]] = batch
        while entries and entries[-1] is None:
            entries.pop()
        specs.append(PartitionSpec(*entries))
    return tuple(specs)


def _mesh_axes(mesh, argument: str, axis_name) -> tuple:
    names = axis_names(axis_name)
    missing = [name for name in names if name not in mesh.axis_names]
    if missing:
        raise ValueError(f"{OP}: {argument}: {missing} not among the mesh's axes {mesh.axis_names}")
    return names


def tensor_parallel_decode_step(*operands, spec: DecodeSpec, mesh, axis_name="model", batch_axis=None, **named):
    """decode_step over the whole model's operands (spec.tensor_parallel = 1), computed as Megatron shards on the
    ranks of mesh axis `axis_name` of `mesh` (a jax.sharding.Mesh): `jax.shard_map` over the mesh, each device
    binding decode_step_p on its shard (`tensor_parallel_partition_specs`) with the per-rank spec
    (`tensor_parallel_spec`) and axis_name, so the XLA lowering all-reduces o's and down's outputs in every layer
    and gathers the logits. Returns (logits [B, T, V] float32; k_cache, v_cache split over their KV heads).
    batch_axis: None (other mesh axes see the same computation: replicated), or mesh axes (not axis_name's) that
    split the rows B (which they must divide): each group of ranks then decodes its rows, and the logits and caches
    come back split over B too. A vocabulary that does not split is padded with zero columns of the head on every
    call (and the logits cut back); heads, KV heads and MLP features must split (ValueError naming them). On the
    emulator backend every rank's looped kernel runs in one emulated launch on the mesh's first device, with the
    same results' shardings (`_emulated_tensor_parallel_step`; not under vmap); on "neuron" it raises
    NotImplementedError when the step is lowered (see `per_device_tensor_parallel_unsupported`)."""
    check_spec(spec, OP)
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"{OP}: mesh: got {type(mesh).__name__}, expected a jax.sharding.Mesh")
    names = _mesh_axes(mesh, "axis_name", axis_name)
    axis = _entry(names)
    ranks = math.prod(mesh.shape[name] for name in names)
    ops = operands_of(operands, named, spec)
    ops = shapes.checked_decode_operands(OP, spec, ops)
    batch, groups = None, 1
    if batch_axis is not None and spec.paged:
        raise ValueError(
            f"{OP}: batch_axis: got {batch_axis!r} with a paged cache (spec.block_size = {spec.block_size}), whose "
            "pools every row shares: expected None (the rows of a paged step are not split over ranks)"
        )
    if batch_axis is not None:
        batch_names = _mesh_axes(mesh, "batch_axis", batch_axis)
        if set(batch_names) & set(names):
            raise ValueError(f"{OP}: batch_axis {batch_axis!r} shares mesh axes with axis_name {axis_name!r}")
        groups = math.prod(mesh.shape[name] for name in batch_names)
        if ops.x.shape[0] % groups:
            raise ValueError(
                f"{OP}: x: got B = {ops.x.shape[0]} rows, expected a multiple of the {groups} row groups of "
                f"batch_axis {batch_axis!r}"
            )
        batch = _entry(batch_names)
    vocab = spec.vocab
    padding = -vocab % ranks
    if padding:  # zero columns: logits 0 there, cut off below
        pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, padding)])  # noqa: E731
        head = ops.head
        if isinstance(head, Factored):
            head = dataclasses.replace(head, v=pad(head.v), v_scale=None if head.v_scale is None else pad(head.v_scale))
        elif isinstance(head, Quantized):
            head = Quantized(pad(head.w), pad(head.scale))
        else:
            head = pad(head)
        ops = ops.replace(head=head)
        spec = spec.replace(vocab=vocab + padding)
    rank_spec = tensor_parallel_spec(spec, ranks)
    leaves, treedef = jax.tree_util.tree_flatten(ops)
    cache = PartitionSpec(None, batch, None, axis)
    in_specs = tensor_parallel_partition_specs(spec, axis, batch)
    out_specs = (PartitionSpec() if batch is None else PartitionSpec(batch), cache, cache)
    if get_backend() == "emulator":
        logits, k_cache, v_cache = _emulated_tensor_parallel_step(
            leaves, treedef, spec, rank_spec, groups, mesh, in_specs, out_specs
        )
    else:

        def per_rank(*blocks):
            return tuple(decode_step_p.bind(*blocks, spec=rank_spec, treedef=treedef, axis_name=axis))

        leaves = [explicit_sharding.typed_as(a, NamedSharding(mesh, s)) for a, s in zip(leaves, in_specs)]
        logits, k_cache, v_cache = jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=False,  # the primitive states no varying-axes types; the body's collectives make these outputs
        )(*leaves)
    return (logits[..., :vocab] if padding else logits), k_cache, v_cache


def _emulated_tensor_parallel_step(leaves, treedef, spec, rank_spec, groups, mesh, in_specs, out_specs):
    """tensor_parallel_decode_step on the emulator backend: ONE emulated run of the step, by the mesh's first
    device, of every rank's looped kernel with its collectives (`_every_rank_on_the_emulator`: one simulate_spmd
    launch of rank_spec.tensor_parallel ranks per group of rows, `groups` being batch_axis's row groups, as each
    group of ranks decodes its rows on the mesh), on the whole operands; the results leave placed by out_specs, as
    the shard_map's. One rank's shard (in_specs' blocks) is checked against the kernel now, before anything runs.

    How: a `jax.shard_map` manual over every mesh axis gives each device the whole operands and a host call
    (`host_callback.host_call`, numpy in and out) in which only the first device runs the step and the others
    return zeros at once; a psum gives every device the first one's results (exactly: the rest adds zeros). The
    host call never raises: what fails (a bad write_index, a kernel error) comes back as text, and every device
    raises it once the psum is done (`_raise_failure`), so none is left waiting in a collective for a device that
    stopped (XLA's CPU runtime aborts the process after 40 s of that)."""
    ops = unflatten(leaves, spec, treedef)
    check_kernel_dtype("emulator", ops.x.dtype)
    target = dispatch.launch_target(emulated=True)
    blocks = [
        jax.ShapeDtypeStruct(NamedSharding(mesh, s).shard_shape(a.shape), a.dtype) for a, s in zip(leaves, in_specs)
    ]
    try:
        looped_plan(unflatten(blocks, rank_spec, treedef), rank_spec, target)
    except ValueError as error:
        block_shapes = ", ".join(str(b.shape) for b in blocks)
        raise ValueError(
            f"{OP}: one rank's shard ({block_shapes}) of a step over {rank_spec.tensor_parallel} tensor-parallel "
            f"ranks cannot run as the looped NKI kernel on {target}: {error}"
        ) from None
    axes = tuple(mesh.axis_names)
    host = functools.partial(
        _every_rank_on_the_emulator, spec=spec, treedef=treedef, ranks=rank_spec.tensor_parallel, groups=groups
    )
    logits = (ops.x.shape[:2] + (spec.vocab,), np.float32)
    results = (logits, (ops.k_cache.shape, ops.k_cache.dtype), (ops.v_cache.shape, ops.v_cache.dtype))
    results += (((_FAILURE_BYTES,), np.uint8),)

    def on_every_device(*whole):
        computed = host_call(host, results, lax.axis_index(axes) == 0, *whole)
        # The first device's results on every device (the others' are zeros); the barrier holds the check below
        # until all of them arrived.
        step, failure = lax.optimization_barrier((lax.psum(computed[:3], axes), lax.psum(computed[3], axes)))
        (checked,) = host_call(_raise_failure, (logits,), failure, step[0])
        return lax.optimization_barrier((checked, *step[1:]))  # every result waits for the check

    replicated = PartitionSpec()
    whole = [explicit_sharding.typed_as(a, NamedSharding(mesh, replicated)) for a in leaves]
    outputs = jax.shard_map(on_every_device, mesh=mesh, in_specs=replicated, out_specs=replicated, check_vma=False)(
        *whole
    )
    return tuple(explicit_sharding.placed_as(r, NamedSharding(mesh, s)) for r, s in zip(outputs, out_specs))


_FAILURE_BYTES = 4096  # the longest error text the emulator's host call returns (longer ones are cut)


def _every_rank_on_the_emulator(first, *leaves, spec, treedef, ranks, groups):
    """Host side of `_emulated_tensor_parallel_step` on one device: zeros unless `first` (the mesh's first device).
    There, the whole model's operands (spec.tensor_parallel = 1) cut into `ranks` Megatron shards
    (`nki_kernels.decode.sharding.shard_operands`, the layout of `tensor_parallel_partition_specs`) and run as the
    looped kernel on that many emulated NeuronCores (`runner.run_sharded_looped_step`: one simulate_spmd launch, real
    data through nki.collectives), once for each of `groups` equal row groups; the ranks' caches put back together.
    Returns (logits, k_cache, v_cache, failure): failure zeros, or, when anything raised (write_index out of range
    included), the error's text (UTF-8, zero padded to _FAILURE_BYTES) and zero results."""
    ops = with_fp8_leaves(unflatten(leaves, spec, treedef), kernel_fp8)
    zeros = [np.zeros(ops.x.shape[:2] + (spec.vocab,), np.float32), np.zeros_like(ops.k_cache)]
    zeros += [np.zeros_like(ops.v_cache), np.zeros(_FAILURE_BYTES, np.uint8)]
    if not first:
        return zeros
    try:
        if spec.paged:
            check_lengths(OP, ops.lengths, ops.block_table, block_size=spec.block_size, num_blocks=ops.k_cache.shape[1])
        else:
            check_write_index(OP, ops.write_index, slots=ops.k_cache.shape[2], tokens=ops.x.shape[1])
        parts = []
        for group in range(groups):
            rows = ops.replace(
                **{
                    name: np.ascontiguousarray(np.split(getattr(ops, name), groups, axis)[group])
                    for name, axis in ROW_OPERANDS.items()
                    if getattr(ops, name) is not None  # a contiguous step has no block table nor lengths
                }
            )
            rank_spec, shards = shard_operands(spec, rows, ranks)
            logits, k_caches, v_caches = run_sharded_looped_step(shards, rank_spec)
            parts.append((logits, *(gather_cache(c, spec.num_kv_heads) for c in (k_caches, v_caches))))
    except Exception as error:  # every error, raised on every device by _raise_failure
        text = f"{type(error).__name__}: {error}".encode()[:_FAILURE_BYTES]
        zeros[3][: len(text)] = np.frombuffer(text, np.uint8)
        return zeros
    return [np.concatenate(p, axis) for p, axis in zip(zip(*parts), (0, 1, 1))] + [zeros[3]]


def _raise_failure(failure, logits):
    """Host side, on every device: RuntimeError with the emulator's failure text when there is one, else
    (logits,)."""
    text = bytes(failure).rstrip(b"\0").decode(errors="replace")
    if text:
        raise RuntimeError(f"{OP}: the tensor-parallel step on the emulator failed: {text}")
    return (logits,)
