"""Baselines on the emulator: tutorial-style blocked matmul, transpose, unfused low-rank chain."""

import ml_dtypes
import numpy as np
import pytest
from harness.baselines import dense_mlp, unfused_svd_matmul, unfused_svd_mlp

from nki_kernels import reference
from nki_kernels.activations import ACTIVATIONS
from nki_kernels.baseline_matmul import (
    TUTORIAL_BLOCKS,
    baseline_matmul_kernel,
    baseline_sbuf_bytes,
    fit_baseline_blocks,
)
from nki_kernels.emulator import profile
from nki_kernels.gated_activation import gated_activation_kernel
from nki_kernels.transpose import transpose_kernel

BF16 = np.dtype(ml_dtypes.bfloat16)
TOLERANCE = {np.dtype(np.float32): 1e-5, BF16: 1e-2}


def relative_error(got, want):
    got = np.asarray(got).astype(np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize(
    "k,m,n,dtype,blocks",
    [
        (100, 1, 1000, np.float32, TUTORIAL_BLOCKS),
        (200, 7, 1000, BF16, TUTORIAL_BLOCKS),
        (200, 130, 1000, np.float32, TUTORIAL_BLOCKS),
        (300, 600, 700, np.float32, {"tiles_m": 2, "tiles_n": 1, "tiles_k": 1}),  # several M, N and K blocks
        (300, 600, 700, BF16, {"tiles_m": 2, "tiles_n": 1, "tiles_k": 1}),
        (100, 1, 1000, BF16, {**TUTORIAL_BLOCKS, "hoist_lhsT": True}),
        (300, 600, 700, np.float32, {"tiles_m": 2, "tiles_n": 1, "tiles_k": 1, "hoist_lhsT": True}),
        (300, 130, 1000, BF16, {"tiles_m": 16, "tiles_n": 1, "tiles_k": 2, "hoist_lhsT": True}),
    ],
)
def test_baseline_matmul_matches_float64_reference(rng, k, m, n, dtype, blocks):
    lhsT = rng.standard_normal((k, m)).astype(dtype)
    rhs = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    out = baseline_matmul_kernel(lhsT, rhs, **blocks)
    assert out.shape == (m, n) and out.dtype == np.dtype(dtype)
    assert relative_error(out, reference.matmul_lhsT_f64(lhsT, rhs)) <= TOLERANCE[np.dtype(dtype)]


@pytest.mark.parametrize("m,n", [(1, 130), (7, 1000), (600, 130)])
def test_transpose_kernel_is_exact(rng, m, n):
    a = rng.standard_normal((m, n)).astype(BF16)
    np.testing.assert_array_equal(transpose_kernel(a).astype(np.float64), reference.transpose_f64(a))


@pytest.mark.parametrize(
    "t,k,r,n,dtype", [(1, 100, 130, 1000, np.float32), (130, 200, 1, 1000, BF16), (600, 200, 130, 1000, np.float32)]
)
def test_unfused_chain_matches_reference_and_round_trips_the_intermediate(rng, t, k, r, n, dtype):
    x = rng.standard_normal((t, k)).astype(dtype)
    u = (rng.standard_normal((k, r)) / np.sqrt(k)).astype(dtype)
    v = (rng.standard_normal((r, n)) / np.sqrt(r)).astype(dtype)
    with profile() as prof:
        y = unfused_svd_matmul(np.ascontiguousarray(x.T), u, v)
    assert relative_error(y, reference.svd_matmul_f64(x, u, v)) <= TOLERANCE[np.dtype(dtype)]
    assert [run.name for run in prof.runs] == ["baseline_matmul_kernel", "transpose_kernel", "baseline_matmul_kernel"]
    size = np.dtype(dtype).itemsize
    # x·u written, read and written transposed, read again: four extra crossings of T·r elements.
    minimum = (t * k + k * r + r * n + t * n) * size
    assert prof.hbm_bytes_read + prof.hbm_bytes_written >= minimum + 4 * t * r * size


@pytest.mark.parametrize("hoist_lhsT,extra_lhsT_reads", [(False, 4), (True, 1)])
def test_hoisted_lhsT_is_loaded_once_per_m_block(rng, hoist_lhsT, extra_lhsT_reads):
    # One M block, 4 N blocks of 512: the tutorial order reads lhsT once per N block, the hoisted order once.
    k, m, n = 200, 7, 2000
    lhsT = rng.standard_normal((k, m)).astype(BF16)
    rhs = rng.standard_normal((k, n)).astype(BF16)
    with profile() as prof:
        out = baseline_matmul_kernel(lhsT, rhs, **{**TUTORIAL_BLOCKS, "tiles_n": 1, "hoist_lhsT": hoist_lhsT})
    assert relative_error(out, reference.matmul_lhsT_f64(lhsT, rhs)) <= TOLERANCE[BF16]
    assert prof.hbm_bytes_read == (extra_lhsT_reads * k * m + k * n) * BF16.itemsize
    assert prof.hbm_bytes_written == m * n * BF16.itemsize


def test_baseline_rejects_mismatched_contraction(rng):
    with pytest.raises(ValueError, match="rhs has shape"):
        baseline_matmul_kernel(np.ones((100, 7), np.float32), np.ones((99, 10), np.float32))


def test_fit_baseline_blocks_keeps_tutorial_blocks_when_they_fit_and_shrinks_otherwise():
    assert fit_baseline_blocks(2048, 2048, 8192, 2, 192 * 1024) == {**TUTORIAL_BLOCKS, "hoist_lhsT": True}
    shrunk = fit_baseline_blocks(8192, 4096, 14336, 2, 192 * 1024)
    assert {name: shrunk[name] for name in TUTORIAL_BLOCKS} != TUTORIAL_BLOCKS
    assert baseline_sbuf_bytes(8192, 4096, 14336, 2, **shrunk) <= 192 * 1024
    # A whole lhsT block of 2048 tokens × K = 14336 (448 KiB per partition) does not fit: tutorial order kept.
    assert fit_baseline_blocks(2048, 14336, 4096, 2, 192 * 1024)["hoist_lhsT"] is False


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_kernel(rng, activation):
    gate, up = (rng.standard_normal((130, 700)).astype(np.float32) for _ in range(2))
    h = gated_activation_kernel(gate, up, activation=activation, block_f=256)
    want = ACTIVATIONS[activation].reference(gate) * up.astype(np.float64)
    assert relative_error(h, want) <= 1e-5


def test_unfused_and_dense_mlp_baselines_match_reference(rng):
    t, h, i, r = 7, 100, 300, 130
    x = rng.standard_normal((t, h)).astype(np.float32)
    factors = [
        (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
        for s in [(h, r), (r, i), (h, r), (r, i), (i, r), (r, h)]
    ]
    want = reference.svd_mlp_f64(x, *factors, "gelu_tanh")
    xT = np.ascontiguousarray(x.T)
    with profile() as prof:
        y = unfused_svd_mlp(xT, *factors, activation="gelu_tanh")
    assert len(prof.runs) == 11
    assert relative_error(y, want) <= 1e-5
    gu, gv, uu, uv, du, dv = factors
    dense = dense_mlp(xT, gu @ gv, uu @ uv, du @ dv, activation="gelu_tanh")
    assert relative_error(dense, want) <= 1e-5
