"""A whole model's decode operands cut into Megatron tensor-parallel shards, one per rank (NeuronCore), and the
per-rank caches put back together.

Rank r of T = tensor_parallel ranks holds (contract.DecodeSpec.tensor_parallel describes what a per-rank spec counts):
- attention by KV-head groups: KV heads [r·kv/T, (r+1)·kv/T) and the query heads that read them (GQA groups are
  consecutive, so query heads [r·nh/T, (r+1)·nh/T)): q, k and v's columns of those heads, o's rows of them, and the
  KV caches' heads. With more ranks than KV heads (T a multiple of kv), each KV head is replicated on the T/kv
  consecutive ranks that split its query heads (rank r: KV head r·kv/T, query heads [r·nh/T, (r+1)·nh/T)), as
  Megatron-style inference does: those ranks hold the same k/v columns and each keeps its own copy of the head's
  cache;
- the MLP by the intermediate features [r·I/T, (r+1)·I/T): gate and up's columns, down's rows;
- the LM head by the vocabulary [r·V/T, (r+1)·V/T): its columns;
- everything else whole: x, norms, q/k norms, RoPE tables, masks, write_index, final norm.
Packed weights (DecodeSpec.packed_weights) stay packed: each rank's packed operand holds its own shard's values.
A column-split weight that is factored keeps u whole and splits v's columns; a row-split one (contract.SPLIT_ROWS:
o and down) splits u's rows and keeps v whole. fp8 scales go with their columns: a column-split weight's output
scales are split, a row-split one's (and every u_scale, over the whole rank) kept. Per-layer ranks are the whole
model's (the factors keep their stacking and zero padding).
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from nki_kernels.decode.contract import (
    PROJECTIONS,
    SPLIT_ROWS,
    DecodeOperands,
    DecodeSpec,
    Factored,
    Quantized,
    check,
    check_spec,
)
from nki_kernels.decode.packing import pack_weights, unpack_weights, unpacked_spec


def shard_spec(spec: DecodeSpec, tensor_parallel: int) -> DecodeSpec:
    """The per-rank spec of the whole-model `spec` (tensor_parallel 1) split over `tensor_parallel` ranks; a
    ValueError naming the argument when the ranks do not divide the KV heads (nor are a multiple of them that
    divides the query heads: replicated KV heads), the intermediate features or the vocabulary."""
    where = "shard_spec"
    check_spec(spec, where)
    try:
        ranks = operator.index(tensor_parallel)
    except TypeError:
        raise TypeError(f"{where}: tensor_parallel: got {tensor_parallel!r}, expected an int") from None
    if ranks < 1:
        raise ValueError(f"{where}: tensor_parallel: got {ranks}, expected >= 1")
    if spec.tensor_parallel != 1:
        raise ValueError(
            f"{where}: spec.tensor_parallel: got {spec.tensor_parallel}, expected 1 (the whole model's spec)"
        )
    kv, heads = spec.num_kv_heads, spec.num_heads
    if kv % ranks and (ranks % kv or heads % ranks):
        raise ValueError(
            f"{where}: tensor_parallel: got {ranks}, which does not divide spec.num_kv_heads = {kv} (nor is it a "
            f"multiple of them that divides spec.num_heads = {heads}, for replicated KV heads)"
        )
    for name in ("intermediate", "vocab"):
        size = getattr(spec, name)
        if size % ranks:
            raise ValueError(
                f"{where}: tensor_parallel: got {ranks}, which does not divide spec.{name} = {size} (each rank "
                f"takes an equal share of the {name})"
            )
    return spec.replace(
        tensor_parallel=ranks,
        num_heads=heads // ranks,
        num_kv_heads=max(1, kv // ranks),
        intermediate=spec.intermediate // ranks,
        vocab=spec.vocab // ranks,
    )


def _span(per_rank, rank):
    """Rank `rank`'s share [rank·per_rank, (rank+1)·per_rank) of an axis, as a slice."""
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _columns(array, span):
    """Columns `span` (a slice) of the last axis, as a standalone array."""
    return np.ascontiguousarray(array[..., span])


def _rows(array, span):
    """Rows `span` (a slice) of the second-to-last axis (a weight's K), as a standalone array."""
    return np.ascontiguousarray(array[..., span, :])


def _weight_shard(weight, split_rows: bool, span: slice):
    """One rank's part of a stored weight: K rows `span` (split_rows) or N columns `span` of the values (u's rows /
    v's columns when factored), with the output scales of the columns it keeps."""
    if isinstance(weight, Factored):
        if split_rows:
            return dataclasses.replace(weight, u=_rows(weight.u, span))
        v_scale = None if weight.v_scale is None else _columns(weight.v_scale, span)
        return dataclasses.replace(weight, v=_columns(weight.v, span), v_scale=v_scale)
    if isinstance(weight, Quantized):
        if split_rows:
            return dataclasses.replace(weight, w=_rows(weight.w, span))
        return Quantized(_columns(weight.w, span), _columns(weight.scale, span))
    return _rows(weight, span) if split_rows else _columns(weight, span)


def shard_operands(spec: DecodeSpec, operands, tensor_parallel: int) -> tuple[DecodeSpec, list[DecodeOperands]]:
    """(per-rank spec, [rank r's DecodeOperands for r in range(tensor_parallel)]) of a whole model's step:
    `operands` (DecodeOperands or a sequence in field order; numpy arrays) follow the contract for `spec` (its
    tensor_parallel 1); each rank's are standalone arrays cut as the module docstring says. Packed weights
    (spec.packed_weights) are packed per rank: each rank's `packed` holds its shard's values in its layout."""
    rank_spec = shard_spec(spec, tensor_parallel)
    ops = check(spec, operands, "shard_operands", padded_ranks=True)
    if spec.packed_weights:  # cut from the stored weights; each rank's packed again in its shard's layout
        shards = shard_operands(unpacked_spec(spec), unpack_weights(ops, spec), tensor_parallel)[1]
        return rank_spec, [pack_weights(shard, rank_spec) for shard in shards]
    ranks = rank_spec.tensor_parallel
    shards = []
    for r in range(ranks):
        first_kv = r * spec.num_kv_heads // ranks  # this rank's first KV head (shared by T/kv ranks when replicated)
        heads = _span(rank_spec.num_heads * spec.head_dim, r)
        kv_heads = slice(first_kv * spec.head_dim, (first_kv + rank_spec.num_kv_heads) * spec.head_dim)
        spans = dict(q=heads, k=kv_heads, v=kv_heads, o=heads, head=_span(rank_spec.vocab, r))
        spans.update(dict.fromkeys(("gate", "up", "down"), _span(rank_spec.intermediate, r)))
        changes = {
            name: _weight_shard(getattr(ops, name), name in SPLIT_ROWS, spans[name]) for name in (*PROJECTIONS, "head")
        }
        for cache in ("k_cache", "v_cache"):  # [L, B, S, kv_heads, D]: this rank's KV heads
            changes[cache] = np.ascontiguousarray(
                getattr(ops, cache)[:, :, :, first_kv : first_kv + rank_spec.num_kv_heads]
            )
        shards.append(ops.replace(**changes))
    return rank_spec, shards


def gather_cache(rank_caches, num_kv_heads: int) -> np.ndarray:
    """The whole model's cache [L, B, S, num_kv_heads, D] from the ranks' caches (rank order; each [L, B, S, kv, D]
    with kv = max(1, num_kv_heads / T)): their heads side by side, one copy of each replicated KV head (the first
    of the ranks sharing it)."""
    caches = list(rank_caches)
    copies = len(caches) * caches[0].shape[3] // num_kv_heads
    return np.concatenate(caches[::copies], axis=3)
