"""`nki.collectives` on the emulator: one NeuronCore, so every replica group holds only this rank.

The emulator runs one core: a collective over a group of one rank is a copy (all_reduce, all_gather,
reduce_scatter, all_to_all, permutations onto oneself), done by DMA. Groups naming other ranks raise.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import context
from . import isa as _isa
from .tensor import NKIObject, NkiTensor


@dataclasses.dataclass
class ReplicaGroup(NKIObject):
    """Groups of ranks taking part in a collective; on the emulator every group must be [0]."""

    replica_groups: list = dataclasses.field(default_factory=lambda: [[0]])


def _check_group(what, group):
    groups = group.replica_groups if isinstance(group, ReplicaGroup) else group
    if groups is None:
        return
    ranks = [r for g in groups for r in (g if isinstance(g, (list, tuple)) else [g])]
    if any(int(r) != 0 for r in ranks):
        raise NotImplementedError(f"nki.collectives.{what}: replica groups {groups} name ranks other than 0; the "
                                  f"emulator runs one core (replica groups of one)")


def _copy_all(what, srcs, dsts):
    if len(srcs) != len(dsts):
        raise ValueError(f"nki.collectives.{what}: {len(srcs)} srcs but {len(dsts)} dsts")
    for src, dst in zip(srcs, dsts):
        if not isinstance(src, NkiTensor) or not isinstance(dst, NkiTensor):
            raise TypeError(f"nki.collectives.{what}: srcs and dsts must be NKI tensors")
        if src.is_on_chip != dst.is_on_chip:
            raise ValueError(f"nki.collectives.{what}: all tensors must be in HBM or all in SBUF")
        if src.is_on_chip:
            _isa.tensor_copy(dst, src)
        else:
            _isa.dma_copy(dst, src)


def all_reduce(srcs, dsts, replica_group, op, priority=None, name=None):
    _check_group("all_reduce", replica_group)
    _copy_all("all_reduce", srcs, dsts)


def all_gather(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    _check_group("all_gather", replica_group)
    _copy_all("all_gather", srcs, dsts)


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op, priority=None, name=None):
    _check_group("reduce_scatter", replica_group)
    _copy_all("reduce_scatter", srcs, dsts)


def all_to_all(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    _check_group("all_to_all", replica_group)
    _copy_all("all_to_all", srcs, dsts)


def collective_permute(srcs, dsts, source_target_pairs, priority=None, name=None):
    if any(tuple(pair) != (0, 0) for pair in source_target_pairs):
        raise NotImplementedError(f"nki.collectives.collective_permute: pairs {source_target_pairs} name ranks "
                                  f"other than 0; the emulator runs one core")
    _copy_all("collective_permute", srcs, dsts)


def rank_id(name=None):
    """This core's rank (0) as a [1, 1] int32 SBUF tile, usable as a dynamic index."""
    from .tensor import allocate
    context.current("nki.collectives.rank_id")
    tile = allocate((1, 1), np.int32, "sbuf")
    _isa.memset(tile, 0)
    return tile


__all__ = ["ReplicaGroup", "all_gather", "all_reduce", "all_to_all", "collective_permute", "rank_id",
           "reduce_scatter"]
