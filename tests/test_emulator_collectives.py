"""Several NeuronCores on the emulator: simulate_spmd and nki.collectives against numpy, rules, deadlocks."""

import os
import time

import numpy as np
import pytest
from emulator_helpers import rand

from nki_kernels import emulator
from nki_kernels.binding import nisa, nki, nl
from nki_kernels.emulator import NkiCollectiveError, NkiDeadlockError, collective_costs, cost_model, simulate_spmd

cc = nki.collectives
HERE = os.path.basename(__file__)


def line_of(marker):
    """'test_emulator_collectives.py:N' of the line of this file that ends with the comment `# <marker>`."""
    with open(__file__) as f:
        for n, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {marker}"):
                return f"{HERE}:{n}"
    raise AssertionError(marker)


def per_rank(shape, ranks, seed, dtype=np.float32):
    return [rand(shape, dtype, seed=seed + r) for r in range(ranks)]


def everyone(n):
    return cc.ReplicaGroup([list(range(n))])


# -- results against numpy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("op, reduce", [(nl.add, np.sum), (nl.maximum, np.max), (nl.minimum, np.min)])
def test_all_reduce_hbm_coalesced(ranks, op, reduce):
    @nki.jit
    def kernel(a, b):
        outs = [nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm) for t in (a, b)]
        cc.all_reduce([a, b], outs, everyone(ranks), op)
        return outs[0], outs[1]

    a, b = per_rank((7, 33), ranks, 1), per_rank((130,), ranks, 50)
    results = simulate_spmd(kernel, ranks)(*zip(a, b))
    for got_a, got_b in results:
        np.testing.assert_allclose(got_a, reduce(np.stack(a).astype(np.float64), axis=0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_b, reduce(np.stack(b).astype(np.float64), axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [2, 4])
def test_all_reduce_sbuf_bf16_in_place(ranks):
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        cc.all_reduce([tile], [tile], everyone(ranks), nl.add)  # dst = src: the sources are read first
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, tile)
        return out

    xs = per_rank((100, 65), ranks, 3, nl.bfloat16)
    want = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for got in simulate_spmd(kernel, ranks)(*[(x,) for x in xs]):
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("ranks", [2, 4])
def test_all_gather_hbm_and_sbuf(ranks):
    @nki.jit
    def kernel(x):
        rows = nl.ndarray((x.shape[0] * ranks, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
        cc.all_gather([x], [rows], everyone(ranks), collective_dim=0)
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        wide = nl.ndarray((x.shape[0], x.shape[1] * ranks), x.dtype, buffer=nl.sbuf)
        cc.all_gather([tile], [wide], everyone(ranks), collective_dim=1)
        cols = nl.ndarray(wide.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(cols, wide)
        return rows, cols

    xs = per_rank((9, 13), ranks, 7)
    for rows, cols in simulate_spmd(kernel, ranks)(*[(x,) for x in xs]):
        np.testing.assert_array_equal(rows, np.concatenate(xs, axis=0))
        np.testing.assert_array_equal(cols, np.concatenate(xs, axis=1))


@pytest.mark.parametrize("ranks", [2, 4])
def test_reduce_scatter(ranks):
    @nki.jit
    def kernel(x):
        out = nl.ndarray((x.shape[0] // ranks, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
        cc.reduce_scatter([x], [out], everyone(ranks), collective_dim=0, op=nl.add)
        return out

    xs = per_rank((3 * ranks, 29), ranks, 11)
    total = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for r, got in enumerate(simulate_spmd(kernel, ranks)(*[(x,) for x in xs])):
        np.testing.assert_allclose(got, total[3 * r : 3 * r + 3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [2, 4])
def test_collective_permute_ring_and_all_to_all(ranks):
    pairs = [(r, (r + 1) % ranks) for r in range(ranks)]

    @nki.jit
    def kernel(x):
        moved = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.collective_permute([x], [moved], source_target_pairs=pairs)
        swapped = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_to_all([x], [swapped], everyone(ranks), collective_dim=0)
        return moved, swapped

    xs = per_rank((2 * ranks, 5), ranks, 13)
    for r, (moved, swapped) in enumerate(simulate_spmd(kernel, ranks)(*[(x,) for x in xs])):
        np.testing.assert_array_equal(moved, xs[(r - 1) % ranks])
        np.testing.assert_array_equal(swapped, np.concatenate([xs[s][2 * r : 2 * r + 2] for s in range(ranks)]))


def test_permute_leaves_ranks_outside_the_pairs_alone():
    @nki.jit
    def kernel(x, keep):
        nki.collectives.collective_permute([x], [keep], source_target_pairs=[(0, 2), (2, 0)])
        return keep

    xs, keeps = per_rank((3, 4), 4, 20), per_rank((3, 4), 4, 40)
    got = simulate_spmd(kernel, 4)(*zip(xs, keeps))
    for r, want in enumerate([xs[2], keeps[1], xs[0], keeps[3]]):
        np.testing.assert_array_equal(got[r], want)


@pytest.mark.parametrize("ranks", [2, 4])
def test_implicit_ring_all_gather(ranks):
    """A ring all-gather written with the implicit permute: each step forwards what arrived last step, and
    current_processing_rank_id says whose chunk that is."""

    @nki.jit
    def kernel(x):
        group = everyone(ranks)
        out = nl.ndarray((ranks * x.shape[0], x.shape[1]), x.dtype, buffer=nl.shared_hbm)
        m = x.shape[0]
        held = x
        for step in range(ranks):
            owner = int(cc.collective_permute_implicit_current_processing_rank_id(step, group))
            nisa.dma_copy(out[owner * m : (owner + 1) * m, :], held)
            if step + 1 < ranks:
                arrived = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
                cc.collective_permute_implicit([[held]], [[arrived]], group)
                held = arrived
        return out

    xs = per_rank((3, 6), ranks, 30)
    for got in simulate_spmd(kernel, ranks)(*[(x,) for x in xs]):
        np.testing.assert_array_equal(got, np.concatenate(xs))


def test_implicit_reduce_takes_the_predecessors_reduction():
    @nki.jit
    def kernel(a, b):
        ta, tb = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf), nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(ta, a)
        nisa.dma_copy(tb, b)
        got = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        cc.collective_permute_implicit_reduce([[ta]], [[tb]], [[got]], everyone(3), nl.maximum)
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, got)
        return out

    a, b = per_rank((5, 17), 3, 60), per_rank((5, 17), 3, 70)
    for r, got in enumerate(simulate_spmd(kernel, 3)(*zip(a, b))):
        np.testing.assert_array_equal(got, np.maximum(a[(r - 1) % 3], b[(r - 1) % 3]))


def test_sub_groups_reduce_independently():
    groups = cc.ReplicaGroup.from_partition_op(4, cc.rg_partition_op.mod, 2)
    assert groups.replica_groups == [[0, 2], [1, 3]]
    assert cc.ReplicaGroup.from_partition_op(8, cc.rg_partition_op.div, 4).replica_groups == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]

    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_reduce([x], [out], groups, nl.add)
        return out

    xs = per_rank((6, 10), 4, 80)
    got = simulate_spmd(kernel, 4)(*[(x,) for x in xs])
    for r in range(4):
        np.testing.assert_allclose(got[r], xs[r % 2] + xs[r % 2 + 2], rtol=1e-6)


def test_ranks_have_their_own_memory_and_program_ids():
    """rank_id is the launch rank; nl.program_id / num_programs count the programs of one rank's grid, which share
    that rank's shared_hbm; writing an input changes only that rank's copy."""

    @nki.jit
    def kernel(x):
        out = nl.ndarray((nl.num_programs(), 2), nl.int32, buffer=nl.shared_hbm)
        ids = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf)
        nisa.memset(ids[:, 0:1], int(cc.rank_id()))
        nisa.memset(ids[:, 1:2], nl.program_id(0))
        nisa.dma_copy(out[nl.program_id(0) : nl.program_id(0) + 1, :], ids)
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.memset(tile, float(int(cc.rank_id())))
        nisa.dma_copy(x, tile)  # scribble on this rank's input
        mirror = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(mirror, x)
        return out, mirror

    xs = per_rank((4, 3), 3, 90)
    before = [x.copy() for x in xs]
    got = simulate_spmd(kernel[2], 3)(*[(x,) for x in xs])
    for r, (ids, mirror) in enumerate(got):
        np.testing.assert_array_equal(ids, [[r, 0], [r, 1]])
        np.testing.assert_array_equal(mirror, np.full((4, 3), r, np.float32))
    for x, b in zip(xs, before):
        np.testing.assert_array_equal(x, b)  # the callers' arrays are copied, never written


def test_profile_gets_one_run_per_rank_with_collective_records():
    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_reduce([x], [out], everyone(2), nl.add)
        return out

    xs = per_rank((8, 256), 2, 100)
    with emulator.profile() as prof, emulator.count_only():
        outs = simulate_spmd(kernel, 2)(*[(x,) for x in xs])
    assert [o.shape for o in outs] == [(8, 256), (8, 256)]
    assert [run.rank for run in prof.runs] == [0, 1]
    assert all(run.latency_us["trn2"] > 0 for run in prof.runs)


# -- rules and errors -----------------------------------------------------------------------------------------------


def _one_all_reduce(groups):
    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_reduce([x], [out], cc.ReplicaGroup(groups), nl.add)  # bad group
        return out

    return kernel


@pytest.mark.parametrize(
    "groups, ranks, message",
    [
        ([[0, 1], [1, 2, 3]], 4, "rank 1 appears more than once"),
        ([[0, 1, 2, 3, 4]], 4, "names rank 4, but the kernel runs on 4 rank"),
        ([[0, 1]], 4, r"leaves out rank\(s\) \[2, 3\]"),
        ([[0, 1], []], 2, "at least one rank"),
        ([[0, 1]], 1, "names rank 1, but the kernel runs on 1 rank"),
    ],
)
def test_replica_group_rules(groups, ranks, message):
    xs = per_rank((3, 4), ranks, 0)
    with pytest.raises(NkiCollectiveError, match=message) as info:
        simulate_spmd(_one_all_reduce(groups), ranks)(*[(x,) for x in xs])
    assert line_of("bad group") in str(info.value)


def test_memory_shape_and_pattern_rules():
    def run(body, ranks=2, shape=(4, 6)):
        kernel = nki.jit(body)
        return simulate_spmd(kernel, ranks)(*[(x,) for x in per_rank(shape, ranks, 5)])

    def sbuf_coalesced(x):
        a, b = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf), nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(a, x)
        nisa.dma_copy(b, x)
        cc.all_reduce([a, b], [a, b], everyone(2), nl.add)

    with pytest.raises(NkiCollectiveError, match="coalesced collectives .* need HBM"):
        run(sbuf_coalesced)

    def hbm_dim1(x):
        out = nl.ndarray((x.shape[0], 2 * x.shape[1]), x.dtype, buffer=nl.shared_hbm)
        cc.all_gather([x], [out], everyone(2), collective_dim=1)

    with pytest.raises(NkiCollectiveError, match=r"collective_dim 1: HBM tensors allow \(0,\)"):
        run(hbm_dim1)

    def wrong_gather_shape(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_gather([x], [out], everyone(2), collective_dim=0)

    with pytest.raises(NkiCollectiveError, match=r"must have shape \[8, 6\]"):
        run(wrong_gather_shape)

    def not_circular(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.collective_permute([x], [out], source_target_pairs=[(0, 1)])

    with pytest.raises(NkiCollectiveError, match="not circular"):
        run(not_circular)

    def bad_op(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_reduce([x], [out], everyone(2), nl.multiply)

    with pytest.raises(NkiCollectiveError, match="op must be nl.add, nl.minimum or nl.maximum"):
        run(bad_op)

    def priority_on_trn2(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_reduce([x], [out], everyone(2), nl.add, priority=0)

    with emulator.use_target("trn2"), pytest.raises(NkiCollectiveError, match="NeuronCore-v4"):
        run(priority_on_trn2)


def test_ranks_with_different_shapes_are_named():
    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_reduce([x], [out], everyone(2), nl.add)  # shapes differ
        return out

    with pytest.raises(NkiCollectiveError, match="different shapes") as info:
        simulate_spmd(kernel, 2)((rand((3, 4)),), (rand((3, 5)),))
    assert "rank 0 at " + line_of("shapes differ") in str(info.value)
    assert "rank 1 at " + line_of("shapes differ") in str(info.value)


def test_ranks_reaching_different_collectives_name_both_lines():
    @nki.jit
    def kernel(x):
        out = nl.ndarray((2 * x.shape[0], x.shape[1]), x.dtype, buffer=nl.shared_hbm)
        if int(cc.rank_id()) == 0:
            cc.all_gather([x], [out], everyone(2), collective_dim=0)  # rank 0 gathers
        else:
            cc.all_reduce([x], [out[: x.shape[0]]], everyone(2), nl.add)  # rank 1 reduces
        return out

    with pytest.raises(NkiCollectiveError, match="different collectives") as info:
        simulate_spmd(kernel, 2)((rand((3, 4)),), (rand((3, 4)),))
    message = str(info.value)
    assert f"rank 0: all_gather at {line_of('rank 0 gathers')}" in message
    assert f"rank 1: all_reduce at {line_of('rank 1 reduces')}" in message


def test_deadlock_when_a_rank_returns_without_the_collective():
    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        if int(cc.rank_id()) != 1:
            cc.all_reduce([x], [out], everyone(3), nl.add)  # ranks 0 and 2 wait here
        return out  # rank 1 returns

    start = time.monotonic()
    with pytest.raises(NkiDeadlockError) as info:
        simulate_spmd(kernel, 3)(*[(x,) for x in per_rank((2, 3), 3, 0)])
    assert time.monotonic() - start < 10  # found when rank 1 returns, not by the timeout
    message = str(info.value)
    assert f"waits in all_reduce at {line_of('ranks 0 and 2 wait here')}" in message
    assert f"rank 1 returned from the kernel at {line_of('rank 1 returns')} after 0 collective(s)" in message


def test_deadlock_by_timeout_names_the_line_the_late_rank_is_running():
    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        if int(cc.rank_id()) == 1:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:  # rank 1 is busy
                pass
        cc.all_reduce([x], [out], everyone(2), nl.add)  # rank 0 waits
        return out

    with pytest.raises(NkiDeadlockError, match="still missing after 0.3 s") as info:
        simulate_spmd(kernel, 2, timeout_s=0.3)(*[(x,) for x in per_rank((2, 3), 2, 0)])
    message = str(info.value)
    assert f"rank 0 waits in all_reduce at {line_of('rank 0 waits')}" in message
    assert f"rank 1 is running at {line_of('rank 1 is busy')}" in message


def test_a_failing_rank_stops_the_others():
    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        if int(cc.rank_id()) == 1:
            nl.ndarray((129, 2), x.dtype, buffer=nl.sbuf)
        cc.all_reduce([x], [out], everyone(2), nl.add)
        return out

    with pytest.raises(emulator.NkiHardwareError, match="exceeds 128 partitions") as info:
        simulate_spmd(kernel, 2, timeout_s=30)(*[(x,) for x in per_rank((2, 3), 2, 0)])
    assert "rank 1 of 2" in "".join(getattr(info.value, "__notes__", []))


def test_argument_errors():
    kernel = _one_all_reduce([[0, 1]])
    with pytest.raises(TypeError, match="one tuple of arguments per rank"):
        simulate_spmd(kernel, 2)((rand((2, 2)),))
    with pytest.raises(ValueError, match="at least 1 rank"):
        simulate_spmd(kernel, 0)


# -- cost model ---------------------------------------------------------------------------------------------------


def test_link_figures_are_the_documented_ones():
    trn1, trn2 = cost_model.collective_links("trn1"), cost_model.collective_links("trn2")
    # trainium2.rst: inter-chip interconnect 384 (Trainium) GB/s per chip; trn2-arch.rst: 1,024 intra-instance.
    assert (trn1.chip_link_bytes_per_ns, trn2.chip_link_bytes_per_ns) == (384.0, 1024.0)
    # Two NeuronCore-v2 per Trainium chip, one rank each; trn2 LNC=2: 4 ranks of 2 cores per chip; 16 chips.
    assert (trn1.ranks_per_chip, trn2.ranks_per_chip, trn1.max_ranks, trn2.max_ranks) == (2, 4, 32, 64)
    # intranode-collective-comm.rst: 1-2 µs per hop.
    assert collective_costs.HOP_LATENCY_SWEEP_US == (1.0, 2.0) and trn2.hop_latency_us == 1.5
    # No documented figure between ranks of a chip: the rank's HBM-to-HBM DMA rate (half its cores' HBM share).
    assert trn1.core_link_bytes_per_ns == pytest.approx(820 / 2 / 2)
    assert trn2.core_link_bytes_per_ns == pytest.approx(2 * 2900 / 8 / 2)
    with pytest.raises(ValueError, match="inter-instance"):
        collective_costs.collective_us("all_reduce", 1024, 33, trn1)
    with pytest.raises(ValueError, match="hop_latency_us"):
        cost_model.collective_links("trn2", hop_latency_us=-1)


def test_collective_time_by_hand():
    lk = cost_model.collective_links("trn2", hop_latency_us=2.0)
    big, small = 64 << 20, 8 << 10
    # Ring all-reduce over 8 ranks on 2 chips: 14 steps of B/8 at the chip's egress (1024 / 2) capped by the
    # on-chip link (362.5 B/ns).
    ring = 14 * (2.0 + big / 8 / min(362.5, 512.0) / 1e3)
    assert collective_costs.ring_us("all_reduce", big, 8, lk) == pytest.approx(ring)
    assert collective_costs.collective_us("all_reduce", big, 8, lk) == pytest.approx(ring)
    # Small messages take the one-hop mesh: 3 peers on the chip, 4 ranks x 4 remote peers over the egress.
    mesh = 2.0 + max(3 * small / 362.5, 4 * 4 * small / 512.0) / 1e3
    assert collective_costs.mesh_us("all_reduce", small, 8, lk) == pytest.approx(mesh)
    assert collective_costs.collective_us("all_reduce", small, 8, lk) == pytest.approx(mesh)
    # All-gather on one trn1 chip (2 ranks): one step of the whole source over the on-chip link.
    trn1 = cost_model.collective_links("trn1", hop_latency_us=1.0)
    assert collective_costs.collective_us("all_gather", big, 2, trn1) == pytest.approx(1.0 + big / 205.0 / 1e3)


def test_schedule_prices_collectives_of_an_spmd_run():
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_reduce([x], [out], everyone(4), nl.add)
        return out

    runs = []
    emulator.trace.add_listener(runs.append)
    try:
        with emulator.count_only():
            simulate_spmd(kernel, 4)(*[(np.zeros((128, 2048), np.float32),)] * 4)
    finally:
        emulator.trace.remove_listener(runs.append)
    assert [run.rank for run in runs] == [0, 1, 2, 3]
    (record,) = [r for r in runs[0].records if r.collective is not None]
    assert record.collective == emulator.trace.CollectiveInfo("all_reduce", 128 * 2048 * 4, 4, 4)
    for hop in collective_costs.HOP_LATENCY_SWEEP_US:
        lk = cost_model.collective_links("trn2", hop_latency_us=hop)
        sched = cost_model.schedule(runs[0], "trn2", lk)
        assert sched.collective_us == pytest.approx(collective_costs.collective_us("all_reduce", 128 * 2048 * 4, 4, lk))
        assert sched.latency_us >= sched.collective_us
    with pytest.raises(ValueError, match="scheduled on 'trn1'"):
        cost_model.schedule(runs[0], "trn1", cost_model.collective_links("trn2"))


def test_each_rank_has_its_own_sbuf():
    """Two thirds of SBUF live on every rank at once fits: capacity is per NeuronCore, not per launch."""
    with emulator.use_target("trn2"):
        free = nl.tile_size.total_available_sbuf_size * 2 // 3 // 4

    @nki.jit
    def kernel(x):
        big = nl.ndarray((128, free), nl.float32, buffer=nl.sbuf)
        nisa.memset(big, 1.0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        cc.all_reduce([x], [out], everyone(2), nl.add)
        nisa.dma_copy(out[:, :1], big[: x.shape[0], :1])
        return out

    with emulator.use_target("trn2"):
        got = simulate_spmd(kernel, 2)(*[(x,) for x in per_rank((3, 2), 2, 0)])
    for out in got:
        np.testing.assert_array_equal(out[:, 0], 1.0)


def test_collectives_overlap_independent_loads_and_delay_dependent_ones():
    """A collective runs on its own queue: a weight load that does not need its result overlaps it, a load of its
    result waits for it."""

    def traced(dependent):
        @nki.jit
        def kernel(x, w):
            reduced = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
            cc.all_reduce([x], [reduced], everyone(8), nl.add)
            tile = nl.ndarray((128, w.shape[1]), w.dtype, buffer=nl.sbuf)
            nisa.dma_copy(tile, reduced if dependent else w)
            return reduced

        runs = []
        emulator.trace.add_listener(runs.append)
        try:
            with emulator.count_only():
                simulate_spmd(kernel, 8)(*[(np.zeros((128, 4096), np.float32),) * 2] * 8)
        finally:
            emulator.trace.remove_listener(runs.append)
        return cost_model.schedule(runs[0], "trn2")

    independent, dependent = traced(False), traced(True)
    assert independent.collective_us == pytest.approx(dependent.collective_us)
    load_us = dependent.latency_us - dependent.collective_us
    assert load_us > 0
    assert independent.latency_us == pytest.approx(max(independent.collective_us, load_us), rel=0.05)
