"""Where a decode step's vectors and weights lie in SBUF: the feature layouts of a spec (`Layouts`, `grouped_layout`)
and the layout of packed weights (DecodeSpec.packed_weights; nki_kernels.decode.packing packs, unpacks and loads
them).

Packed weights: the fp8 values of some projections of every layer stored together in one operand, `packed`
[L, 128, E], already in the layout the kernels read, so that one DMA per layer (or a few) reads each partition's
bytes of all of them as one contiguous run. A weight read alone moves (its size ÷ 128) bytes a partition, which
for a small factor is a short run on the DMA efficiency curve; packed together, a layer's factors are one long run.

The layout of one layer (`packed_segments`): a sequence of segments, one per *stage* (a dense weight's w; a
factored one's u [K, r], then v [r, N], at the layer's rank r) and per block of the layout the stage's input
vector lies in (`tiles.layout_blocks`: hidden for q, k, v, gate, up; the attention output for o; the intermediate
for down; `grouped_layout` for a v). A block of `count` tiles of `partitions` partitions, its first feature k0, holds
the stage's rows k0 .. k0 + partitions·count - 1 with partition p holding rows k0 + p·count .. k0 + p·count +
count - 1, whole, as `count·columns` consecutive elements of that partition: the [partitions, count, columns] block
the projections multiply (stationary tiles [partitions, columns of an output tile] of each of its count rows).
Segments follow spec.packed_weights' order and, within one weight, the stage and block order; partitions past a
segment's `partitions` and elements past a layer's last segment are zeros (never read). E is the widest layer's
width (ranks may differ per layer).

This module takes the spec as it is (no import of the contract, which sizes the packed operand from it).
"""

from __future__ import annotations

import dataclasses
import functools

from nki_kernels.binding import nl
from nki_kernels.decode import tiles


def _min_row_elements(spec, names):
    """The fewest columns any weight contracting over a vector has (dense N, or the smallest rank)."""
    widths = []
    for name in names:
        dense = spec.out_features(name)
        widths += [dense if r is None else r for r in (spec.rank(name, layer) for layer in range(spec.num_layers))]
    return min(widths)


def grouped_layout(features, row_columns):
    """The layout of a vector of `features` contracted against weight rows of `row_columns` columns (a factored
    projection's rank-r intermediate (x·u)ᵀ against v, an MLP's intermediate against down): its whole 128-row tiles
    grouped (`tiles.choose_group`), the last features % 128 rows in a tile of their own, so that the grouped rows
    are read as runs several rows long where natural tiles read one row a run (an MLP pruned to 1600 neurons:
    down's rows in 1536 grouped, 64 alone)."""
    whole = features - features % nl.tile_size.pmax
    return tiles.feature_layout(features, tiles.choose_group(whole, row_columns) if whole else 1)


class Layouts:
    """Feature layouts of one spec: hidden (grouped for q/k/v/gate/up rows), intermediate (for down), attention
    output (for o), and the natural layouts of q and k/v (what attention takes)."""

    def __init__(self, spec):
        head_width = spec.vocab if spec.head_rank is None else spec.head_rank
        hidden_rows = min(_min_row_elements(spec, ("q", "k", "v", "gate", "up")), head_width)
        self.hidden = tiles.feature_layout(spec.hidden, tiles.choose_group(spec.hidden, hidden_rows))
        self.inter = grouped_layout(spec.intermediate, _min_row_elements(spec, ("down",)))
        self.q = tiles.feature_layout(spec.num_heads * spec.head_dim)
        # The attention output, regrouped on chip for o's weight rows (attention returns natural tiles).
        self.attn = tiles.feature_layout(
            spec.num_heads * spec.head_dim,
            tiles.choose_group(spec.num_heads * spec.head_dim, _min_row_elements(spec, ("o",))),
        )
        self.kv = tiles.feature_layout(spec.num_kv_heads * spec.head_dim)

    def input(self, projection):
        """The layout of a projection's input."""
        return {"o": self.attn, "down": self.inter}.get(projection, self.hidden)

    def output(self, projection):
        """The layout of a projection's output."""
        return {"q": self.q, "k": self.kv, "v": self.kv, "o": self.hidden, "down": self.hidden}.get(
            projection, self.inter
        )


@dataclasses.dataclass(frozen=True)
class Segment:
    """One block of one stage of a packed weight in a layer's packed row (see the module docstring): the stage's
    rows [k0, k0 + partitions·count) of `columns` columns, at elements [offset, offset + count·columns) of
    partitions 0 .. partitions - 1. weight: the projection; part: "u", "v" (factored) or "w" (dense)."""

    weight: str
    part: str
    k0: int
    partitions: int
    count: int
    columns: int
    offset: int

    @property
    def width(self) -> int:
        """Elements per partition."""
        return self.count * self.columns

    @property
    def rows(self) -> int:
        return self.partitions * self.count


def _stages(spec, layouts: Layouts, name: str, layer: int):
    """[(part, input layout, columns)] of projection `name` in `layer`: w, or u then v at the layer's rank."""
    rank = spec.rank(name, layer)
    if rank is None:
        return [("w", layouts.input(name), spec.out_features(name))]
    n = spec.out_features(name)
    return [("u", layouts.input(name), rank), ("v", grouped_layout(rank, n), n)]


@functools.lru_cache(maxsize=256)
def packed_segments(spec, layer: int) -> tuple[Segment, ...]:
    """The segments of `layer`'s packed row, in order (spec.packed_weights' order)."""
    layouts = Layouts(spec)
    segments, offset = [], 0
    for name in spec.packed_weights:
        for part, layout, columns in _stages(spec, layouts, name, layer):
            for k0, _, _, count, partitions in tiles.layout_blocks(layout):
                segments.append(Segment(name, part, k0, partitions, count, columns, offset))
                offset += count * columns
    return tuple(segments)


def packed_width(spec) -> int:
    """E: the elements per partition of the widest layer's packed row (0 without packed weights)."""
    return max((sum(s.width for s in packed_segments(spec, layer)) for layer in range(spec.num_layers)), default=0)


def packed_shape(spec) -> tuple[int, int, int]:
    """The packed operand's shape, [L, 128, E]."""
    return spec.num_layers, nl.tile_size.pmax, packed_width(spec)
