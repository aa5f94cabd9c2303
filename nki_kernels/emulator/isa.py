"""`nki.isa` on the CPU: dst-first ISA instructions over emulator tensors.

Every instruction checks the documented hardware rules (raising NkiHardwareError that names the
instruction and the kernel line), computes its result in float32 as the engines do (unless numerics are
off in count-only mode), rounds into the destination dtype, and appends one trace.InstructionRecord.
This module is the public namespace; the instructions live in isa_core (elementwise engines), isa_dma (DMA),
isa_matmul (TensorE) and, by idea, isa_control, isa_gather, isa_select and isa_vector.
"""

import numpy as np

from . import isa_constants as constants
from . import tensor
from .isa_constants import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd
from .isa_control import (
    NkiInstruction,
    VirtualRegister,
    activate2,
    core_barrier,
    dma_compute,
    dropout,
    exponential,
    get_nc_sub_version,
    nc_matmul_mx,
    quantize_mx,
    rand2,
    rand_get_state,
    rand_set_state,
    register_alloc,
    register_load,
    register_move,
    register_store,
    rng,
    sendrecv,
    set_rng_seed,
)
from .isa_core import (
    NkiValidationError,
    activation,
    get_nc_version,
    gpsimd_engine,
    iota,
    memset,
    scalar_engine,
    tensor_copy,
    tensor_engine,
    tensor_reduce,
    tensor_scalar,
    tensor_tensor,
    tensor_tensor_scan,
    unknown_engine,
    vector_engine,
)
from .isa_dma import dma_copy, dma_transpose
from .isa_gather import (
    local_gather,
    nc_n_gather,
    nc_stream_shuffle,
    nonzero_with_count,
    sequence_bounds,
    tensor_partition_reduce,
    topk,
)
from .isa_matmul import nc_matmul, nc_transpose
from .isa_select import (
    affine_select,
    max8,
    nc_find_index8,
    nc_match_replace8,
    range_select,
    select_reduce,
    tensor_copy_predicated,
)
from .isa_vector import (
    activation_reduce,
    bn_aggr,
    bn_stats,
    reciprocal,
    scalar_tensor_tensor,
    tensor_scalar_cumulative,
    tensor_scalar_reduce,
)


def _assign_tile(view, value):
    """`tile[key] = value` (the language guide's style): copies an NKI tensor (tensor_copy on chip, dma_copy
    when HBM is involved) or fills with a number (memset)."""
    if isinstance(value, tensor.NkiTensor):
        if view.is_on_chip and value.is_on_chip:
            tensor_copy(view, value)
        else:
            dma_copy(view, value)
    elif isinstance(value, (bool, int, float, np.number)):
        if not view.is_on_chip:
            raise TypeError(f"{view.describe()}: item assignment of a number needs an on-chip tile (memset)")
        memset(view, value)
    else:
        raise TypeError(f"item assignment: expected an NKI tensor or a number, got {type(value).__name__}")


tensor.install_item_assignment(_assign_tile)  # tensors cannot import the instructions that build on them

__all__ = [
    "NkiInstruction",
    "NkiValidationError",
    "VirtualRegister",
    "activate2",
    "activation",
    "activation_reduce",
    "affine_select",
    "bn_aggr",
    "bn_stats",
    "constants",
    "core_barrier",
    "dge_mode",
    "dma_compute",
    "dma_copy",
    "dma_engine",
    "dma_transpose",
    "dropout",
    "engine",
    "exponential",
    "get_nc_sub_version",
    "get_nc_version",
    "gpsimd_engine",
    "iota",
    "local_gather",
    "matmul_perf_mode",
    "max8",
    "memset",
    "nc_find_index8",
    "nc_match_replace8",
    "nc_matmul",
    "nc_matmul_mx",
    "nc_n_gather",
    "nc_stream_shuffle",
    "nc_transpose",
    "nc_version",
    "nonzero_with_count",
    "oob_mode",
    "quantize_mx",
    "rand2",
    "rand_get_state",
    "rand_set_state",
    "range_select",
    "reciprocal",
    "reduce_cmd",
    "register_alloc",
    "register_load",
    "register_move",
    "register_store",
    "rng",
    "scalar_engine",
    "scalar_tensor_tensor",
    "select_reduce",
    "sendrecv",
    "sequence_bounds",
    "set_rng_seed",
    "tensor_copy",
    "tensor_copy_predicated",
    "tensor_engine",
    "tensor_partition_reduce",
    "tensor_reduce",
    "tensor_scalar",
    "tensor_scalar_cumulative",
    "tensor_scalar_reduce",
    "tensor_tensor",
    "tensor_tensor_scan",
    "topk",
    "unknown_engine",
    "vector_engine",
]
