"""Registers and register-driven loops, random numbers, DMA compute, collectives on one core, scheduling
metadata, NeuronCore-v4-only instructions, and the documented errors of NKI 0.3+ (hwdge casts, memset types,
jit(platform_target=...), nl.rsqrt on PSUM)."""

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import hardware_error_check, rand, run_tiles

from nki_kernels import emulator
from nki_kernels.binding import nisa, nki, nl

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32
raises = hardware_error_check(__file__)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def test_fori_loop_with_register_bound_and_scalar_offset():
    n = 13

    @nki.jit
    def kernel(data, bound):
        bound_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(bound_sb, bound)
        upper = nisa.register_alloc()
        nisa.register_load(upper, bound_sb)
        out = nl.ndarray((1, n), data.dtype, buffer=nl.shared_hbm)
        zeros = nl.zeros((1, n), data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(out, zeros)
        temp = nl.ndarray((1, 1), data.dtype, buffer=nl.sbuf)

        def body(i):
            nisa.dma_copy(temp, data.ap([[1, 1], [1, 1]], scalar_offset=i, indirect_dim=1))
            nisa.tensor_scalar(temp, temp, nl.multiply, 2.0)
            nisa.dma_copy(out.ap([[1, 1], [1, 1]], scalar_offset=i, indirect_dim=1), temp)

        nl.fori_loop(2, upper, body)
        return out

    data = rand((1, n), seed=1)
    got = kernel(data, np.array([[9]], np.int32))
    expected = np.zeros((1, n))
    expected[0, 2:9] = 2 * _f64(data[0, 2:9])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_while_loop_counts_down_and_register_store():
    @nki.jit
    def kernel(value, count):
        val = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(val, value)
        acc = nl.zeros((1, 1), nl.float32, buffer=nl.sbuf)
        count_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(count_sb, count)
        one = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(one, 1)
        reg = nisa.register_alloc()
        nisa.register_load(reg, count_sb)
        iterations = nisa.register_alloc(0)

        def body(r):
            nisa.tensor_tensor(acc, acc, val, nl.add)
            nisa.tensor_tensor(count_sb, count_sb, one, nl.subtract)
            nisa.register_load(r, count_sb)
            nisa.register_move(iterations, int(iterations) + 1)
            return r

        nl.while_loop(reg, body)
        out = nl.ndarray((1, 2), nl.float32, buffer=nl.shared_hbm)
        stored = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.register_store(stored, iterations)
        both = nl.ndarray((1, 2), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(both[:, 0:1], acc)
        nisa.tensor_copy(both[:, 1:2], stored)
        nisa.dma_copy(out, both)
        return out

    for count in (0, 1, 7):
        got = kernel(np.array([[1.25]], np.float32), np.array([[count]], np.int32))
        np.testing.assert_allclose(got[0], [1.25 * count, count])


def test_dynamic_range_and_no_reorder_rules():
    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        for _ in nl.dynamic_range(nisa.register_alloc(3)):
            nisa.tensor_scalar(tile, tile, nl.add, 1.0)
        with nl.no_reorder():
            nisa.tensor_scalar(tile, tile, nl.multiply, 2.0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, tile)
        return out

    x = rand((3, 5), seed=2)
    np.testing.assert_allclose(kernel(x), (_f64(x) + 3) * 2, rtol=1e-6)

    @nki.jit
    def loop_in_no_reorder(x):
        with nl.no_reorder():
            nl.fori_loop(0, 2, lambda i: None)

    with pytest.raises(ValueError, match="no_reorder"):
        loop_in_no_reorder(x)

    @nki.jit
    def body_returns(x):
        nl.fori_loop(0, 2, lambda i: i)

    with pytest.raises(ValueError, match="cannot return"):
        body_returns(x)


def test_rng_is_seeded_and_truncates_to_the_dtype():
    def body(seed, a, b, c):
        nisa.set_rng_seed(seed)
        nisa.rng(a)
        nisa.set_rng_seed(seed)
        nisa.rng(b)
        nisa.rng(c)

    seed = np.array([[1234]], np.int32)
    a, b, c = run_tiles(body, [seed], [((64, 100), np.uint32), ((64, 100), np.uint32), ((64, 100), np.uint8)])
    np.testing.assert_array_equal(a, b)
    assert len(np.unique(a)) > 6000  # 32 random bits per element
    assert c.dtype == np.uint8 and len(np.unique(c)) > 200
    raises("rng", run_tiles, lambda out: nisa.rng(out), [], [((4, 4), np.float32)])
    raises(
        "rng", run_tiles, lambda out: nisa.rng(out, engine=nisa.engine.gpsimd), [], [((4, 4), np.int32)], target="trn1"
    )


def test_dropout_rate_and_nl_rand_range():
    x = rand((128, 512), seed=3) + 10.0
    prob = np.linspace(0.0, 1.0, 128, dtype=np.float32)[:, None]
    (got,) = run_tiles(lambda x, p, out: nisa.dropout(out, x, p), [x, prob], [((128, 512), F32)])
    kept = got != 0
    np.testing.assert_array_equal(got[kept], x[kept])  # kept values are not rescaled
    dropped = 1 - kept.mean(axis=1)
    assert dropped[0] == 0 and dropped[-1] == 1
    np.testing.assert_allclose(dropped, prob[:, 0], atol=0.08)

    @nki.jit
    def kernel():
        seed = nl.full((1, 1), 42, nl.int32, buffer=nl.sbuf)
        nl.random_seed(seed)
        a = nl.rand((128, 512), nl.float32)
        nl.random_seed(seed)
        b = nl.rand((128, 512), nl.float32)
        out = nl.ndarray((2, 128, 512), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(out[0], a)
        nisa.dma_copy(out[1], b)
        return out

    values = kernel()
    np.testing.assert_array_equal(values[0], values[1])
    assert values.min() >= 0 and values.max() < 1 and abs(values.mean() - 0.5) < 0.01


def test_dma_compute_sums_sources_into_dst():
    a, b, c = rand((7, 130), seed=4), rand((7, 130), BF16, seed=5), rand((7, 130), seed=6)

    @nki.jit
    def kernel(a, b, c):
        acc = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(acc, a)
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_compute(out, [acc, b, c], nl.add)
        return out

    np.testing.assert_allclose(kernel(a, b, c), _f64(a) + _f64(b) + _f64(c), rtol=1e-5, atol=1e-6)

    @nki.jit
    def bad_scale(a):
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_compute(out, [a, a], nl.add, scales=[1.0, 2.0])

    with pytest.raises(emulator.NkiHardwareError, match="scales"):
        bad_scale(a)


def test_collectives_on_one_core():
    @nki.jit
    def kernel(x):
        group = nki.collectives.ReplicaGroup([[0]])
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        reduced = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nki.collectives.all_reduce(srcs=[tile], dsts=[reduced], replica_group=group, op=nl.add)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nki.collectives.all_gather(srcs=[x], dsts=[out], replica_group=group, collective_dim=0)
        rank = nki.collectives.rank_id()
        picked = x.reshape((1,) + x.shape).select(0, rank)
        out2 = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out2, picked)
        return out, out2

    x = rand((5, 6), seed=7)
    with emulator.as_nki():
        import nki as nki_module  # the emulator under the real package's name

        assert nki_module.collectives.ReplicaGroup is nki.collectives.ReplicaGroup
    got, got2 = kernel(x)
    np.testing.assert_array_equal(got, x)
    np.testing.assert_array_equal(got2, x)

    @nki.jit
    def two_ranks(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nki.collectives.all_reduce([tile], [tile], nki.collectives.ReplicaGroup([[0, 1]]), nl.add)

    with pytest.raises(emulator.NkiCollectiveError, match=r"names rank 1, but the kernel runs on 1 rank"):
        two_ranks(x)


def test_implicit_ring_permute_of_one_rank():
    a, b = rand((7, 33), seed=12), rand((7, 33), seed=13)

    @nki.jit
    def kernel(a, b):
        group = nki.collectives.ReplicaGroup([[0]])
        ta, tb = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf), nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(ta, a)
        nisa.dma_copy(tb, b)
        reduced = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nki.collectives.collective_permute_implicit_reduce([[ta]], [[tb]], [[reduced]], group, nl.maximum)
        moved = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nki.collectives.collective_permute_implicit([[a]], [[moved]], group)
        rank = nki.collectives.collective_permute_implicit_current_processing_rank_id(3, group)
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, reduced)
        assert int(rank) == 0
        return out, moved

    reduced, moved = kernel(a, b)
    np.testing.assert_array_equal(reduced, np.maximum(a, b))
    np.testing.assert_array_equal(moved, a)


@pytest.mark.parametrize("name", ["nc_matmul_mx", "activate2", "rand2", "exponential", "quantize_mx"])
def test_trn3_only_instructions_name_the_target(name):
    @nki.jit
    def kernel(x):
        getattr(nisa, name)(x)

    with pytest.raises(NotImplementedError, match="NeuronCore-v4.*trn2"):
        kernel(rand((2, 2)))


def test_hwdge_dma_copy_between_dtypes_is_an_error():
    x = rand((4, 8), seed=8)

    def body(x, out):
        nisa.dma_copy(out, x, dge_mode=nisa.dge_mode.hwdge)

    raises("dma_copy", run_tiles, body, [x], [((4, 8), BF16)])
    (same,) = run_tiles(body, [x], [((4, 8), F32)])
    np.testing.assert_array_equal(same, x)
    (cast,) = run_tiles(lambda x, out: nisa.dma_copy(out, x, dge_mode=nisa.dge_mode.swdge), [x], [((4, 8), BF16)])
    np.testing.assert_array_equal(cast, x.astype(BF16))
    # nki-library passes the enum's integer value (dge_mode=3 for none); the migration guide says integers are
    # rejected since NKI 0.3. The emulator follows AWS's own kernels and accepts the value.
    (by_value,) = run_tiles(lambda x, out: nisa.dma_copy(out, x, dge_mode=3), [x], [((4, 8), BF16)])
    np.testing.assert_array_equal(by_value, x.astype(BF16))


def test_memset_value_must_match_an_integer_dtype():
    raises("memset", run_tiles, lambda out: nisa.memset(out, 2.0), [], [((4, 4), np.int32)])
    (ok,) = run_tiles(lambda out: nisa.memset(out, 2), [], [((4, 4), np.int32)])
    np.testing.assert_array_equal(ok, np.full((4, 4), 2))


def test_jit_platform_target_is_an_error():
    with pytest.raises(TypeError, match="NEURON_PLATFORM_TARGET_OVERRIDE"):
        nki.jit(platform_target="trn2")(lambda x: x)


def test_nl_rsqrt_refuses_psum_and_is_precise_on_sbuf():
    x = rand((7, 100), seed=9) ** 2 + 0.1

    @nki.jit
    def kernel(x, in_psum):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.psum if in_psum else nl.sbuf)
        staged = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(staged, x)
        nisa.tensor_copy(tile, staged)
        result = nl.rsqrt(tile)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, result)
        return out

    np.testing.assert_allclose(kernel(x, False), 1 / np.sqrt(_f64(x)), rtol=2e-7)
    with pytest.raises(emulator.NkiHardwareError, match="PSUM"):
        kernel(x, True)


def test_with_schedule_keeps_checked_edges():
    @nki.jit
    def kernel(x):
        return x

    scheduled = kernel.with_schedule([("plus1", "recip"), ("act2", ["act0", "act1"])])
    assert scheduled.options["schedule"] == (("plus1", ("recip",)), ("act2", ("act0", "act1")))
    assert "schedule" not in kernel.options
    with pytest.raises(ValueError, match="pair"):
        kernel.with_schedule([("only-one",)])


def test_instruction_handles_and_sub_version():
    handle = nisa.NkiInstruction()
    assert handle.depends_on(nisa.NkiInstruction(), nisa.NkiInstruction()) is handle
    assert nisa.get_nc_sub_version() == 0
    with emulator.use_target("trn1"):
        assert nisa.get_nc_version() == nisa.nc_version.gen2 < nisa.nc_version.gen3  # generations are ordered


def test_rand_state_round_trip_and_nl_dropout():
    x = rand((16, 200), seed=14) + 5.0

    def body(x, state, a, b):
        nisa.rand_get_state(state)
        nisa.rand_set_state(state)
        nisa.rng(a)
        nisa.rand_set_state(state)
        nisa.rng(b)

    state, a, b = run_tiles(body, [x], [((16, 6), np.uint32), ((16, 200), np.uint32), ((16, 200), np.uint32)])
    np.testing.assert_array_equal(a, b)  # restoring a state replays the sequence
    raises("rand_set_state", run_tiles, lambda s: nisa.rand_set_state(s), [state], [], target="trn1")

    @nki.jit
    def kernel(x):
        tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x)
        out = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(out, nl.dropout(tile, 0.25, dtype=nl.bfloat16))
        return out

    got = _f64(kernel(x))
    kept = got != 0
    np.testing.assert_array_equal(got[kept], _f64(x.astype(BF16))[kept])
    assert abs((1 - kept.mean()) - 0.25) < 0.03


def test_multi_core_instructions_on_one_core():
    x = rand((4, 8), seed=15)

    def body(x, out):
        nisa.sendrecv(x, out, send_to_rank=0, recv_from_rank=0, pipe_id=0)

    (got,) = run_tiles(body, [x], [((4, 8), F32)])
    np.testing.assert_array_equal(got, x)

    def other_core(x, out):
        nisa.sendrecv(x, out, send_to_rank=1, recv_from_rank=1, pipe_id=0)

    with pytest.raises(NotImplementedError, match="second core"):
        run_tiles(other_core, [x], [((4, 8), F32)])

    @nki.jit
    def barrier(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, x)
        nisa.core_barrier(out, (0, 1))
        return out

    np.testing.assert_array_equal(barrier(x), x)
    with emulator.use_target("trn1"), pytest.raises(emulator.NkiHardwareError, match="core_barrier"):
        barrier(x)
