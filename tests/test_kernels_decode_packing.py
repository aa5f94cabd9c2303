"""Packed weights of the decode step (DecodeSpec.packed_weights; nki_kernels.decode.layouts, .packing), fp8 and
bf16: the packed layout element by element against an independent float64 construction, the pack / unpack round
trip, the looped and per-layer kernels on packed operands (one rank, and every rank of a tensor-parallel split
packing its own shard) against the float64 reference and the unpacked kernels, the default packing, the DMA runs
it buys, and errors that name the argument.

Ragged shapes: the Gemma-3-like spec has H = 256 (row-grouped), factored q / v / o at per-layer ranks 70, 33, 130 /
5, 64, 1 / 20, 40, 60 (rank 130: a 128-partition tile and a 2-partition one), k dense (Quantized in fp8); the
Llama-like one H = 200 (natural tiles of 128 and 72 partitions), every projection dense (fp8).
"""

import dataclasses

import numpy as np
import pytest
from decode_operands import (
    BF16,
    GEMMA3,
    GEMMA3_8,
    GEMMA3_DENSE,
    GEMMA3_DENSE_LAYERS,
    GEMMA3_DENSE_LAYERS_8,
    LLAMA,
    LLAMA8,
    RING,
    WEIGHT_INDEX,
    check_cache,
    fp8_operands,
    make_operands,
    relative_error,
)
from harness import comparison
from harness.runner import run_decode_step, run_sharded_decode_step

from nki_kernels import emulator
from nki_kernels.decode import layouts, packing, reference, tiles
from nki_kernels.decode.contract import FP8, OPTIONAL_LAST, PROJECTIONS, DecodeOperands, Dense, Factored, check
from nki_kernels.decode.sharding import gather_cache, shard_operands
from nki_kernels.emulator import cost_model, trace

ATTENTION = ("q", "k", "v", "o")
GEMMA_PACKED = GEMMA3_8.replace(packed_weights=ATTENTION)
LLAMA_PACKED = LLAMA8.replace(packed_weights=("k", "o", "up"))
# bf16: the factored attention projections (k is dense) and down (ranks 60, 1, 100: a rank-1 layer's 1-element rows).
GEMMA_BF16_PACKED = GEMMA3.replace(packed_weights=("q", "v", "o", "down"))
# bf16 with dense projections packed (packing.attention_packing(..., dense=True), a tensor-parallel rank's small
# shards): the attention with k dense beside its factors, and every one of Llama's dense (H = 200: natural tiles).
GEMMA_BF16_MIXED = GEMMA3.replace(packed_weights=ATTENTION)
LLAMA_BF16_PACKED = LLAMA.replace(packed_weights=ATTENTION)
# Layers left dense in factored stacks (rank None: their W packed alone), fp8 and bf16.
GEMMA_DENSE_LAYERS_PACKED = GEMMA3_DENSE_LAYERS_8.replace(packed_weights=("q", "v", "o"))
GEMMA_BF16_DENSE_LAYERS_PACKED = GEMMA3_DENSE_LAYERS.replace(packed_weights=("q", "v", "o", "down"))
SPECS = [
    GEMMA_PACKED,
    LLAMA_PACKED,
    GEMMA_BF16_PACKED,
    GEMMA_BF16_MIXED,
    LLAMA_BF16_PACKED,
    GEMMA_DENSE_LAYERS_PACKED,
    GEMMA_BF16_DENSE_LAYERS_PACKED,
]
SPEC_IDS = [
    "gemma3-attention",
    "llama-dense",
    "gemma3-bf16",
    "gemma3-bf16-dense-k",
    "llama-bf16-dense",
    "gemma3-dense-layers",
    "gemma3-bf16-dense-layers",
]


def _operands(rng, spec, b, t, s, w, dtype=BF16):
    """Unpacked operands of `spec`'s unpacked spec: fp8 weights, or ones in the model's dtype `dtype` (factors
    stacked past their ranks)."""
    plain = packing.unpacked_spec(spec)
    if spec.packed_fp8:
        return fp8_operands(rng, plain, b, t, s, w)
    return make_operands(rng, plain, b, t, s, w, dtype)


def _layer_values(ops, spec, name, layer):
    """[(part, [K, N] float64 values)] of projection `name` in `layer`, cut to the layer's rank (a layer left dense
    in a factored stack: its W, v's first K rows or o's and down's u's first N columns)."""
    weight, rank = getattr(ops, name), spec.rank(name, layer)
    if rank is None and isinstance(weight, Factored):
        k, n = spec.in_features(name), spec.out_features(name)
        w = weight.u[layer][:, :n] if name in ("o", "down") else weight.v[layer][:k]
        return [("w", w.astype(np.float64))]
    if rank is None:
        return [("w", (weight.w if hasattr(weight, "w") else weight)[layer].astype(np.float64))]
    return [("u", weight.u[layer][:, :rank].astype(np.float64)), ("v", weight.v[layer][:rank].astype(np.float64))]


def _packed_f64(ops, spec):
    """The packed operand built element by element from the layouts' definition: partition p of a block of
    `count` tiles starting at feature k0 holds rows k0 + p·count + i (i < count), whole, one after another."""
    rows = []
    for layer in range(spec.num_layers):
        row = np.zeros((128, 0))
        for name in spec.packed_weights:
            lay = layouts.Layouts(spec)
            for part, values in _layer_values(ops, spec, name, layer):
                layout = lay.input(name) if part != "v" else layouts.grouped_layout(values.shape[0], values.shape[1])
                for k0, ks, _, count, partitions in tiles.layout_blocks(layout):
                    block = np.zeros((128, count * values.shape[1]))
                    for p in range(partitions):
                        for i in range(count):
                            n = values.shape[1]
                            block[p, i * n : (i + 1) * n] = values[k0 + p * count + i]
                    row = np.concatenate([row, block], axis=1)
        rows.append(row)
    width = max(row.shape[1] for row in rows)
    return np.stack([np.pad(row, ((0, 0), (0, width - row.shape[1]))) for row in rows])


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_packed_layout_and_round_trip(rng, spec):
    plain = packing.unpacked_spec(spec)
    ops = DecodeOperands.of(_operands(rng, spec, 2, 1, 8, 3), plain)
    packed = packing.pack_weights(ops, spec)
    check(spec, packed, "test", padded_ranks=True)
    assert packed.packed.shape == layouts.packed_shape(spec)
    assert packed.packed.dtype == (FP8 if spec.packed_fp8 else BF16)
    np.testing.assert_array_equal(packed.packed.astype(np.float64), _packed_f64(ops, spec))
    for name in spec.packed_weights:
        weight = getattr(packed, name)
        assert all(getattr(weight, part) is None for part in ("u", "v", "w") if hasattr(weight, part))
        if not spec.packed_fp8:  # nothing left of it: an empty Factored (Dense), None as a kernel argument
            assert type(weight) is (Factored if spec.factored(name) else Dense)
            assert weight.parts() == {} and DecodeOperands.of(packed.kernel_args(), spec) == packed
    back = packing.unpack_weights(packed, spec)
    assert back.packed is None
    check(plain, back, "test", padded_ranks=True)
    for name in PROJECTIONS:
        want, got = getattr(ops, name), getattr(back, name)
        if not hasattr(want, "parts"):
            np.testing.assert_array_equal(got, want)
            continue
        for part, value in want.parts().items():  # fp8: padded past the largest rank as given; bf16: to it
            got_part = getattr(got, part).astype(np.float64)
            cut = tuple(slice(0, size) for size in got_part.shape)
            np.testing.assert_array_equal(got_part, value[cut].astype(np.float64))


@pytest.mark.parametrize("composition", ["looped", "per_layer"])
@pytest.mark.parametrize(
    "spec, b, t, s, w, dtype, tolerance",
    [
        (GEMMA_PACKED, 1, 2, 20, 7, BF16, 5e-2),
        (LLAMA_PACKED, 3, 1, 12, 11, BF16, 5e-2),
        (GEMMA_BF16_PACKED, 2, 3, 19, 5, BF16, 1e-1),
        (GEMMA_BF16_PACKED, 1, 2, 20, 7, np.float32, 1e-5),
        (GEMMA_BF16_MIXED, 2, 1, 19, 5, BF16, 1e-1),
        (LLAMA_BF16_PACKED, 3, 1, 13, 11, BF16, 5e-2),
        (LLAMA_BF16_PACKED, 1, 7, 20, 4, np.float32, 1e-5),
        (GEMMA_DENSE_LAYERS_PACKED, 2, 1, 19, 5, BF16, 5e-2),
        (GEMMA_BF16_DENSE_LAYERS_PACKED, 1, 2, 20, 7, np.float32, 1e-5),
    ],
    ids=[*SPEC_IDS[:3], "gemma3-fp32", *SPEC_IDS[3:5], "llama-fp32-dense", *SPEC_IDS[5:]],
)
def test_kernels_on_packed_weights_match_float64_reference(rng, composition, spec, b, t, s, w, dtype, tolerance):
    """The packed step against the float64 reference of the unpacked operands, and bit for bit the unpacked
    kernels' step (the same matmuls on the same values). The reference's tolerance is that of the activations'
    dtype: bf16 over a few layers of fp8 weights spanning the whole e4m3 range, or of bf16 factors whose rank-r
    intermediates (ranks 1 to 130) are rounded to bf16 (the unpacked kernels' error on the same draw); fp32 tight
    (the packed operand then holds fp32 values)."""
    plain = packing.unpacked_spec(spec)
    operands = _operands(rng, spec, b, t, s, w, dtype)
    packed = packing.pack_weights(DecodeOperands.of(operands, plain), spec)
    want_logits, want_k, want_v = reference.decode_step_f64(operands, plain)
    np.testing.assert_array_equal(reference.decode_step_f64(packed, spec)[0], want_logits)  # it unpacks them
    k_before, v_before = operands[10].copy(), operands[11].copy()
    logits, k_cache, v_cache = run_decode_step(composition, packed, spec, **RING)
    assert np.std(want_logits) > 0.1
    assert relative_error(logits, want_logits) < tolerance
    check_cache(k_cache, k_before, want_k, w, t, tolerance)
    check_cache(v_cache, v_before, want_v, w, t, tolerance)
    caches = dict(k_cache=k_before.copy(), v_cache=v_before.copy())
    unpacked = run_decode_step(composition, DecodeOperands.of(operands, plain).replace(**caches), plain, **RING)
    np.testing.assert_array_equal(logits, unpacked[0])
    np.testing.assert_array_equal(k_cache.view(np.uint8), unpacked[1].view(np.uint8))


def test_default_packing_takes_gemma_attention_factors_only():
    models = comparison.published_decode_models(["Gemma 3 270M", "Llama-3.2-1B"])
    gemma = comparison.decode_spec(models["Gemma 3 270M"], 18, compressed=True, fp8=True)
    assert gemma.packed_weights == ATTENTION and layouts.packed_shape(gemma) == (18, 128, 8448)
    assert comparison.decode_spec(models["Gemma 3 270M"], 18, compressed=False, fp8=True).packed_weights == ()
    bf16 = comparison.decode_spec(models["Gemma 3 270M"], 18, compressed=True)  # 16896 bytes a partition
    assert bf16.packed_weights == ATTENTION and not bf16.packed_fp8 and layouts.packed_shape(bf16) == (18, 128, 8448)
    assert comparison.decode_spec(models["Gemma 3 270M"], 18, compressed=False).packed_weights == ()
    for ranks in (2, 4):  # each rank packs its shard's factors
        assert comparison.tp_spec(models["Gemma 3 270M"], 2, True, ranks).packed_weights == ATTENTION
    assert comparison.decode_spec(models["Llama-3.2-1B"], 2, compressed=True, fp8=True).packed_weights == ()
    assert comparison.decode_spec(models["Llama-3.2-1B"], 2, compressed=True).packed_weights == ()
    # fp8 beside bf16 factors: the fp8 ones (one dtype to a packed operand)
    mixed = packing.unpacked_spec(gemma).replace(fp8_weights=("q", "o"))
    assert packing.attention_packing(mixed) == ("q", "o")


@pytest.mark.parametrize(
    "spec",
    [GEMMA_PACKED, GEMMA_BF16_PACKED, GEMMA3_DENSE.replace(packed_weights=ATTENTION)],
    ids=["fp8", "bf16", "bf16-dense"],
)
def test_tensor_parallel_ranks_each_pack_their_shard(rng, spec):
    """A whole model's packed step split over T = 2 and 4 ranks (shard_operands unpacks, shards, and packs each
    rank's shard in its own layout): every rank's looped kernel on its packed shard returns bit for bit what the
    unpacked shards return, and the float64 reference's logits and caches."""
    plain = packing.unpacked_spec(spec)
    b, t, s, w = 2, 1, 16, 6
    operands = _operands(rng, spec, b, t, s, w)
    want_logits, want_k, want_v = reference.decode_step_f64(operands, plain)
    packed = packing.pack_weights(DecodeOperands.of(operands, plain), spec)
    for ranks in (2, 4):
        rank_spec, shards = shard_operands(spec, packed, ranks)
        assert rank_spec.packed_weights == spec.packed_weights and rank_spec.tensor_parallel == ranks
        for shard in shards:
            check(rank_spec, shard, "test", padded_ranks=True)
            assert shard.packed.shape == layouts.packed_shape(rank_spec)
        logits, k_caches, v_caches = run_sharded_decode_step("looped", shards, rank_spec, **RING)
        plain_spec, plain_shards = shard_operands(plain, DecodeOperands.of(operands, plain), ranks)
        unpacked = run_sharded_decode_step("looped", plain_shards, plain_spec, **RING)
        np.testing.assert_array_equal(logits, unpacked[0])
        assert relative_error(logits, want_logits) < 5e-2
        k_cache = gather_cache(k_caches, spec.num_kv_heads)
        check_cache(k_cache, operands[10], want_k, w, t, 5e-2)
        check_cache(gather_cache(v_caches, spec.num_kv_heads), operands[11], want_v, w, t, 5e-2)
        np.testing.assert_array_equal(
            k_cache.view(np.uint8), gather_cache(unpacked[1], spec.num_kv_heads).view(np.uint8)
        )


def test_tensor_parallel_ranks_pack_dense_attention_where_it_fits_a_block():
    """comparison.tp_spec packs a rank's dense bf16 attention (attention_packing(..., dense=True)) at batch 1
    where the four shards fit one ring block a partition: Llama-3.1-8B at T = 32 exactly (q, k, v [4096, 128],
    o [128, 4096]: 32 KiB), not at T = 8; one rank and batch 8 keep decode_spec's packing (none for a dense
    model); compressed shards pack their factors as before, and fp8_only (the JAX side's choice) never packs dense
    weights."""
    models = comparison.published_decode_models(["Gemma 3 270M", "Llama-3.1-8B"])
    llama = models["Llama-3.1-8B"]
    spec = comparison.tp_spec(llama, 2, False, 32)
    assert spec.packed_weights == ATTENTION and not spec.packed_fp8
    assert layouts.packed_shape(spec) == (2, 128, packing.RING_BLOCK_BYTES // 2)
    assert comparison.tp_spec(llama, 2, False, 8).packed_weights == ()
    assert comparison.tp_spec(models["Gemma 3 270M"], 2, False, 1).packed_weights == ()
    assert comparison.tp_spec(models["Gemma 3 270M"], 2, False, 4).packed_weights == ATTENTION
    assert comparison.tp_spec(models["Gemma 3 270M"], 2, True, 4).packed_weights == ATTENTION
    assert comparison.tp_spec(llama, 2, False, 32, batch=8).packed_weights == ()  # chain-bound: left unpacked
    assert comparison.tp_spec(models["Gemma 3 270M"], 2, True, 4, batch=8).packed_weights == ATTENTION
    assert packing.attention_packing(spec, fp8_only=True) == () and packing.attention_packing(spec) == ()
    assert packing.attention_packing(packing.unpacked_spec(spec), dense=True) == ATTENTION


def test_packed_attention_moves_long_runs_once():
    """Gemma 3 270M (2 layers, keep 0.8, fp8): the packed step reads the bytes the unpacked one does, and its
    attention factors in one 8448-byte run a partition a layer where alone they moved 256 to 2048 bytes."""
    model = comparison.published_decode_models(["Gemma 3 270M"])["Gemma 3 270M"]
    spec = comparison.decode_spec(model, 2, compressed=True, fp8=True)
    runs = {}
    for key, case in (("packed", spec), ("plain", packing.unpacked_spec(spec))):
        records = []
        trace.add_listener(records.append)
        try:
            with emulator.use_target("trn2"), emulator.count_only():
                run_decode_step("looped", comparison.operand_specs(case, 1, 64), case, numerics=False)
        finally:
            trace.remove_listener(records.append)
        runs[key] = records[0]

    def hbm_read(run):
        return sum(r.dma.nbytes for r in run.records if r.engine == "dma" and r.dma and r.dma.src_buffer == "hbm")

    assert hbm_read(runs["packed"]) == hbm_read(runs["plain"])

    def weight_runs(run):
        return {
            cost_model.dma_buffer_bytes(r)
            for r in run.records
            if r.engine == "dma" and r.dma and r.dma.src_buffer == "hbm" and r.line.split("/")[-1].startswith("ring")
        }

    assert {256, 640} <= weight_runs(runs["plain"])
    assert 8448 in weight_runs(runs["packed"]) and min(weight_runs(runs["packed"])) > 1024


def test_bad_packing_is_refused_naming_the_argument(rng):
    with pytest.raises(ValueError, match=r"packed_weights.*fp8_weights names only \['q'\].*share one dtype"):
        GEMMA3_8.replace(fp8_weights=("q",), packed_weights=("q", "v"))
    with pytest.raises(ValueError, match=r"packed_weights.*distinct names"):
        GEMMA3_8.replace(packed_weights=("head",))
    bf16_plain = packing.unpacked_spec(GEMMA_BF16_PACKED)
    bf16_ops = DecodeOperands.of(make_operands(rng, bf16_plain, 1, 1, 8, 3, BF16), bf16_plain)
    bf16 = packing.pack_weights(bf16_ops, GEMMA_BF16_PACKED)
    with pytest.raises(TypeError, match=r"test: packed: got dtype float32, expected bfloat16"):
        check(GEMMA_BF16_PACKED, bf16.replace(packed=bf16.packed.astype(np.float32)), "test", padded_ranks=True)
    with pytest.raises(ValueError, match=r"test: v.u: expected None since spec.packed_weights names v"):
        check(GEMMA_BF16_PACKED, bf16.replace(v=bf16_ops.v), "test", padded_ranks=True)
    plain = packing.unpacked_spec(GEMMA_PACKED)
    ops = DecodeOperands.of(fp8_operands(rng, plain, 1, 1, 8, 3), plain)
    packed = packing.pack_weights(ops, GEMMA_PACKED)
    with pytest.raises(ValueError, match=r"test: packed: got None, expected \[L, 128, E\]"):
        check(GEMMA_PACKED, packed.replace(packed=None), "test", padded_ranks=True)
    with pytest.raises(ValueError, match=r"test: q.u: expected None since spec.packed_weights names q"):
        check(GEMMA_PACKED, packed.replace(q=ops.q), "test", padded_ranks=True)
    with pytest.raises(ValueError, match=r"test: packed: expected None since spec.packed_weights is \(\)"):
        check(plain, ops.replace(packed=packed.packed), "test", padded_ranks=True)
    with pytest.raises(ValueError, match=r"test: packed: got shape \(3, 128, 7\)"):
        check(GEMMA_PACKED, packed.replace(packed=packed.packed[:, :, :7]), "test", padded_ranks=True)
    with pytest.raises(TypeError, match=r"test: packed: got dtype float32, expected float8_e4m3"):
        check(GEMMA_PACKED, packed.replace(packed=packed.packed.astype(np.float32)), "test", padded_ranks=True)
    with pytest.raises(ValueError, match=r"pack_weights: spec.packed_weights is empty"):
        packing.pack_weights(ops, plain)
    with pytest.raises(ValueError, match=r"composition 'per_op'.*packed_weights"):
        run_decode_step("per_op", packed, GEMMA_PACKED, **RING)
    with pytest.raises(ValueError, match=r"q.u of layer 0 takes 140 bytes a partition.*ring_block_bytes"):
        run_decode_step("looped", packed, GEMMA_PACKED, ring_block_bytes=128, ring_bytes=10000)


def test_operand_lists_may_leave_out_packed(rng):
    operands = fp8_operands(rng, GEMMA3_8, 1, 1, 8, 3)
    assert len(operands) == len(dataclasses.fields(DecodeOperands)) - len(OPTIONAL_LAST)  # packed, block table...
    assert DecodeOperands.of(operands, GEMMA3_8).packed is None
    assert WEIGHT_INDEX["head"] == len(operands) - 1
