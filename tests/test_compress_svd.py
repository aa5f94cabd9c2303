"""block_aligned_rank, truncated_svd and whitened_svd against float64 numpy."""

import ml_dtypes
import numpy as np
import pytest

from jax_neuronmm.compress import (
    WhiteningDampedWarning,
    block_aligned_rank,
    truncated_svd,
    whitened_svd,
    whitened_svd_with_info,
)


def correlated_activations(rng, n, k, decay=3.0, mixing=None):
    """Activations [n, k] with a strongly non-isotropic covariance (singular values spread over 10^decay)."""
    if mixing is None:
        mixing = np.linalg.qr(rng.standard_normal((k, k)))[0] * np.logspace(0, -decay, k)
    return rng.standard_normal((n, k)) @ mixing.T, mixing


@pytest.mark.parametrize(
    "k, n, keep, block, expected",
    [
        (4096, 14336, 0.5, 128, 1536),  # 4096·14336·0.5/(18432·128) = 12.44 → 12 blocks
        (4096, 4096, 1.0, 128, 2048),
        (4096, 11008, 0.25, 128, 768),  # 5.86 blocks → 6
        (100, 60, 0.5, 128, 19),  # budget 18.75 is under half a block: unaligned fallback, round(18.75)
        (1000, 200, 1.0, 128, 128),  # budget 166.7 = 1.30 blocks → 1 block
        (4096, 4096, 0.02, 128, 41),  # budget 40.96 = 0.32 blocks → 0: unaligned fallback, round(40.96)
    ],
)
def test_block_aligned_rank_values(k, n, keep, block, expected):
    assert block_aligned_rank(k, n, keep, block) == expected


def test_factors_never_outgrow_the_dense_layer():
    for k, n in [(128, 384), (100, 200), (512, 512), (130, 7), (2048, 8192), (896, 4864), (64, 200)]:
        for keep in (0.3, 0.5, 0.8, 0.9, 0.99, 1.0):
            for block in (1, 16, 128):
                rank = block_aligned_rank(k, n, keep, block)
                assert rank * (k + n) <= k * n, (k, n, keep, block, rank)
    # Aligned 128 would be full rank, 133% of the dense parameters; below one block: round(76.8) = 77 (80%).
    assert block_aligned_rank(128, 384, 0.8) == 77


def test_block_aligned_rank_is_aligned_and_clamped():
    for k, n in [(512, 512), (1024, 4096), (4096, 1024), (896, 4864)]:
        for keep in (0.1, 0.3, 0.5, 0.8, 1.0):
            rank = block_aligned_rank(k, n, keep)
            budget = k * n * keep / (k + n)
            assert 1 <= rank <= min(k, n)
            assert rank % 128 == 0 if budget >= 64 else rank == round(budget)
    # Tiny layers: never 0, never above min(k, n).
    assert block_aligned_rank(3, 2, 0.01) == 1
    assert block_aligned_rank(1, 1000, 1.0) == 1
    assert block_aligned_rank(130, 7, 1.0) == 6  # budget 6.6 → 7 would outgrow the dense 130×7: break-even 6
    assert block_aligned_rank(300, 300, 1.0, block=16) == 144  # 150/16 = 9.375 → 9 blocks


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(k=0, n=4, keep=0.5), "k"),
        (dict(k=4, n=-1, keep=0.5), "n"),
        (dict(k=4, n=4, keep=0.0), "keep"),
        (dict(k=4, n=4, keep=1.5), "keep"),
        (dict(k=4, n=4, keep=float("nan")), "keep"),
        (dict(k=4, n=4, keep=0.5, block=0), "block"),
    ],
)
def test_block_aligned_rank_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        block_aligned_rank(**kwargs)


@pytest.mark.parametrize("shape, rank", [((100, 70), 1), ((100, 70), 23), ((70, 100), 70), ((3, 130, 200), 17)])
def test_truncated_svd_is_eckart_young_optimal(rng, shape, rank):
    w = rng.standard_normal(shape)
    u, v = truncated_svd(w, rank)
    assert u.shape == shape[:-2] + (shape[-2], rank) and v.shape == shape[:-2] + (rank, shape[-1])
    assert u.dtype == v.dtype == np.float64
    sigma = np.linalg.svd(w, compute_uv=False)
    error2 = np.sum((w - u @ v) ** 2, axis=(-2, -1))
    np.testing.assert_allclose(error2, np.sum(sigma[..., rank:] ** 2, axis=-1), rtol=1e-9, atol=1e-9)
    # u = U·√Σ and v = √Σ·Vᵀ share the scale: the column norms of u equal the row norms of v (= √σ).
    np.testing.assert_allclose(np.linalg.norm(u, axis=-2), np.sqrt(sigma[..., :rank]), rtol=1e-9)
    np.testing.assert_allclose(np.linalg.norm(v, axis=-1), np.sqrt(sigma[..., :rank]), rtol=1e-9)


def test_truncated_svd_float32_and_bfloat16(rng):
    w64 = rng.standard_normal((130, 90))
    sigma = np.linalg.svd(w64, compute_uv=False)
    u, v = truncated_svd(w64.astype(np.float32), 40)
    assert u.dtype == np.float32
    error = np.linalg.norm(w64 - u.astype(np.float64) @ v.astype(np.float64))
    np.testing.assert_allclose(error, np.sqrt(np.sum(sigma[40:] ** 2)), rtol=1e-4)
    u16, v16 = truncated_svd(w64.astype(ml_dtypes.bfloat16), 40)
    assert u16.dtype == ml_dtypes.bfloat16
    error16 = np.linalg.norm(w64 - u16.astype(np.float64) @ v16.astype(np.float64))
    np.testing.assert_allclose(error16, np.sqrt(np.sum(sigma[40:] ** 2)), rtol=0.02)


def test_truncated_svd_signs_are_canonical_and_deterministic(rng):
    w = rng.standard_normal((60, 50))
    u, v = truncated_svd(w, 10)
    pivots = u[np.argmax(np.abs(u), axis=0), np.arange(10)]
    assert np.all(pivots > 0)
    u_again, v_again = truncated_svd(w.copy(), 10)
    assert np.array_equal(u, u_again) and np.array_equal(v, v_again)


@pytest.mark.parametrize("rank", [0, 51, -1, 2.5, True])
def test_truncated_svd_bad_rank(rng, rank):
    with pytest.raises(ValueError, match="rank"):
        truncated_svd(rng.standard_normal((60, 50)), rank)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_truncated_svd_rejects_non_finite(rng, bad):
    w = rng.standard_normal((20, 30))
    w[3, 4] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        truncated_svd(w, 5)


def test_truncated_svd_rejects_vectors_and_integers(rng):
    with pytest.raises(ValueError, match="at least 2-D"):
        truncated_svd(rng.standard_normal(10), 1)
    with pytest.raises(ValueError, match="floating"):
        truncated_svd(np.ones((4, 4), np.int32), 1)


@pytest.mark.parametrize("k, n, rank", [(64, 48, 8), (100, 130, 30)])
def test_whitened_beats_plain_svd_on_held_out_activations(rng, k, n, rank):
    calibration, mixing = correlated_activations(rng, 4 * k, k)
    held_out, _ = correlated_activations(rng, 2000, k, mixing=mixing)
    w = rng.standard_normal((k, n))
    u, v = truncated_svd(w, rank)
    wu, wv = whitened_svd(w, calibration, rank)
    plain_error = np.linalg.norm(held_out @ w - held_out @ u @ v)
    whitened_error = np.linalg.norm(held_out @ w - held_out @ wu @ wv)
    assert whitened_error < 0.7 * plain_error


def test_whitened_is_optimal_on_the_calibration_set(rng):
    k, n, rank = 40, 30, 6
    x, _ = correlated_activations(rng, 200, k)
    w = rng.standard_normal((k, n))
    u, v = whitened_svd(w, x, rank)
    # The best rank-r approximation of X·W is the truncated SVD of X·W; X·u·v must reach it.
    sigma = np.linalg.svd(x @ w, compute_uv=False)
    error2 = np.sum((x @ w - x @ u @ v) ** 2)
    np.testing.assert_allclose(error2, np.sum(sigma[rank:] ** 2), rtol=1e-6)


def test_whitened_full_rank_reproduces_w(rng):
    x, _ = correlated_activations(rng, 300, 50, decay=1.0)
    w = rng.standard_normal((50, 40))
    u, v = whitened_svd(w, x, 40)
    np.testing.assert_allclose(u @ v, w, rtol=1e-7, atol=1e-7)


def test_whitened_batched_over_stacked_layers(rng):
    x, _ = correlated_activations(rng, 150, 30, decay=1.0)
    w = rng.standard_normal((2, 30, 20))
    u, v = whitened_svd(w, x, 5)
    assert u.shape == (2, 30, 5) and v.shape == (2, 5, 20)
    for layer in range(2):
        u_layer, v_layer = whitened_svd(w[layer], x, 5)
        np.testing.assert_allclose(u[layer], u_layer, rtol=1e-10, atol=1e-12)
    per_layer_x = np.stack([x, 2 * x[::-1]])
    u2, _ = whitened_svd(w, per_layer_x, 5)
    np.testing.assert_allclose(u2[1], whitened_svd(w[1], 2 * x[::-1], 5)[0], rtol=1e-10, atol=1e-12)


def test_whitened_damps_and_reports_rank_deficient_gram(rng):
    w = rng.standard_normal((64, 32))
    few_tokens = rng.standard_normal((10, 64))  # XᵀX has rank 10 < 64
    with pytest.warns(WhiteningDampedWarning, match="not positive definite"):
        factors = whitened_svd_with_info(w, few_tokens, 8)
    assert factors.damping_added > 0
    assert np.all(np.isfinite(factors.u)) and np.all(np.isfinite(factors.v))
    # The damping is tiny, so on the calibration tokens the error is still the rank-8 optimum for X·W.
    error2 = np.sum((few_tokens @ w - few_tokens @ factors.u @ factors.v) ** 2)
    sigma = np.linalg.svd(few_tokens @ w, compute_uv=False)
    np.testing.assert_allclose(error2, np.sum(sigma[8:] ** 2), rtol=1e-3)
    full = whitened_svd_with_info(w, rng.standard_normal((500, 64)), 8)
    assert full.damping_added == 0.0


@pytest.mark.parametrize(
    "activations, match",
    [
        (np.ones((10, 7)), "activations must have shape"),
        (np.ones(20), "activations must have shape"),
        (np.full((30, 20), np.nan), "NaN or Inf"),
        (np.zeros((30, 20)), "all zero"),
    ],
)
def test_whitened_bad_activations(rng, activations, match):
    with pytest.raises(ValueError, match=match):
        whitened_svd(rng.standard_normal((20, 10)), activations, 3)


def test_whitened_bad_rank_and_damping(rng):
    w, x = rng.standard_normal((20, 10)), rng.standard_normal((50, 20))
    with pytest.raises(ValueError, match="rank"):
        whitened_svd(w, x, 11)
    with pytest.raises(ValueError, match="damping"):
        whitened_svd(w, x, 3, damping=0.0)
    with pytest.raises(ValueError, match="stacked dims"):
        whitened_svd(rng.standard_normal((2, 20, 10)), rng.standard_normal((3, 50, 20)), 3)
