"""Decode-step specs and random operands shared by the decode tests (a helper module, not a test file).

Tiny ragged specs (H = 200 natural tiles, H = 256 row-grouped tiles, I = 200 / 320 / 384, V = 300): Llama-like (dense,
no softcaps) and Gemma-3-like (unit-offset norms, q/k norms, sandwich norms, both softcaps, per-layer RoPE tables and
masks, factored projections and head with different per-layer ranks); random operands per the contract, in bf16 /
float32 or with fp8 weights (`fp8_operands`).
"""

import ml_dtypes
import numpy as np

from nki_kernels.decode.contract import (
    PROJECTIONS,
    SPLIT_ROWS,
    WEIGHTS,
    DecodeShapes,
    DecodeSpec,
    ModelVariant,
    WeightStorage,
    dense_as_factors,
)
from nki_kernels.emulator.kernel import Spec

BF16 = ml_dtypes.bfloat16
RING = dict(ring_block_bytes=4096, ring_bytes=10000)  # a few blocks: the cursor wraps inside every layer


def llama_like(num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate):
    """A Llama-like spec of this shape (vocabulary 300): SiLU, plain norms, no q/k or sandwich norms, no softcaps,
    1/sqrt(head_dim) query scaling, one RoPE table and one mask for every layer, dense projections and head."""
    return DecodeSpec(
        shapes=DecodeShapes(
            num_layers=num_layers,
            hidden=hidden,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            vocab=300,
        ),
        variant=ModelVariant(
            norm_eps=1e-5,
            norm_unit_offset=False,
            qk_norm=False,
            sandwich=False,
            activation="silu",
            query_scaling=head_dim**-0.5,
            attn_logit_softcap=None,
            final_logit_softcap=None,
            layer_rope=(0,) * num_layers,
            layer_mask=(0,) * num_layers,
        ),
    )


LLAMA = llama_like(num_layers=2, hidden=200, num_heads=4, num_kv_heads=2, head_dim=32, intermediate=200)
# An intermediate of 9 whole tiles and a ragged one (a pruned MLP's width): down's rows in grouped blocks of 5 and 4
# tiles (9's divisors up to MAX_GROUP, 1 and 3, give shorter blocks), then 64 alone.
LLAMA_RAGGED_INTERMEDIATE = LLAMA.replace(intermediate=1216)
GEMMA3 = DecodeSpec(
    shapes=DecodeShapes(
        num_layers=3, hidden=256, num_heads=4, num_kv_heads=1, head_dim=64, intermediate=384, vocab=300
    ),
    variant=ModelVariant(
        norm_eps=1e-6,
        norm_unit_offset=True,
        qk_norm=True,
        sandwich=True,
        activation="gelu_tanh",
        query_scaling=0.125,
        attn_logit_softcap=5.0,
        final_logit_softcap=3.0,
        layer_rope=(0, 1, 0),
        layer_mask=(1, 0, 1),
    ),
    storage=WeightStorage(
        ranks=((70, 33, 130), None, (5, 64, 1), (20, 40, 60), (40, 130, 7), (33, 20, 129), (60, 1, 100)), head_rank=70
    ),
)
GEMMA3_DENSE = GEMMA3.replace(ranks=(None,) * len(PROJECTIONS), head_rank=None)
# Layers left dense in factored stacks (rank None; contract.dense_in_stack): q and gate (columns split, K <= N), v
# (K > N: the stack as wide as K), o and down (rows split: W in u).
GEMMA3_DENSE_LAYERS = GEMMA3.replace(
    ranks=((70, None, 130), None, (5, None, 1), (None, 40, 60), (None, 130, 7), (33, 20, 129), (60, None, 100))
)


def make_operands(rng, spec, b, t, s, w, dtype):
    """Random operands per the contract: factors stacked to Rmax = spec.stacked_rank + 3 with zero padding (a layer
    the spec leaves dense in a factored stack: a random W as its exact factors, contract.dense_as_factors),
    rotate-half tables with duplicated halves, a causal mask with a padded first slot for row 0 (second table: a
    window)."""
    h, d, layers = spec.hidden, spec.head_dim, spec.num_layers

    def arr(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    operands = [
        arr((b, t, h)),
        arr((layers, spec.num_norms, h), 0.3),
        arr((layers, 2, d), 0.3) if spec.qk_norm else None,
    ]
    for name in PROJECTIONS:
        k, n = spec.in_features(name), spec.out_features(name)
        ranks = spec.ranks[PROJECTIONS.index(name)]
        if ranks is None:
            operands.append(arr((layers, k, n), k**-0.5))
            continue
        rmax = spec.stacked_rank(name) + 3
        spread = max(r for r in ranks if r is not None)
        u, v = arr((layers, k, rmax), k**-0.5), arr((layers, rmax, n), spread**-0.5)
        for layer, r in enumerate(ranks):
            if r is None:
                du, dv = dense_as_factors(name, arr((k, n), k**-0.5))
                u[layer], v[layer] = 0, 0
                u[layer, :, : du.shape[1]], v[layer, : dv.shape[0]] = du, dv
                continue
            u[layer, :, r:] = 0
            v[layer, r:] = 0
        operands.append([u, v])
    operands += [
        arr((layers, b, s, spec.num_kv_heads, d)),
        arr((layers, b, s, spec.num_kv_heads, d)),
        np.array([[w]], dtype=np.int32),
    ]
    angles = rng.uniform(0, 2 * np.pi, (spec.num_rope_tables, b, t, d // 2))
    angles = np.concatenate([angles, angles], axis=-1)
    operands += [np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)]
    slots = np.arange(s)
    visible = slots[None, None, :] <= w + np.arange(t)[None, :, None]  # [1, T, S] causal
    masks = np.broadcast_to(visible, (spec.num_masks, b, t, s)).copy()
    masks[:, 0, :, 0] = False  # row 0 has a padded first slot
    if spec.num_masks > 1:
        masks[1] &= slots[None, None, :] > w - 4  # a sliding window
    operands.append(np.where(masks, 0.0, np.finfo(np.float32).min).astype(np.float32))
    operands.append(arr((h,), 0.3))
    operands.append(
        arr((h, spec.vocab), h**-0.5)
        if spec.head_rank is None
        else [arr((h, spec.head_rank), h**-0.5), arr((spec.head_rank, spec.vocab), spec.head_rank**-0.5)]
    )
    return operands


def relative_error(got, want):
    return np.abs(np.asarray(got, dtype=np.float64) - want).max() / np.abs(want).max()


def check_cache(got, before, want, w, t, tolerance):
    """Only slots [w, w+t) changed (bit for bit elsewhere), and they hold the reference's k / v."""
    untouched = np.ones(got.shape[2], dtype=bool)
    untouched[w : w + t] = False
    np.testing.assert_array_equal(got[:, :, untouched].view(np.uint8), before[:, :, untouched].view(np.uint8))
    assert relative_error(got[:, :, w : w + t], want[:, :, w : w + t]) < tolerance


FP8 = np.dtype(ml_dtypes.float8_e4m3)  # Trainium's e4m3: ±240
WEIGHT_INDEX = {name: 3 + i for i, name in enumerate(WEIGHTS[:-1])} | {"head": 17}
LLAMA8 = LLAMA.replace(fp8_weights=WEIGHTS)
GEMMA3_8 = GEMMA3.replace(fp8_weights=WEIGHTS)  # k dense, the rest factored (head too)
GEMMA3_DENSE_LAYERS_8 = GEMMA3_DENSE_LAYERS.replace(fp8_weights=WEIGHTS)
LLAMA_RAGGED_INTERMEDIATE_8 = LLAMA_RAGGED_INTERMEDIATE.replace(fp8_weights=WEIGHTS)


def fp8_matrix(rng, shape, contraction):
    """(values, scales) of a random fp8 weight [..., K, N] whose dequantized columns all have about the spread of
    a 1/√contraction Gaussian, while the values cover Trainium's whole e4m3 range and the scales four orders of
    magnitude: column j's values lie in ±m_j (a quarter of them at ±m_j, the rest uniform, rounded to e4m3) with
    m_j from 240 (values at ±240) down to 0.024 (subnormals), and its float32 scale is about 1 / (m_j·√contraction)."""
    exponent = rng.uniform(0, 4, shape[:-2] + (1, shape[-1]))
    exponent[..., 0] = 0  # one column at ±240 in every matrix
    magnitude = 240 * 10.0**-exponent
    values = rng.uniform(-1, 1, shape)
    edge = rng.random(shape) < 0.25
    values[edge] = np.sign(values[edge])
    scale = np.sqrt(3) / (magnitude * np.sqrt(contraction))
    return (values * magnitude).astype(FP8), np.squeeze(scale, -2).astype(np.float32)


def fp8_weight(rng, bf16_weight, ranks=None, name=None):
    """The operand of a weight as fp8 parts with the shapes of `bf16_weight` (stacked factors keep their zero rank
    padding): [w, scale] dense, [u, v, u_scale, v_scale] factored (ranks: the per-layer ranks, for v's spread; a
    layer with rank None holds W as exact factors of projection `name`: the identity in fp8 with unit u_scale, W's
    scales in v_scale, contract.dense_in_stack)."""
    if not isinstance(bf16_weight, list):
        return list(fp8_matrix(rng, bf16_weight.shape, bf16_weight.shape[-2]))
    spread = max((r for r in ranks if r is not None), default=None) if ranks else None
    u, u_scale = fp8_matrix(rng, bf16_weight[0].shape, bf16_weight[0].shape[-2])
    v, v_scale = fp8_matrix(rng, bf16_weight[1].shape, spread or bf16_weight[1].shape[-2])
    for padded, factor in zip((u, v), bf16_weight):
        padded[factor.astype(np.float32) == 0] = 0  # the stacked factors' zero padding past each layer's rank
    for layer, r in enumerate(ranks or ()):
        if r is None:
            identity = v if name in SPLIT_ROWS else u
            width = identity.shape[-1] if name in SPLIT_ROWS else identity.shape[-2]
            identity[layer] = 0
            identity[layer, :width, :width] = np.eye(width, dtype=FP8)
            u_scale[layer] = 1
    return [u, v, u_scale, v_scale]


def fp8_operands(rng, spec, b, t, s, w, dtype=BF16):
    """make_operands in `dtype` with every weight the spec names in fp8_weights as fp8 parts."""
    operands = make_operands(rng, spec, b, t, s, w, dtype)
    for name in spec.fp8_weights:
        ranks = spec.ranks[WEIGHTS.index(name)] if name != "head" else None
        operands[WEIGHT_INDEX[name]] = fp8_weight(rng, operands[WEIGHT_INDEX[name]], ranks, name)
    return operands


def placeholders(operands):
    """Count-only Spec placeholders of operands (write_index kept: a value the kernels read)."""
    return [
        op
        if op is None or isinstance(op, np.ndarray) and op.dtype == np.int32
        else [Spec(f.shape, f.dtype) for f in op]
        if isinstance(op, list)
        else Spec(op.shape, op.dtype)
        for op in operands
    ]


def paged_operands(rng, spec, lengths, max_blocks, num_blocks, dtype, *, shared=0):
    """(operands, block_table) of a paged step (spec.block_size = BS) for rows at positions `lengths` (-1: an
    inactive row): make_operands' weights, x and tables for T = 1; random pools of num_blocks blocks; each row's
    max_blocks table entries distinct blocks drawn at random from the pool (scattered), rows 0 and 1 sharing their
    first `shared` blocks (a common prefix, wholly before both rows' positions); masks causal at each row's
    position (the second table also a sliding window of WINDOW positions)."""
    bs, b, s = spec.block_size, len(lengths), max_blocks * spec.block_size
    lengths = np.asarray(lengths, dtype=np.int32)
    operands = make_operands(rng, spec, b, 1, s, 0, dtype)
    pool = (spec.num_layers, num_blocks, bs, spec.num_kv_heads, spec.head_dim)
    operands[10] = (rng.standard_normal(pool)).astype(dtype)
    operands[11] = (rng.standard_normal(pool)).astype(dtype)
    operands[12] = None
    table = np.stack([rng.permutation(num_blocks)[:max_blocks] for _ in range(b)]).astype(np.int32)
    if shared:
        assert min(lengths[0], lengths[1]) >= shared * bs, "a shared block is written by neither row"
        table[1, :shared] = table[0, :shared]
        # the rest of row 1's blocks must not be row 0's shared ones
        others = [blk for blk in rng.permutation(num_blocks) if blk not in table[0, :shared]]
        table[1, shared:] = others[: max_blocks - shared]
    slots = np.arange(s)
    position = np.maximum(lengths, 0)[:, None]
    visible = slots[None, :] <= position  # [B, S]
    masks = np.broadcast_to(visible[None, :, None, :], (spec.num_masks, b, 1, s)).copy()
    if spec.num_masks > 1:
        masks[1] &= (slots[None, :] > position - WINDOW)[:, None, :]
    operands[15] = np.where(masks, 0.0, np.finfo(np.float32).min).astype(np.float32)
    operands += [None, table, lengths]
    return operands, table


WINDOW = 4  # the sliding window (positions) of paged_operands' second mask table
