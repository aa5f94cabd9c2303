"""A whole model's decode operands cut into Megatron tensor-parallel shards, one per rank (NeuronCore), and the
per-rank caches put back together.

Rank r of T holds (contract.DecodeSpec.tensor_parallel describes what a per-rank spec counts):
- attention by KV-head groups: KV heads [r·kv/T, (r+1)·kv/T) and the query heads that read them (GQA groups are
  consecutive, so query heads [r·nh/T, (r+1)·nh/T)): q, k and v's columns of those heads, o's rows of them, and the
  KV caches' heads;
- the MLP by the intermediate features [r·I/T, (r+1)·I/T): gate and up's columns, down's rows;
- the LM head by the vocabulary [r·V/T, (r+1)·V/T): its columns;
- everything else whole: x, norms, q/k norms, RoPE tables, masks, write_index, final norm.
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

# The spec's sizes that count one rank's share (the rest are whole).
_SPLIT_SIZES = ("num_kv_heads", "num_heads", "intermediate", "vocab")


def shard_spec(spec: DecodeSpec, tensor_parallel: int) -> DecodeSpec:
    """The per-rank spec of the whole-model `spec` (tensor_parallel 1) split over `tensor_parallel` ranks; a
    ValueError naming the argument when the ranks do not divide the KV heads, the intermediate features or the
    vocabulary."""
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
    for name in _SPLIT_SIZES:
        size = getattr(spec, name)
        if size % ranks:
            raise ValueError(
                f"{where}: tensor_parallel: got {ranks}, which does not divide spec.{name} = {size} (each rank "
                f"takes an equal share of the {name})"
            )
    return dataclasses.replace(
        spec, tensor_parallel=ranks, **{name: getattr(spec, name) // ranks for name in _SPLIT_SIZES}
    )


def _columns(array, rank, per_rank):
    """Columns [rank·per_rank, (rank+1)·per_rank) of the last axis, as a standalone array."""
    return np.ascontiguousarray(array[..., rank * per_rank : (rank + 1) * per_rank])


def _rows(array, rank, per_rank):
    """Rows [rank·per_rank, (rank+1)·per_rank) of the second-to-last axis (a weight's K), as a standalone array."""
    return np.ascontiguousarray(array[..., rank * per_rank : (rank + 1) * per_rank, :])


def _weight_shard(weight, split_rows: bool, rank: int, per_rank: int):
    """One rank's part of a stored weight: K rows (split_rows) or N columns of the values (u's rows / v's columns
    when factored), with the output scales of the columns it keeps."""
    if isinstance(weight, Factored):
        if split_rows:
            return dataclasses.replace(weight, u=_rows(weight.u, rank, per_rank))
        v_scale = None if weight.v_scale is None else _columns(weight.v_scale, rank, per_rank)
        return dataclasses.replace(weight, v=_columns(weight.v, rank, per_rank), v_scale=v_scale)
    if isinstance(weight, Quantized):
        if split_rows:
            return dataclasses.replace(weight, w=_rows(weight.w, rank, per_rank))
        return Quantized(_columns(weight.w, rank, per_rank), _columns(weight.scale, rank, per_rank))
    return _rows(weight, rank, per_rank) if split_rows else _columns(weight, rank, per_rank)


def shard_operands(spec: DecodeSpec, operands, tensor_parallel: int) -> tuple[DecodeSpec, list[DecodeOperands]]:
    """(per-rank spec, [rank r's DecodeOperands for r in range(tensor_parallel)]) of a whole model's step:
    `operands` (DecodeOperands or a sequence in field order; numpy arrays) follow the contract for `spec` (its
    tensor_parallel 1); each rank's are standalone arrays cut as the module docstring says."""
    rank_spec = shard_spec(spec, tensor_parallel)
    ops = check(spec, operands, "shard_operands", padded_ranks=True)
    ranks = rank_spec.tensor_parallel
    head_dim = spec.head_dim
    per_rank = {
        "q": rank_spec.num_heads * head_dim,
        "k": rank_spec.num_kv_heads * head_dim,
        "v": rank_spec.num_kv_heads * head_dim,
        "o": rank_spec.num_heads * head_dim,
        "gate": rank_spec.intermediate,
        "up": rank_spec.intermediate,
        "down": rank_spec.intermediate,
        "head": rank_spec.vocab,
    }
    shards = []
    for r in range(ranks):
        changes = {
            name: _weight_shard(getattr(ops, name), name in SPLIT_ROWS, r, per_rank[name])
            for name in (*PROJECTIONS, "head")
        }
        for cache in ("k_cache", "v_cache"):  # [L, B, S, kv_heads, D]: this rank's KV heads
            heads = rank_spec.num_kv_heads
            changes[cache] = np.ascontiguousarray(getattr(ops, cache)[:, :, :, r * heads : (r + 1) * heads])
        shards.append(ops.replace(**changes))
    return rank_spec, shards


def gather_cache(rank_caches) -> np.ndarray:
    """The whole model's cache [L, B, S, kv_heads, D] from the ranks' caches (rank order; each [L, B, S,
    kv_heads / T, D])."""
    return np.concatenate(list(rank_caches), axis=3)
