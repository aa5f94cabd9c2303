"""emulator.profile(): counters of hand-built runs and of a real emulated matmul kernel."""

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import blocked_matmul, rand

from nki_kernels import emulator
from nki_kernels.binding import nisa, nki, nl
from nki_kernels.emulator import cost_model, trace

A = trace.Access


def _record(opcode, engine, *, reads=(), writes=(), partitions=128, free=64, dtype="float32", matmul=None, dma=None):
    return trace.InstructionRecord(
        opcode, engine, "k.py:1", partitions, free, dtype, tuple(reads), tuple(writes), matmul=matmul, dma=dma
    )


def _synthetic_run():
    load = _record(
        "dma_copy",
        "dma",
        reads=[A(1, "hbm", 0, 1, 0, 6000)],
        writes=[A(2, "sbuf", 0, 100, 0, 60)],
        dma=trace.DmaInfo(6000, "hbm", "sbuf", 60),
    )
    mm = _record(
        "nc_matmul",
        "tensor",
        reads=[A(2, "sbuf", 0, 100, 0, 60), A(2, "sbuf", 0, 100, 0, 60)],
        writes=[A(3, "psum", 0, 30, 0, 1200)],
        matmul=trace.MatmulInfo(contraction=100, stationary_free=30, moving_free=300, input_dtype="bfloat16"),
    )
    mm_full = _record(
        "nc_matmul",
        "tensor",
        reads=[A(2, "sbuf", 0, 100, 0, 60)],
        writes=[A(4, "psum", 0, 128, 0, 2048)],
        matmul=trace.MatmulInfo(128, 128, 512, "bfloat16"),
    )
    evict = _record("tensor_copy", "scalar", reads=[A(3, "psum", 0, 30, 0, 1200)], writes=[A(5, "sbuf", 0, 30, 0, 600)])
    fill = _record("memset", "gpsimd", writes=[A(6, "sbuf", 0, 30, 0, 600)])
    store = _record(
        "dma_copy",
        "dma",
        reads=[A(5, "sbuf", 0, 30, 0, 600)],
        writes=[A(7, "hbm", 0, 1, 0, 18000)],
        dma=trace.DmaInfo(18000, "sbuf", "hbm", 600),
    )
    h2h = _record(
        "dma_copy",
        "dma",
        partitions=1,
        reads=[A(1, "hbm", 0, 1, 0, 500)],
        writes=[A(8, "hbm", 0, 1, 0, 500)],
        dma=trace.DmaInfo(500, "hbm", "hbm", 500),
    )
    return trace.KernelRun("synthetic_kernel", "trn2", (2,), [load, mm, mm_full, evict, fill, store, h2h])


def test_counters_of_a_synthetic_run():
    run = _synthetic_run()
    with emulator.profile() as prof:
        trace.kernel_finished(run)
        trace.kernel_finished(run)
    assert len(prof.runs) == 2
    r = prof.runs[0]
    assert (r.name, r.target, r.grid, r.instructions) == ("synthetic_kernel", "trn2", (2,), 7)
    assert r.hbm_bytes_read == 6000 + 500
    assert r.hbm_bytes_written == 18000 + 500
    assert r.dma_count == 3 and r.dma_sizes == (6000, 18000, 500)
    assert r.matmul_count == 2
    assert r.pe_fill == pytest.approx((100 * 30 / 128**2 + 1.0) / 2)
    assert r.moving_fill == pytest.approx((300 / 512 + 1.0) / 2)
    assert r.engine_counts == {"tensor": 2, "vector": 0, "scalar": 1, "gpsimd": 1, "dma": 3}
    for target in ("trn1", "trn2"):
        assert r.latency_us[target] == pytest.approx(cost_model.model_latency(run, target))
        assert r.latency_us[target] > 0
    assert prof.hbm_bytes_read == 2 * 6500 and prof.dma_count == 6 and prof.matmul_count == 4
    assert prof.engine_counts["dma"] == 6
    assert prof.latency_us["trn1"] == pytest.approx(2 * r.latency_us["trn1"])
    table = str(prof)
    assert "synthetic_kernel" in table and "TOTAL" in table and "trn2 us" in table


def test_latency_is_modeled_per_target_on_first_read(monkeypatch):
    scheduled = []
    schedule = cost_model.schedule

    def counting_schedule(run, target, links=None):
        scheduled.append(target)
        return schedule(run, target, links)

    monkeypatch.setattr(cost_model, "schedule", counting_schedule)
    run = _synthetic_run()
    with emulator.profile() as prof:
        trace.kernel_finished(run)
    r = prof.runs[0]
    assert scheduled == [] and r.dma_count == 3  # counters are there, nothing scheduled yet
    trn2 = r.latency_us["trn2"]
    assert scheduled == ["trn2"]
    assert r.latency_us["trn2"] == trn2 and scheduled == ["trn2"]  # computed once
    run.records.clear()  # the summary models the run as it finished
    assert dict(r.latency_us) == {"trn1": pytest.approx(schedule(_synthetic_run(), "trn1").latency_us), "trn2": trn2}
    assert scheduled == ["trn2", "trn1"] and len(r.latency_us) == 2
    assert dict(r.collective_us) == {"trn1": 0.0, "trn2": 0.0} and r.collectives == 0  # no new schedule
    assert scheduled == ["trn2", "trn1"]
    with pytest.raises(KeyError):
        r.latency_us["trn9"]


def test_dependency_floor_is_modeled_beside_the_latency_when_asked():
    run = _synthetic_run()
    with emulator.profile(dependency_floor=True) as prof:
        trace.kernel_finished(run)
    with emulator.profile() as plain:
        trace.kernel_finished(run)
    r = prof.runs[0]
    for target in cost_model.TARGETS:
        assert r.dependency_floor_us[target] == pytest.approx(cost_model.dependency_floor_us(run, target))
        assert 0 < r.dependency_floor_us[target] < r.latency_us[target] == plain.runs[0].latency_us[target]
    with pytest.raises(ValueError, match="dependency_floor=True"):
        plain.runs[0].dependency_floor_us["trn2"]


def test_listener_is_removed_after_the_block():
    with emulator.profile() as prof:
        pass
    trace.kernel_finished(_synthetic_run())
    assert prof.runs == []


def test_run_without_matmuls_or_dmas_reports_zero_fill():
    run = trace.KernelRun("empty", "trn1", (), [_record("iota", "gpsimd", writes=[A(1, "sbuf", 0, 8, 0, 32)])])
    with emulator.profile() as prof:
        trace.kernel_finished(run)
    r = prof.runs[0]
    assert (r.matmul_count, r.pe_fill, r.moving_fill, r.dma_count, r.mean_dma_bytes) == (0, 0.0, 0.0, 0, 0.0)
    assert r.latency_us["trn1"] == pytest.approx((cost_model.IOTA_FIXED_CYCLES + 64) / 1.4 / 1e3)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_profile_of_an_emulated_matmul(target):
    k, m, n = 200, 130, 600  # ragged in every dimension: tiles of 128 x 128 x 512
    rng = np.random.default_rng(7)
    lhs_t = rng.standard_normal((k, m)).astype(np.float32)
    rhs = rng.standard_normal((k, n)).astype(np.float32)
    with emulator.use_target(target), emulator.profile() as prof:
        out = blocked_matmul(lhs_t, rhs)
    np.testing.assert_allclose(out, lhs_t.astype(np.float64).T @ rhs.astype(np.float64), rtol=1e-4, atol=1e-3)

    assert len(prof.runs) == 1
    r = prof.runs[0]
    assert r.target == target and "blocked_matmul" in r.name
    m_sizes, n_sizes, k_tiles = [128, 2], [512, 88], [128, 72]
    # Every (m, n) tile reloads its lhs and rhs strips per k tile, then stores once.
    tiles = [(mt, nt, kt) for mt in m_sizes for nt in n_sizes for kt in k_tiles]
    assert r.matmul_count == len(tiles) == 8
    assert r.hbm_bytes_read == sum(4 * kt * (mt + nt) for mt, nt, kt in tiles)
    assert r.hbm_bytes_written == 4 * m * n
    assert r.dma_count == 2 * len(tiles) + len(m_sizes) * len(n_sizes)
    assert sorted(r.dma_sizes) == sorted(
        [4 * kt * mt for mt, nt, kt in tiles]
        + [4 * kt * nt for mt, nt, kt in tiles]
        + [4 * mt * nt for mt in m_sizes for nt in n_sizes]
    )
    assert r.pe_fill == pytest.approx(np.mean([kt * mt / 128**2 for mt, nt, kt in tiles]))
    assert r.moving_fill == pytest.approx(np.mean([nt / 512 for mt, nt, kt in tiles]))
    assert r.engine_counts["tensor"] == 8 and r.engine_counts["dma"] == r.dma_count
    copies = sum(r.engine_counts[e] for e in ("vector", "scalar", "gpsimd"))
    assert copies == len(m_sizes) * len(n_sizes)
    # The modeled time covers at least the fp32 matmul passes and the DMA traffic.
    floor = cost_model.roofline_us(2 * k * m * n, r.hbm_bytes_read + r.hbm_bytes_written, target, "float32")
    assert r.latency_us[target] > floor


@nki.jit
def _transpose_then_matmul(x, w, identity):
    """x [P, F] -> xT [F, P] by nc_transpose, then nc_matmul(is_transpose=True), then xT.T @ w as a real matmul."""
    data = nl.load(x)
    xt_psum = nl.ndarray((x.shape[1], x.shape[0]), nl.float32, buffer=nl.psum)
    nisa.nc_transpose(xt_psum, data)
    xt_again = nl.ndarray((x.shape[1], x.shape[0]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(xt_again, data, nl.load(identity), is_transpose=True)
    xt = nl.ndarray(xt_psum.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(xt, xt_psum)
    product = nl.ndarray((x.shape[0], w.shape[1]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(product, xt, nl.load(w))
    result = nl.ndarray(product.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(result, product)
    out = nl.ndarray(product.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, result)
    return out


def test_transposes_are_tensor_instructions_but_not_matmuls():
    rows, cols, n = 100, 40, 300
    x, w = rand((rows, cols), seed=11), rand((cols, n), seed=12)
    runs = []
    trace.add_listener(runs.append)
    try:
        with emulator.profile() as prof:
            out = _transpose_then_matmul(x, w, np.eye(rows, dtype=np.float32))
    finally:
        trace.remove_listener(runs.append)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    # The data [rows, cols] is the stationary operand, the [rows, rows] identity the moving one.
    infos = [(r.opcode, r.matmul) for r in runs[0].records if r.matmul is not None]
    assert infos == [
        ("nc_transpose", trace.MatmulInfo(rows, cols, rows, "float32", True)),
        ("nc_matmul", trace.MatmulInfo(rows, cols, rows, "float32", True)),
        ("nc_matmul", trace.MatmulInfo(cols, rows, n, "float32", False)),
    ]
    r = prof.runs[0]
    assert (r.matmul_count, r.transposes, prof.matmul_count, prof.transposes) == (1, 2, 1, 2)
    assert r.engine_counts["tensor"] == 3
    assert r.pe_fill == pytest.approx(cols * rows / 128**2)  # the real matmul only
    assert r.moving_fill == pytest.approx(n / 512)
    assert "transp" in str(prof)


@nki.jit
def _casting_round_trip(x_bf16):
    """bf16 HBM -> fp32 SBUF -> bf16 HBM, both DMAs casting."""
    wide = nl.ndarray(x_bf16.shape, nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(wide, x_bf16)
    out = nl.ndarray(x_bf16.shape, nl.bfloat16, buffer=nl.shared_hbm)
    nisa.dma_copy(out, wide)
    return out


def test_casting_dmas_count_hbm_bytes_on_the_hbm_side():
    x = rand((96, 70), dtype=ml_dtypes.bfloat16, seed=13)
    with emulator.profile() as prof:
        out = _casting_round_trip(x)
    np.testing.assert_array_equal(out, x)
    r = prof.runs[0]
    assert r.hbm_bytes_read == 2 * x.size  # bf16 read from HBM, though 4 bytes land per element
    assert r.hbm_bytes_written == 2 * x.size
    assert r.dma_sizes == (4 * x.size, 2 * x.size)  # bytes written by each DMA


@nki.jit
def _evictions(x, w):
    """x [K, M], w [K, N] bf16: x.T @ w into fp32 PSUM, evicted to bf16 SBUF, copied bf16 -> bf16 in SBUF
    (contiguous, stored) and through a view taking every other column (strided)."""
    acc = nl.ndarray((x.shape[1], w.shape[1]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, nl.load(x), nl.load(w))
    evicted = nl.ndarray(acc.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(evicted, acc)
    copied = nl.ndarray(acc.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(copied, evicted)
    every_other = nl.ndarray((x.shape[1], w.shape[1] // 2), nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(every_other, evicted[:, ::2])
    out = nl.ndarray(acc.shape, nl.bfloat16, buffer=nl.shared_hbm)
    nl.store(out, copied)
    return out


def test_records_carry_input_dtypes_for_the_vector_perf_mode():
    k, m, n = 64, 96, 512
    x, w = rand((k, m), dtype=ml_dtypes.bfloat16, seed=14), rand((k, n), dtype=ml_dtypes.bfloat16, seed=15)
    runs = []
    trace.add_listener(runs.append)
    try:
        with emulator.use_target("trn2"):
            out = _evictions(x, w)
    finally:
        trace.remove_listener(runs.append)
    expected = x.astype(np.float64).T @ w.astype(np.float64)
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=1e-2, atol=1e-2)
    copies = [r for r in runs[0].records if r.opcode == "tensor_copy"]
    assert [(r.input_dtypes, r.dtype, r.inner_contiguous) for r in copies] == [
        (("float32",), "bfloat16", True),
        (("bfloat16",), "bfloat16", True),
        (("bfloat16",), "bfloat16", False),
    ]
    # trn2 VectorE performance mode: none for the fp32 PSUM eviction, 4x for the contiguous bf16 SBUF copy,
    # 2x for the strided one.
    hw = cost_model.HARDWARE["trn2"]
    assert [cost_model.compute_cycles(r, hw) for r in copies] == [n, n / 4, n / 2 / 2]
