"""The gated MLP of the decode kernels: down(act(h·gate) * (h·up)) on column tiles, the intermediate kept on chip."""

from __future__ import annotations

import dataclasses

from nki_kernels.binding import nl
from nki_kernels.decode.matmul import copy_into, multiply_into, projection
from nki_kernels.decode.tiles import column_tiles


@dataclasses.dataclass(frozen=True)
class GatedMlp:
    """One layer's MLP as gated_mlp takes it: the stored weights of gate, up and down (HBM views, or a packed layer's
    values on chip; see matmul.projection), their ranks (None where dense), their fp8 scales already on chip
    (LayerScales.of; None: loaded where needed) and the activation applied to gate (an nl op)."""

    gate: object
    up: object
    down: object
    activation: object
    ranks: tuple = (None, None, None)
    scales: tuple = (None, None, None)


def gated_mlp(h, hidden_layout, inter_layout, mlp, rows, ring, evict, reduce=None):
    """down(act(h·gate) * (h·up)) of `mlp` (GatedMlp) with h column tiles of hidden_layout (model dtype). act(gate) is
    applied by ScalarE evicting PSUM; VectorE multiplies by up straight from PSUM; the intermediate (column tiles of
    inter_layout, model dtype) stays on chip. evict: as `dense_projection`'s, for the down projection's output
    (hidden features in hidden_layout); reduce: `projection`'s, for down."""
    ranks, scales = mlp.ranks, mlp.scales
    act = column_tiles(inter_layout, rows, nl.float32, "mlp_act", zero=False)
    projection(
        h, hidden_layout, mlp.gate, ranks[0], inter_layout, rows, ring, copy_into(act, mlp.activation), scales[0]
    )
    hidden = column_tiles(inter_layout, rows, h.dtype, "mlp_hidden", zero=False)
    projection(h, hidden_layout, mlp.up, ranks[1], inter_layout, rows, ring, multiply_into(hidden, act), scales[1])
    del act
    projection(hidden, inter_layout, mlp.down, ranks[2], hidden_layout, rows, ring, evict, scales[2], reduce)
