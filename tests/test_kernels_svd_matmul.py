"""Fused X·U·V kernels on the emulator: float64 references, HBM traffic, bad input."""

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import reference
from nki_kernels.emulator import profile
from nki_kernels.svd_matmul import (svd_matmul_decode_kernel, svd_matmul_kernel, svd_matmul_t_in_kernel,
                                    svd_matmul_t_out_kernel)

BF16 = np.dtype(ml_dtypes.bfloat16)
TOLERANCE = {np.dtype(np.float32): 1e-5, BF16: 1e-2}

# name → (kernel, takes xᵀ, returns yᵀ)
VARIANTS = {
    "normal": (svd_matmul_kernel, False, False),
    "t_out": (svd_matmul_t_out_kernel, False, True),
    "t_in": (svd_matmul_t_in_kernel, True, False),
    "decode": (svd_matmul_decode_kernel, False, False),
}

# A representative spread rather than the full product: every T, K, r and both dtypes appear with each variant.
CASES = [
    (1, 100, 130, 1000, np.float32),
    (7, 200, 1, 1000, BF16),
    (130, 200, 130, 1000, np.float32),
    (600, 100, 130, 1000, BF16),
    (600, 200, 1, 1000, np.float32),
    (130, 100, 1, 1000, BF16),
    (7, 512, 130, 1000, np.float32),  # K of whole tiles: the permuted K layout in one block
]


def make_operands(rng, t, k, r, n, dtype):
    # Scaled so y has entries of order one whatever K and r are.
    x = rng.standard_normal((t, k))
    u = rng.standard_normal((k, r)) / np.sqrt(k)
    v = rng.standard_normal((r, n)) / np.sqrt(r)
    return tuple(a.astype(dtype) for a in (x, u, v))


def relative_error(got, want):
    got = np.asarray(got).astype(np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


def run_variant(name, x, u, v, **blocks):
    kernel, takes_xT, returns_yT = VARIANTS[name]
    out = kernel(np.ascontiguousarray(x.T) if takes_xT else x, u, v, **blocks)
    return out.T if returns_yT else out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("t,k,r,n,dtype", CASES)
def test_matches_float64_reference(rng, variant, t, k, r, n, dtype):
    x, u, v = make_operands(rng, t, k, r, n, dtype)
    y = run_variant(variant, x, u, v)
    assert y.shape == (t, n)
    assert y.dtype == np.dtype(dtype)
    assert relative_error(y, reference.svd_matmul_ref(x, u, v)) <= TOLERANCE[np.dtype(dtype)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_small_blocks_cover_every_tile_edge(rng, variant):
    # Several token, rank and N blocks, each ending ragged.
    x, u, v = make_operands(rng, 300, 200, 300, 700, np.float32)
    y = run_variant(variant, x, u, v, block_t=128, block_k=256, block_n=512)
    assert relative_error(y, reference.svd_matmul_ref(x, u, v)) <= 1e-5


def test_layout_references_agree_with_kernels(rng):
    x, u, v = make_operands(rng, 7, 100, 130, 1000, np.float32)
    np.testing.assert_allclose(svd_matmul_t_out_kernel(x, u, v), reference.svd_matmul_t_out_ref(x, u, v),
                               rtol=1e-5, atol=1e-5)
    xT = np.ascontiguousarray(x.T)
    np.testing.assert_allclose(svd_matmul_t_in_kernel(xT, u, v), reference.svd_matmul_t_in_ref(xT, u, v),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("t", [1, 7, 130, 512])
def test_hbm_traffic_is_minimum_for_one_token_block(rng, variant, t):
    k, r, n = 200, 130, 1000
    x, u, v = make_operands(rng, t, k, r, n, BF16)
    with profile() as prof:
        run_variant(variant, x, u, v, block_t=512)
    (run,) = prof.runs
    itemsize = BF16.itemsize
    assert run.hbm_bytes_read == (t * k + k * r + r * n) * itemsize
    assert run.hbm_bytes_written == t * n * itemsize


def test_hbm_traffic_rereads_weights_once_per_token_block(rng):
    t, k, r, n = 600, 200, 130, 1000
    x, u, v = make_operands(rng, t, k, r, n, BF16)
    with profile() as prof:
        svd_matmul_kernel(x, u, v, block_t=256)
    (run,) = prof.runs
    blocks = 3  # ceil(600 / 256)
    assert run.hbm_bytes_read == (t * k + blocks * (k * r + r * n)) * BF16.itemsize
    assert run.hbm_bytes_written == t * n * BF16.itemsize


def test_rank_intermediate_never_reaches_hbm(rng):
    # Only DMAs from x, u, v and to y: every HBM byte moved is accounted for by the minimum.
    x, u, v = make_operands(rng, 130, 200, 130, 1000, BF16)
    with profile() as prof:
        svd_matmul_kernel(x, u, v)
    (run,) = prof.runs
    assert sum(run.dma_sizes) == run.hbm_bytes_read + run.hbm_bytes_written


@pytest.mark.parametrize("bad,message", [
    (lambda x, u, v: (x, u[:-1], v), "u has shape"),
    (lambda x, u, v: (x, u, v[:-1]), "v has shape"),
    (lambda x, u, v: (x[None], u, v), "x must be 2-D"),
    (lambda x, u, v: (x, u.astype(np.float32), v), "u has dtype float32 but x has bfloat16"),
])
def test_bad_operands_raise_value_or_type_error(rng, bad, message):
    x, u, v = make_operands(rng, 7, 100, 130, 1000, BF16)
    with pytest.raises((ValueError, TypeError), match=message):
        svd_matmul_kernel(*bad(x, u, v))


def test_integer_inputs_raise_type_error(rng):
    x, u, v = make_operands(rng, 7, 100, 130, 1000, np.float32)
    with pytest.raises(TypeError, match="x has dtype int32"):
        svd_matmul_kernel(x.astype(np.int32), u.astype(np.int32), v.astype(np.int32))


@pytest.mark.parametrize("blocks,name", [({"block_t": 100}, "block_t"), ({"block_k": 0}, "block_k"),
                                         ({"block_n": 64}, "block_n")])
def test_blocks_must_be_multiples_of_128(rng, blocks, name):
    x, u, v = make_operands(rng, 7, 100, 130, 1000, np.float32)
    with pytest.raises(ValueError, match=name):
        svd_matmul_kernel(x, u, v, **blocks)


@pytest.mark.parametrize("variant", ["normal", "t_in"])
@pytest.mark.parametrize("t,block_t", [(130, 512), (600, 1024)])
def test_x_streams_in_several_k_segments(rng, variant, t, block_t):
    # K beyond one staging segment, ending ragged; with block_t=1024 one token block of two moving chunks.
    x, u, v = make_operands(rng, t, 2200, 300, 300, np.float32)
    y = run_variant(variant, x, u, v, block_t=block_t, block_k=256)
    assert relative_error(y, reference.svd_matmul_ref(x, u, v)) <= 1e-5
