"""decode_step on the NKI kernels: the looped kernel (one launch for every layer of a step) from
`nki_kernels.dispatch`, run on the emulator or traced for Trainium, and why a per-device tensor-parallel bind is
refused there.
"""

from __future__ import annotations

import jax

from jax_neuronmm import shapes
from jax_neuronmm.backend import get_backend
from jax_neuronmm.decode_step_operands import OP, unflatten, with_fp8_leaves
from jax_neuronmm.kernel_calls import kernel_fp8
from nki_kernels.decode.contract import FP8, DecodeOperands, DecodeSpec, check_lengths, check_write_index
from nki_kernels.decode.step import decode_step_plan


def plan(*operands, target, spec, treedef=None, axis_name=None):
    """The looped kernel from nki_kernels.dispatch, once its operand checks pass (`looped_plan`). A spec with
    tensor_parallel > 1 (one rank's shard, bound on each device inside shard_map) raises NotImplementedError
    (`per_device_tensor_parallel_unsupported`)."""
    if spec.tensor_parallel != 1:
        raise NotImplementedError(per_device_tensor_parallel_unsupported(spec, axis_name))
    return looped_plan(unflatten(operands, spec, treedef), spec, target)


def looped_plan(ops: DecodeOperands, spec: DecodeSpec, target):
    """(kernel, kwargs) of the looped kernel for ops (arrays or abstract values; fp8 weights as float8_e4m3fn) from
    nki_kernels.decode.step.decode_step_plan, whose checks also limit B·T to one partition tile and need bf16 /
    fp16 x beside fp8 weights; ValueError when they fail."""
    ops = with_fp8_leaves(ops, lambda a: jax.ShapeDtypeStruct(a.shape, FP8))
    return decode_step_plan(ops, spec, target)


def run(plan, *operands, spec, treedef=None, axis_name=None):
    """One launch of the looped kernel for the whole step (on the emulator, once write_index's value is checked)."""
    del axis_name  # _plan refused tensor-parallel specs
    kernel, kwargs = plan
    ops = with_fp8_leaves(unflatten(operands, spec, treedef), kernel_fp8)
    index = shapes.concrete_value(ops.write_index)
    if index is not None:
        check_write_index(OP, index, slots=ops.k_cache.shape[2], tokens=ops.x.shape[1])
    lengths, table = shapes.concrete_value(ops.lengths), shapes.concrete_value(ops.block_table)
    if lengths is not None and table is not None:
        check_lengths(OP, lengths, table, block_size=spec.block_size, num_blocks=ops.k_cache.shape[1])
    return kernel(ops.kernel_args(), spec=spec, **kwargs)


def per_device_tensor_parallel_unsupported(spec: DecodeSpec, axis_name) -> str:
    """Why an NKI-kernel backend refuses decode_step_p bound on one rank's shard on each device of a shard_map."""
    bound = (
        f"{OP}: a decode step bound on one rank's Megatron shard on each device of mesh axis {axis_name!r} "
        f"(spec.tensor_parallel = {spec.tensor_parallel}, inside jax.shard_map)"
    )
    if get_backend() == "emulator":
        return (
            f"{bound} cannot run on backend 'emulator': each device would run its own host callback, and the "
            "emulated nki.collectives meet only between the ranks of one simulate_spmd launch. Call "
            "tensor_parallel_decode_step with the whole model's operands (on the emulator it runs every rank in "
            "one simulate_spmd launch on the mesh's first device, as models.generate does), or use backend 'xla' "
            "inside your own shard_map"
        )
    return (
        f"{bound} is not supported on backend 'neuron': each NeuronCore would run the looped kernel on its shard "
        "with nki.collectives over the ranks of one replica group, and this package has neither made those ranks "
        "the devices of the shard_map axis in NKI's custom calls nor run such a program on Trainium (none is "
        "available to it); the emulator's way, one host callback running every rank, is no option there (host "
        "callbacks do not run on the neuron platform). Use jax_neuronmm.use_backend('xla') for tensor-parallel "
        "decode steps (the XLA lowering's psums and all-gather), or replicate the parameters to run the kernel on "
        "whole arrays"
    )
