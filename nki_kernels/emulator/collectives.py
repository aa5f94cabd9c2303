"""`nki.collectives` on the emulator: real data exchanged between the ranks of a `simulate_spmd` launch.

Each call checks the documented rules, meets the same call of every other rank (`spmd.World.exchange`), computes
this rank's result from the other ranks' snapshots of their sources in float32 (integers in int64), writes its
dsts and records one instruction with `trace.CollectiveInfo` for the cost model. A plain launch is one rank.
docs/emulator.md ("Collectives: the rules checked") lists the rules, shapes and orders, with their sources.
"""

from __future__ import annotations

import dataclasses
import enum
import operator

import numpy as np

from . import context, dtypes, ops, spmd
from .errors import NkiCollectiveError
from .isa_control import VirtualRegister
from .isa_core import _write
from .tensor import NKIObject, NkiTensor
from .trace import CollectiveInfo, InstructionRecord

MAX_CHANNELS = 4


class rg_partition_op(enum.Enum):  # noqa: N801 -- NKI's name
    """How `ReplicaGroup.from_partition_op` maps a rank to its rank-list id: op(rank, operand)."""

    bitwise_and = "bitwise_and"
    div = "div"
    mod = "mod"


_PARTITION = {
    rg_partition_op.bitwise_and: operator.and_,
    rg_partition_op.div: operator.floordiv,
    rg_partition_op.mod: operator.mod,
}


@dataclasses.dataclass
class ReplicaGroup(NKIObject):
    """The ranks a collective runs on, as a list of rank-lists (each rank in only one); default: [[0]]."""

    replica_groups: list = dataclasses.field(default_factory=lambda: [[0]])

    @staticmethod
    def from_partition_op(world_size, op, operand):
        """Ranks [0, world_size) with equal op(rank, operand) form one rank-list, ordered by that id."""
        if op not in _PARTITION:
            raise TypeError(f"ReplicaGroup.from_partition_op: op must be an rg_partition_op, got {op!r}")
        lists: dict[int, list[int]] = {}
        for rank in range(world_size):
            lists.setdefault(_PARTITION[op](rank, operand), []).append(rank)
        return ReplicaGroup([lists[k] for k in sorted(lists)])


@dataclasses.dataclass
class _Payload:
    specs: tuple  # ((shape, dtype name), ...) of srcs then dsts
    arrays: list | None  # snapshots of the sources (None without numerics)


def _fail(what, line, message):
    raise NkiCollectiveError(f"nki.collectives.{what} at {line}: {message}")


def _start(what, priority=None):
    ctx = context.current(f"nki.collectives.{what}")
    line = context.caller_line()
    if priority is not None and ctx.target in ("trn1", "trn2"):
        _fail(what, line, f"priority={priority!r} is a NeuronCore-v4 (trn3) option; this kernel targets {ctx.target}")
    rank, world = spmd.rank_and_world(f"nki.collectives.{what}")
    return ctx, line, rank, world


def _rank_lists(what, line, group, num_ranks):
    """The rank-lists of a replica group as a tuple of tuples, checked against the launch's ranks."""
    raw = group.replica_groups if isinstance(group, ReplicaGroup) else group
    if raw is None:
        raw = [list(range(num_ranks))]
    try:
        lists = tuple(tuple(operator.index(r) for r in (g if isinstance(g, (list, tuple)) else [g])) for g in raw)
    except TypeError:
        _fail(what, line, f"replica group {raw!r}: expected a list of lists of int ranks")
    if not lists or any(not g for g in lists):
        _fail(what, line, f"replica group {[list(g) for g in lists]}: every rank-list needs at least one rank")
    seen = set()
    for g in lists:
        for r in g:
            if not 0 <= r < num_ranks:
                _fail(
                    what,
                    line,
                    f"replica group {[list(g) for g in lists]} names rank {r}, but the kernel runs on {num_ranks} "
                    f"rank(s) (ranks 0..{num_ranks - 1}; launch several with simulate_spmd(kernel, num_ranks))",
                )
            if r in seen:
                _fail(
                    what,
                    line,
                    f"replica group {[list(g) for g in lists]}: rank {r} appears more than once; each rank "
                    f"participates in only one rank-list",
                )
            seen.add(r)
    missing = sorted(set(range(num_ranks)) - seen)
    if missing:
        _fail(
            what,
            line,
            f"replica group {[list(g) for g in lists]} leaves out rank(s) {missing} of the {num_ranks}; every rank "
            f"runs the kernel's collectives (SPMD), so each must be in exactly one rank-list",
        )
    return lists


def _my_list(lists, rank):
    return next(g for g in lists if rank in g)


def _tensors(what, line, srcs, dsts, hbm_only=False, single=False):
    """(srcs, dsts, on_chip) as lists, with the documented memory and count rules checked."""
    srcs, dsts = list(srcs), list(dsts)
    if not srcs or len(srcs) != len(dsts):
        _fail(what, line, f"{len(srcs)} srcs but {len(dsts)} dsts; give one dst per src (at least one)")
    for label, ts in (("srcs", srcs), ("dsts", dsts)):
        for i, t in enumerate(ts):
            if not isinstance(t, NkiTensor):
                raise TypeError(f"nki.collectives.{what} at {line}: {label}[{i}] must be an NKI tensor, got {t!r}")
    kinds = {t.storage.kind for t in srcs + dsts}
    if "psum" in kinds:
        _fail(what, line, "collectives read and write HBM or SBUF, not PSUM")
    if len(kinds) > 1:
        _fail(what, line, "all tensors must be in HBM or all in SBUF, not a mix")
    on_chip = kinds == {"sbuf"}
    if on_chip and hbm_only:
        _fail(what, line, f"{what} takes HBM tensors only (SBUF is not supported)")
    if single and len(srcs) != 1:
        _fail(what, line, f"exactly one src and one dst (coalesced tensors are not supported), got {len(srcs)}")
    if on_chip and len(srcs) > 1:
        _fail(what, line, f"{len(srcs)} SBUF tensors: coalesced collectives (several tensors) need HBM tensors")
    return srcs, dsts, on_chip


def _reduce_op(what, line, op):
    name = ops.op_name(op, f"nki.collectives.{what} op")
    if name not in ("add", "minimum", "maximum"):
        _fail(what, line, f"op must be nl.add, nl.minimum or nl.maximum, got {op!r}")
    return name


def _payload(ctx, srcs, dsts):
    specs = tuple((tuple(t.shape), dtypes.NAME[t.dtype]) for t in srcs + dsts)
    arrays = [np.array(t.array(), copy=True) for t in srcs] if ctx.numerics else None
    return _Payload(specs, arrays)


def _same_specs(what, line, ranks, calls):
    """Every rank of `ranks` passed tensors of the same shapes and dtypes."""
    first = calls[ranks[0]].payload.specs
    if all(calls[r].payload.specs == first for r in ranks):
        return
    described = "; ".join(f"rank {r} at {calls[r].line}: {list(calls[r].payload.specs)}" for r in ranks)
    _fail(
        what,
        line,
        f"ranks of one rank-list pass tensors of different shapes or dtypes ([shape, dtype] of srcs, "
        f"then dsts): {described}",
    )


def _reduce(arrays, op, dtype):
    acc = np.float32 if dtypes.is_float(dtype) else np.int64
    total = np.asarray(arrays[0]).astype(acc)
    fn = {"add": np.add, "minimum": np.minimum, "maximum": np.maximum}[op]
    for a in arrays[1:]:
        total = fn(total, np.asarray(a).astype(acc))
    return total


def _record(ctx, what, line, srcs, dsts, kind, group_size, world, nbytes=None):
    ctx.check_capacity(what, line)
    first = dsts[0]
    partitions = first.shape[0] if first.is_on_chip else 1
    nbytes = sum(t.size * t.dtype.itemsize for t in srcs) if nbytes is None else nbytes
    ctx.run.records.append(
        InstructionRecord(
            what,
            "dma",
            line,
            partitions,
            first.size // partitions,
            dtypes.NAME[first.dtype],
            tuple(t.access() for t in srcs),
            tuple(t.access() for t in dsts),
            input_dtypes=tuple(dtypes.NAME[t.dtype] for t in srcs),
            collective=CollectiveInfo(kind, nbytes, group_size, world.num_ranks),
        )
    )


def _key(what, lists, **params):
    return (what, ("replica_group", [list(g) for g in lists]), *((k, v) for k, v in params.items()))


# -- the collectives --------------------------------------------------------------------------------------------


def all_reduce(srcs, dsts, replica_group, op, priority=None, name=None):
    """Every rank of a rank-list gets op over the rank-list's srcs (element-wise) in its dsts."""
    what = "all_reduce"
    ctx, line, rank, world = _start(what, priority)
    srcs, dsts, _ = _tensors(what, line, srcs, dsts)
    op_name = _reduce_op(what, line, op)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if s.shape != d.shape:
            _fail(what, line, f"srcs[{i}] {s.describe()} and dsts[{i}] {d.describe()} must have the same shape")
    lists = _rank_lists(what, line, replica_group, world.num_ranks)
    calls = world.exchange(rank, spmd.Call(what, line, _key(what, lists, op=op_name), _payload(ctx, srcs, dsts)))
    mine = _my_list(lists, rank)
    _same_specs(what, line, mine, calls)
    if ctx.numerics:
        for i, d in enumerate(dsts):
            _write(d, _reduce([calls[r].payload.arrays[i] for r in mine], op_name, d.dtype))
    _record(ctx, what, line, srcs, dsts, what, len(mine), world)


def all_gather(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """dsts = the rank-list's srcs concatenated along collective_dim, in rank-list order."""
    what = "all_gather"
    ctx, line, rank, world = _start(what, priority)
    srcs, dsts, on_chip = _tensors(what, line, srcs, dsts)
    allowed = (0, 1) if on_chip else (0,)
    if collective_dim not in allowed:
        _fail(what, line, f"collective_dim {collective_dim!r}: {'SBUF' if on_chip else 'HBM'} tensors allow {allowed}")
    if on_chip and any(len(t.shape) != 2 for t in srcs + dsts):
        _fail(what, line, "SBUF collectives take 2-D tensors (the partition dim and one free dim)")
    lists = _rank_lists(what, line, replica_group, world.num_ranks)
    mine = _my_list(lists, rank)
    n = len(mine)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        want = list(s.shape)
        want[collective_dim] *= n
        if list(d.shape) != want:
            _fail(
                what,
                line,
                f"dsts[{i}] {d.describe()} must have shape {want}: srcs[{i}] {s.describe()} with dim "
                f"{collective_dim} times the {n} ranks of rank-list {list(mine)}",
            )
    calls = world.exchange(
        rank, spmd.Call(what, line, _key(what, lists, collective_dim=collective_dim), _payload(ctx, srcs, dsts))
    )
    _same_specs(what, line, mine, calls)
    if ctx.numerics:
        for i, d in enumerate(dsts):
            _write(d, np.concatenate([calls[r].payload.arrays[i] for r in mine], axis=collective_dim).astype(d.dtype))
    _record(ctx, what, line, srcs, dsts, what, n, world)


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op, priority=None, name=None):
    """The rank at position i of its rank-list gets the i-th dim-0 chunk of op over the rank-list's srcs."""
    what = "reduce_scatter"
    ctx, line, rank, world = _start(what, priority)
    srcs, dsts, _ = _tensors(what, line, srcs, dsts)
    op_name = _reduce_op(what, line, op)
    if collective_dim != 0:
        _fail(what, line, f"collective_dim {collective_dim!r}: only 0 is supported")
    lists = _rank_lists(what, line, replica_group, world.num_ranks)
    mine = _my_list(lists, rank)
    n = len(mine)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if list(s.shape) != [d.shape[0] * n, *d.shape[1:]]:
            _fail(
                what,
                line,
                f"srcs[{i}] {s.describe()} must be dsts[{i}] {d.describe()} with dim 0 times the {n} ranks of "
                f"rank-list {list(mine)}",
            )
    calls = world.exchange(
        rank, spmd.Call(what, line, _key(what, lists, op=op_name, collective_dim=0), _payload(ctx, srcs, dsts))
    )
    _same_specs(what, line, mine, calls)
    if ctx.numerics:
        pos = mine.index(rank)
        for i, d in enumerate(dsts):
            m = d.shape[0]
            _write(d, _reduce([calls[r].payload.arrays[i][pos * m : (pos + 1) * m] for r in mine], op_name, d.dtype))
    _record(ctx, what, line, srcs, dsts, what, n, world)


def all_to_all(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """The rank at position i gets the i-th dim-0 chunk of every rank's src, concatenated in rank-list order."""
    what = "all_to_all"
    ctx, line, rank, world = _start(what, priority)
    srcs, dsts, _ = _tensors(what, line, srcs, dsts, hbm_only=True)
    if collective_dim != 0:
        _fail(what, line, f"collective_dim {collective_dim!r}: only 0 is supported")
    lists = _rank_lists(what, line, replica_group, world.num_ranks)
    mine = _my_list(lists, rank)
    n = len(mine)
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if s.shape != d.shape or s.shape[0] % n:
            _fail(
                what,
                line,
                f"srcs[{i}] {s.describe()} and dsts[{i}] {d.describe()} need one shape with dim 0 divisible by the "
                f"{n} ranks of rank-list {list(mine)}",
            )
    calls = world.exchange(rank, spmd.Call(what, line, _key(what, lists, collective_dim=0), _payload(ctx, srcs, dsts)))
    _same_specs(what, line, mine, calls)
    if ctx.numerics:
        pos = mine.index(rank)
        for i, d in enumerate(dsts):
            m = d.shape[0] // n
            parts = [calls[r].payload.arrays[i][pos * m : (pos + 1) * m] for r in mine]
            _write(d, np.concatenate(parts, axis=0).astype(d.dtype))
    _record(ctx, what, line, srcs, dsts, what, n, world)


def _pairs(what, line, source_target_pairs, num_ranks):
    try:
        pairs = tuple((operator.index(s), operator.index(t)) for s, t in source_target_pairs)
    except (TypeError, ValueError):
        _fail(what, line, f"source_target_pairs {source_target_pairs!r}: expected (source, target) pairs of ranks")
    for s, t in pairs:
        if not (0 <= s < num_ranks and 0 <= t < num_ranks):
            _fail(
                what,
                line,
                f"pair {(s, t)} names a rank outside 0..{num_ranks - 1}; the kernel runs on {num_ranks} rank(s) "
                f"(launch several with simulate_spmd(kernel, num_ranks))",
            )
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    if len(set(sources)) != len(sources) or len(set(targets)) != len(targets):
        _fail(what, line, f"pairs {list(pairs)}: each rank sends at most once and receives at most once")
    if set(sources) != set(targets):
        _fail(
            what,
            line,
            f"pairs {list(pairs)} are not circular (senders {sorted(set(sources))}, receivers "
            f"{sorted(set(targets))}); the Neuron runtime supports only circular permute patterns",
        )
    return pairs


def collective_permute(srcs, dsts, source_target_pairs, priority=None, name=None):
    """For each (source, target) pair, target's dst = source's src; ranks that are no target keep their dst."""
    what = "collective_permute"
    ctx, line, rank, world = _start(what, priority)
    srcs, dsts, _ = _tensors(what, line, srcs, dsts, hbm_only=True, single=True)
    pairs = _pairs(what, line, source_target_pairs, world.num_ranks)
    key = (what, ("source_target_pairs", [list(p) for p in pairs]))
    calls = world.exchange(rank, spmd.Call(what, line, key, _payload(ctx, srcs, dsts)))
    sender = next((s for s, t in pairs if t == rank), None)
    if sender is not None:
        _same_specs(what, line, [sender, rank], calls)
        if ctx.numerics:
            _write(dsts[0], calls[sender].payload.arrays[0].astype(dsts[0].dtype))
    takes_part = sender is not None or any(s == rank for s, _ in pairs)
    _record(ctx, what, line, srcs, dsts, "permute", 2 if takes_part else 1, world, None if takes_part else 0)


def _by_channel(what, line, channel_ids, *lists):
    channels = [list(c) for c in lists[0]]
    for lst in lists:
        if len(lst) != len(channels):
            _fail(what, line, f"every argument needs one list per channel; got {[len(x) for x in lists]} channels")
        if any(len(inner) != 1 for inner in lst):
            _fail(what, line, "each channel takes exactly one tensor per list (coalescing is not supported)")
    ids = list(channel_ids)
    if ids != list(range(len(ids))) or len(ids) != len(channels):
        _fail(
            what,
            line,
            f"channel_ids {ids}: must be consecutive from 0, one per channel ({len(channels)} channel(s) given)",
        )
    if len(ids) > MAX_CHANNELS:
        _fail(what, line, f"{len(ids)} channels: at most {MAX_CHANNELS} are available")
    return [tuple(lst[c][0] for lst in lists) for c in range(len(channels))]


def _ring(what, line, ctx, rank, world, replica_group, key_params, srcs, dsts, sent_arrays, extra_reads=()):
    lists = _rank_lists(what, line, replica_group, world.num_ranks)
    srcs, dsts, _ = _tensors(what, line, srcs, dsts)
    payload = _payload(ctx, srcs, dsts)
    if ctx.numerics:
        payload.arrays = sent_arrays()
    calls = world.exchange(rank, spmd.Call(what, line, _key(what, lists, **key_params), payload))
    mine = _my_list(lists, rank)
    _same_specs(what, line, mine, calls)
    pred = mine[(mine.index(rank) - 1) % len(mine)]
    if ctx.numerics:
        for i, d in enumerate(dsts):
            _write(d, np.asarray(calls[pred].payload.arrays[i]))
    nbytes = sum(d.size * d.dtype.itemsize for d in dsts)
    _record(ctx, what, line, srcs + list(extra_reads), dsts, "permute", min(2, len(mine)), world, nbytes)


def collective_permute_implicit(
    srcs_by_channel, dsts_by_channel, replica_group, channel_ids=(0,), priority=None, name=None
):
    """Ring step: each rank's dst (per channel) = its predecessor's src in its rank-list."""
    what = "collective_permute_implicit"
    ctx, line, rank, world = _start(what, priority)
    channels = _by_channel(what, line, channel_ids, srcs_by_channel, dsts_by_channel)
    srcs, dsts = [c[0] for c in channels], [c[1] for c in channels]
    _ring(
        what,
        line,
        ctx,
        rank,
        world,
        replica_group,
        {"channels": len(channels)},
        srcs,
        dsts,
        lambda: [np.array(s.array(), copy=True) for s in srcs],
    )


def collective_permute_implicit_reduce(
    srcs0_by_channel, srcs1_by_channel, dsts_by_channel, replica_group, op, channel_ids=(0,), priority=None, name=None
):
    """Ring step with reduction: each rank's dst (per channel) = op(src0, src1) of its predecessor."""
    what = "collective_permute_implicit_reduce"
    ctx, line, rank, world = _start(what, priority)
    op_name = _reduce_op(what, line, op)
    channels = _by_channel(what, line, channel_ids, srcs0_by_channel, srcs1_by_channel, dsts_by_channel)
    for c, (src0, src1, dst) in enumerate(channels):
        if not dst.is_on_chip and op_name != "add":
            _fail(what, line, "HBM tensors are reduced by DMA compute, which adds only (op must be nl.add)")
        if src0.shape != src1.shape or src0.shape != dst.shape:
            _fail(what, line, f"channel {c}: src0, src1 and dst need one shape")
    srcs0, dsts = [c[0] for c in channels], [c[2] for c in channels]
    _ring(
        what,
        line,
        ctx,
        rank,
        world,
        replica_group,
        {"op": op_name, "channels": len(channels)},
        srcs0,
        dsts,
        lambda: [_reduce([c[0].array(), c[1].array()], op_name, c[2].dtype) for c in channels],
        extra_reads=[c[1] for c in channels],
    )


def collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group, channel_id=0, name=None):
    """The rank whose data ring step `iteration_id` processes: this rank at step 0, then each predecessor in turn
    (a register holding it)."""
    what = "collective_permute_implicit_current_processing_rank_id"
    _, line, rank, world = _start(what)
    if not 0 <= operator.index(channel_id) < MAX_CHANNELS:
        _fail(what, line, f"channel_id {channel_id!r}: expected 0..{MAX_CHANNELS - 1}")
    mine = _my_list(_rank_lists(what, line, replica_group, world.num_ranks), rank)
    step = operator.index(iteration_id)
    return VirtualRegister(mine[(mine.index(rank) - step) % len(mine)])


def _variable_length(what):
    def collective(*args, **kwargs):
        raise NotImplementedError(f"nki.collectives.{what}: the variable-length metadata tensor layout is not emulated")

    collective.__name__ = collective.__qualname__ = what
    return collective


all_gather_v = _variable_length("all_gather_v")
all_to_all_v = _variable_length("all_to_all_v")


def rank_id(name=None):
    """This rank's id in the launch (0 for a plain launch; r for rank r of simulate_spmd), as a register usable
    as a dynamic index."""
    rank, _ = spmd.rank_and_world("nki.collectives.rank_id")
    return VirtualRegister(rank)


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
    "rg_partition_op",
]
