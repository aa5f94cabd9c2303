"""`nki.collectives` on the emulator: one NeuronCore, so every replica group holds only this rank.

The emulator runs one core: a collective over a group of one rank is a copy (all_reduce, all_gather,
reduce_scatter, all_to_all, permutations onto oneself), done by DMA (tensor_copy for SBUF tensors). Groups naming
other ranks raise; so do the variable-length collectives (all_gather_v, all_to_all_v).
"""

from __future__ import annotations

import dataclasses

from . import context
from . import isa as _isa
from .isa_control import VirtualRegister
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
        raise NotImplementedError(
            f"nki.collectives.{what}: replica groups {groups} name ranks other than 0; the "
            f"emulator runs one core (replica groups of one)"
        )


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
        raise NotImplementedError(
            f"nki.collectives.collective_permute: pairs {source_target_pairs} name ranks "
            f"other than 0; the emulator runs one core"
        )
    _copy_all("collective_permute", srcs, dsts)


def _one_tensor_per_channel(what, *lists):
    pairs = []
    for channel in zip(*lists):
        if any(len(inner) != 1 for inner in channel):
            raise ValueError(f"nki.collectives.{what}: each channel takes exactly one tensor per list")
        pairs.append(tuple(inner[0] for inner in channel))
    return pairs


def collective_permute_implicit(
    srcs_by_channel, dsts_by_channel, replica_group, channel_ids=(0,), priority=None, name=None
):
    """Ring send to the successor / receive from the predecessor; in a ring of one, each channel's dst = src."""
    _check_group("collective_permute_implicit", replica_group)
    for src, dst in _one_tensor_per_channel("collective_permute_implicit", srcs_by_channel, dsts_by_channel):
        _copy_all("collective_permute_implicit", [src], [dst])


def collective_permute_implicit_reduce(
    srcs0_by_channel, srcs1_by_channel, dsts_by_channel, replica_group, op, channel_ids=(0,), priority=None, name=None
):
    """dst = op(src0, src1) of the predecessor; in a ring of one, of this rank (VectorE on chip, else by DMA)."""
    _check_group("collective_permute_implicit_reduce", replica_group)
    if getattr(op, "nki_op", op) not in ("add", "minimum", "maximum"):
        raise ValueError(
            f"nki.collectives.collective_permute_implicit_reduce: op must be nl.add, nl.minimum or "
            f"nl.maximum, got {op!r}"
        )
    for src0, src1, dst in _one_tensor_per_channel(
        "collective_permute_implicit_reduce", srcs0_by_channel, srcs1_by_channel, dsts_by_channel
    ):
        if dst.is_on_chip:
            _isa.tensor_tensor(dst, src0, src1, op)
        else:
            if getattr(op, "nki_op", op) != "add":
                raise NotImplementedError(
                    "collective_permute_implicit_reduce: HBM tensors are reduced by DMA compute, which adds only"
                )
            _isa.dma_compute(dst, [src0, src1], op)


def collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group, channel_id=0, name=None):
    """The rank whose data a ring step processes: with one rank, always this one (a register holding 0)."""
    _check_group("collective_permute_implicit_current_processing_rank_id", replica_group)
    return VirtualRegister(0)


def _variable_length(what):
    def collective(*args, **kwargs):
        raise NotImplementedError(f"nki.collectives.{what}: the variable-length metadata tensor layout is not emulated")

    collective.__name__ = collective.__qualname__ = what
    return collective


all_gather_v = _variable_length("all_gather_v")
all_to_all_v = _variable_length("all_to_all_v")


def rank_id(name=None):
    """This core's rank in the group: a register holding 0 (one core), usable as a dynamic index."""
    context.current("nki.collectives.rank_id")
    return VirtualRegister(0)


__all__ = [
    "ReplicaGroup",
    "all_gather",
    "all_gather_v",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "collective_permute",
    "collective_permute_implicit",
    "collective_permute_implicit_current_processing_rank_id",
    "collective_permute_implicit_reduce",
    "rank_id",
    "reduce_scatter",
]
