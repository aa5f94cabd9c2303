"""Decode attention (nki_kernels.decode.attention) on the emulator against a float64 reference of the spec.

The reference follows the contract (nki_kernels.decode.contract): optional RMSNorm over head_dim (1 + w),
rotate-half RoPE from the tables, k and v written at slots [w, w + T) of layer `layer`'s cache, scores
(q·k)·scaling, optional tanh softcap, + mask bias, softmax over all S slots, weights·V (with a window, the kernel
reads only the slots the mask can make visible: the rest are NaN in the windowed tests).
"""

import ml_dtypes
import numpy as np
import pytest
from emulator_helpers import sliding_window_case

from nki_kernels.binding import nki, nl
from nki_kernels.decode.attention import (
    AttentionOperands,
    attention,
    attention_kernel,
    cache_write_kernel,
    rope_kernel,
)
from nki_kernels.decode.contract import DecodeShapes, DecodeSpec, ModelVariant
from nki_kernels.decode.tiles import load_natural_columns, store_natural_columns
from nki_kernels.emulator import count_only, profile
from nki_kernels.emulator.kernel import Spec, run

BF16 = np.dtype(ml_dtypes.bfloat16)
TOLERANCE = {np.dtype(np.float32): 2e-5, BF16: 3e-2}
LAYERS = 2
LAYER = 1  # uses rope table 0 and mask 1 (below), so table indexing is exercised


def make_spec(heads, kv, d, qk_norm, softcap):
    return DecodeSpec(
        shapes=DecodeShapes(
            num_layers=LAYERS, hidden=64, num_heads=heads, num_kv_heads=kv, head_dim=d, intermediate=64, vocab=32
        ),
        variant=ModelVariant(
            norm_eps=1e-6,
            norm_unit_offset=True,
            qk_norm=qk_norm,
            sandwich=False,
            activation="gelu_tanh",
            query_scaling=d**-0.5,
            attn_logit_softcap=softcap,
            final_logit_softcap=None,
            layer_rope=(1, 0),
            layer_mask=(0, 1),
        ),
    )


def make_operands(rng, spec, s, b, t, w, dtype):
    d, heads, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    q = rng.standard_normal((b, t, heads * d)).astype(dtype)
    k = rng.standard_normal((b, t, kv * d)).astype(dtype)
    v = rng.standard_normal((b, t, kv * d)).astype(dtype)
    k_cache = rng.standard_normal((LAYERS, b, s, kv, d)).astype(dtype)
    v_cache = rng.standard_normal((LAYERS, b, s, kv, d)).astype(dtype)
    write_index = np.array([[w]], dtype=np.int32)
    positions = w + np.arange(t)[None, :] + rng.integers(0, 5, size=(b, 1))  # row offsets: padded rows
    tables = []
    for base in (10000.0, 100.0):
        inv_freq = base ** (-np.arange(0, d, 2) / d)
        angles = positions[..., None] * inv_freq
        angles = np.concatenate([angles, angles], axis=-1)
        tables.append((np.cos(angles), np.sin(angles)))
    cos = np.stack([c for c, _ in tables]).astype(np.float32)
    sin = np.stack([s_ for _, s_ in tables]).astype(np.float32)
    # Mask 0: causal over the written slots with per-row padding; mask 1: a sliding window of 3 slots.
    slot = np.arange(s)
    query_slot = (w + np.arange(t))[None, :, None]
    padding = rng.integers(0, max(1, w // 2) + 1, size=(b, 1, 1))
    causal = (slot <= query_slot) & (slot >= padding)
    window = (slot <= query_slot) & (slot > query_slot - 3)
    lowest = np.finfo(np.float32).min
    mask_bias = np.stack([np.where(causal, 0.0, lowest), np.where(window & np.ones((b, 1, 1), bool), 0.0, lowest)])
    qk_norms = (0.5 * rng.standard_normal((LAYERS, 2, d))).astype(dtype) if spec.qk_norm else None
    return q, k, v, k_cache, v_cache, write_index, cos, sin, mask_bias.astype(np.float32), qk_norms


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def reference_norm_rope(q, k, cos, sin, qk_norms, spec, layer):
    """(q [B, T, heads, D], k [B, T, kv, D]) in float64 after the optional RMSNorm and RoPE."""
    b, t, _ = q.shape
    d = spec.head_dim
    q = q.astype(np.float64).reshape(b, t, spec.num_heads, d)
    k = k.astype(np.float64).reshape(b, t, spec.num_kv_heads, d)
    if spec.qk_norm:

        def norm(x, w):
            w = w.astype(np.float64)
            return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + spec.norm_eps) * (1.0 + w)

        q, k = norm(q, qk_norms[layer, 0]), norm(k, qk_norms[layer, 1])
    c = cos[spec.layer_rope[layer]].astype(np.float64)[:, :, None, :]
    s = sin[spec.layer_rope[layer]].astype(np.float64)[:, :, None, :]
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def reference_attend(q, k_layer, v_layer, mask, spec):
    """attn [B, T, heads·D] float64 of q [B, T, heads, D] over caches [B, S, kv, D] with mask [B, T, S]."""
    b, t, heads, d = q.shape
    g = heads // spec.num_kv_heads
    keys = np.repeat(k_layer.astype(np.float64), g, axis=2)
    values = np.repeat(v_layer.astype(np.float64), g, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, keys) * spec.query_scaling
    if spec.attn_logit_softcap:
        scores = np.tanh(scores / spec.attn_logit_softcap) * spec.attn_logit_softcap
    scores = scores + mask.astype(np.float64)[:, None]
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", weights, values).reshape(b, t, heads * d)


def reference(operands, spec, layer):
    """(attn float64, k rows written, v rows written) of one layer's decode attention."""
    q, k, v, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norms = operands
    b, t, _ = q.shape
    w = int(write_index[0, 0])
    q64, k64 = reference_norm_rope(q, k, cos, sin, qk_norms, spec, layer)
    new_k = k64.astype(k_cache.dtype)  # the cache holds the model dtype
    new_v = v.reshape(new_k.shape)
    k_layer, v_layer = k_cache[layer].copy(), v_cache[layer].copy()
    k_layer[:, w : w + t], v_layer[:, w : w + t] = new_k, new_v
    attn = reference_attend(q64, k_layer, v_layer, mask_bias[spec.layer_mask[layer]], spec)
    return attn, new_k, new_v


@nki.jit
def attention_layer_kernel(q, k, v, caches, write_index, rope, mask_bias, qk_norms, *, layer, spec):
    """attention() between row loads and stores, caches = (k_cache, v_cache), rope = (cos, sin): returns (attn rows
    [B, T, heads·D], k_cache, v_cache)."""
    (k_cache, v_cache), (cos, sin) = caches, rope
    ops = AttentionOperands(k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norms)
    attnT = attention(load_natural_columns(q), load_natural_columns(k), load_natural_columns(v), ops, layer, spec)
    out = nl.ndarray(q.shape, dtype=k_cache.dtype, buffer=nl.shared_hbm, name="attn")
    store_natural_columns(out, attnT)
    return out, k_cache, v_cache


def relative_error(got, want):
    return np.abs(np.asarray(got, dtype=np.float64) - want).max() / np.abs(want).max()


def check_caches(got, before, new_rows, w, t):
    """The cache equals `before` except slots [w, w+t) of layer LAYER, which hold new_rows exactly."""
    expected = before.copy()
    expected[LAYER, :, w : w + t] = new_rows
    np.testing.assert_array_equal(
        got.view(np.uint8) if got.dtype == BF16 else got,
        expected.view(np.uint8) if expected.dtype == BF16 else expected,
    )


# (head_dim, heads, kv_heads, S, B, T, write slot, qk_norm, softcap, dtype): ragged S, write in the middle and at
# the end, D below a tile (several heads per tile) and two tiles per head.
CASES = [
    (32, 4, 2, 10, 3, 2, 4, True, None, np.float32),
    (64, 4, 1, 130, 1, 1, 129, False, 30.0, np.float32),
    (256, 4, 1, 130, 1, 2, 128, True, None, np.float32),
    (256, 4, 2, 10, 3, 1, 3, False, 50.0, np.float32),
    (32, 4, 1, 130, 3, 2, 64, False, 20.0, np.float32),
    (64, 4, 2, 130, 3, 1, 60, True, 20.0, BF16),
    # S >= 256: cache blocks of several slots per partition (the permuted slot order of the scores)
    (64, 4, 2, 300, 2, 2, 150, False, None, np.float32),
    (256, 4, 1, 300, 1, 1, 299, True, None, BF16),  # Gemma 3 270M's heads; bf16 keys turned on the PE
    (128, 8, 8, 300, 1, 1, 299, False, None, BF16),  # bf16 keys by transposing DMA (8 tiles x 300 slots)
    # KV features that end in a ragged tile (3 x 64 = 192, 5 x 64 = 320), queries too (9 x 64 = 576): keys turned
    # on the PE, then by transposing DMA (bf16, 1100 slots)
    (64, 9, 3, 40, 2, 2, 20, True, 30.0, np.float32),
    (64, 10, 5, 1100, 1, 1, 1000, True, None, BF16),
]


def layer_kernel_call(operands, spec, layer=LAYER):
    """attention_layer_kernel of `layer` on make_operands' flat operands."""
    q, k, v, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norms = operands
    caches, rope = (k_cache, v_cache), (cos, sin)
    return attention_layer_kernel(q, k, v, caches, write_index, rope, mask_bias, qk_norms, layer=layer, spec=spec)


@pytest.mark.parametrize("case", CASES)
def test_attention_matches_float64_reference(rng, case):
    d, heads, kv, s, b, t, w, qk_norm, softcap, dtype = case
    spec = make_spec(heads, kv, d, qk_norm, softcap)
    operands = make_operands(rng, spec, s, b, t, w, np.dtype(dtype))
    attn, k_cache, v_cache = layer_kernel_call(operands, spec)
    want, new_k, new_v = reference(operands, spec, LAYER)
    assert attn.shape == (b, t, heads * d) and attn.dtype == np.dtype(dtype)
    assert relative_error(attn, want) < TOLERANCE[np.dtype(dtype)]
    if dtype == np.float32:
        assert np.abs(k_cache[LAYER, :, w : w + t] - new_k).max() < 1e-5
        new_k = k_cache[LAYER, :, w : w + t]  # fp32 rounding of norm and RoPE; exactness checked for bf16
    check_caches(k_cache, operands[3], new_k, w, t)
    check_caches(v_cache, operands[4], new_v, w, t)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]])
def test_per_op_kernels_compose_to_the_reference(rng, case):
    d, heads, kv, s, b, t, w, qk_norm, softcap, dtype = case
    spec = make_spec(heads, kv, d, qk_norm, softcap)
    operands = make_operands(rng, spec, s, b, t, w, np.dtype(dtype))
    q, k, v, k_cache, v_cache, write_index, cos, sin, mask_bias, qk_norms = operands
    q_rope, k_rope = rope_kernel(q, k, cos, sin, qk_norms, layer=LAYER, spec=spec)
    q64, k64 = reference_norm_rope(q, k, cos, sin, qk_norms, spec, LAYER)
    assert relative_error(q_rope, q64.reshape(q.shape)) < 1e-5
    assert relative_error(k_rope, k64.reshape(k.shape)) < 1e-5
    k_out, v_out = cache_write_kernel(k_rope, v, k_cache, v_cache, write_index, layer=LAYER)
    check_caches(k_out, k_cache, k_rope.reshape(b, t, kv, d), w, t)
    check_caches(v_out, v_cache, v.reshape(b, t, kv, d), w, t)
    attn = attention_kernel(q_rope, k_out, v_out, write_index, mask_bias, layer=LAYER, spec=spec)
    want, _, _ = reference(operands, spec, LAYER)
    assert relative_error(attn, want) < 1e-4


def windowed_operands(rng, spec, s, b, t, w, window, dtype):
    """(kernel operands, reference operands) with mask 1 a sliding window of `window` slots per query over
    left-padded rows (row b's first pad_b <= w slots hold no token, so rows sit at different positions). In the
    kernel's copy, layer LAYER's cache slots outside the window the kernel may read are NaN: reading one would
    poison the scores."""
    operands = list(make_operands(rng, spec, s, b, t, w, dtype))
    operands[8] = operands[8].copy()
    operands[8][1], outside = sliding_window_case(rng, s, b, t, w, window)
    poisoned = list(operands)
    for i in (3, 4):
        poisoned[i] = operands[i].copy()
        poisoned[i][LAYER][:, outside] = np.nan
    return poisoned, operands


# (head_dim, heads, kv_heads, S, B, T, write slot, window, dtype): the window's first slot clamped to 0 (before
# and at the window's edge), inside the cache (past the edge, T = 2, ragged S), clamped to S - window at the end
# (slots blocked several per partition); bf16 keys by transposing DMA.
WINDOW_CASES = [
    (64, 4, 1, 20, 3, 1, 2, 5, np.float32),
    (64, 4, 1, 20, 3, 1, 4, 5, np.float32),
    (32, 4, 2, 130, 3, 2, 64, 7, np.float32),
    (256, 4, 1, 300, 2, 1, 299, 260, BF16),
    (256, 4, 1, 300, 1, 2, 150, 130, BF16),
    (64, 4, 2, 300, 2, 2, 200, 150, np.float32),
]


@pytest.mark.parametrize("d,heads,kv,s,b,t,w,window,dtype", WINDOW_CASES)
def test_windowed_attention_reads_only_the_window(rng, d, heads, kv, s, b, t, w, window, dtype):
    spec = make_spec(heads, kv, d, True, 20.0).replace(mask_windows=(None, window))
    poisoned, operands = windowed_operands(rng, spec, s, b, t, w, window, np.dtype(dtype))
    want, new_k, new_v = reference(operands, spec, LAYER)
    attn, k_cache, v_cache = layer_kernel_call(poisoned, layer=LAYER, spec=spec)
    assert relative_error(attn, want) < TOLERANCE[np.dtype(dtype)]
    if dtype == np.float32:
        new_k = k_cache[LAYER, :, w : w + t]
    check_caches(k_cache, poisoned[3], new_k, w, t)
    check_caches(v_cache, poisoned[4], new_v, w, t)
    # The per-op kernel takes the same window.
    q_rope, _ = rope_kernel(*(operands[i] for i in (0, 1, 6, 7, 9)), layer=LAYER, spec=spec)
    attn = attention_kernel(q_rope, k_cache, v_cache, poisoned[5], poisoned[8], layer=LAYER, spec=spec)
    assert relative_error(attn, want) < TOLERANCE[np.dtype(dtype)] + 1e-4


# (head_dim, heads, kv_heads, S, B, T, write slot, window or None, dtype): attention() reads the window before it
# writes this step's slots. Blocks of 512-byte slots at S = 300: slots 0..287 on 18 partitions of 16, then 288..299
# one per partition. New slots at a block's first slot, a partition's first column inside a block, the last slot of
# a block, across two blocks (T = 2), in the middle of a partition, at the cache's end; B = 2 (the new piece holds
# both rows' tokens, each masked for the other row); a sliding window whose first slot is not 0.
NEW_SLOT_CASES = [
    (64, 4, 2, 300, 1, 1, 288, None, np.float32),
    (64, 4, 2, 300, 2, 1, 80, None, np.float32),
    (64, 4, 2, 300, 1, 1, 287, None, np.float32),
    (64, 4, 2, 300, 2, 2, 287, None, np.float32),
    (256, 4, 1, 300, 1, 1, 150, None, BF16),
    (256, 4, 1, 300, 1, 2, 298, None, BF16),
    (64, 4, 2, 300, 2, 2, 200, 150, np.float32),
]


@pytest.mark.parametrize("d,heads,kv,s,b,t,w,window,dtype", NEW_SLOT_CASES)
def test_new_tokens_enter_from_chip(rng, d, heads, kv, s, b, t, w, window, dtype):
    """This step's slots hold large stale values before the step (finite, as the contract asks): had attention read
    them, they would dominate the scores and the output. It must give them weight 0, take the new k and v from chip
    exactly (the float64 reference attends over the written cache) and still write them."""
    spec = make_spec(heads, kv, d, True, None)
    if window is None:
        operands = list(make_operands(rng, spec, s, b, t, w, np.dtype(dtype)))
    else:
        spec = spec.replace(mask_windows=(None, window))
        _, operands = windowed_operands(rng, spec, s, b, t, w, window, np.dtype(dtype))
    want, new_k, new_v = reference(operands, spec, LAYER)
    stale = list(operands)
    for i, value in ((3, 1e4), (4, 1e6)):
        stale[i] = operands[i].copy()
        stale[i][LAYER, :, w : w + t] = value
    attn, k_cache, v_cache = layer_kernel_call(stale, layer=LAYER, spec=spec)
    assert relative_error(attn, want) < TOLERANCE[np.dtype(dtype)]
    if dtype == np.float32:
        new_k = k_cache[LAYER, :, w : w + t]
    check_caches(k_cache, stale[3], new_k, w, t)
    check_caches(v_cache, stale[4], new_v, w, t)


@pytest.mark.parametrize("s,t,window", [(300, 1, 64), (2048, 1, 512), (130, 2, 40)])
def test_windowed_attention_moves_only_the_window(s, t, window):
    """Count-only: the cache and mask bytes read shrink by exactly the slots outside the window."""
    b, d, heads, kv = 2, 256, 4, 1
    dtype = np.dtype(BF16)
    spec = make_spec(heads, kv, d, True, None)
    args = (
        Spec((b, t, heads * d), dtype),
        Spec((LAYERS, b, s, kv, d), dtype),
        Spec((LAYERS, b, s, kv, d), dtype),
        np.array([[s // 2]], dtype=np.int32),
        Spec((2, b, t, s), np.float32),
    )
    read = {}
    for windows in ((), (None, window)):
        with count_only(), profile() as prof:
            run(attention_kernel, args, dict(layer=LAYER, spec=spec.replace(mask_windows=windows)))
        read[windows] = prof.runs[0].hbm_bytes_read
    span = window + t - 1
    assert read[()] - read[(None, window)] == b * (s - span) * (2 * kv * d * dtype.itemsize + t * 4)


def test_rejects_bad_operands(rng):
    spec = make_spec(4, 2, 32, False, None)
    operands = list(make_operands(rng, spec, 10, 1, 1, 2, np.dtype(np.float32)))
    operands[5] = np.array([[2]], dtype=np.int16)
    with pytest.raises(TypeError, match="write_index"):
        layer_kernel_call(operands, layer=LAYER, spec=spec)
    operands[5] = np.array([[2]], dtype=np.int32)
    with pytest.raises(ValueError, match="layer"):
        layer_kernel_call(operands, layer=LAYERS, spec=spec)
    with pytest.raises(ValueError, match="head_dim"):
        layer_kernel_call(operands, layer=LAYER, spec=make_spec(4, 2, 48, False, None))
    # The HBM operands are checked against the contract (nki_kernels.decode.contract).
    cos = operands[6]
    operands[6] = cos[..., :16]
    with pytest.raises(ValueError, match=r"attention: cos: got shape \(2, 1, 1, 16\), expected \(2, 1, 1, 32\)"):
        layer_kernel_call(operands, layer=LAYER, spec=spec)
    operands[6], operands[9] = cos, np.ones((LAYERS, 2, 32), dtype=np.float32)
    with pytest.raises(ValueError, match="attention: qk_norms: expected None since spec.qk_norm is False"):
        layer_kernel_call(operands, layer=LAYER, spec=spec)
