"""Engine cycles of the instructions whose documented cost differs from the cost model's default.

The default (cost_model.compute_cycles) streams N elements per partition at one per cycle with a floor of MIN_II
cycles (2N for VectorE instructions with two input tiles, such as scalar_tensor_tensor, by the architecture
guide's rule), which is the documented cost of most element-wise Vector/Scalar/GpSimd instructions and is what the
instructions without a documented figure (reciprocal, select_reduce, range_select, max8, nc_find_index8,
bn_stats, local_gather, ...) are charged. Sources:
  [ISA-0.6]  nki.isa docstrings of NKI 0.6 (aws-neuron-sdk, nki/api/nki/isa/__init__.py)
  [ISA-0.1]  "Estimated instruction cost" of the NKI 0.1 nki.isa reference (general/nki/api, Neuron 2.23)
"""

from __future__ import annotations

import math
from collections.abc import Callable

from . import trace

MIN_II_CYCLES = 64  # [ISA-0.1] minimum instruction initiation interval, as in cost_model


def _topk(record: trace.InstructionRecord) -> float:
    # [ISA-0.6] topk: "4*n + K GpSIMD Engine cycles per partition"; the record's free size is n and its first
    # write is val_dst [P, K] in bfloat16.
    values = record.writes[0]
    k = (values.b_stop - values.b_start) // 2
    return 4 * record.free_elements + k


def _tensor_scalar_reduce(record: trace.InstructionRecord) -> float:
    # [ISA-0.1] tensor_scalar_reduce: "max(MIN_II, N) + MIN_II Vector Engine cycles".
    return max(MIN_II_CYCLES, record.free_elements) + MIN_II_CYCLES


def _activation(record: trace.InstructionRecord) -> float:
    # [ISA-0.1] activation_reduce (nisa.activation writing reduce_res, its second write): "max(MIN_II, N) + MIN_II
    # Scalar Engine cycles"; without it, the default max(MIN_II, N).
    return max(MIN_II_CYCLES, record.free_elements) + (MIN_II_CYCLES if len(record.writes) > 1 else 0)


def _nc_n_gather(record: trace.InstructionRecord) -> float:
    # [ISA-0.6] nc_n_gather is n = ceil(elements per partition / 512) instructions of the underlying ISA: each
    # at least MIN_II, and one element per cycle.
    groups = math.ceil(record.free_elements / 512)
    return max(groups * MIN_II_CYCLES, record.free_elements)


COST: dict[str, Callable[[trace.InstructionRecord], float]] = {
    "topk": _topk,
    "tensor_scalar_reduce": _tensor_scalar_reduce,
    "nc_n_gather": _nc_n_gather,
    "activation": _activation,
}


def cycles(record: trace.InstructionRecord) -> float | None:
    """Engine cycles of a record from the table above, or None to use the cost model's default."""
    cost = COST.get(record.opcode)
    return None if cost is None else cost(record)
