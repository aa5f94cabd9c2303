"""Packed weights of the decode step (DecodeSpec.packed_weights; their layout: nki_kernels.decode.layouts):
which weights a spec packs by default (`attention_packing`), the moves between the packed operand and the
contract's stacked weights (`pack_weights` / `unpack_weights`: numpy, or any module with numpy's reshape /
concatenate / pad / stack, such as jax.numpy, with which the XLA reference unpacks), and the kernels' loads of a
layer's packed weights through the weight ring (`load_packed`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nki_kernels.binding import nl
from nki_kernels.decode.contract import (
    FP8,
    DecodeOperands,
    DecodeSpec,
    Dense,
    Factored,
    Quantized,
    dense_as_factors,
    dense_in_stack,
    layer_weight,
)
from nki_kernels.decode.layouts import packed_segments, packed_width
from nki_kernels.decode.matmul import OnChipWeight
from nki_kernels.decode.ring import RING_BLOCK_BYTES

# The attention's projections, which `attention_packing` packs.
ATTENTION = ("q", "k", "v", "o")


# Bytes of a packed value in the model's dtype, as attention_packing sizes a packed row (bf16 and fp16; an fp32
# model's row may take two ring blocks, which load_packed loads as two DMAs).
MODEL_ITEMSIZE = 2


def attention_packing(spec: DecodeSpec, fp8_only: bool = False, dense: bool = False) -> tuple[str, ...]:
    """The projections a spec packs by default: its factored attention projections (of q, k, v, o) of one dtype
    (the fp8 ones where any is fp8, else those in the model's dtype) when every layer's packed row of them fits one
    weight-ring block (RING_BLOCK_BYTES a partition: one DMA a layer), else none: small factors read alone move
    short runs per partition, low on the DMA efficiency curve, while a large model's factors are long runs already
    and would not fit one block. A tensor-parallel spec (one
    rank's shard) packs its shard's factors the same way (each rank's packed operand holds its own shard).
    fp8_only: pack fp8 factors only (models.decode.decode_plan's choice: its stacked bf16 weights stay (u, v)).
    dense: (without fp8 factors) also pack the attention's dense projections in the model's dtype, beside its
    factored ones: a tensor-parallel rank's small shards, read alone, move short runs; packed, one long run."""
    factored = [name for name in ATTENTION if spec.factored(name)]
    fp8 = tuple(name for name in factored if spec.fp8(name))
    in_model = tuple(name for name in ATTENTION if not spec.fp8(name) and (dense or spec.factored(name)))
    names = fp8 or (() if fp8_only else in_model)
    if not names:
        return ()
    width = packed_width(spec.replace(packed_weights=names))
    return names if width * (FP8.itemsize if fp8 else MODEL_ITEMSIZE) <= RING_BLOCK_BYTES else ()


def unpacked_spec(spec: DecodeSpec) -> DecodeSpec:
    """`spec` with no packed weights (the contract `pack_weights` takes and `unpack_weights` gives)."""
    return spec.replace(packed_weights=())


def _stage_values(spec: DecodeSpec, name: str, weight, part: str, layer: int):
    """Layer `layer`'s [K, N] values of a stage of a stacked stored weight (u cut to the layer's rank of columns, v
    to its rank of rows; a layer left dense in a factored stack: its W, contract.dense_in_stack)."""
    rank = spec.rank(name, layer)
    if part == "w" and isinstance(weight, Factored):
        w = dense_in_stack(spec, name, layer_weight(weight, layer))
        return w.w if isinstance(w, Quantized) else w
    if part == "w":
        return (weight.w if isinstance(weight, Quantized) else weight)[layer]
    if part == "u":
        return weight.u[layer][:, 0:rank]
    return weight.v[layer][0:rank, :]


def pack_weights(ops: DecodeOperands, spec: DecodeSpec, xp=np) -> DecodeOperands:
    """ops (following `unpacked_spec(spec)`: spec.packed_weights stored as usual) as the operands `spec` takes:
    the values of spec.packed_weights moved into `packed` [L, 128, E] (their scales stay where they were, the
    values' parts become None). xp: numpy, or a module with its reshape / concatenate / pad / stack."""
    if not spec.packed_weights:
        raise ValueError("pack_weights: spec.packed_weights is empty: there is nothing to pack")
    pmax, width = nl.tile_size.pmax, packed_width(spec)
    layers = []
    for layer in range(spec.num_layers):
        pieces = []
        for s in packed_segments(spec, layer):
            values = _stage_values(spec, s.weight, _as_stored(getattr(ops, s.weight)), s.part, layer)
            block = xp.reshape(values[s.k0 : s.k0 + s.rows, :], (s.partitions, s.width))
            pieces.append(xp.pad(block, ((0, pmax - s.partitions), (0, 0))))
        row = xp.concatenate(pieces, axis=1)
        layers.append(xp.pad(row, ((0, 0), (0, width - row.shape[1]))))
    values = {name: _without_values(getattr(ops, name)) for name in spec.packed_weights}
    return ops.replace(packed=xp.stack(layers), **values)


def _as_stored(weight):
    """A stored weight; a (u, v) pair of factors in the model's dtype as Factored(u, v)."""
    if isinstance(weight, (tuple, list)) and len(weight) == 2:
        return Factored(*weight)
    return weight


def _without_values(weight):
    """A stored weight with its values' parts set to None (an fp8 one's scales kept; one in the model's dtype
    then holds nothing: Factored(), or Dense() for a dense array)."""
    weight = _as_stored(weight)
    if isinstance(weight, Factored):
        return dataclasses.replace(weight, u=None, v=None)
    if isinstance(weight, Quantized):
        return dataclasses.replace(weight, w=None)
    if hasattr(weight, "shape") and hasattr(weight, "dtype"):
        return Dense()
    raise ValueError(
        f"pack_weights: got {type(weight).__name__}, expected a Factored weight, a Quantized fp8 one or a dense "
        "array in the model's dtype"
    )


def unpack_weights(ops: DecodeOperands, spec: DecodeSpec, xp=np) -> DecodeOperands:
    """The inverse of `pack_weights`: ops following `spec` as the operands of `unpacked_spec(spec)`, each packed
    weight's values back in its stored weight, stacked over layers (factors zero padded to the rank their scales
    are stacked to, or without scales to spec.stacked_rank; a layer left dense in a factored stack as its exact
    factors, contract.dense_as_factors)."""
    if not spec.packed_weights:
        return ops
    packed = ops.packed
    values = {}
    for name in spec.packed_weights:
        weight = getattr(ops, name)
        blocks = {}  # (layer, part) -> the stage's row blocks, in order
        for layer in range(spec.num_layers):
            for s in packed_segments(spec, layer):
                if s.weight == name:
                    block = packed[layer, 0 : s.partitions, s.offset : s.offset + s.width]
                    blocks.setdefault((layer, s.part), []).append(xp.reshape(block, (s.rows, s.columns)))
        layers = [
            {part: xp.concatenate(b, axis=0) for (at, part), b in blocks.items() if at == layer}
            for layer in range(spec.num_layers)
        ]
        if not isinstance(weight, Factored):
            w = xp.stack([parts["w"] for parts in layers])
            values[name] = w if isinstance(weight, Dense) else dataclasses.replace(weight, w=w)
            continue
        stacked = spec.stacked_rank(name) if weight.u_scale is None else weight.u_scale.shape[-1]
        us, vs = [], []
        for parts in layers:
            u, v = dense_as_factors(name, parts["w"], xp) if "w" in parts else (parts["u"], parts["v"])
            us.append(xp.pad(u, ((0, 0), (0, stacked - u.shape[1]))))
            vs.append(xp.pad(v, ((0, stacked - v.shape[0]), (0, 0))))
        values[name] = dataclasses.replace(weight, u=xp.stack(us), v=xp.stack(vs))
    return ops.replace(packed=None, **values)


def packed_pieces(spec: DecodeSpec, layer: int, block_bytes: int, itemsize: int):
    """`layer`'s segments in the DMAs that load them: [(first element, elements, partitions, segments)], runs of
    consecutive segments of equal partitions whose elements fit `block_bytes` per partition (a weight-ring block);
    a ValueError when one segment alone does not fit."""
    pieces = []
    for s in packed_segments(spec, layer):
        if s.width * itemsize > block_bytes:
            raise ValueError(
                f"packed weights: {s.weight}.{s.part} of layer {layer} takes {s.width * itemsize} bytes a partition, "
                f"more than a weight-ring block of {block_bytes} (ring_block_bytes); expected spec.packed_weights "
                "to name weights whose blocks fit one"
            )
        last = pieces[-1] if pieces else None
        if last and last[2] == s.partitions and (last[1] + s.width) * itemsize <= block_bytes:
            last[1] += s.width
            last[3].append(s)
        else:
            pieces.append([s.offset, s.width, s.partitions, [s]])
    return [tuple(piece) for piece in pieces]


def load_packed(packed, layer, spec, ring):
    """Layer `layer`'s packed weights (packed: the [L, 128, E] operand in HBM) loaded through `ring`, one DMA
    block per piece (`packed_pieces`): {weight: {part: OnChipWeight}}, each stage as one [partitions, count,
    columns] SBUF view per block of its input layout. The blocks stay pinned in the ring (later loads skip their
    bytes) until the next call or until the caller clears ring.pinned after its last packed weight's matmuls are
    issued (step.decoder_layer), as weights that are not packed may stream through the ring before a packed
    one is read (with the attention's four packed, none do)."""
    loaded = {}
    ring.pinned = []
    pinned = []
    for first, elements, partitions, segments in packed_pieces(spec, layer, ring.block_bytes, packed.dtype.itemsize):
        src = packed[layer, 0:partitions, first : first + elements].reshape_dim(1, (1, elements))
        block = ring.load(src, partitions, 1, elements)
        pinned.append((ring.cursor - elements * packed.dtype.itemsize, ring.cursor))  # the stretch it took
        ring.pinned = list(pinned)  # a layer's pieces never overwrite one another
        for s in segments:
            view = block[0:partitions, 0, s.offset - first : s.offset - first + s.width].reshape_dim(
                1, (s.count, s.columns)
            )
            loaded.setdefault(s.weight, {}).setdefault(s.part, []).append((s, view))
    return {
        name: {
            part: OnChipWeight([view for _, view in blocks], sum(s.rows for s, _ in blocks), blocks[0][0].columns)
            for part, blocks in parts.items()
        }
        for name, parts in loaded.items()
    }
