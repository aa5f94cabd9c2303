"""fp8 e4m3 factors with fp32 scales in the fused kernels on the emulator: float64 references of the dequantized
weights, HBM traffic (fp8 weight bytes half of bf16's), the hardware's dtype rules, bad input."""

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import reference
from nki_kernels.binding import nisa, nki, nl
from nki_kernels.emulator import NkiHardwareError, profile
from nki_kernels.svd_matmul import svd_matmul_decode_kernel, svd_matmul_kernel, svd_matmul_t_out_kernel
from nki_kernels.svd_mlp import svd_mlp_down_kernel, svd_mlp_gate_up_kernel

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3)  # Trainium's e4m3: ±240
TOLERANCE = 1e-2  # bf16 rounding of the rank-r intermediate and of the output, as for bf16 weights

# name → (kernel, takes xᵀ, returns yᵀ)
VARIANTS = {
    "normal": (svd_matmul_kernel, False, False),
    "t_out": (svd_matmul_t_out_kernel, False, True),
    "t_in": (svd_mlp_down_kernel, True, False),
    "decode": (svd_matmul_decode_kernel, False, False),
}

CASES = [  # (T, K, r, N)
    (1, 100, 130, 1000),
    (7, 200, 1, 1000),
    (130, 200, 130, 1000),
    (130, 100, 1, 1000),
]


def quantize(w):
    """Per-column fp8 values (Trainium e4m3, the largest magnitude of each column at ±240) and fp32 scales."""
    scale = (np.abs(w).max(axis=0) / 240.0).astype(np.float32)
    scale[scale == 0] = 1.0
    values = np.clip(w / scale, -240, 240).astype(FP8)
    return values, scale


def fp8_operands(rng, t, k, r, n, dtype=BF16):
    """x, (u values, u scales), (v values, v scales); column magnitudes of u span six orders (undone in v's
    rows, so y stays O(1)), so the scales do too."""
    x = rng.standard_normal((t, k)).astype(dtype)
    spread = np.logspace(-3, 3, r)
    u = rng.standard_normal((k, r)) * spread / np.sqrt(k)
    v = rng.standard_normal((r, n)) / spread[:, None] / np.sqrt(r) * np.logspace(-2, 2, n)
    return x, quantize(u), quantize(v)


def dequantized(values, scale):
    return values.astype(np.float64) * scale.astype(np.float64)


def relative_error(got, want):
    return np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()


def run_variant(name, x, u, v, **blocks):
    kernel, takes_xT, returns_yT = VARIANTS[name]
    out = kernel(np.ascontiguousarray(x.T) if takes_xT else x, u[0], v[0], u[1], v[1], **blocks)
    return out.T if returns_yT else out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("t,k,r,n", CASES)
def test_matches_float64_reference_of_dequantized_weights(rng, variant, t, k, r, n):
    x, u, v = fp8_operands(rng, t, k, r, n)
    y = run_variant(variant, x, u, v)
    assert y.shape == (t, n) and y.dtype == BF16
    want = reference.svd_matmul_f64(x, dequantized(*u), dequantized(*v))
    assert relative_error(y, want) <= TOLERANCE


def test_values_at_240_and_float16_activations(rng):
    # Every weight at ±240 or a large power of two below it: exact in fp8, sums far beyond fp8's range.
    t, k, r, n = 7, 200, 130, 1000
    x = rng.standard_normal((t, k)).astype(np.float16)
    u = (rng.choice([-240.0, 240.0, -128.0, 192.0], (k, r))).astype(FP8), np.full(r, 1e-4, np.float32)
    v = (rng.choice([-240.0, 240.0, 0.0], (r, n))).astype(FP8), np.logspace(-5, -1, n).astype(np.float32)
    y = svd_matmul_kernel(x, *(u[0], v[0], u[1], v[1]))
    assert y.dtype == np.float16
    want = reference.svd_matmul_f64(x, dequantized(*u), dequantized(*v))
    assert np.abs(want).max() > 1
    assert relative_error(y, want) <= 2e-3


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_small_blocks_cover_every_tile_edge(rng, variant):
    # Several token, K, rank and N blocks, each ending ragged: the scaled eviction after a float32 accumulator.
    x, u, v = fp8_operands(rng, 300, 700, 300, 700)
    y = run_variant(variant, x, u, v, block_t=128, block_k=256, block_n=512)
    want = reference.svd_matmul_f64(x, dequantized(*u), dequantized(*v))
    assert relative_error(y, want) <= TOLERANCE


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("t", [1, 7, 130])
def test_hbm_weight_bytes_are_half_of_bf16(rng, variant, t):
    k, r, n = 200, 130, 1000
    x, u, v = fp8_operands(rng, t, k, r, n)
    with profile() as prof:
        run_variant(variant, x, u, v)
        run_variant(variant, x, (u[0].astype(BF16), None), (v[0].astype(BF16), None))
    fp8_run, bf16_run = prof.runs
    x_bytes, scale_bytes = t * k * BF16.itemsize, (r + n) * 4
    assert bf16_run.hbm_bytes_read == x_bytes + (k * r + r * n) * 2
    assert fp8_run.hbm_bytes_read == x_bytes + (k * r + r * n) * 1 + scale_bytes
    assert fp8_run.hbm_bytes_read - x_bytes - scale_bytes == (bf16_run.hbm_bytes_read - x_bytes) // 2
    assert fp8_run.hbm_bytes_written == bf16_run.hbm_bytes_written == t * n * BF16.itemsize


def silu(a):
    return a / (1 + np.exp(-a))


@pytest.mark.parametrize("t", [1, 7, 130])
def test_gate_up_and_down_kernels_match_float64(rng, t):
    h, i, rg, ru, rd = 200, 1000, 130, 1, 130
    x = rng.standard_normal((t, h)).astype(BF16)
    gate_u, up_u = quantize(rng.standard_normal((h, rg)) / np.sqrt(h)), quantize(rng.standard_normal((h, ru)))
    gate_v = quantize(rng.standard_normal((rg, i)) / np.sqrt(rg) * np.logspace(-2, 1, i))
    up_v = quantize(rng.standard_normal((ru, i)) * np.logspace(1, -2, i) / np.sqrt(h))
    down_u, down_v = quantize(rng.standard_normal((i, rd)) / np.sqrt(i)), quantize(rng.standard_normal((rd, h)))
    factors = (gate_u, gate_v, up_u, up_v)
    hT = svd_mlp_gate_up_kernel(x, *(f[0] for f in factors), *(f[1] for f in factors), activation="silu")
    x64 = x.astype(np.float64)
    g, u = x64 @ dequantized(*gate_u) @ dequantized(*gate_v), x64 @ dequantized(*up_u) @ dequantized(*up_v)
    want_h = silu(g) * u
    assert hT.shape == (i, t) and hT.dtype == BF16
    assert relative_error(hT.T, want_h) <= TOLERANCE
    y = svd_mlp_down_kernel(hT, down_u[0], down_v[0], down_u[1], down_v[1])
    want = want_h @ dequantized(*down_u) @ dequantized(*down_v)
    assert relative_error(y, want) <= TOLERANCE


def test_bad_operands_raise(rng):
    x, u, v = fp8_operands(rng, 7, 100, 13, 100)
    with pytest.raises(TypeError, match="x has dtype float32; fp8 factors need bfloat16 or float16 activations"):
        svd_matmul_kernel(x.astype(np.float32), u[0], v[0], u[1], v[1])
    with pytest.raises(TypeError, match="v_scale is missing"):
        svd_matmul_kernel(x, u[0], v[0], u[1])
    with pytest.raises(TypeError, match="u has dtype bfloat16 with scales given; expected float8_e4m3"):
        svd_matmul_kernel(x, u[0].astype(BF16), v[0], u[1], v[1])
    with pytest.raises(TypeError, match=r"v_scale is bfloat16 \(100,\); expected float32 of shape \(100,\)"):
        svd_matmul_kernel(x, u[0], v[0], u[1], v[1].astype(BF16))
    with pytest.raises(TypeError, match=r"u_scale is float32 \(12,\); expected float32 of shape \(13,\)"):
        svd_matmul_kernel(x, u[0], v[0], u[1][:12], v[1])
    with pytest.raises(TypeError, match="gate and up factors must both be fp8 with scales, or neither"):
        svd_mlp_gate_up_kernel(x, u[0], v[0], u[0].astype(BF16), v[0].astype(BF16), u[1], v[1])


# --- the hardware's dtype rules the kernels live by ----------------------------------------------------------


@nki.jit
def _matmul_with(lhs_t, rhs):
    """out = lhs_t.T @ rhs through one nc_matmul; operands loaded in their own dtypes."""
    out = nl.ndarray((lhs_t.shape[1], rhs.shape[1]), nl.float32, buffer=nl.shared_hbm)
    a = nl.ndarray(lhs_t.shape, lhs_t.dtype, buffer=nl.sbuf)
    b = nl.ndarray(rhs.shape, rhs.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=lhs_t)
    nisa.dma_copy(dst=b, src=rhs)
    acc = nl.ndarray(out.shape, nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=a, moving=b)
    result = nl.ndarray(out.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=result, src=acc)
    nisa.dma_copy(dst=out, src=result)
    return out


def test_fp8_beside_bf16_is_one_matmul_int8_and_ocp_fp8_are_not_matmul_dtypes(rng):
    weights = rng.choice([-240.0, -1.5, 0.0, 0.25, 240.0], (64, 32))
    x = rng.standard_normal((64, 8)).astype(BF16)
    got = _matmul_with(weights.astype(FP8), x)  # fp8 stationary, bf16 moving: legal, fp32 PSUM
    np.testing.assert_allclose(got, weights.T @ x.astype(np.float64), rtol=1e-5, atol=1e-3)
    for dtype in (np.int8, ml_dtypes.float8_e4m3fn):
        with pytest.raises(NkiHardwareError, match=f"stationary dtype {np.dtype(dtype).name} is not a TensorE"):
            _matmul_with(weights.clip(-100, 100).astype(dtype), x)
    with pytest.raises(NkiHardwareError, match="if one operand is float32 the other must be too"):
        _matmul_with(weights.astype(FP8), x.astype(np.float32))


@nki.jit
def _dma_transpose_fp8(w):
    out = nl.ndarray((w.shape[1], w.shape[0]), w.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray((w.shape[1], w.shape[0]), w.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=tile, src=w, dge_mode=nisa.dge_mode.hwdge)
    nisa.dma_copy(dst=out, src=tile)
    return out


def test_dma_transpose_needs_two_byte_dtypes(rng):
    # Why fp8 weights are stored in the layout the kernels read (no transposing DMA on the way in).
    w = rng.standard_normal((16, 64)).astype(FP8)
    with pytest.raises(NkiHardwareError, match="2-byte dtype, got float8_e4m3"):
        _dma_transpose_fp8(w)


def test_gate_up_small_blocks_cover_every_tile_edge(rng):
    # Several token, K and feature blocks, each ending ragged: scaled stage-1 evictions after the float32
    # accumulator, slot scales of ragged feature blocks.
    t, h, i, r = 300, 300, 700, 130
    x = rng.standard_normal((t, h)).astype(BF16)
    gate_u, up_u = (quantize(rng.standard_normal((h, r)) * np.logspace(-3, 3, r) / np.sqrt(h)) for _ in range(2))
    gate_v, up_v = (
        quantize(rng.standard_normal((r, i)) / np.logspace(-3, 3, r)[:, None] / np.sqrt(r)) for _ in range(2)
    )
    factors = (gate_u, gate_v, up_u, up_v)
    hT = svd_mlp_gate_up_kernel(
        x,
        *(f[0] for f in factors),
        *(f[1] for f in factors),
        activation="gelu_tanh",
        block_t=128,
        block_k=128,
        block_n=256,
    )
    x64 = x.astype(np.float64)
    g, u = x64 @ dequantized(*gate_u) @ dequantized(*gate_v), x64 @ dequantized(*up_u) @ dequantized(*up_v)
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
    assert relative_error(hT.T, gelu * u) <= TOLERANCE


def test_dispatch_plans_fp8_kernels(rng):
    from nki_kernels import dispatch, footprint

    x, u, v = fp8_operands(rng, 7, 200, 130, 1000)
    kernel, blocks = dispatch.svd_matmul_plan(7, 200, 130, 1000, BF16, "trn2", weight_dtype=FP8)
    y = kernel(x, u[0], v[0], u[1], v[1], **blocks)
    assert relative_error(y, reference.svd_matmul_f64(x, dequantized(*u), dequantized(*v))) <= TOLERANCE
    with pytest.raises(TypeError, match="dtype: got float32 with fp8 weights; TensorE takes fp8 beside bfloat16"):
        dispatch.svd_matmul_plan(7, 200, 130, 1000, np.float32, "trn2", weight_dtype=FP8)
    with pytest.raises(TypeError, match="weight_dtype: got int8, expected None or float8_e4m3"):
        dispatch.svd_matmul_plan(7, 200, 130, 1000, BF16, "trn2", weight_dtype=np.int8)
    # fp8 factors take half the SBUF of bf16 ones, plus their float32 scales.
    shape, blocks = (1, 2048, 1024, 8192), dict(block_t=512, block_k=1024, block_n=2048)
    bf16 = footprint.sbuf_bytes("svd_matmul", "decode", shape, 2, blocks)
    fp8 = footprint.sbuf_bytes("svd_matmul", "decode", shape, 2, blocks, weight_itemsize=1)
    assert fp8 < bf16
