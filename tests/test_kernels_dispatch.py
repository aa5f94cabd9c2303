"""Dispatch plans, the tuned block table, the footprint filter and the tuner."""

import ml_dtypes
import numpy as np
import pytest
import tuning  # benchmarks/tuning.py (pytest.ini puts benchmarks/ on sys.path)
from harness import paper_shapes

from nki_kernels import (
    block_table,
    dispatch,
    footprint,
    hardware,
    ranks,
    reference,
    svd_matmul,
    svd_mlp,
)
from nki_kernels.emulator import count_only, use_target

BF16 = np.dtype(ml_dtypes.bfloat16)


def relative_error(got, want):
    return np.abs(np.asarray(got).astype(np.float64) - want).max() / np.abs(want).max()


def test_svd_matmul_plan_runs_and_matches_reference(rng):
    t, k, r, n = 7, 200, 130, 1000
    x = rng.standard_normal((t, k)).astype(np.float32)
    u = (rng.standard_normal((k, r)) / np.sqrt(k)).astype(np.float32)
    v = (rng.standard_normal((r, n)) / np.sqrt(r)).astype(np.float32)
    kernel, kwargs = dispatch.svd_matmul_plan(t, k, r, n, np.float32)
    y = kernel(x, u, v, **kwargs)
    assert relative_error(y, reference.svd_matmul_f64(x, u, v)) <= 1e-5


def test_svd_mlp_plan_is_two_kernels_matching_reference(rng):
    t, h, i, r = 7, 100, 1000, 130
    arrays = [rng.standard_normal((t, h))] + [
        rng.standard_normal(s) / np.sqrt(s[0]) for s in [(h, r), (r, i), (h, r), (r, i), (i, r), (r, h)]
    ]
    x, gu, gv, uu, uv, du, dv = (a.astype(BF16) for a in arrays)
    (gate_up, gate_up_kwargs), (down, down_kwargs) = dispatch.svd_mlp_plan(
        t, h, i, r, r, r, BF16, activation="gelu_tanh"
    )
    assert gate_up is svd_mlp.svd_mlp_gate_up_kernel and down is svd_mlp.svd_mlp_down_kernel
    y = down(gate_up(x, gu, gv, uu, uv, **gate_up_kwargs), du, dv, **down_kwargs)
    assert relative_error(y, reference.svd_mlp_f64(x, gu, gv, uu, uv, du, dv, "gelu_tanh")) <= 1e-2


def test_plans_are_cached_and_callers_cannot_corrupt_the_cache():
    first = dispatch.svd_matmul_plan(16, 2048, 1280, 8192, BF16)
    first[1]["block_t"] = -1
    hits = dispatch._svd_matmul_plan.cache_info().hits
    second = dispatch.svd_matmul_plan(16, 2048, 1280, 8192, "bfloat16")
    assert dispatch._svd_matmul_plan.cache_info().hits == hits + 1
    assert second[1]["block_t"] > 0


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: dispatch.svd_matmul_plan(0, 10, 10, 10, np.float32), ValueError, "T: got 0"),
        (lambda: dispatch.svd_matmul_plan(1, 10, 10, 10, np.int32), TypeError, "dtype: got int32"),
        (lambda: dispatch.svd_matmul_plan(1, 10, 10, 10, np.float32, target="trn9"), ValueError, "target"),
        (lambda: dispatch.svd_mlp_plan(1, 10, 10, 1, 1, 1, np.float32, activation="relu"), ValueError, "activation"),
    ],
)
def test_bad_plan_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_shipped_table_covers_the_paper_shapes_and_every_entry_fits():
    table = block_table.load_table()
    for kind, shape in paper_shapes.paper_tuning_jobs():
        for target in hardware.TARGETS:
            entry = table[block_table.table_key(kind, target, BF16, shape)]
            assert entry["variant"] in block_table.KERNEL_VARIANTS[kind]
            blocks = {name: entry[name] for name in block_table.BLOCK_NAMES}
            assert footprint.fits(kind, entry["variant"], shape, BF16.itemsize, blocks, target)
            assert entry["modeled_us"] > 0


def test_lookup_uses_the_table_entry_of_the_nearest_tuned_token_count():
    entry = block_table.load_table()[block_table.table_key("svd_matmul", "trn1", BF16, (2048, 2048, 1280, 8192))]
    got = block_table.lookup("svd_matmul", 1800, 2048, 1280, 8192, BF16, "trn1")
    assert got == {name: entry[name] for name in ("variant",) + block_table.BLOCK_NAMES}


def test_default_blocks_for_unknown_shapes_fit_and_the_emulator_agrees():
    # K = 14336 makes the Xᵀ strip and U blocks large: the footprint filter must shrink the blocks enough
    # for the emulator's SBUF check (trn1, the smaller SBUF) to pass.
    shape = (512, 14336, 256, 640)
    entry = block_table.lookup("svd_matmul", *shape, BF16, "trn1")
    assert entry["variant"] == "rows"
    blocks = {name: entry[name] for name in block_table.BLOCK_NAMES}
    assert (
        footprint.sbuf_bytes("svd_matmul", "rows", shape, BF16.itemsize, blocks)
        <= hardware.SBUF_BYTES_PER_PARTITION["trn1"]
    )
    too_big = dict(blocks, block_k=14336)
    assert not footprint.fits("svd_matmul", "rows", shape, BF16.itemsize, too_big, "trn1")
    t, k, r, n = shape
    with use_target("trn1"), count_only():
        y = svd_matmul.svd_matmul_kernel(
            np.zeros((t, k), BF16), np.zeros((k, r), BF16), np.zeros((r, n), BF16), **blocks
        )
    assert y.shape == (t, n)


def test_tuner_picks_the_fastest_candidate_per_target():
    shape = (16, 256, 128, 1024)
    best = tuning.tune("svd_matmul", shape, BF16)
    for target in hardware.TARGETS:
        measured = [
            tuning.measure("svd_matmul", variant, shape, BF16, blocks).latency_us[target]
            for variant, blocks in tuning.candidates("svd_matmul", shape, BF16.itemsize, target)
        ]
        assert len(measured) > 1
        assert best[target]["modeled_us"] == pytest.approx(min(measured), abs=1e-3)


def test_block_aligned_rank_matches_the_paper_formula():
    assert ranks.block_aligned_rank(2048, 8192, 0.8) == 1280
    assert ranks.block_aligned_rank(4096, 14336, 0.8) == 2560
