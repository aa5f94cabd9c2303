"""KV widths that are not whole partition tiles: the decode step equals the float64 reference when kv_heads·D is
ragged (3 × 64 = 192: one whole tile and half of one; 5 × 32 = 160; 5 × 64 = 320) and the query width too (9 × 64 =
576), for the looped and per-layer kernels, bf16 and fp8 weights, a contiguous and a paged cache.

Kᵀ is built from cache blocks by PE transposes (short windows) or by transposing DMAs (long bf16 windows); both must
slice a ragged last tile at its own width, and q/k norm and RoPE must not mix the partitions past it into the heads.
"""

import numpy as np
import pytest
from decode_operands import (
    BF16,
    RING,
    WEIGHT_INDEX,
    check_cache,
    fp8_weight,
    llama_like,
    make_operands,
    paged_operands,
    relative_error,
)
from harness.runner import run_decode_step

from nki_kernels.decode import reference
from nki_kernels.decode.contract import WEIGHTS

# 9 query heads over 3 KV heads of 64 (192 KV features), a ragged hidden size; q/k norms on to cover their
# cross-partition sums over a ragged tile.
NINE_BY_THREE = llama_like(
    num_layers=2, hidden=200, num_heads=9, num_kv_heads=3, head_dim=64, intermediate=200
).replace(qk_norm=True, norm_unit_offset=True)
FIVE_BY_THIRTY_TWO = llama_like(num_layers=2, hidden=160, num_heads=5, num_kv_heads=5, head_dim=32, intermediate=96)
TEN_BY_FIVE = llama_like(num_layers=2, hidden=128, num_heads=10, num_kv_heads=5, head_dim=64, intermediate=160)


def _fp8(rng, operands, spec):
    """operands with every weight as fp8 parts (spec.fp8_weights = WEIGHTS)."""
    for name in WEIGHTS:
        operands[WEIGHT_INDEX[name]] = fp8_weight(rng, operands[WEIGHT_INDEX[name]])
    return operands


# (spec, B, T, S, write slot, fp8 weights): S = 1100 bf16 reads 192 or 320 KV features a slot by transposing DMAs.
CONTIGUOUS = [
    (NINE_BY_THREE, 2, 1, 40, 21, False),
    (NINE_BY_THREE, 1, 2, 300, 150, True),
    (FIVE_BY_THIRTY_TWO, 3, 1, 30, 29, False),
    (TEN_BY_FIVE, 1, 1, 1100, 1000, False),
    (NINE_BY_THREE, 1, 1, 1100, 700, True),
]


@pytest.mark.parametrize("composition", ["looped", "per_layer"])
@pytest.mark.parametrize(
    "spec, b, t, s, w, fp8",
    CONTIGUOUS,
    ids=["3x64-bf16", "3x64-fp8", "5x32-bf16", "5x64-long-bf16", "3x64-long-fp8"],
)
def test_ragged_kv_width_matches_float64_reference(rng, composition, spec, b, t, s, w, fp8):
    if fp8:
        spec = spec.replace(fp8_weights=WEIGHTS)
    operands = make_operands(rng, spec, b, t, s, w, BF16)
    if fp8:
        operands = _fp8(rng, operands, spec)
    k_before, v_before = operands[10].copy(), operands[11].copy()
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    logits, k_cache, v_cache = run_decode_step(composition, operands, spec, **RING)
    assert logits.shape == (b, t, spec.vocab) and np.std(want_logits) > 0.1
    assert relative_error(logits, want_logits) < 3e-2
    check_cache(k_cache, k_before, want_k, w, t, 3e-2)
    check_cache(v_cache, v_before, want_v, w, t, 3e-2)


@pytest.mark.parametrize("composition", ["looped", "per_layer"])
@pytest.mark.parametrize(
    "spec, fp8",
    [(NINE_BY_THREE, False), (NINE_BY_THREE, True), (TEN_BY_FIVE, False)],
    ids=["3x64-bf16", "3x64-fp8", "5x64-bf16"],
)
def test_ragged_kv_width_on_a_paged_cache(rng, composition, spec, fp8):
    """Rows at their own positions in 5-slot blocks scattered over a pool; only each row's slot is written."""
    spec = spec.replace(block_size=5, fp8_weights=WEIGHTS if fp8 else ())
    lengths = [17, 10, -1]
    operands, table = paged_operands(rng, spec, lengths, 6, 30, BF16, shared=1)
    if fp8:
        operands = _fp8(rng, operands, spec)
    k_before, v_before = operands[10].copy(), operands[11].copy()
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    logits, k_pool, v_pool = run_decode_step(composition, operands, spec, **RING)
    active = [row for row, p in enumerate(lengths) if p >= 0]
    assert relative_error(logits[active], want_logits[active]) < 3e-2
    for got, before, want in ((k_pool, k_before, want_k), (v_pool, v_before, want_v)):
        written = np.zeros(got.shape[:3], dtype=bool)
        for row, p in enumerate(lengths):
            if p >= 0:
                written[:, table[row, p // 5], p % 5] = True
        np.testing.assert_array_equal(got[~written].view(np.uint8), before[~written].view(np.uint8))
        assert relative_error(got[written], want[written]) < 3e-2
