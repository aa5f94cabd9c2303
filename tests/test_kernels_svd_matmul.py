"""Fused X·U·V kernels on the emulator: float64 references, HBM traffic, bad input."""

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import reference
from nki_kernels.binding import nisa, nki, nl
from nki_kernels.emulator import profile, trace
from nki_kernels.svd_matmul import svd_matmul_decode_kernel, svd_matmul_kernel, svd_matmul_t_out_kernel
from nki_kernels.svd_mlp import svd_mlp_down_kernel

BF16 = np.dtype(ml_dtypes.bfloat16)
TOLERANCE = {np.dtype(np.float32): 1e-5, BF16: 1e-2}

# name → (kernel, takes xᵀ, returns yᵀ)
VARIANTS = {
    "normal": (svd_matmul_kernel, False, False),
    "t_out": (svd_matmul_t_out_kernel, False, True),
    "t_in": (svd_mlp_down_kernel, True, False),  # the transposed-input fused matmul
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
    assert relative_error(y, reference.svd_matmul_f64(x, u, v)) <= TOLERANCE[np.dtype(dtype)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_small_blocks_cover_every_tile_edge(rng, variant):
    # Several token, rank and N blocks, each ending ragged.
    x, u, v = make_operands(rng, 300, 200, 300, 700, np.float32)
    y = run_variant(variant, x, u, v, block_t=128, block_k=256, block_n=512)
    assert relative_error(y, reference.svd_matmul_f64(x, u, v)) <= 1e-5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_last_token_block_of_one_token(rng, variant):
    # T = block_t + 1: the last token block holds one token of many, so its Yᵀ column is strided in HBM and must
    # go out as Yᵀ tiles; only a call with T = 1 takes the single-token row path (a DMA from one partition).
    t, k, r, n = 513, 200, 130, 1000
    x, u, v = make_operands(rng, t, k, r, n, np.float32)
    y, run = traced_run(run_variant, variant, x, u, v, block_t=512)
    assert relative_error(y, reference.svd_matmul_f64(x, u, v)) <= TOLERANCE[np.dtype(np.float32)]
    if VARIANTS[variant][2]:
        hbm_writes = [record for record in run.records if record.dma and record.dma.dst_buffer == "hbm"]
        assert all(record.partitions > 1 for record in hbm_writes)


def test_layout_references_agree_with_kernels(rng):
    x, u, v = make_operands(rng, 7, 100, 130, 1000, np.float32)
    np.testing.assert_allclose(
        svd_matmul_t_out_kernel(x, u, v), reference.svd_matmul_t_out_f64(x, u, v), rtol=1e-5, atol=1e-5
    )
    xT = np.ascontiguousarray(x.T)
    np.testing.assert_allclose(
        svd_mlp_down_kernel(xT, u, v), reference.svd_mlp_down_f64(xT, u, v), rtol=1e-5, atol=1e-5
    )


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


def traced_run(kernel, *args, **kwargs):
    """The kernel's output and its finished trace.KernelRun (every instruction's accesses)."""
    runs = []
    trace.add_listener(runs.append)
    try:
        out = kernel(*args, **kwargs)
    finally:
        trace.remove_listener(runs.append)
    (run,) = runs
    return out, run


def hbm_traffic_problems(run, t, k, r, n, itemsize):
    """Why the run's HBM traffic is not exactly: x, u, v each read and never written, one output written and
    never read, bytes read = x + u + v once, bytes written = y once ([] when it is)."""
    read, written = set(), set()
    bytes_read = bytes_written = 0
    for record in run.records:
        read |= {access.storage for access in record.reads if access.buffer == "hbm"}
        written |= {access.storage for access in record.writes if access.buffer == "hbm"}
        if record.dma is not None:
            bytes_read += record.dma.bytes_read if record.dma.src_buffer == "hbm" else 0
            bytes_written += record.dma.nbytes if record.dma.dst_buffer == "hbm" else 0
    problems = []
    if read & written:
        problems.append(f"HBM storages both written and read (a scratch round trip): {sorted(read & written)}")
    if len(read) != 3 or len(written) != 1:
        problems.append(f"{len(read)} HBM storages read and {len(written)} written, expected x, u, v and y")
    if bytes_read != (t * k + k * r + r * n) * itemsize:
        problems.append(f"{bytes_read} HBM bytes read, expected x, u and v once")
    if bytes_written != t * n * itemsize:
        problems.append(f"{bytes_written} HBM bytes written, expected y once")
    return problems


@nki.jit
def spilling_svd_matmul_kernel(x, u, v):
    """y = x·u·v for single tiles (T, K, r ≤ 128, N ≤ 512) that sends (xu)ᵀ [r, T] through an HBM scratch
    tensor: the unfused pattern hbm_traffic_problems must catch."""
    t, k = x.shape
    r, n = v.shape
    x_rows = nl.ndarray((t, k), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_rows, src=x)
    xT_psum = nl.ndarray((k, t), dtype=x.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=xT_psum, data=x_rows)
    xT = nl.ndarray((k, t), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=xT, src=xT_psum)
    u_tile = nl.ndarray((k, r), dtype=u.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=u_tile, src=u)
    xuT_psum = nl.ndarray((r, t), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=xuT_psum, stationary=u_tile, moving=xT)
    xuT = nl.ndarray((r, t), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=xuT, src=xuT_psum)
    scratch = nl.ndarray((r, t), dtype=x.dtype, buffer=nl.hbm)
    nisa.dma_copy(dst=scratch, src=xuT)
    xuT_again = nl.ndarray((r, t), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xuT_again, src=scratch)
    v_tile = nl.ndarray((r, n), dtype=v.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=v_tile, src=v)
    y_psum = nl.ndarray((t, n), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=y_psum, stationary=xuT_again, moving=v_tile)
    y_tile = nl.ndarray((t, n), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=y_tile, src=y_psum)
    y = nl.ndarray((t, n), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=y, src=y_tile)
    return y


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rank_intermediate_never_reaches_hbm(rng, variant):
    t, k, r, n = 130, 200, 130, 1000
    x, u, v = make_operands(rng, t, k, r, n, BF16)
    kernel, takes_xT, _ = VARIANTS[variant]
    _, run = traced_run(kernel, np.ascontiguousarray(x.T) if takes_xT else x, u, v)
    assert hbm_traffic_problems(run, t, k, r, n, BF16.itemsize) == []


def test_hbm_traffic_check_catches_a_spilled_intermediate(rng):
    t, k, r, n = 7, 100, 30, 200
    x, u, v = make_operands(rng, t, k, r, n, np.float32)
    y, run = traced_run(spilling_svd_matmul_kernel, x, u, v)
    assert relative_error(y, reference.svd_matmul_f64(x, u, v)) <= TOLERANCE[np.dtype(np.float32)]
    problems = hbm_traffic_problems(run, t, k, r, n, 4)
    assert any("both written and read" in p for p in problems) and any("bytes read" in p for p in problems)


@pytest.mark.parametrize(
    "bad,message",
    [
        (lambda x, u, v: (x, u[:-1], v), "u has shape"),
        (lambda x, u, v: (x, u, v[:-1]), "v has shape"),
        (lambda x, u, v: (x[None], u, v), "x must be 2-D"),
        (lambda x, u, v: (x, u.astype(np.float32), v), "u has dtype float32 but x has bfloat16"),
    ],
)
def test_bad_operands_raise_value_or_type_error(rng, bad, message):
    x, u, v = make_operands(rng, 7, 100, 130, 1000, BF16)
    with pytest.raises((ValueError, TypeError), match=message):
        svd_matmul_kernel(*bad(x, u, v))


def test_integer_inputs_raise_type_error(rng):
    x, u, v = make_operands(rng, 7, 100, 130, 1000, np.float32)
    with pytest.raises(TypeError, match="x has dtype int32"):
        svd_matmul_kernel(x.astype(np.int32), u.astype(np.int32), v.astype(np.int32))


@pytest.mark.parametrize(
    "blocks,name", [({"block_t": 100}, "block_t"), ({"block_k": 0}, "block_k"), ({"block_n": 64}, "block_n")]
)
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
    assert relative_error(y, reference.svd_matmul_f64(x, u, v)) <= 1e-5
