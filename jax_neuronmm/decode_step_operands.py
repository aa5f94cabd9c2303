"""decode_step's operands: how the public call's arguments become `DecodeOperands`, the pytree the primitive binds
(its leaves and a treedef that regroups them), and the checks of the mesh axis a tensor-parallel step runs on.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax

from jax_neuronmm import shapes, weights  # noqa: F401  (weights: Factored and Quantized as pytrees)
from nki_kernels.decode.contract import (
    OPTIONAL_LAST,
    DecodeOperands,
    DecodeSpec,
    batch_axes,
    expected_shapes,
    operand_fields,
)

# The operands are a pytree (their stored weights are, by jax_neuronmm.weights): the primitive binds the leaves.
jax.tree_util.register_dataclass(
    DecodeOperands, data_fields=[f.name for f in dataclasses.fields(DecodeOperands)], meta_fields=[]
)

OP = "decode_step"
ROW_OPERANDS = batch_axes()  # operand name -> its B axis


def operands_of(operands, named, spec) -> DecodeOperands:
    """decode_step's operands (positional, by name, or one DecodeOperands) as DecodeOperands."""
    if len(operands) == 1 and isinstance(operands[0], DecodeOperands) and not named:
        return operands[0]
    fields = operand_fields()
    if len(operands) > len(fields):
        raise TypeError(f"{OP}: got {len(operands)} positional operands, expected at most {len(fields)} {fields}")
    values = dict(zip(fields, operands))
    for name, value in named.items():
        if name not in fields or name in values:
            raise TypeError(f"{OP}: unexpected or repeated operand {name!r}; the operands are {fields}")
        values[name] = value
    for name in OPTIONAL_LAST:  # the last operands, present only with spec.packed_weights / spec.block_size
        values.setdefault(name, None)
    missing = [name for name in fields if name not in values]
    if missing:
        raise TypeError(f"{OP}: missing operands {missing}")
    return DecodeOperands.of([values[name] for name in fields], spec)


def axis_param(axis_name) -> dict:
    """The primitive's axis_name param, left out when None (direct binds without it stay valid)."""
    return {} if axis_name is None else {"axis_name": axis_name}


def axis_names(axis_name) -> tuple:
    """axis_name (a mesh axis name or a tuple of them) as a tuple of names; TypeError naming it otherwise."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(name, str) for name in names):
        raise TypeError(f"{OP}: axis_name: got {axis_name!r}, expected a mesh axis name (str) or a tuple of them")
    return names


def check_axis(spec: DecodeSpec, axis_name) -> None:
    """A tensor-parallel spec needs the axis its ranks are on, bound (inside shard_map) with spec.tensor_parallel
    ranks."""
    if axis_name is None:
        if spec.tensor_parallel != 1:
            raise ValueError(
                f"{OP}: spec.tensor_parallel is {spec.tensor_parallel}, so the operands are one rank's Megatron shard: "
                "expected axis_name, the mesh axis of the ranks (call it inside jax.shard_map over that axis), or "
                "use tensor_parallel_decode_step with the whole model's operands"
            )
        return
    axis_names(axis_name)
    try:
        size = lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{OP}: axis_name {axis_name!r} is not a mesh axis bound here: expected a call inside jax.shard_map "
            "over it (or tensor_parallel_decode_step with the whole model's operands)"
        ) from None
    if size != spec.tensor_parallel:
        raise ValueError(
            f"{OP}: axis_name {axis_name!r} has {size} ranks but spec.tensor_parallel is {spec.tensor_parallel}; "
            "expected the spec of one rank's shard over that axis (tensor_parallel_spec(spec, ranks))"
        )


def operand_treedef(spec: DecodeSpec):
    """The structure of the DecodeOperands `decode_step_p` binds for `spec` (which operands exist, which weights
    are factored)."""
    return jax.tree_util.tree_structure(expected_shapes(spec, 1, 1, 1), is_leaf=lambda a: isinstance(a, tuple))


def operand_names(spec: DecodeSpec) -> tuple[str, ...]:
    """Names of the flat operands `decode_step_p` binds, in order (a stored weight gives one per part: "name.u",
    "name.v" (, "name.u_scale", "name.v_scale"), or "name.w", "name.scale")."""
    return tuple(name for name, _ in expected_shapes(spec, 1, 1, 1).named_leaves())


def unflatten(leaves, spec, treedef) -> DecodeOperands:
    """The bound leaves as DecodeOperands (treedef None: the spec's structure, for direct binds of the leaves)."""
    return jax.tree_util.tree_unflatten(operand_treedef(spec) if treedef is None else treedef, leaves)


def with_fp8_leaves(ops: DecodeOperands, convert) -> DecodeOperands:
    """ops with convert(a) for every fp8 weight leaf a (float8_e4m3fn storage, which the kernels take as
    Trainium's float8_e4m3: the same bits within ±240)."""
    return jax.tree_util.tree_map(lambda a: convert(a) if shapes.is_fp8(a.dtype) else a, ops)
