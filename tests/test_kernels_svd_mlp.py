"""Fused low-rank MLP kernels on the emulator: float64 references, HBM traffic, bad input."""

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import reference
from nki_kernels.emulator import profile, trace
from nki_kernels.svd_mlp import svd_mlp_down_kernel, svd_mlp_gate_up_kernel

BF16 = np.dtype(ml_dtypes.bfloat16)
TOLERANCE = {np.dtype(np.float32): 1e-5, BF16: 1e-2}

# (T, H, I, rank of gate, up, down, dtype): every T, both hidden sizes, ranks 1 and 130, both dtypes.
CASES = [
    (1, 100, 1000, 130, 1, 130, np.float32),
    (7, 200, 1000, 1, 130, 130, BF16),
    (130, 200, 1000, 130, 130, 1, np.float32),
    (600, 100, 1000, 130, 130, 130, BF16),
]


def make_mlp(rng, t, h, i, rg, ru, rd, dtype):
    def factor(rows, cols):
        return rng.standard_normal((rows, cols)) / np.sqrt(rows)

    arrays = (
        rng.standard_normal((t, h)),
        factor(h, rg),
        factor(rg, i),
        factor(h, ru),
        factor(ru, i),
        factor(i, rd),
        factor(rd, h),
    )
    return tuple(a.astype(dtype) for a in arrays)


def relative_error(got, want):
    got = np.asarray(got).astype(np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("t,h,i,rg,ru,rd,dtype", CASES)
def test_two_kernel_mlp_matches_float64_reference(rng, activation, t, h, i, rg, ru, rd, dtype):
    x, gu, gv, uu, uv, du, dv = make_mlp(rng, t, h, i, rg, ru, rd, dtype)
    hT = svd_mlp_gate_up_kernel(x, gu, gv, uu, uv, activation=activation)
    assert hT.shape == (i, t) and hT.dtype == np.dtype(dtype)
    want_hT = reference.svd_mlp_gate_up_f64(x, gu, gv, uu, uv, activation)
    assert relative_error(hT, want_hT) <= TOLERANCE[np.dtype(dtype)]
    y = svd_mlp_down_kernel(hT, du, dv)
    assert y.shape == (t, h) and y.dtype == np.dtype(dtype)
    # The down kernel against its own reference on the kernel's hᵀ (isolates it from the gate/up rounding) ...
    assert relative_error(y, reference.svd_mlp_down_f64(hT, du, dv)) <= TOLERANCE[np.dtype(dtype)]
    # ... and the whole MLP end to end.
    want_y = reference.svd_mlp_f64(x, gu, gv, uu, uv, du, dv, activation)
    assert relative_error(y, want_y) <= TOLERANCE[np.dtype(dtype)]


def test_activations_differ(rng):
    # Guards against an activation argument that is silently ignored.
    x, gu, gv, uu, uv, _, _ = make_mlp(rng, 7, 100, 1000, 130, 130, 130, np.float32)
    silu = svd_mlp_gate_up_kernel(x, gu, gv, uu, uv, activation="silu")
    gelu = svd_mlp_gate_up_kernel(x, gu, gv, uu, uv, activation="gelu_tanh")
    assert relative_error(gelu, reference.svd_mlp_gate_up_f64(x, gu, gv, uu, uv, "gelu_tanh")) <= 1e-5
    assert np.abs(silu - gelu).max() > 1e-2


def test_last_token_block_of_one_token(rng):
    # T = block_t + 1: the last token block holds one token of many, so its hᵀ column is strided in HBM and goes
    # out with the block's other columns; only a call with T = 1 turns it into one row (a DMA from one partition).
    t, h, i = 513, 200, 1000
    x, gu, gv, uu, uv, du, dv = make_mlp(rng, t, h, i, 130, 130, 130, np.float32)
    runs = []
    trace.add_listener(runs.append)
    try:
        hT = svd_mlp_gate_up_kernel(x, gu, gv, uu, uv, block_t=512)
    finally:
        trace.remove_listener(runs.append)
    assert relative_error(hT, reference.svd_mlp_gate_up_f64(x, gu, gv, uu, uv)) <= 1e-5
    (run,) = runs
    hbm_writes = [record for record in run.records if record.dma and record.dma.dst_buffer == "hbm"]
    assert all(record.partitions > 1 for record in hbm_writes)
    y = svd_mlp_down_kernel(hT, du, dv, block_t=512)
    assert relative_error(y, reference.svd_mlp_f64(x, gu, gv, uu, uv, du, dv)) <= 1e-5


def test_small_blocks_cover_every_tile_edge(rng):
    x, gu, gv, uu, uv, du, dv = make_mlp(rng, 300, 200, 700, 300, 130, 300, np.float32)
    hT = svd_mlp_gate_up_kernel(x, gu, gv, uu, uv, block_t=128, block_k=256, block_n=256)
    assert relative_error(hT, reference.svd_mlp_gate_up_f64(x, gu, gv, uu, uv)) <= 1e-5
    y = svd_mlp_down_kernel(hT, du, dv, block_t=128, block_k=256, block_n=512)
    assert relative_error(y, reference.svd_mlp_down_f64(hT, du, dv)) <= 1e-5


@pytest.mark.parametrize("t", [1, 7])
def test_whole_blocks_of_features_and_hidden_rows(rng, t):
    # Feature and K blocks of whole 128-row tiles: the permuted layouts (hᵀ written, and read back, one
    # contiguous run per partition) rather than the ragged fallback.
    x, gu, gv, uu, uv, du, dv = make_mlp(rng, t, 256, 512, 130, 130, 130, np.float32)
    hT = svd_mlp_gate_up_kernel(x, gu, gv, uu, uv, block_k=256, block_n=256)
    assert relative_error(hT, reference.svd_mlp_gate_up_f64(x, gu, gv, uu, uv)) <= 1e-5
    y = svd_mlp_down_kernel(hT, du, dv, block_k=256)
    assert relative_error(y, reference.svd_mlp_down_f64(hT, du, dv)) <= 1e-5


@pytest.mark.parametrize("t", [1, 130, 512])
def test_hbm_traffic_is_minimum_for_one_token_block(rng, t):
    h, i, r = 200, 1000, 130
    x, gu, gv, uu, uv, du, dv = make_mlp(rng, t, h, i, r, r, r, BF16)
    with profile() as prof:
        hT = svd_mlp_gate_up_kernel(x, gu, gv, uu, uv)
        svd_mlp_down_kernel(hT, du, dv)
    gate_up, down = prof.runs
    size = BF16.itemsize
    assert gate_up.hbm_bytes_read == (t * h + 2 * (h * r + r * i)) * size
    assert gate_up.hbm_bytes_written == i * t * size
    assert down.hbm_bytes_read == (i * t + i * r + r * h) * size
    assert down.hbm_bytes_written == t * h * size


def test_unknown_activation_raises(rng):
    x, gu, gv, uu, uv, _, _ = make_mlp(rng, 7, 100, 1000, 130, 130, 130, np.float32)
    with pytest.raises(ValueError, match="activation: got 'relu'"):
        svd_mlp_gate_up_kernel(x, gu, gv, uu, uv, activation="relu")


def test_gate_and_up_must_share_intermediate_size(rng):
    x, gu, gv, uu, uv, _, _ = make_mlp(rng, 7, 100, 1000, 130, 130, 130, np.float32)
    with pytest.raises(ValueError, match="gate_v has 1000 columns but up_v has 999"):
        svd_mlp_gate_up_kernel(x, gu, gv, uu, uv[:, :-1])


def test_down_factor_rows_must_match_intermediate(rng):
    _, _, _, _, _, du, dv = make_mlp(rng, 7, 100, 1000, 130, 130, 130, np.float32)
    hT = rng.standard_normal((999, 7)).astype(np.float32)
    with pytest.raises(ValueError, match="u has shape"):
        svd_mlp_down_kernel(hT, du, dv)
