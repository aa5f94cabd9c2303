"""The decode step over all layers (harness.runner; the library's nki_kernels.decode.runner): every composition
equals the float64 reference.

Tiny ragged shapes (H = 200 natural tiles, H = 256 row-grouped tiles, I = 200 / 384 / 1216, V = 300), Llama-like
(dense, no softcaps) and Gemma-3-like (unit-offset norms, q/k norms, sandwich norms, both softcaps, per-layer RoPE
tables and masks, factored projections and head with different per-layer ranks) specs, fresh random inputs, a causal +
padding mask, and a small weight ring so blocks wrap around it within a layer.
"""

import numpy as np
import pytest
from decode_operands import (
    BF16,
    GEMMA3,
    GEMMA3_DENSE,
    GEMMA3_DENSE_LAYERS,
    LLAMA,
    LLAMA_RAGGED_INTERMEDIATE,
    RING,
    WEIGHT_INDEX,
    check_cache,
    llama_like,
    make_operands,
    placeholders,
    relative_error,
)
from emulator_helpers import sliding_window_case
from harness.runner import COMPOSITIONS, run_decode_step

from nki_kernels.decode import layouts, reference, tiles, traffic
from nki_kernels.decode.contract import PROJECTIONS
from nki_kernels.decode.ring import SMALL_TILE_BYTES
from nki_kernels.decode.runner import run_looped_step, run_sharded_looped_step
from nki_kernels.decode.step import reserved_bytes
from nki_kernels.emulator import profile, use_target
from nki_kernels.emulator.kernel import Spec

# (spec, B, T, S, write slot, dtype, tolerance)
CASES = [
    (LLAMA, 3, 1, 12, 11, np.float32, 1e-5),
    (GEMMA3, 1, 2, 20, 7, np.float32, 1e-5),
    (GEMMA3_DENSE, 3, 1, 10, 4, BF16, 2e-2),
    (GEMMA3, 1, 1, 20, 7, np.float32, 1e-5),  # one row: the sandwich norms' fused residual adds
    (GEMMA3_DENSE_LAYERS, 1, 2, 20, 7, np.float32, 1e-5),
    (GEMMA3_DENSE_LAYERS, 2, 1, 12, 5, BF16, 2e-2),
    (LLAMA_RAGGED_INTERMEDIATE, 2, 1, 12, 5, np.float32, 1e-5),
]


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize(
    "spec, b, t, s, w, dtype, tolerance",
    CASES,
    ids=[
        "llama-fp32",
        "gemma3-factored-fp32",
        "gemma3-dense-bf16",
        "gemma3-one-row",
        "gemma3-dense-layers-fp32",
        "gemma3-dense-layers-bf16",
        "llama-ragged-intermediate-fp32",
    ],
)
def test_composition_matches_float64_reference(rng, composition, spec, b, t, s, w, dtype, tolerance):
    operands = make_operands(rng, spec, b, t, s, w, dtype)
    k_before, v_before = operands[10].copy(), operands[11].copy()
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    with profile() as prof:
        logits, k_cache, v_cache = run_decode_step(composition, operands, spec, **RING)
    assert logits.shape == (b, t, spec.vocab) and logits.dtype == np.float32
    assert relative_error(logits, want_logits) < tolerance
    check_cache(k_cache, k_before, want_k, w, t, tolerance)
    check_cache(v_cache, v_before, want_v, w, t, tolerance)
    launches = {"looped": 1, "per_layer": spec.num_layers + 1}
    if composition in launches:
        assert len(prof.runs) == launches[composition]
    else:
        assert len(prof.runs) > 4 * spec.num_layers  # one launch per op


WINDOW = 4
GEMMA3_WINDOWED = GEMMA3.replace(mask_windows=(None, WINDOW))  # layers 0 and 2 slide


def windowed_operands(rng, spec, b, t, s, w, dtype):
    """(kernel operands, reference operands): mask 1 a sliding window of WINDOW positions per query over
    left-padded rows (row b's first pad_b <= w slots hold no token: rows at different positions); in the kernel's
    copy the sliding layers' cache slots outside the window the kernels may read are NaN."""
    operands = make_operands(rng, spec, b, t, s, w, dtype)
    operands[15] = operands[15].copy()
    operands[15][1], outside = sliding_window_case(rng, s, b, t, w, WINDOW)
    sliding = [layer for layer, mask in enumerate(spec.layer_mask) if mask == 1]
    poisoned = list(operands)
    for i in (10, 11):
        poisoned[i] = operands[i].copy()
        for layer in sliding:
            poisoned[i][layer][:, outside] = np.nan
    return poisoned, operands


# (B, T, S, write slot): the window clamped to slot 0 (before and at its edge), inside the cache (past the edge,
# T = 2) and clamped to S - window at the end; ragged S.
WINDOW_CASES = [(2, 1, 13, 1), (2, 1, 13, 3), (3, 2, 13, 6), (1, 1, 13, 12)]


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("b, t, s, w", WINDOW_CASES)
def test_sliding_window_layers_read_only_the_window(rng, composition, b, t, s, w):
    spec = GEMMA3_WINDOWED
    poisoned, operands = windowed_operands(rng, spec, b, t, s, w, np.float32)
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    logits, k_cache, v_cache = run_decode_step(composition, poisoned, spec, **RING)
    assert relative_error(logits, want_logits) < 3e-5
    check_cache(k_cache, poisoned[10], want_k, w, t, 3e-5)
    check_cache(v_cache, poisoned[11], want_v, w, t, 3e-5)


@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_count_only_sliding_layers_move_only_the_window(composition):
    """HBM bytes read drop by exactly the cache and mask slots outside the window, in each sliding layer."""
    b, t, s = 2, 1, 300
    spec = GEMMA3_DENSE
    operands = [
        op
        if op is None or isinstance(op, np.ndarray) and op.dtype == np.int32
        else [Spec(f.shape, f.dtype) for f in op]
        if isinstance(op, list)
        else Spec(op.shape, op.dtype)
        for op in make_operands(np.random.default_rng(0), spec, b, t, s, 200, BF16)
    ]
    read = {}
    for windows in ((), (None, WINDOW)):
        with profile() as prof:
            run_decode_step(composition, operands, spec.replace(mask_windows=windows), numerics=False)
        read[windows] = sum(run.hbm_bytes_read for run in prof.runs)
    sliding = spec.layer_mask.count(1)
    slot_bytes = 2 * spec.num_kv_heads * spec.head_dim * 2 + t * 4  # k and v (bf16), the mask bias (fp32)
    assert read[()] - read[(None, WINDOW)] == sliding * b * (s - WINDOW) * slot_bytes


# MLP ranks that differ from layer to layer and are not multiples of 128 (rank layouts of grouped whole tiles and a
# ragged tail), in stacks (Rmax = largest + 3) whose rows the kernels read whole (bf16: 1046 bytes or less) or
# only each layer's rank of (float32: 2092 bytes).
RAGGED_MLP_RANKS = {
    "bf16": (BF16, {"gate": (320, 448), "up": (448, 320), "down": (520, 300)}, 2e-2),
    "fp32": (np.float32, {"gate": (300, 520), "up": (520, 300), "down": (300, 520)}, 1e-5),
}


@pytest.mark.parametrize("composition", ["looped", "per_layer"])
@pytest.mark.parametrize("case", RAGGED_MLP_RANKS)
def test_mlp_ranks_that_differ_per_layer_match_float64_reference(rng, composition, case):
    dtype, mlp_ranks, tolerance = RAGGED_MLP_RANKS[case]
    spec = llama_like(num_layers=2, hidden=640, num_heads=4, num_kv_heads=2, head_dim=32, intermediate=768)
    spec = spec.replace(ranks=tuple(mlp_ranks.get(name) for name in PROJECTIONS))
    b, t, s, w = 2, 1, 12, 5
    operands = make_operands(rng, spec, b, t, s, w, dtype)
    k_before, v_before = operands[10].copy(), operands[11].copy()
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    with profile() as prof:
        logits, k_cache, v_cache = run_decode_step(composition, operands, spec, **RING)
    assert relative_error(logits, want_logits) < tolerance
    check_cache(k_cache, k_before, want_k, w, t, tolerance)
    check_cache(v_cache, v_before, want_v, w, t, tolerance)
    # Count-only: a stack 3 wider than the largest rank costs bf16 those 3 columns of u in every layer (rows read
    # whole, their padding with them), float32 nothing (each layer's rank read).
    tight = list(operands)
    for name, ranks in mlp_ranks.items():
        u, v = operands[WEIGHT_INDEX[name]]
        tight[WEIGHT_INDEX[name]] = [u[:, :, : max(ranks)], v[:, : max(ranks)]]
    read = [
        sum(run.hbm_bytes_read for run in _profiled_runs(composition, placeholders(ops), spec))
        for ops in (operands, tight)
    ]
    itemsize = np.dtype(dtype).itemsize
    padding = sum(spec.num_layers * spec.in_features(name) * 3 * itemsize for name in mlp_ranks)
    assert read[0] - read[1] == (padding if dtype == BF16 else 0)
    assert len(prof.runs) == {"looped": 1, "per_layer": spec.num_layers + 1}[composition]


@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_layers_left_dense_in_a_factored_stack_read_their_weight_alone(composition):
    """A layer whose rank the spec leaves None reads its W [K, N] alone, never the identity its stack holds beside
    it: every composition reads, beyond the weights the traffic model counts (K·N for such a layer, r·(K + N) for
    a factored one), what it reads beyond them for the all-dense model. float32 stacks wider than 2 KiB a row, so
    factored layers read their rank's columns only (projections.whole_rows)."""
    dense = llama_like(num_layers=2, hidden=640, num_heads=4, num_kv_heads=2, head_dim=32, intermediate=768)
    mixed = {"q": (None, 60), "k": (None, 30), "o": (None, 60), "gate": (None, 320), "down": (300, None)}
    mixed = dense.replace(ranks=tuple(mixed.get(name) for name in PROJECTIONS))
    beyond = []
    for spec in (dense, mixed):
        operands = make_operands(np.random.default_rng(0), spec, 2, 1, 12, 5, np.float32)
        read = sum(run.hbm_bytes_read for run in _profiled_runs(composition, placeholders(operands), spec))
        beyond.append(read - traffic.weight_bytes(spec, itemsize=4))
    assert beyond[0] == beyond[1]
    assert traffic.weight_bytes(mixed, 4) < traffic.weight_bytes(dense, 4)


def _profiled_runs(composition, operands, spec):
    with profile() as prof:
        run_decode_step(composition, operands, spec, numerics=False, **RING)
    return prof.runs


def test_today_runs_the_fused_mlp_kernels_when_factored(rng):
    spec = GEMMA3.replace(
        num_layers=1, layer_rope=(0,), layer_mask=(0,), ranks=tuple(None if r is None else r[:1] for r in GEMMA3.ranks)
    )
    operands = make_operands(rng, spec, 1, 1, 8, 3, np.float32)
    with profile() as prof:
        run_decode_step("per_op_svd_mlp", operands, spec)
    names = [run.name for run in prof.runs]
    assert "svd_mlp_gate_up_kernel" in names and "svd_mlp_down_kernel" in names
    assert "gated_activation_kernel" not in names


def test_count_only_trace_with_placeholders():
    """Spec placeholders (no weight memory) give a count-only trace with the real bytes moved."""
    spec, b, t, s = GEMMA3, 2, 1, 16
    operands = [
        op
        if op is None or isinstance(op, np.ndarray) and op.dtype == np.int32
        else [Spec(f.shape, f.dtype) for f in op]
        if isinstance(op, list)
        else Spec(op.shape, op.dtype)
        for op in make_operands(np.random.default_rng(0), spec, b, t, s, 3, BF16)
    ]
    with profile() as prof:
        logits, _, _ = run_decode_step("looped", operands, spec, numerics=False)
    assert logits.shape == (b, t, spec.vocab)
    head_bytes = 2 * spec.head_rank * (spec.hidden + spec.vocab)
    assert prof.runs[0].hbm_bytes_read > head_bytes
    assert prof.runs[0].latency_us["trn2"] > 0


def test_default_ring_leaves_sbuf_for_a_long_cache():
    """The default weight ring keeps attention's cache tiles out of its SBUF: 8 kv heads of 128 over 2048 slots in
    bf16 take 64 KiB per partition per row, which overflowed trn1's SBUF when the ring took all but 64 KiB."""
    spec = llama_like(num_layers=1, hidden=256, num_heads=8, num_kv_heads=8, head_dim=128, intermediate=256)
    operands = [
        op if op is None or isinstance(op, np.ndarray) and op.dtype == np.int32 else Spec(op.shape, op.dtype)
        for op in make_operands(np.random.default_rng(0), spec, 1, 1, 2048, 5, BF16)
    ]
    for target in ("trn1", "trn2"):
        with use_target(target):
            logits, _, _ = run_decode_step("looped", operands, spec, numerics=False)
        assert logits.shape == (1, 1, spec.vocab)


@pytest.mark.parametrize("hidden, rows", [(256, 1), (640, 8), (2048, 1)])
def test_default_ring_reserves_the_small_tiles_and_a_staged_row(hidden, rows):
    """The looped step's default ring leaves the small tiles and a staged [R, hidden] float32 row block beside it,
    sized from the hidden size (10.5 KiB at Gemma 3 270M's 640, 16 KiB at Llama-3.2-1B's 2048), and the step fits
    SBUF with it: the emulator checks every instruction's live SBUF."""
    spec = llama_like(num_layers=2, hidden=hidden, num_heads=4, num_kv_heads=1, head_dim=64, intermediate=256)
    assert reserved_bytes(spec) == SMALL_TILE_BYTES + 4 * hidden
    operands = [
        op if op is None or isinstance(op, np.ndarray) and op.dtype == np.int32 else Spec(op.shape, op.dtype)
        for op in make_operands(np.random.default_rng(0), spec, rows, 1, 64, 5, BF16)
    ]
    for target in ("trn1", "trn2"):
        with use_target(target):
            logits, _, _ = run_decode_step("looped", operands, spec, numerics=False)
        assert logits.shape == (rows, 1, spec.vocab)


def test_rejects_bad_arguments(rng):
    for windows in ((4,), (None, 0), (None, 2.5)):
        with pytest.raises(ValueError, match="mask_windows"):
            GEMMA3.replace(mask_windows=windows)
    for q_ranks in ((None, None, None), (70, 0, 130), (70, 257, 130), (70, 33)):
        ranks = (q_ranks, *GEMMA3.ranks[1:])
        with pytest.raises(ValueError, match=r"DecodeSpec.ranks\['q'\]: got .* 3 entries, each a rank in \[1, 256\]"):
            GEMMA3.replace(ranks=ranks)
    # The stacks' width: the largest rank, or the width that holds a dense layer's W (v's K rows, o's N columns).
    assert [GEMMA3_DENSE_LAYERS.stacked_rank(name) for name in ("q", "v", "o", "up", "head")] == [
        256,
        256,
        256,
        129,
        70,
    ]
    operands = make_operands(rng, LLAMA, 1, 1, 8, 3, np.float32)
    with pytest.raises(ValueError, match="composition"):
        run_decode_step("fused", operands, LLAMA)
    with pytest.raises(TypeError, match="spec"):
        run_decode_step("looped", operands, LLAMA.__dict__)
    bad = list(operands)
    bad[0] = bad[0][:, :, :100]
    with pytest.raises(ValueError, match="x has shape"):
        run_decode_step("looped", bad, LLAMA)
    bad = list(operands)
    bad[4] = [bad[4], bad[4]]
    with pytest.raises(ValueError, match="k has shape"):
        run_decode_step("looped", bad, LLAMA)
    # Heads of 16 features with 2 KV heads: KV head 1 would start at partition 16 (a hardware error mid-kernel).
    narrow = llama_like(num_layers=1, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=64)
    narrow_operands = make_operands(rng, narrow, 1, 1, 8, 3, np.float32)
    with pytest.raises(ValueError, match="head_dim: got 16 with 2 KV heads, expected a multiple of 32"):
        run_decode_step("looped", narrow_operands, narrow)


def test_library_runner_runs_the_looped_kernel_alone(rng):
    """nki_kernels.decode.runner (what the JAX side runs) launches the looped kernel once, as the harness's looped
    composition does, against the float64 reference; a sharded spec is sent to the sharded runner by name."""
    spec, b, t, s, w = LLAMA_RAGGED_INTERMEDIATE, 2, 1, 13, 6
    operands = make_operands(rng, spec, b, t, s, w, np.float32)
    k_before, v_before = operands[10].copy(), operands[11].copy()
    again = [*operands[:10], k_before.copy(), v_before.copy(), *operands[12:]]  # the caches are written in place
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    with profile() as prof:
        logits, k_cache, v_cache = run_looped_step(operands, spec, **RING)
    assert len(prof.runs) == 1 and relative_error(logits, want_logits) < 1e-5
    check_cache(k_cache, k_before, want_k, w, t, 1e-5)
    check_cache(v_cache, v_before, want_v, w, t, 1e-5)
    harness_logits, _, _ = run_decode_step("looped", again, spec, **RING)
    np.testing.assert_array_equal(harness_logits, logits)
    sharded = spec.replace(tensor_parallel=2)
    with pytest.raises(ValueError, match="run_looped_step: spec.tensor_parallel is 2; .* run_sharded_looped_step"):
        run_looped_step(operands, sharded)
    with pytest.raises(ValueError, match="rank_operands: got 1 operand sets, expected one per rank"):
        run_sharded_looped_step([operands], sharded)


def test_an_intermediate_with_a_ragged_tile_groups_its_whole_tiles():
    """down's rows for an intermediate of 9 whole tiles and 64 more: grouped blocks of 5 and 4 tiles (long runs per
    partition), then the 64 alone, not ten natural tiles."""
    inter = layouts.Layouts(LLAMA_RAGGED_INTERMEDIATE).inter
    blocks = [(k0, ks, count) for k0, ks, _, count, _ in tiles.layout_blocks(inter)]
    assert blocks == [(0, 640, 5), (640, 512, 4), (1152, 64, 1)]
