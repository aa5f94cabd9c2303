"""fp8 weights in the decode step (nki_kernels.decode): every composition against the float64 reference of the
dequantized weights, HBM traffic (fp8 weight bytes half of bf16's, plus the scales), the dtype rules the kernels
live by, and errors that name the operand.

Weights are fp8 e4m3 values across Trainium's whole range (columns reaching ±240, others subnormal) times float32
per-output-column scales spanning four orders of magnitude (decode_operands.fp8_matrix); ragged shapes (H = 200
natural tiles, H = 256 row-grouped tiles, ranks 1 .. 130, V = 300), dense and factored projections and LM heads.
"""

import ml_dtypes
import numpy as np
import pytest
from decode_operands import (
    BF16,
    GEMMA3,
    GEMMA3_8,
    GEMMA3_DENSE_LAYERS_8,
    LLAMA,
    LLAMA8,
    LLAMA_RAGGED_INTERMEDIATE_8,
    RING,
    WEIGHT_INDEX,
    check_cache,
    fp8_matrix,
    fp8_operands,
    fp8_weight,
    make_operands,
    placeholders,
    relative_error,
)
from harness.compositions import projection_kernel
from harness.runner import COMPOSITIONS, run_decode_step

from nki_kernels import emulator
from nki_kernels.binding import nki, nl
from nki_kernels.decode import projections, reference, tiles, traffic
from nki_kernels.decode.contract import FP8, WEIGHTS, Factored, Quantized, check
from nki_kernels.decode.ring import RING_BLOCK_BYTES, WeightRing
from nki_kernels.emulator import NkiHardwareError, cost_model, profile, trace
from nki_kernels.emulator.kernel import Spec, run

# (spec, B, T, S, write slot)
CASES = [
    (LLAMA8, 3, 1, 12, 11),
    (GEMMA3_8, 1, 2, 20, 7),
    (GEMMA3_DENSE_LAYERS_8, 2, 1, 12, 5),
    (LLAMA_RAGGED_INTERMEDIATE_8, 2, 1, 12, 5),  # packed down rows in blocks of 5 and 4 tiles, then 64
]


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize(
    "spec, b, t, s, w",
    CASES,
    ids=["llama-dense", "gemma3-factored", "gemma3-dense-layers", "llama-ragged-intermediate"],
)
def test_composition_matches_float64_reference_of_dequantized_weights(rng, composition, spec, b, t, s, w):
    operands = fp8_operands(rng, spec, b, t, s, w)
    assert np.abs(operands[3][0].astype(np.float32)).max() == 240
    k_before, v_before = operands[10].copy(), operands[11].copy()
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    logits, k_cache, v_cache = run_decode_step(composition, operands, spec, **RING)
    assert logits.dtype == np.float32 and np.std(want_logits) > 0.1
    assert relative_error(logits, want_logits) < 2e-2  # bf16 activations, as for bf16 weights
    check_cache(k_cache, k_before, want_k, w, t, 2e-2)
    check_cache(v_cache, v_before, want_v, w, t, 2e-2)


def test_dequantized_reference_scales_each_output_column(rng):
    w, scale = fp8_matrix(rng, (2, 3, 5), 3)
    assert scale.shape == (2, 5) and np.abs(w.astype(np.float32)).max() == 240
    got = reference.dequantized_f64(Quantized(w, scale))
    np.testing.assert_array_equal(got[1, :, 4], w[1, :, 4].astype(np.float64) * np.float64(scale[1, 4]))
    (u, _), (v, _) = fp8_matrix(rng, (3, 2), 3), fp8_matrix(rng, (2, 5), 2)
    factored = reference.dequantized_f64(Factored(u, v, np.float32([2.0, 0.5]), np.ones(5, np.float32)))
    np.testing.assert_array_equal(factored.u, u.astype(np.float64) * [2.0, 0.5])
    assert factored.u_scale is None and factored.v_scale is None


def _hbm_bytes(composition, operands, spec):
    with profile() as prof:
        run_decode_step(composition, placeholders(operands), spec, numerics=False)
    return sum(run.hbm_bytes_read + run.hbm_bytes_written for run in prof.runs)


def test_must_move_bytes_count_fp8_weights_at_one_byte_plus_their_scales():
    for spec in (LLAMA, GEMMA3):
        fp8 = spec.replace(fp8_weights=WEIGHTS)
        values = scales = 0
        for name in WEIGHTS:
            k, n = (spec.hidden, spec.vocab) if name == "head" else (spec.in_features(name), spec.out_features(name))
            ranks = [spec.head_rank] if name == "head" else spec.ranks[WEIGHTS.index(name)] or [None] * spec.num_layers
            for r in ranks:
                values += k * n if r is None else r * (k + n)
                scales += n if r is None else r + n
        bf16_bytes = traffic.must_move_bytes(spec, 3, 40)
        assert bf16_bytes - traffic.must_move_bytes(fp8, 3, 40) == 2 * values - (values + 4 * scales)
        # The head alone in fp8: only its bytes change, to half plus V (+ r) float32 scales.
        r = spec.head_rank
        h, v = spec.hidden, spec.vocab
        head_values, head_scales = (h * v, v) if r is None else (r * (h + v), r + v)
        head_only = spec.replace(fp8_weights=("head",))
        assert bf16_bytes - traffic.must_move_bytes(head_only, 3, 40) == head_values - 4 * head_scales


def _whole_row_padding_bytes(spec, operands, itemsize, composition):
    """Bytes of stacked zero padding the kernels read beside a factor u of `itemsize` bytes a value: layers whose
    u rows they read whole (projections.whole_rows: a rank below the stack's, short rows). per_op_svd_mlp's MLP
    kernels take each layer's exact factors."""
    skipped = ("gate", "up", "down") if composition == "per_op_svd_mlp" else ()
    total = 0
    for name in WEIGHTS:
        if name == "head" or name in skipped or not spec.factored(name):
            continue
        stored = operands[WEIGHT_INDEX[name]][0].shape[-1]
        for rank in spec.ranks[WEIGHTS.index(name)]:
            if projections.whole_rows(rank, stored, itemsize):
                total += spec.in_features(name) * (stored - rank) * itemsize
    return total


@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_kernels_move_fp8_weights_at_half_the_bytes_of_bf16(rng, composition):
    """What the kernels move (count-only) drops by exactly what must-move drops: every fp8 weight byte crosses HBM
    once, at half of bf16's bytes, plus its float32 scales once (one row: the head's scales are read once); besides
    them, only the zero padding of the u rows read whole (the ragged GEMMA3 stacks)."""
    for spec in (LLAMA, GEMMA3):
        fp8 = spec.replace(fp8_weights=WEIGHTS)
        bf16_operands = make_operands(rng, spec, 1, 1, 40, 9, BF16)
        fp8_ops = list(bf16_operands)
        for name in WEIGHTS:
            fp8_ops[WEIGHT_INDEX[name]] = fp8_weight(rng, bf16_operands[WEIGHT_INDEX[name]], [1])
        moved = _hbm_bytes(composition, bf16_operands, spec) - _hbm_bytes(composition, fp8_ops, fp8)
        padding = _whole_row_padding_bytes(spec, bf16_operands, 2, composition) - _whole_row_padding_bytes(
            spec, fp8_ops, 1, composition
        )
        assert padding > 0 or spec is LLAMA
        assert moved == traffic.must_move_bytes(spec, 1, 40) - traffic.must_move_bytes(fp8, 1, 40) + padding > 0


def test_fp8_weights_need_two_byte_activations(rng):
    operands = fp8_operands(rng, LLAMA8, 1, 1, 8, 3, np.float32)
    with pytest.raises(TypeError, match="x has dtype float32 with fp8 weights .* bfloat16 or float16 activations"):
        run_decode_step("looped", operands, LLAMA8)
    # The emulator's rule behind it: TensorE does not mix fp8 with float32.
    x = rng.standard_normal((2, LLAMA.hidden)).astype(np.float32)
    with pytest.raises(NkiHardwareError, match="if one operand is float32 the other must be too"):
        projection_kernel(x, operands[WEIGHT_INDEX["q"]], layer=0)
    # JAX holds fp8 values as float8_e4m3fn; the kernels take Trainium's float8_e4m3 (the same bits within ±240).
    operands = fp8_operands(rng, LLAMA8, 1, 1, 8, 3)
    operands[3] = [operands[3][0].view(ml_dtypes.float8_e4m3fn), operands[3][1]]
    with pytest.raises(TypeError, match="q.w: got dtype float8_e4m3fn, expected float8_e4m3"):
        run_decode_step("looped", operands, LLAMA8)


def test_missing_or_misshapen_scales_name_the_operand(rng):
    operands = fp8_operands(rng, GEMMA3_8, 1, 1, 8, 3)

    def replaced(name, value, spec=GEMMA3_8):
        bad = list(operands)
        bad[WEIGHT_INDEX[name]] = value
        return check(spec, bad, "decode_step_kernel", padded_ranks=True)

    u, v, u_scale, v_scale = operands[WEIGHT_INDEX["q"]]
    with pytest.raises(ValueError, match="decode_step_kernel: q.u_scale: got None: spec.fp8_weights names q"):
        replaced("q", Factored(u, v))
    with pytest.raises(ValueError, match="q.v_scale: got None"):
        replaced("q", Factored(u, v, u_scale))
    with pytest.raises(ValueError, match=r"q.v_scale: got shape \(3, 255\), expected \(3, 256\)"):
        replaced("q", Factored(u, v, u_scale, v_scale[:, :-1]))
    with pytest.raises(ValueError, match=r"q.u_scale: got shape \(3, 132\), expected \(3, 133\)"):
        replaced("q", Factored(u, v, u_scale[:, 1:], v_scale))
    w, scale = operands[WEIGHT_INDEX["k"]]
    with pytest.raises(ValueError, match=r"k: got one array, expected Quantized\(w, scale\) .* spec.fp8_weights names"):
        replaced("k", w)
    with pytest.raises(ValueError, match=r"k.scale: got shape \(3, 32\), expected \(3, 64\)"):
        replaced("k", Quantized(w, scale[:, :32]))
    with pytest.raises(TypeError, match="k.scale: got dtype bfloat16, expected float32"):
        replaced("k", Quantized(w, scale.astype(BF16)))
    with pytest.raises(TypeError, match="k.w: got dtype bfloat16, expected float8_e4m3 .spec.fp8_weights names k"):
        replaced("k", Quantized(w.astype(BF16), scale))
    # Not named in fp8_weights: fp8 values are not a weight in x's dtype, and scales do not belong.
    bf16_spec = GEMMA3_8.replace(fp8_weights=WEIGHTS[1:])
    with pytest.raises(ValueError, match=r"q.u_scale: expected None since spec.fp8_weights does not name q"):
        replaced("q", Factored(u, v, u_scale, v_scale), bf16_spec)
    with pytest.raises(TypeError, match="q.u: got dtype float8_e4m3, expected bfloat16 .x's dtype.; an fp8 weight"):
        replaced("q", Factored(u, v), bf16_spec)
    with pytest.raises(ValueError, match="k: got Quantized, expected one dense array"):
        replaced("k", Quantized(w, scale), GEMMA3_8.replace(fp8_weights=("q",)))
    with pytest.raises(ValueError, match="DecodeSpec.fp8_weights"):
        GEMMA3.replace(fp8_weights=("q", "lm_head"))


@nki.jit
def fp8_head_kernel(h, w, scale, *, softcap, block_bytes=None):
    """head_projection of rows h [R, K] (bf16) by fp8 w [K, V] with scales [V], in a weight ring of the default
    size beside the head's staged logits (blocks of block_bytes per partition, default when None)."""
    rows, k = h.shape
    layout = tiles.feature_layout(k, tiles.head_group(k))
    hc = tiles.column_tiles(layout, rows, h.dtype, "h", zero=False)
    tiles.load_columns(hc, h, layout)
    logits = nl.ndarray((rows, w.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm, name="logits")
    block = RING_BLOCK_BYTES if block_bytes is None else block_bytes
    staging = projections.head_staging_bytes(w.dtype, True, rows, w.shape[1], block)
    projections.head_projection(hc, layout, w, rows, WeightRing(block_bytes, None, staging), logits, softcap, scale)
    return logits


@pytest.mark.parametrize("rows, softcap", [(1, None), (3, 2.0)])
def test_fp8_head_logit_buffer_across_ranges(rng, rows, softcap):
    """fp8 LM head whose scaled logit columns gather over ranges into buffers turned into rows 16 groups a
    partition: K = 200 (ragged tiles), 1536-column ranges (12 groups) that straddle a buffer's end, V = 131 groups
    (the last partial, 77 columns): a first buffer of 115 groups (so that 16 are left for the last), then the last
    buffer turned a group a partition, 15 whole groups and the partial one left over."""
    v = 130 * 128 + 77
    h = rng.standard_normal((rows, 200)).astype(BF16)
    w, scale = fp8_matrix(rng, (200, v), 200)
    logits = fp8_head_kernel(h, w, scale, softcap=softcap, block_bytes=1536)
    want = h.astype(np.float64) @ reference.dequantized_f64(Quantized(w, scale))
    if softcap:
        want = np.tanh(want / softcap) * softcap
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows, softcap", [(72, 3.0), (5, None)])
def test_fp8_head_with_many_rows_and_wide_ranges(rng, rows, softcap):
    """fp8 LM head, vocabulary on the partitions: one range of V = 4700 columns (a ragged last group) cut by
    head_ranges into 2304, 1152 and 1244 columns; with 72 rows an accumulator holds 16 groups, so the first range's
    blocks stay live over two accumulators."""
    h = rng.standard_normal((rows, 256)).astype(BF16)
    w, scale = fp8_matrix(rng, (256, 4700), 256)
    logits = fp8_head_kernel(h, w, scale, softcap=softcap)
    want = h.astype(np.float64) @ reference.dequantized_f64(Quantized(w, scale))
    if softcap:
        want = np.tanh(want / softcap) * softcap
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize(
    "rows, rank, v, min_run",
    [(1, 448, 262144, 4096), (8, 448, 262144, 4096), (1, 576, 262144, 4096), (1, 3200, 128256, 2048)],
)
def test_fp8_heads_at_real_sizes_fit_sbuf_and_read_each_weight_once(target, rows, rank, v, min_run):
    """Factored heads (v [rank, V] fp8) of Gemma 3 270M and Llama-3.1-8B (rank 3200) on their own default ring: the
    ranges (8 KiB runs of each weight row with the logits gathered over ranges, 4096 columns with 8 rows staging
    theirs, halved where a range's blocks would take over a third of the ring, HEAD_COLUMNS where even those would)
    fit SBUF on both targets, read each weight and scale byte once, and move all but the narrowed last ranges'
    weight bytes in runs of at least min_run bytes a partition."""
    operands = (Spec((rows, rank), BF16), Spec((rank, v), FP8), Spec((v,), np.float32))
    runs = []
    trace.add_listener(runs.append)
    try:
        with emulator.use_target(target), profile() as prof:
            run(fp8_head_kernel, operands, {"softcap": 30.0}, numerics=False)
    finally:
        trace.remove_listener(runs.append)
    (summary,), (head,) = prof.runs, runs
    assert summary.hbm_bytes_read == rows * rank * 2 + rank * v + v * 4
    assert summary.hbm_bytes_written == rows * v * 4
    weight_dmas = [r for r in head.records if r.dma and "ring.py" in r.line]  # the weight ring's loads
    long_runs = sum(r.dma.nbytes for r in weight_dmas if cost_model.dma_buffer_bytes(r) >= min_run)
    assert long_runs >= rank * (v - 2 * projections.HEAD_TAIL_COLUMNS)
