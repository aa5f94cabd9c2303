"""Numerics and semantics of the NKI emulator against float64 numpy references."""

import math
import sys

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import blocked_matmul

from nki_kernels import binding, emulator
from nki_kernels.binding import nisa, nki, nl
from nki_kernels.emulator import trace

BF16 = np.dtype(ml_dtypes.bfloat16)


def _rng(seed):
    return np.random.default_rng(seed)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


@pytest.mark.parametrize("k,m,n", [(200, 130, 1000), (100, 7, 1), (128, 128, 512)])
def test_blocked_matmul_bf16(k, m, n):
    rng = _rng(k * m + n)
    lhs_t = rng.standard_normal((k, m)).astype(BF16)
    rhs = rng.standard_normal((k, n)).astype(BF16)
    got = blocked_matmul(lhs_t, rhs)
    assert got.dtype == BF16 and got.shape == (m, n)
    expected = _f64(lhs_t).T @ _f64(rhs)
    np.testing.assert_allclose(_f64(got), expected, rtol=1e-2, atol=1e-2 * math.sqrt(k))
    # fp32 accumulation then one bf16 rounding: the result equals the rounded exact product (up to sum order)
    np.testing.assert_allclose(_f64(got), _f64(expected.astype(np.float32).astype(BF16)), rtol=8e-3, atol=1e-3)


def test_accumulate_none_tracks_first_write_per_location():
    @nki.jit
    def kernel(lhs_t, rhs):
        a, b = nl.load(lhs_t), nl.load(rhs)
        acc = nl.ndarray((lhs_t.shape[1], 64), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc[:, 0:32], a, b)  # first write: overwrites the NaN of fresh PSUM
        nisa.nc_matmul(acc[:, 0:32], a, b)  # accumulates
        nisa.nc_matmul(acc[:, 32:64], a, b, accumulate=False)
        result = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(result, acc)
        out = nl.ndarray(acc.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, result)
        return out

    rng = _rng(1)
    lhs_t, rhs = rng.standard_normal((50, 20)).astype(np.float32), rng.standard_normal((50, 32)).astype(np.float32)
    product = _f64(lhs_t).T @ _f64(rhs)
    got = kernel(lhs_t, rhs)
    np.testing.assert_allclose(got[:, :32], 2 * product, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[:, 32:], product, rtol=1e-5, atol=1e-4)


def test_transposes_and_casts():
    @nki.jit
    def kernel(x):
        t = nl.load(x)  # [P, F] float32
        tt = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.psum)
        nisa.nc_transpose(tt, t)  # TensorE: SBUF -> PSUM
        as_bf16 = nl.ndarray(tt.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(as_bf16, tt)  # PSUM eviction with a cast
        out_t = nl.ndarray(tt.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(out_t, as_bf16)  # DMA casts bf16 -> fp32 exactly
        dma_t = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dma_t, x)
        out_dma_t = nl.ndarray(dma_t.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out_dma_t, dma_t)
        return out_t, out_dma_t

    x = _rng(2).standard_normal((100, 70)).astype(np.float32)
    got_t, got_dma_t = kernel(x)
    np.testing.assert_array_equal(got_t, x.T.astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(got_dma_t, x.T)


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


@pytest.mark.parametrize(
    "op,reference",
    [
        ("exp", np.exp),
        ("silu", lambda x: x / (1 + np.exp(-x))),
        ("gelu", _gelu),
        ("gelu_apprx_tanh", lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))),
        ("rsqrt", lambda x: 1 / np.sqrt(np.abs(x) + 0.5)),
        ("tanh", np.tanh),
        ("sigmoid", lambda x: 1 / (1 + np.exp(-x))),
    ],
)
def test_activation_with_bias_and_scale(op, reference):
    @nki.jit
    def kernel(x, bias, scale, opname):
        t, b = nl.load(x), nl.load(bias)
        if opname == "rsqrt":  # keep rsqrt's argument positive: |x| + 0.5 via tensor_scalar
            pos = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(pos, t, nl.abs_max, 0.0, op1=nl.add, operand1=0.5)
            t = pos
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(
            y, getattr(nl, opname), t, bias=b if opname != "rsqrt" else None, scale=scale if opname != "rsqrt" else 1.0
        )
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, y)
        return out

    rng = _rng(3)
    x = rng.standard_normal((96, 40)).astype(np.float32)
    bias = rng.standard_normal((96, 1)).astype(np.float32)
    scale = 0.75
    got = kernel(x, bias, scale, op)
    argument = _f64(x) if op == "rsqrt" else _f64(x) * scale + _f64(bias)
    np.testing.assert_allclose(got, reference(argument), rtol=2e-5, atol=2e-6)


def test_vector_ops_and_iota():
    @nki.jit
    def kernel(x, y, v):
        a, b, vec = nl.load(x), nl.load(y), nl.load(v)
        diff = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(diff, a, b, nl.subtract)
        scaled = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(scaled, diff, nl.multiply, vec, op1=nl.subtract, operand1=2.0, reverse1=True)
        red = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(red, nl.maximum, scaled, axis=1, negate=True)
        idx = nl.ndarray((x.shape[0], 6), nl.int32, buffer=nl.sbuf)
        nisa.iota(idx, [[3, 2], [1, 3]], offset=5, channel_multiplier=10)
        outs = []
        for t in (scaled, red, idx):
            o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
            nl.store(o, t)
            outs.append(o)
        return tuple(outs)

    rng = _rng(4)
    x, y = rng.standard_normal((33, 17)).astype(np.float32), rng.standard_normal((33, 17)).astype(np.float32)
    v = rng.standard_normal((33, 1)).astype(np.float32)
    scaled, red, idx = kernel(x, y, v)
    expected = 2.0 - (_f64(x) - _f64(y)) * _f64(v)
    np.testing.assert_allclose(scaled, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(red[:, 0], -expected.max(axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(idx, 5 + 10 * np.arange(33)[:, None] + np.array([0, 1, 2, 3, 4, 5])[None, :])


def test_nl_tile_functions_and_views():
    @nki.jit
    def kernel(x, w):
        t = nl.load(x[1:9, :])  # [8, 12] rows 1..8
        row = nl.load(x[0])  # HBM int index drops the dim -> loads as [1, 12]
        col = t[:, 3]  # on-chip int index: stays 2-D [8, 1]
        part = t[2]  # partition int index keeps size 1: [1, 12]
        s = nl.sum(nl.multiply(t, col), axis=1)  # [8, 1]
        m = nl.max(nl.exp(t[:, nl.ds(4, 5)]), axis=[1], keepdims=True)
        g = nl.silu(nl.add(t, nl.load(w)), dtype=nl.bfloat16)
        strided = t.ap([[12, 8], [2, 6]])  # every other column
        outs = []
        for tile in (row, part, s, m, g, nl.add(strided, 1.0)):
            o = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
            nl.store(o, tile)
            outs.append(o)
        return outs

    rng = _rng(5)
    x = rng.standard_normal((10, 12)).astype(np.float32)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    row, part, s, m, g, strided = kernel(x, w)
    t = _f64(x[1:9])
    assert isinstance(row, np.ndarray) and row.shape == (1, 12) and part.shape == (1, 12)
    np.testing.assert_array_equal(row[0], x[0])
    np.testing.assert_array_equal(part[0], x[3])
    np.testing.assert_allclose(s[:, 0], (t * t[:, 3:4]).sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m[:, 0], np.exp(t[:, 4:9]).max(axis=1), rtol=1e-6)
    assert g.dtype == BF16
    z = t + _f64(w)
    np.testing.assert_allclose(_f64(g), z / (1 + np.exp(-z)), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(strided, t[:, 0::2] + 1.0, rtol=1e-6)


def test_fresh_memory_is_nan_or_sentinel():
    @nki.jit
    def kernel(x):
        f = nl.ndarray((4, 3), nl.float32, buffer=nl.shared_hbm)
        i = nl.ndarray((4, 3), nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 3), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(f, t)
        return f, i

    f, i = kernel(np.ones((1, 1), np.float32))
    assert np.isnan(f).all()
    assert (i == np.iinfo(np.int32).max).all()


def test_store_rounds_to_low_precision_dtypes():
    @nki.jit
    def kernel(x, dtype):
        t = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        nisa.dma_copy(t, x)
        back = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(back, t)
        return back

    x = _rng(6).standard_normal((16, 40)).astype(np.float32) * 3
    for dtype in (nl.bfloat16, nl.float16, nl.float8_e4m3, nl.float8_e5m2):
        got = kernel(x, dtype)
        np.testing.assert_array_equal(got, x.astype(dtype).astype(np.float32))
        assert not np.array_equal(got, x)


def test_spmd_grid_and_constant_arguments():
    @nki.jit
    def kernel(x, scale, label, flag):
        assert label == "rows" and flag is True
        i, j = nl.program_id(0), nl.program_id(1)
        rows = x.shape[0] // nl.num_programs(0)
        cols = x.shape[1] // nl.num_programs(1)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.load(x[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols])
        y = nl.ndarray(t.shape, x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(y, t, nl.multiply, float(scale), op1=nl.add, operand1=float(i * 10 + j))
        nl.store(out[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols], y)
        return out

    x = _rng(7).standard_normal((6, 8)).astype(np.float32)
    got = kernel[3, 2](x, 2, "rows", True)
    offsets = np.repeat(np.repeat(np.array([[0, 1], [10, 11], [20, 21]]), 2, axis=0), 4, axis=1)
    np.testing.assert_allclose(got, x * 2 + offsets, rtol=1e-6)
    np.testing.assert_allclose(nki.simulate(kernel[3, 2])(x, 2, "rows", True), got)


def test_tile_size_per_target(monkeypatch):
    with emulator.use_target("trn1"):
        assert nl.tile_size.sbuf_fmax_bytes == 192 * 1024
    with emulator.use_target("trn2"):
        assert nl.tile_size.sbuf_fmax_bytes == 224 * 1024
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    assert nl.tile_size.sbuf_fmax_bytes == 192 * 1024
    assert (nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax) == (128, 128, 512)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn9")
    with pytest.raises(ValueError, match="trn9"):
        nl.tile_size.sbuf_fmax_bytes


def test_binding_and_as_nki():
    assert binding.USING_EMULATOR and binding.nki is emulator.api and binding.nl is emulator.language
    assert "nki" not in sys.modules
    with emulator.as_nki():
        import nki as real_name
        import nki.isa as isa_module
        import nki.language as language_module
        from nki.typing import tensor

        assert real_name is emulator.api and isa_module is emulator.isa and language_module is emulator.language
        assert tensor.__name__ == "NkiTensor"
    assert "nki" not in sys.modules and "nki.language" not in sys.modules


def test_as_nki_refuses_when_real_package_present(monkeypatch):
    import nki_kernels.emulator.nki_import as nki_import

    monkeypatch.setattr(nki_import, "load_real_nki", lambda: object())
    with pytest.raises(RuntimeError, match="real `nki` package"):
        with emulator.as_nki():
            pass


def test_trace_records_and_listener():
    runs = []
    trace.add_listener(runs.append)
    try:
        lhs_t = _rng(8).standard_normal((200, 130)).astype(np.float32)
        rhs = _rng(9).standard_normal((200, 600)).astype(np.float32)
        blocked_matmul(lhs_t, rhs)
    finally:
        trace.remove_listener(runs.append)
    (run,) = runs
    ops = [r.opcode for r in run.records]
    # 2 m-tiles x 2 n-tiles x 2 k-tiles matmuls, 2 loads each, one eviction and one store per output tile
    assert ops.count("nc_matmul") == 8 and ops.count("dma_copy") == 20 and ops.count("tensor_copy") == 4
    matmuls = [r for r in run.records if r.opcode == "nc_matmul"]
    assert {(r.matmul.contraction, r.matmul.stationary_free, r.matmul.moving_free) for r in matmuls} == {
        (128, 128, 512),
        (72, 128, 512),
        (128, 2, 512),
        (72, 2, 512),
        (128, 128, 88),
        (72, 128, 88),
        (128, 2, 88),
        (72, 2, 88),
    }
    assert all(r.line.startswith("emulator_helpers.py:") for r in run.records)
    load = run.records[0]
    assert load.engine == "dma" and load.dma.src_buffer == "hbm" and load.dma.dst_buffer == "sbuf"
    assert load.dma.nbytes == 128 * 128 * 4 and load.dma.contiguous_bytes == 128 * 4
    assert run.target in ("trn1", "trn2") and run.name.endswith("blocked_matmul")


def test_count_only_skips_numerics_but_checks_rules():
    runs = []
    trace.add_listener(runs.append)
    try:
        lhs_t = np.ones((256, 130), np.float32)
        rhs = np.ones((256, 700), np.float32)
        with emulator.count_only():
            got = blocked_matmul(lhs_t, rhs)
        real = blocked_matmul(lhs_t, rhs)
    finally:
        trace.remove_listener(runs.append)
    assert got.shape == real.shape and np.isnan(got).all() and (real == 256).all()
    assert [r.opcode for r in runs[0].records] == [r.opcode for r in runs[1].records]
    with emulator.count_only(), pytest.raises(emulator.NkiHardwareError, match="moving free size"):
        _single_matmul(np.ones((8, 4), np.float32), np.ones((8, 600), np.float32))


@nki.jit
def _single_matmul(lhs_t, rhs):
    a, b = nl.load(lhs_t), nl.load(rhs)
    acc = nl.ndarray((lhs_t.shape[1], 512), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, a, b)
    return acc


def test_output_specs():
    specs = emulator.output_specs(blocked_matmul, [((300, 130), BF16), ((300, 1000), BF16)])
    assert specs == [((130, 1000), BF16)]

    @nki.jit
    def two_outputs(x, factor):
        a = nl.ndarray((x.shape[0] * factor, 3), nl.float32, buffer=nl.shared_hbm)
        b = nl.ndarray((2,), nl.int32, buffer=nl.shared_hbm)
        return a, b

    spec_like = np.zeros((5, 2), np.float16)  # anything with .shape/.dtype is a spec
    assert emulator.output_specs(two_outputs, [spec_like], kwargs={"factor": 4}, grid=2) == [
        ((20, 3), np.dtype(np.float32)),
        ((2,), np.dtype(np.int32)),
    ]


class _ForeignArray:
    """Stands in for a jax Array: has shape and dtype but is not a numpy array."""

    def __init__(self, value):
        self.shape, self.dtype, self.value = value.shape, value.dtype, value


def test_array_frontend_hook():
    from nki_kernels.emulator import kernel as kernel_module

    installed = kernel_module._array_frontend[0]  # importing jax_neuronmm installs one; start without
    emulator.set_array_frontend(None)
    try:
        _check_array_frontend_hook()
    finally:
        emulator.set_array_frontend(installed)


def _check_array_frontend_hook():
    x = _ForeignArray(np.ones((4, 4), np.float32))
    with pytest.raises(TypeError, match="set_array_frontend"):
        blocked_matmul(x, x)
    with pytest.raises(TypeError, match="numpy arrays only"):
        nki.simulate(blocked_matmul)(x, x)
    calls = []

    def frontend(kernel, grid, args, kwargs):
        calls.append((kernel, grid, args, kwargs))
        return kernel(*[a.value for a in args], **kwargs)

    emulator.set_array_frontend(frontend)
    got = blocked_matmul[1](x, x)
    assert len(calls) == 1 and calls[0][1] == (1,) and calls[0][2] == (x, x)
    np.testing.assert_array_equal(got, np.full((4, 4), 4.0, np.float32))


def test_matmul_transpose_mode_keeps_dtype():
    @nki.jit
    def kernel(x, identity):
        data, eye = nl.load(x), nl.load(identity)
        tt = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.psum)
        nisa.nc_matmul(tt, data, eye, is_transpose=True)  # data.T @ I, bf16 dst allowed in transpose mode
        result = nl.ndarray(tt.shape, x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(result, tt)
        out = nl.ndarray(tt.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, result)
        return out

    x = _rng(10).standard_normal((48, 20)).astype(BF16)
    got = kernel(x, np.eye(48, dtype=BF16))
    assert got.dtype == BF16
    np.testing.assert_array_equal(got, x.T)


def test_tensor_tensor_scan_and_broadcast_to():
    @nki.jit
    def kernel(decay, drive, row):
        a, b, r = nl.load(decay), nl.load(drive), nl.load(row)  # r: [1, F]
        scanned = nl.ndarray(decay.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(scanned, a, b, initial=0.5, op0=nl.multiply, op1=nl.add)
        # A partition broadcast is a TensorE matmul: its tile lands in PSUM, so it is copied to SBUF to be stored.
        wide = nl.ndarray(decay.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(wide, nl.broadcast_to(r, decay.shape))
        outs = []
        for t in (scanned, wide):
            o = nl.ndarray(decay.shape, nl.float32, buffer=nl.shared_hbm)
            nl.store(o, t)
            outs.append(o)
        return outs

    rng = _rng(11)
    decay, drive = rng.uniform(0, 1, (20, 30)).astype(np.float32), rng.standard_normal((20, 30)).astype(np.float32)
    row = rng.standard_normal((1, 30)).astype(np.float32)
    scanned, wide = kernel(decay, drive, row)
    h = np.full(20, 0.5)
    expected = np.empty((20, 30))
    for t in range(30):
        h = _f64(decay[:, t]) * h + drive[:, t]
        expected[:, t] = h
    np.testing.assert_allclose(scanned, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(wide, np.broadcast_to(row, (20, 30)))


def test_launches_from_several_threads_do_not_interfere():
    """XLA may run independent host callbacks concurrently; each launch must see only its own state."""
    import concurrent.futures

    rng = np.random.default_rng(7)
    pairs = [
        (rng.standard_normal((130, 40)).astype(np.float32), rng.standard_normal((130, 300)).astype(np.float32))
        for _ in range(8)
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: blocked_matmul(*p), pairs))
    for (a, b), got in zip(pairs, results):
        np.testing.assert_allclose(got, a.T.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
