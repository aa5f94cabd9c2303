"""The looped decode step run on the emulator: `run_looped_step` on one NeuronCore, `run_sharded_looped_step` on
P = spec.tensor_parallel ranks, each on its shard (nki_kernels.decode.sharding.shard_operands).

This runner is apart from the kernel (nki_kernels.decode.step) because kernel modules never import the emulator.
Each launch is one emulated run (one row of `emulator.profile()`, one per rank on several ranks: simulate_spmd).
With numerics=False the launch is a count-only trace and operands may be emulator `Spec` placeholders (shape and
dtype, no memory), so full-size models trace without their weights. PerRank, launch and the operand checks are
shared with benchmarks/harness/runner.py, which launches the other compositions of the step.
"""

from __future__ import annotations

import contextlib

import numpy as np

from nki_kernels.decode.contract import DecodeOperands, check_lengths, check_write_index, operand_fields
from nki_kernels.decode.step import check_spec, decode_step_kernel
from nki_kernels.emulator import count_only, simulate_spmd
from nki_kernels.emulator.kernel import run

__all__ = ["run_looped_step", "run_sharded_looped_step"]


class PerRank(tuple):
    """One value per tensor-parallel rank, in rank order: a launch argument each rank takes its own entry of (other
    arguments are the same on every rank), and what a launch on several ranks returns."""

    def map(self, fn):
        return PerRank(fn(value) for value in self)


def each(fn, value):
    """fn of a value, or of each rank's (PerRank)."""
    return value.map(fn) if isinstance(value, PerRank) else fn(value)


def single_operands(where, operands, spec, sharded):
    """DecodeOperands of one NeuronCore's step; a ValueError naming `sharded`, the runner of a sharded step, when
    the spec has several ranks."""
    check_spec(spec)
    if spec.tensor_parallel != 1:
        raise ValueError(
            f"{where}: spec.tensor_parallel is {spec.tensor_parallel}; a sharded step runs with {sharded} (one "
            f"operand set per rank)"
        )
    return DecodeOperands.of(operands, spec)


def sharded_operands(where, rank_operands, spec):
    """DecodeOperands whose every value is PerRank: rank r's from rank_operands[r], one set per rank."""
    check_spec(spec)
    ranks = spec.tensor_parallel
    if len(rank_operands) != ranks:
        raise ValueError(
            f"{where}: rank_operands: got {len(rank_operands)} operand sets, expected one per rank "
            f"(spec.tensor_parallel = {ranks})"
        )
    shards = [DecodeOperands.of(operands, spec) for operands in rank_operands]
    return DecodeOperands(**{name: PerRank(getattr(o, name) for o in shards) for name in operand_fields()})


def run_looped_step(operands, spec, *, numerics=True, ring_block_bytes=None, ring_bytes=None):
    """Run one decode step as the looped kernel on the emulator: (logits [B, T, V] float32, k_cache, v_cache).
    operands: DecodeOperands (or their list) of numpy arrays, or emulator `Spec` placeholders with numerics=False
    (a count-only trace: no weight memory, NaN-filled results)."""
    ops = single_operands("run_looped_step", operands, spec, "run_sharded_looped_step")
    ring = dict(ring_block_bytes=ring_block_bytes, ring_bytes=ring_bytes)
    return run_looped("run_looped_step", ops, spec, numerics, ring)


def run_sharded_looped_step(rank_operands, spec, *, numerics=True, ring_block_bytes=None, ring_bytes=None):
    """Run one tensor-parallel decode step as the looped kernel on P = spec.tensor_parallel emulated ranks, rank r
    on rank_operands[r] (its shard, as nki_kernels.decode.sharding.shard_operands cuts it; numpy arrays, or `Spec`
    placeholders with numerics=False): (logits [B, T, V·P] float32, the whole vocabulary, which every rank
    returns; [k_cache of each rank]; [v_cache of each rank]) (sharding.gather_cache puts a cache back together)."""
    ops = sharded_operands("run_sharded_looped_step", rank_operands, spec)
    ring = dict(ring_block_bytes=ring_block_bytes, ring_bytes=ring_bytes)
    logits, k_cache, v_cache = run_looped("run_sharded_looped_step", ops, spec, numerics, ring)
    return logits[0], list(k_cache), list(v_cache)


def run_looped(where, ops, spec, numerics, ring):
    """One launch of the looped kernel on ops (each operand a value, or PerRank); errors start with `where`."""
    check_values(where, ops, spec)
    with emulation(numerics):
        return launch(decode_step_kernel, kernel_args(ops), spec=spec, **ring)


def emulation(numerics):
    """The emulator's mode for a run: numerics, or a count-only trace."""
    return contextlib.nullcontext() if numerics else count_only()


def check_values(where, ops, spec):
    """The run-time values' rules (write_index, a paged step's lengths and block table) where they are arrays
    (rank 0's on several ranks); a ValueError starting with `where`."""
    first = rank_of(ops, 0) if isinstance(ops.x, PerRank) else ops
    if isinstance(first.write_index, np.ndarray):
        check_write_index(where, first.write_index, slots=first.k_cache.shape[2], tokens=first.x.shape[1])
    if isinstance(first.lengths, np.ndarray) and isinstance(first.block_table, np.ndarray):
        blocks = dict(block_size=spec.block_size, num_blocks=first.k_cache.shape[1])
        check_lengths(where, first.lengths, first.block_table, **blocks)


def rank_of(ops, rank):
    """Rank `rank`'s DecodeOperands of ops holding PerRank values (a value shared by every rank as it is)."""
    values = (value[rank] if isinstance(value, PerRank) else value for value in ops.values())
    return DecodeOperands(**dict(zip(operand_fields(), values)))


def kernel_args(ops):
    """ops.kernel_args() (the looped and per-layer kernels' one list argument), PerRank when ops hold per-rank
    values."""
    if not isinstance(ops.x, PerRank):
        return ops.kernel_args()
    return PerRank(rank_of(ops, r).kernel_args() for r in range(len(ops.x)))


def launch(kernel, *args, **kwargs):
    """One emulated launch (numpy arrays or count-only Spec placeholders as tensor arguments); with PerRank
    arguments, one launch on that many ranks (simulate_spmd), each taking its entry, returning PerRank results."""
    ranks = next((len(a) for a in args if isinstance(a, PerRank)), None)
    if ranks is None:
        return run(kernel, args, kwargs)
    rank_args = [tuple(a[r] if isinstance(a, PerRank) else a for a in args) for r in range(ranks)]
    outputs = simulate_spmd(kernel, ranks)(*rank_args, **kwargs)
    if isinstance(outputs[0], tuple):
        return tuple(PerRank(out[i] for out in outputs) for i in range(len(outputs[0])))
    return PerRank(outputs)
