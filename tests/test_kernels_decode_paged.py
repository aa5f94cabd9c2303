"""The decode kernels on a paged KV cache (spec.block_size): pools of blocks shared by the rows, each row's blocks
read through its block table and its new token written at its own position, equal the float64 reference.

Ragged rows: different lengths, blocks scattered over the pool, two rows sharing their first blocks (a common
prefix), a row whose new token opens a block (it just crossed a block boundary), an inactive row (length -1), block
sizes that are not powers of two (5, 12, 48), Llama-like and Gemma-3-like specs (sliding-window layers, fp8
weights), the looped and the per-layer kernels.
"""

import numpy as np
import pytest
from decode_operands import (
    BF16,
    GEMMA3,
    GEMMA3_8,
    LLAMA,
    RING,
    WINDOW,
    fp8_weight,
    paged_operands,
    relative_error,
)
from harness.runner import run_decode_step, run_sharded_decode_step

from nki_kernels import emulator
from nki_kernels.decode import paged, reference
from nki_kernels.decode.contract import WEIGHTS
from nki_kernels.decode.sharding import gather_cache, shard_operands

WINDOWED = GEMMA3.replace(mask_windows=(None, WINDOW))  # layers 0 and 2 slide (mask table 1)
WINDOWED_8 = GEMMA3_8.replace(mask_windows=(None, WINDOW))


def _fp8(rng, operands, spec):
    """paged_operands' weights as fp8 parts (every weight spec.fp8_weights names)."""
    index = {name: 3 + i for i, name in enumerate(WEIGHTS[:-1])} | {"head": 17}
    for name in spec.fp8_weights:
        ranks = spec.ranks[WEIGHTS.index(name)] if name != "head" else None
        operands[index[name]] = fp8_weight(rng, operands[index[name]], ranks, name)
    return operands


def check_pools(got, before, want, lengths, table, block_size, tolerance):
    """Only each active row's slot at its position changed in every layer (bit for bit elsewhere), holding the
    reference's value."""
    written = np.zeros(got.shape[:3], dtype=bool)
    for row, p in enumerate(lengths):
        if p >= 0:
            written[:, table[row, p // block_size], p % block_size] = True
    np.testing.assert_array_equal(got[~written].view(np.uint8), before[~written].view(np.uint8))
    assert relative_error(got[written], want[written]) < tolerance


# (spec, block size, lengths, table blocks per row MB, pool blocks, shared prefix blocks, dtype, composition, tol)
CASES = [
    # row 1 opens a block (10 = 2·5), row 2 inactive, rows 0 and 1 share block 0
    (LLAMA, 5, [7, 10, -1, 3], 4, 20, 1, np.float32, "looped", 1e-5),
    # row 1 opens a block (12), row 3 at the last slot of its table (47 = 4·12 - 1); sliding windows over 2 blocks
    (WINDOWED, 12, [30, 12, 5, 47], 4, 24, 1, np.float32, "looped", 1e-5),
    (WINDOWED, 5, [33, 20, 9, 2, -1], 8, 50, 2, np.float32, "per_layer", 1e-5),
    # 48-slot blocks (a partition each); a bf16 cache
    (WINDOWED, 48, [60, 48, 100], 3, 9, 1, BF16, "looped", 2e-2),
    (WINDOWED_8, 5, [17, 25, 3, -1], 6, 30, 2, BF16, "looped", 3e-2),
]


@pytest.mark.parametrize(
    "spec, block_size, lengths, max_blocks, num_blocks, shared, dtype, composition, tolerance",
    CASES,
    ids=["llama-5", "gemma3-windows-12", "gemma3-windows-5-per-layer", "gemma3-48-bf16", "gemma3-fp8-5"],
)
def test_paged_step_matches_float64_reference(
    rng, spec, block_size, lengths, max_blocks, num_blocks, shared, dtype, composition, tolerance
):
    spec = spec.replace(block_size=block_size)
    operands, table = paged_operands(rng, spec, lengths, max_blocks, num_blocks, dtype, shared=shared)
    if spec.fp8_weights:
        operands = _fp8(rng, operands, spec)
    k_before, v_before = operands[10].copy(), operands[11].copy()
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    logits, k_pool, v_pool = run_decode_step(composition, operands, spec, **RING)
    active = [row for row, p in enumerate(lengths) if p >= 0]
    assert logits.shape == (len(lengths), 1, spec.vocab)
    assert relative_error(logits[active], want_logits[active]) < tolerance
    check_pools(k_pool, k_before, want_k, lengths, table, block_size, tolerance)
    check_pools(v_pool, v_before, want_v, lengths, table, block_size, tolerance)


@pytest.mark.parametrize("composition", ["looped", "per_layer"])
def test_tensor_parallel_paged_step_matches_float64_reference(rng, composition):
    """Two ranks, each with its KV head's slice of the pools (the Megatron layout), every row at its own position."""
    spec = WINDOWED.replace(num_kv_heads=2, block_size=12)
    lengths = [30, 12, -1, 47]
    operands, table = paged_operands(rng, spec, lengths, 4, 24, np.float32, shared=1)
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    rank_spec, shards = shard_operands(spec, operands, 2)
    logits, k_pools, v_pools = run_sharded_decode_step(composition, shards, rank_spec, **RING)
    active = [row for row, p in enumerate(lengths) if p >= 0]
    assert relative_error(logits[active], want_logits[active]) < 1e-5
    for pools, before, want in ((k_pools, operands[10], want_k), (v_pools, operands[11], want_v)):
        check_pools(gather_cache(pools, spec.num_kv_heads), before, want, lengths, table, 12, 1e-5)


def _window_blocks(p, span, block_size, max_blocks):
    """The table entries (indices) a sliding layer reads for a row at position p (the kernels' window)."""
    count = paged.window_blocks(span, block_size, max_blocks)
    first = max(p - span + 1, 0) // block_size
    first = min(first, max_blocks - count)
    return range(first, first + count)


def test_sliding_layers_read_only_their_windows_blocks(rng):
    """Every block of the pools no row's window holds is NaN in the sliding layers: the results stay finite and
    equal the reference's on clean pools (which the masks make independent of those blocks)."""
    block_size, max_blocks, lengths = 5, 8, [33, 21, 9, 2]
    spec = WINDOWED.replace(block_size=block_size)
    operands, table = paged_operands(rng, spec, lengths, max_blocks, 40, np.float32)
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    read = {table[row, i] for row, p in enumerate(lengths) for i in _window_blocks(p, WINDOW, block_size, max_blocks)}
    poisoned = list(operands)
    sliding = [layer for layer, mask in enumerate(spec.layer_mask) if mask == 1]
    for i in (10, 11):
        poisoned[i] = operands[i].copy()
        for layer in sliding:
            unread = [block for block in range(poisoned[i].shape[1]) if block not in read]
            poisoned[i][layer, unread] = np.nan
    logits, k_pool, v_pool = run_decode_step("looped", poisoned, spec, **RING)
    assert np.isfinite(logits).all()
    assert relative_error(logits, want_logits) < 1e-5
    check_pools(k_pool, poisoned[10], want_k, lengths, table, block_size, 1e-5)
    check_pools(v_pool, poisoned[11], want_v, lengths, table, block_size, 1e-5)


def test_window_blocks_cover_every_window():
    """window_blocks: the fewest consecutive blocks that hold any window of `span` positions ending at p."""
    for block_size in (1, 5, 12, 16):
        for span in range(1, 40):
            count = paged.window_blocks(span, block_size, 1000)
            worst = max(p // block_size - (p - span + 1) // block_size + 1 for p in range(span, span + 3 * block_size))
            assert count == worst


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda ops: ops[20].__setitem__(0, 20), r"lengths: got lengths\[0\] = 20, expected -1"),
        (lambda ops: ops[20].__setitem__(1, -2), r"lengths: got lengths\[1\] = -2"),
        (lambda ops: ops[19].__setitem__((2, 3), 12), r"block_table: got block_table\[2, 3\] = 12, expected a block"),
        (lambda ops: ops[19].__setitem__((0, 0), -1), r"block_table: got block_table\[0, 0\] = -1"),
    ],
)
def test_bad_lengths_or_block_table_name_the_argument(rng, change, message):
    spec = LLAMA.replace(block_size=5)
    operands, _ = paged_operands(rng, spec, [3, 7, 0], 4, 12, np.float32)
    change(operands)
    with pytest.raises(ValueError, match=message):
        run_decode_step("looped", operands, spec, **RING)


def test_paged_operands_and_compositions_are_checked(rng):
    spec = LLAMA.replace(block_size=5)
    operands, _ = paged_operands(rng, spec, [3, 7, 0], 4, 12, np.float32)
    with pytest.raises(ValueError, match="composition 'per_op' writes and reads a contiguous cache"):
        run_decode_step("per_op", operands, spec, **RING)
    two_tokens = list(operands)
    two_tokens[0] = np.concatenate([operands[0]] * 2, axis=1)
    with pytest.raises(ValueError, match="x: got shape .* expected T = 1 token per row since spec.block_size"):
        run_decode_step("looped", two_tokens, spec, **RING)
    no_table = operands[:19]
    with pytest.raises(ValueError, match=r"block_table: got None, expected \[B, MB\] since spec.paged is set"):
        run_decode_step("looped", no_table, spec, **RING)
    with pytest.raises(ValueError, match="write_index: expected None since spec.contiguous is False"):
        run_decode_step("looped", operands[:12] + [np.zeros((1, 1), np.int32)] + operands[13:], spec, **RING)
    wrong_pool = list(operands)
    wrong_pool[11] = operands[11][:, :, :4]
    with pytest.raises(ValueError, match=r"v_cache: got shape \(2, 12, 4, 2, 32\), expected \(2, 12, 5, 2, 32\)"):
        run_decode_step("looped", wrong_pool, spec, **RING)


@pytest.mark.parametrize("block_size", [0, -3, 2.5, True])
def test_block_size_must_be_a_positive_int(block_size):
    with pytest.raises(ValueError, match="DecodeSpec.block_size"):
        LLAMA.replace(block_size=block_size)


def test_a_block_that_cannot_fit_the_partitions_is_refused(rng):
    """257 slots (a prime) of 4-KiB slots split only into single slots: 257 partitions per block."""
    with pytest.raises(ValueError, match="DecodeSpec.block_size: got 257"):
        paged.check_block_size(257, 4096)
    assert paged.slots_per_partition(48, 1024) == 16 and paged.slots_per_partition(12, 1024) == 12


# (kv heads, head dim, block size, table blocks, lengths): one partition per slice of a block (m = BS / q > 1:
# 48-slot blocks of 512-byte slots at q = 16, three partitions each); a window of more blocks than one tuple of 128
# partitions holds (130 five-slot blocks: two tuples).
LAYOUT_CASES = [(2, 64, 48, 3, [100, 48, 7]), (1, 64, 5, 130, [647, 400])]


@pytest.mark.parametrize("kv, head_dim, block_size, max_blocks, lengths", LAYOUT_CASES, ids=["slices", "two-tuples"])
def test_block_layouts_match_float64_reference(rng, kv, head_dim, block_size, max_blocks, lengths):
    spec = WINDOWED.replace(num_kv_heads=kv, head_dim=head_dim, block_size=block_size)
    num_blocks = max_blocks * len(lengths) + 3
    operands, table = paged_operands(rng, spec, lengths, max_blocks, num_blocks, np.float32)
    slot_bytes = kv * head_dim * 4
    layouts = [paged.window_plan(spec, mask, max_blocks * block_size, slot_bytes, len(lengths))[1] for mask in (0, 1)]
    assert any(block_size // q > 1 for layout in layouts for _, _, q in layout) or len(layouts[0]) > 1
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    logits, k_pool, v_pool = run_decode_step("looped", operands, spec, **RING)
    assert relative_error(logits, want_logits) < 1e-5
    check_pools(k_pool, operands[10], want_k, lengths, table, block_size, 1e-5)
    check_pools(v_pool, operands[11], want_v, lengths, table, block_size, 1e-5)


@pytest.mark.parametrize(
    "blocks, block_size, slot_bytes, spread",
    [(33, 16, 512, 2048), (5, 128, 512, 2048), (130, 5, 256, 8192), (300, 48, 1024, 8192)],
)
def test_paged_blocks_cover_each_window_slot_once(blocks, block_size, slot_bytes, spread):
    """Every slot of the window's blocks at exactly one (partition, column) of one tuple, each partition's slots in
    one block, at most 128 partitions and CACHE_BLOCK_BYTES per partition."""
    layout = paged.paged_blocks(blocks, block_size, slot_bytes, spread)
    slots = [s0 + p * q + i for s0, np_, q in layout for p in range(np_) for i in range(q)]
    assert sorted(slots) == list(range(blocks * block_size))
    for s0, np_, q in layout:
        assert s0 % block_size == 0 and block_size % q == 0 and np_ <= 128
        assert q * slot_bytes <= paged.CACHE_BLOCK_BYTES


# (spec, block size, table blocks MB, pool blocks, lengths, shared, composition): bf16 caches whose windows tile into
# gathering transposes (gather_groups): 16-slot blocks ([128, 2] and [32, 1] index tiles), 8-slot blocks with two kv
# heads ([128, 1] and [32, 1]), 384-slot blocks (a multiple of 128, no power of two: one [128, 6] tile), 32-slot
# blocks with fp8 weights.
GATHER_CASES = [
    (WINDOWED, 16, 18, 76, [270, 16, 77, -1], 1, "looped"),
    (WINDOWED.replace(num_kv_heads=2), 8, 20, 70, [159, 40, 3], 2, "looped"),
    (WINDOWED, 384, 2, 7, [700, 384, 5], 1, "per_layer"),
    (WINDOWED_8, 32, 5, 23, [100, 64, 31, 159], 2, "looped"),
]


def _spy_gathers(monkeypatch):
    """Counts paged.gather_keys calls; gathering transposes at any size (spread 0), so small shapes take them."""
    calls = []
    gather_keys, keys_by_gather = paged.gather_keys, paged.keys_by_gather
    monkeypatch.setattr(paged, "gather_keys", lambda *args: calls.append(args[2]) or gather_keys(*args))
    monkeypatch.setattr(paged, "keys_by_gather", lambda groups, f, dtype, spread: keys_by_gather(groups, f, dtype, 0))
    return calls


@pytest.mark.parametrize(
    "spec, block_size, max_blocks, num_blocks, lengths, shared, composition",
    GATHER_CASES,
    ids=["16", "8-two-kv-heads", "384-per-layer", "32-fp8"],
)
def test_keys_gathered_transposed_match_float64_reference(
    rng, monkeypatch, spec, block_size, max_blocks, num_blocks, lengths, shared, composition
):
    """Kᵀ by gathering transposes (trn2, bf16 cache): every layer's window through them, scattered blocks."""
    calls = _spy_gathers(monkeypatch)
    spec = spec.replace(block_size=block_size)
    operands, table = paged_operands(rng, spec, lengths, max_blocks, num_blocks, BF16, shared=shared)
    if spec.fp8_weights:
        operands = _fp8(rng, operands, spec)
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    logits, k_pool, v_pool = run_decode_step(composition, operands, spec, **RING)
    assert len(calls) == spec.num_layers * len(lengths)
    assert any(m > 1 or n == 128 for groups in calls for _, n, m in groups)  # a column-major tile or a full one
    active = [row for row, p in enumerate(lengths) if p >= 0]
    assert relative_error(logits[active], want_logits[active]) < 3e-2
    check_pools(k_pool, operands[10], want_k, lengths, table, block_size, 3e-2)
    check_pools(v_pool, operands[11], want_v, lengths, table, block_size, 3e-2)


def test_trn1_and_untiled_blocks_turn_keys_on_the_pe(rng, monkeypatch):
    """No gathering transposes on trn1 (NeuronCore-v2) nor for 48-slot blocks (neither dividing 128 nor a multiple
    of it); the PE path gives the reference's numbers."""
    calls = _spy_gathers(monkeypatch)
    for target, block_size in (("trn1", 16), ("trn2", 48)):
        spec = WINDOWED.replace(block_size=block_size)
        operands, table = paged_operands(rng, spec, [60, 17, 90], 144 // block_size, 30, BF16)
        want_logits, _, _ = reference.decode_step_f64(operands, spec)
        with emulator.use_target(target):
            logits, _, _ = run_decode_step("looped", operands, spec, **RING)
        assert relative_error(logits, want_logits) < 3e-2
    assert calls == []


def test_gather_groups_tile_windows_into_transposes():
    """Column-major [128, M] tiles then one [n, 1] tile, whole blocks, n a multiple of 16; None where they cannot."""
    assert paged.gather_groups(33, 16) == [(0, 512, 4), (512, 16, 1)]
    assert paged.gather_groups(3, 384) == [(0, 1152, 9)]
    assert paged.gather_groups(6, 8) == [(0, 48, 1)]
    assert paged.gather_groups(5, 8) is None  # 40 slots
    assert paged.gather_groups(8, 48) is None and paged.gather_groups(2, 200) is None
