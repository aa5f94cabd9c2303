"""Hardware rules of the NKI emulator: each with a violating kernel (error names the instruction and this
file's line) and a conforming one that runs."""

import numpy as np
import pytest
from emulator_helpers import hardware_error_check, rand

from nki_kernels import emulator
from nki_kernels.binding import nisa, nki, nl

_raises = hardware_error_check(__file__)


@nki.jit
def _matmul_kernel(lhs_t, rhs, dst_buffer="psum", stationary_buffer="sbuf"):
    """dst = lhs_t.T @ rhs for one tile; buffers configurable to break the memory rules."""
    k, m = lhs_t.shape
    _, n = rhs.shape
    a = nl.ndarray((k, m), lhs_t.dtype, buffer=getattr(nl, stationary_buffer))
    b = nl.ndarray((k, n), rhs.dtype, buffer=nl.sbuf)
    nisa.dma_copy(b, rhs)
    if stationary_buffer == "sbuf":
        nisa.dma_copy(a, lhs_t)
    else:
        staged = nl.load(lhs_t)
        nisa.tensor_copy(a, staged)
    rows = min(m, 128)  # a dst can never have more partitions; the stationary check must fire first
    acc = nl.ndarray((rows, n), nl.float32, buffer=getattr(nl, dst_buffer))
    nisa.nc_matmul(acc, a, b)
    out = nl.ndarray((rows, n), nl.float32, buffer=nl.shared_hbm)
    result = nl.ndarray((rows, n), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(result, acc)
    nisa.dma_copy(out, result)
    return out


def test_partition_over_128():
    @nki.jit
    def kernel(x, rows):
        t = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(t, x[0:rows])
        out = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, t)
        return out

    x = rand((200, 8))
    message = _raises("nl.ndarray", kernel, x, 129)
    assert "129" in message
    np.testing.assert_array_equal(kernel(x, 128), x[:128])


def test_stationary_free_over_128():
    lhs_t, rhs = rand((64, 129)), rand((64, 32), seed=1)
    assert "stationary free size 129" in _raises("nc_matmul", _matmul_kernel, lhs_t, rhs)
    np.testing.assert_allclose(
        _matmul_kernel(lhs_t[:, :128], rhs), lhs_t[:, :128].T.astype(np.float64) @ rhs, rtol=1e-5, atol=1e-4
    )


def test_moving_free_over_512():
    lhs_t, rhs = rand((32, 16)), rand((32, 513), seed=1)
    assert "moving free size 513" in _raises("nc_matmul", _matmul_kernel, lhs_t, rhs)
    np.testing.assert_allclose(
        _matmul_kernel(lhs_t, rhs[:, :512]), lhs_t.T.astype(np.float64) @ rhs[:, :512], rtol=1e-5, atol=1e-4
    )


@nki.jit
def _bank_kernel(lhs_t, rhs, column):
    """Matmul into columns [column, column + n) of a 2-bank PSUM tensor."""
    a, b = nl.load(lhs_t), nl.load(rhs)
    n = rhs.shape[1]
    acc = nl.ndarray((lhs_t.shape[1], 1024), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc[:, column : column + n], a, b)
    result = nl.ndarray((lhs_t.shape[1], n), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(result, acc[:, column : column + n])
    out = nl.ndarray(result.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, result)
    return out


def test_psum_tile_over_one_bank():
    lhs_t, rhs = rand((32, 16)), rand((32, 512), seed=1)
    assert "bank boundary" in _raises("nc_matmul", _bank_kernel, lhs_t, rhs, 256)
    np.testing.assert_allclose(_bank_kernel(lhs_t, rhs, 512), lhs_t.T.astype(np.float64) @ rhs, rtol=1e-5, atol=1e-4)


def test_more_than_8_psum_banks_live():
    @nki.jit
    def kernel(x, tiles):
        held = [nl.ndarray((x.shape[0], 512), nl.float32, buffer=nl.psum) for _ in range(tiles)]
        t = nl.load(x)
        nisa.tensor_copy(held[-1][:, 0 : x.shape[1]], t)
        result = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(result, held[-1][:, 0 : x.shape[1]])
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, result)
        return out

    x = rand((128, 64))
    assert "9 banks" in _raises("dma_copy", kernel, x, 9)
    np.testing.assert_array_equal(kernel(x, 8), x)


def _sbuf_kernel_factory():
    @nki.jit
    def kernel(x, extra_columns):
        big = nl.ndarray((128, 192 * 1024 // 4 - 128), nl.float32, buffer=nl.sbuf)
        nisa.memset(big, 1.0)
        extra = nl.ndarray((128, extra_columns), nl.float32, buffer=nl.sbuf)
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)  # 64 columns
        nisa.dma_copy(t, x)
        nisa.memset(extra, 0.0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, t)
        return out

    return kernel


def test_sbuf_capacity_per_target():
    kernel = _sbuf_kernel_factory()
    x = rand((128, 64))
    with emulator.use_target("trn1"):
        assert "over the 196608 bytes of trn1" in _raises("dma_copy", kernel, x, 65)
        np.testing.assert_array_equal(kernel(x, 64), x)  # exactly 192 KiB per partition
    with emulator.use_target("trn2"):  # 224 KiB per partition: the same kernel fits
        np.testing.assert_array_equal(kernel(x, 65), x)


def test_sbuf_liveness_reassignment_does_not_accumulate():
    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        for i in range(4):  # each 150 KiB tile replaces the previous one
            t = nl.ndarray((128, 150 * 256), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(t[:, 0 : x.shape[1]], x)
            nisa.tensor_scalar(t[:, 0 : x.shape[1]], t[:, 0 : x.shape[1]], nl.add, float(i))
        nisa.dma_copy(out, t[:, 0 : x.shape[1]])
        return out

    @nki.jit
    def holding(x):
        kept = []
        for i in range(2):  # both 150 KiB tiles stay referenced
            kept.append(nl.ndarray((128, 150 * 256), nl.float32, buffer=nl.sbuf))
            nisa.dma_copy(kept[-1][:, 0 : x.shape[1]], x)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, kept[0][:, 0 : x.shape[1]])
        return out

    x = rand((128, 32))
    with emulator.use_target("trn1"):
        np.testing.assert_array_equal(kernel(x), x + 3.0)
        _raises("dma_copy", holding, x)


def test_matmul_operand_and_dst_memory():
    lhs_t, rhs = rand((32, 16)), rand((32, 64), seed=1)
    assert "stationary" in _raises("nc_matmul", _matmul_kernel, lhs_t, rhs, stationary_buffer="psum")
    assert "dst" in _raises("nc_matmul", _matmul_kernel, lhs_t, rhs, dst_buffer="sbuf")
    np.testing.assert_allclose(_matmul_kernel(lhs_t, rhs), lhs_t.T.astype(np.float64) @ rhs, rtol=1e-5, atol=1e-4)


def test_dma_element_count_mismatch():
    @nki.jit
    def kernel(x, columns):
        t = nl.ndarray((x.shape[0], columns), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(t, x)
        out = nl.ndarray(t.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, t)
        return out

    x = rand((16, 10))
    assert "element counts differ" in _raises("dma_copy", kernel, x, 11)
    np.testing.assert_array_equal(kernel(x, 10), x)


def test_out_of_bounds_slice_is_never_clipped():
    @nki.jit
    def kernel(x, stop):
        t = nl.load(x[:, 0:stop])
        out = nl.ndarray(t.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out

    x = rand((8, 10))
    assert "out-of-bounds" in _raises("indexing", kernel, x, 11)
    np.testing.assert_array_equal(kernel(x, 10), x)


@nki.jit
def _accumulate_kernel(lhs_t, rhs, mode):
    """Two matmuls into one PSUM tile; `mode` sets what happens before/at the second."""
    a, b = nl.load(lhs_t), nl.load(rhs)
    acc = nl.ndarray((lhs_t.shape[1], rhs.shape[1]), nl.float32, buffer=nl.psum)
    if mode == "true_on_fresh":
        nisa.nc_matmul(acc, a, b, accumulate=True)
    elif mode == "after_memset":  # a nonzero starting value: accumulating onto it is undefined on trn1/trn2
        nisa.memset(acc, 1.0)
        nisa.nc_matmul(acc, a, b)
    elif mode == "true_after_zeros":  # even zeros from memset are no matmul write for accumulate=True
        nisa.memset(acc, 0.0)
        nisa.nc_matmul(acc, a, b, accumulate=True)
    elif mode == "zeros_then_default":  # conforming: AWS's documented PSUM-accumulation pattern
        acc = nl.zeros(acc.shape, nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, a, b)
        nisa.nc_matmul(acc, a, b)
    else:  # conforming: overwrite, then accumulate
        nisa.nc_matmul(acc, a, b, accumulate=False)
        nisa.nc_matmul(acc, a, b, accumulate=True)
    result = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(result, acc)
    out = nl.ndarray(acc.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, result)
    return out


def test_accumulate_onto_psum_not_written_by_matmul():
    lhs_t, rhs = rand((20, 12)), rand((20, 30), seed=1)
    assert "accumulate=True" in _raises("nc_matmul", _accumulate_kernel, lhs_t, rhs, "true_on_fresh")
    assert "non-matmul" in _raises("nc_matmul", _accumulate_kernel, lhs_t, rhs, "after_memset")
    assert "accumulate=True" in _raises("nc_matmul", _accumulate_kernel, lhs_t, rhs, "true_after_zeros")
    np.testing.assert_allclose(
        _accumulate_kernel(lhs_t, rhs, "zeros_then_default"),
        2 * (lhs_t.T.astype(np.float64) @ rhs),
        rtol=1e-5,
        atol=1e-4,
    )
    np.testing.assert_allclose(
        _accumulate_kernel(lhs_t, rhs, "ok"), 2 * (lhs_t.T.astype(np.float64) @ rhs), rtol=1e-5, atol=1e-4
    )


def test_dtype_rules():
    @nki.jit
    def kernel(x, dst_dtype, stationary_dtype):
        a = nl.ndarray(x.shape, stationary_dtype, buffer=nl.sbuf)
        nisa.dma_copy(a, x)
        b = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(b, x)
        acc = nl.ndarray((x.shape[1], x.shape[1]), dst_dtype, buffer=nl.psum)
        nisa.nc_matmul(acc, a, b)
        result = nl.ndarray(acc.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(result, acc)
        out = nl.ndarray(acc.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, result)
        return out

    x = rand((16, 8))
    assert "must be float32" in _raises("nc_matmul", kernel, x, nl.bfloat16, nl.bfloat16)
    assert "the other must be too" in _raises("nc_matmul", kernel, x, nl.float32, nl.float32)
    xb = x.astype(np.float32).astype(np.dtype("bfloat16")).astype(np.float64)
    np.testing.assert_allclose(kernel(x, nl.float32, nl.bfloat16), xb.T @ xb, rtol=1e-5, atol=1e-4)

    @nki.jit
    def transpose_kernel(x, dst_dtype):
        t = nl.load(x)
        tt = nl.ndarray((x.shape[1], x.shape[0]), dst_dtype, buffer=nl.psum)
        nisa.nc_transpose(tt, t)
        result = nl.ndarray(tt.shape, x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(result, tt)
        out = nl.ndarray(tt.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, result)
        return out

    assert "must equal data dtype" in _raises("nc_transpose", transpose_kernel, x, nl.bfloat16)
    np.testing.assert_array_equal(transpose_kernel(x, nl.float32), x.T)


def test_engine_operand_rules():
    @nki.jit
    def kernel(x, case):
        t = nl.load(x)
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        if case == "bf16_scalar_operand":
            vec = nl.ndarray((x.shape[0], 1), nl.bfloat16, buffer=nl.sbuf)
            nisa.memset(vec, 2.0)
            nisa.tensor_scalar(y, t, nl.multiply, vec)
        elif case == "both_inputs_in_psum":
            p1 = nl.ndarray(x.shape, nl.float32, buffer=nl.psum)
            p2 = nl.ndarray(x.shape, nl.float32, buffer=nl.psum)
            nisa.tensor_copy(p1, t)
            nisa.tensor_copy(p2, t)
            nisa.tensor_tensor(y, p1, p2, nl.add)
        else:  # conforming: float32 [P, 1] operand, one input in PSUM
            vec = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
            nisa.memset(vec, 2.0)
            p1 = nl.ndarray(x.shape, nl.float32, buffer=nl.psum)
            nisa.tensor_copy(p1, t)
            z = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(z, p1, t, nl.add)
            nisa.tensor_scalar(y, z, nl.multiply, vec)
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, y)
        return out

    x = rand((16, 24))
    assert "must be float32" in _raises("tensor_scalar", kernel, x, "bf16_scalar_operand")
    assert "both be in PSUM" in _raises("tensor_tensor", kernel, x, "both_inputs_in_psum")
    np.testing.assert_allclose(kernel(x, "ok"), 4 * x.astype(np.float64), rtol=1e-6)


def test_vector_engine_transpose_size():
    @nki.jit
    def kernel(x):
        t = nl.load(x)
        tt = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.sbuf)
        nisa.nc_transpose(tt, t, engine=nisa.engine.vector)
        out = nl.ndarray(tt.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, tt)
        return out

    x = rand((40, 33))
    assert "over the 32x32" in _raises("nc_transpose", kernel, x)
    np.testing.assert_array_equal(kernel(x[:32, :32]), x[:32, :32].T)


def test_dma_cannot_touch_psum():
    @nki.jit
    def kernel(x, via_psum):
        staged = nl.ndarray(x.shape, x.dtype, buffer=nl.psum if via_psum else nl.sbuf)
        nisa.dma_copy(staged, x)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, staged)
        return out

    x = rand((8, 8))
    assert "DMA cannot access PSUM" in _raises("dma_copy", kernel, x, True)
    np.testing.assert_array_equal(kernel(x, False), x)


@nki.jit
def _activation_kernel(x, opname):
    t = nl.load(x)
    y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.activation(y, getattr(nl, opname), t)
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, y)
    return out


@pytest.mark.parametrize("opname", ["floor", "ceil", "trunc", "cos", "tan", "negative", "logical_not", "invert", "add"])
def test_activation_only_takes_documented_functions(opname):
    # Not in the table of activation functions of the NKI ISA docs (nl.floor etc. exist as nl functions).
    message = _raises("activation", _activation_kernel, rand((8, 6), seed=21), opname)
    assert f"op {opname} is not an activation function" in message


@pytest.mark.parametrize(
    "opname, reference",
    [("sign", np.sign), ("abs", np.abs), ("square", np.square), ("arctan", np.arctan), ("sin", np.sin)],
)
def test_activation_runs_documented_functions(opname, reference):
    x = np.clip(rand((8, 6), seed=22), -1.5, 1.5)  # inside the narrowest valid range ([-pi/2, pi/2], arctan)
    np.testing.assert_allclose(_activation_kernel(x, opname), reference(x.astype(np.float64)), rtol=1e-6, atol=1e-6)
