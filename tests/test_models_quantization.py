"""quantize_model (fp8 e4m3 projections and LM head) and fp8 checkpoints: logits against the model rebuilt from the
dequantized weights, generation, save/load round trips, checksums, errors."""

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
from flax import nnx
from tiny_models import gemma3 as _gemma3
from tiny_models import llama as _llama
from tiny_models import logits as _logits
from tiny_models import token_ids as _ids

from jax_neuronmm.compress import CheckpointError, load_compressed, save_compressed
from jax_neuronmm.models import generate
from jax_neuronmm.nn.nnx import SVDMLP, Linear, SVDLinear
from jax_neuronmm.pipeline import Recipe, compress_model, quantize_model
from jax_neuronmm.weights import WeightFormat


def _fp8(module, cls) -> bool:
    """Whether `module` is a `cls` holding fp8 weights (WeightFormat.FP8_E4M3)."""
    return isinstance(module, cls) and module.format is WeightFormat.FP8_E4M3


def _dequantized(values, scale):
    """values [K, N] · diag(scale [N]) in float64."""
    return np.asarray(values, np.float64) * np.asarray(scale, np.float64)


def _reference(original, quantized):
    """A clone of `original` whose weights are the quantized model's, dequantized (float32): what the fp8
    model computes, up to float32 rounding."""
    ref = nnx.clone(original)

    def copy(target, source):
        if _fp8(source, Linear):
            target.kernel.set_value(
                jnp.asarray(_dequantized(source.kernel[...], source.kernel_scale[...]), jnp.float32)
            )
        elif _fp8(source, SVDLinear):
            target.u.set_value(jnp.asarray(_dequantized(source.u[...], source.u_scale[...]), jnp.float32))
            target.v.set_value(jnp.asarray(_dequantized(source.v[...], source.v_scale[...]), jnp.float32))

    for layer, source in zip(ref.layers, quantized.layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            copy(getattr(layer.self_attn, name), getattr(source.self_attn, name))
        for name in ("gate_proj", "up_proj", "down_proj"):
            copy(getattr(layer.mlp, name), getattr(source.mlp, name))
    head = quantized.lm_head
    if ref.lm_head is None and head is not None:  # tied: the reference head is a dense copy of the quantized one
        ref.lm_head = nnx.data(nnx.Linear(head.in_features, head.out_features, use_bias=False, rngs=nnx.Rngs(0)))
    if head is not None:
        copy(ref.lm_head, head)
    return ref


@pytest.mark.parametrize("make_model", [_llama, _gemma3], ids=["llama", "gemma3"])
def test_dense_model_matches_dequantized_reference(make_model):
    model = make_model()
    ids = _ids(2, 9, seed=1)
    quantized = quantize_model(model)
    assert _fp8(quantized.layers[0].self_attn.q_proj, Linear)
    assert _fp8(quantized.layers[1].mlp.down_proj, Linear)
    assert _fp8(quantized.lm_head, Linear)
    assert quantized.layers[0].mlp.up_proj.kernel[...].dtype == ml_dtypes.float8_e4m3fn
    assert isinstance(model.layers[0].self_attn.q_proj, nnx.Linear), "the input model must stay unchanged"
    got = np.asarray(_logits(quantized, ids), np.float64)
    want = np.asarray(_logits(_reference(model, quantized), ids), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    dense = np.asarray(_logits(model, ids), np.float64)
    assert 0 < np.abs(got - dense).max() <= 0.1 * np.abs(dense).max()  # rounding to fp8 shows, mildly


def test_compressed_model_matches_dequantized_reference():
    with pytest.warns(UserWarning, match="without calibration_ids"):
        model = compress_model(_gemma3(), Recipe(keep=0.6, include=("mlp", "attention"), block=8))
    assert isinstance(model.layers[0].mlp, SVDMLP)
    quantized = quantize_model(model, targets=("attention", "mlp"))
    assert _fp8(quantized.layers[0].mlp, SVDMLP)
    assert _fp8(quantized.layers[0].self_attn.o_proj, SVDLinear)
    assert quantized.lm_head is None  # the head was not a target
    ids = _ids(2, 7, seed=3)
    got = np.asarray(_logits(quantized, ids), np.float64)
    want = np.asarray(_logits(_reference(model, quantized), ids), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("make_model", [_llama, _gemma3], ids=["llama", "gemma3"])
def test_calibration_aware_rounding_lowers_output_error(make_model):
    """GPTQ-style error feedback (calibration_ids) against round to nearest, on held-out token ids: the logits' error
    against the unquantized model, measured. With 2048 calibration tokens it is 10-30% lower on these tiny models
    for every target (attention, MLP, head); with 256 (barely more than the MLP's 200 inputs) it can be higher."""
    model = make_model()
    held_out = _ids(2, 24, seed=8)
    dense = np.asarray(_logits(model, held_out), np.float64)
    nearest = quantize_model(model)
    calibrated = quantize_model(model, calibration_ids=_ids(32, 64, seed=7), progress=False)
    assert _fp8(calibrated.lm_head, Linear)
    errors = [np.linalg.norm(np.asarray(_logits(q, held_out), np.float64) - dense) for q in (nearest, calibrated)]
    assert errors[1] < errors[0], errors
    # The calibrated weights are still the format's: per-column scales of round to nearest, values within ±240.
    kernel = calibrated.layers[0].mlp.down_proj
    np.testing.assert_array_equal(kernel.kernel_scale[...], nearest.layers[0].mlp.down_proj.kernel_scale[...])
    assert np.abs(np.asarray(kernel.kernel[...], np.float32)).max() <= 240


def test_calibration_of_compressed_factors():
    with pytest.warns(UserWarning, match="without calibration_ids"):
        model = compress_model(_llama(), Recipe(keep=0.6, include=("mlp", "attention"), block=8))
    held_out = _ids(2, 24, seed=9)
    dense = np.asarray(_logits(model, held_out), np.float64)
    ids = _ids(32, 64, seed=7)
    # By default calibration leaves SVD factors rounded to nearest (GPTQ on factors measured worse on Gemma 3 270M).
    default = quantize_model(model, calibration_ids=ids, targets=("attention", "mlp"), progress=False)
    nearest_model = quantize_model(model, targets=("attention", "mlp"))
    np.testing.assert_array_equal(
        np.asarray(default.layers[0].mlp.gate_proj.u[...], np.float32),
        np.asarray(nearest_model.layers[0].mlp.gate_proj.u[...], np.float32),
    )
    calibrated = quantize_model(model, calibration_ids=ids, targets=("attention", "mlp"), calibrate_factors=True)
    assert _fp8(calibrated.layers[1].mlp, SVDMLP)
    got = np.asarray(_logits(calibrated, held_out), np.float64)
    want = np.asarray(_logits(_reference(model, calibrated), held_out), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    nearest = np.asarray(_logits(nearest_model, held_out), np.float64)
    assert np.linalg.norm(got - dense) < np.linalg.norm(nearest - dense)


def test_generate_uses_the_quantized_weights():
    quantized = quantize_model(_llama(), targets=("mlp", "head"))
    prompt = _ids(1, 5, seed=4)
    tokens = np.asarray(generate(quantized, prompt, 3))
    ids = np.asarray(prompt)
    for _ in range(3):  # greedy decoding by full forwards
        ids = np.concatenate([ids, np.argmax(np.asarray(_logits(quantized, jnp.asarray(ids)))[:, -1:], -1)], 1)
    np.testing.assert_array_equal(tokens, ids)


def test_checkpoint_round_trip(tmp_path):
    quantized = quantize_model(_gemma3(seed=0))
    path = tmp_path / "fp8.safetensors"
    save_compressed(path, nnx.state(quantized))
    with safetensors.safe_open(str(path), framework="numpy") as reader:
        dtypes = {name: reader.get_slice(name).get_dtype() for name in reader.keys()}
    kernel = "layers/0/mlp/gate_proj/kernel"
    assert dtypes[kernel] == "F8_E4M3" and dtypes[kernel + "_scale"] == "F32"
    assert dtypes["lm_head/kernel"] == "F8_E4M3"
    other = quantize_model(_gemma3(seed=1))  # same structure, different weights
    loaded, _ = load_compressed(path, like=nnx.state(other))
    nnx.update(other, loaded)
    assert other.layers[0].mlp.gate_proj.kernel[...].dtype == ml_dtypes.float8_e4m3fn
    ids = _ids(2, 6, seed=5)
    np.testing.assert_array_equal(np.asarray(_logits(other, ids)), np.asarray(_logits(quantized, ids)))
    plain, _ = load_compressed(path)  # without a template: numpy arrays
    np.testing.assert_array_equal(
        plain["layers"][0]["mlp"]["gate_proj"]["kernel"].view(np.uint8),
        np.asarray(quantized.layers[0].mlp.gate_proj.kernel[...]).view(np.uint8),
    )


def test_checkpoint_fp8_bytes_are_half_of_bf16_and_checksummed(tmp_path, rng):
    values = rng.standard_normal((64, 48)).astype(ml_dtypes.bfloat16)
    path16, path8 = tmp_path / "bf16.safetensors", tmp_path / "fp8.safetensors"
    save_compressed(path16, {"w": values})
    save_compressed(path8, {"w": np.clip(values.astype(np.float32) * 60, -240, 240).astype(ml_dtypes.float8_e4m3fn)})
    with safetensors.safe_open(str(path16), framework="numpy") as r16:
        assert r16.get_slice("w").get_dtype() == "BF16"
    data = bytearray(path8.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    assert len(data) - header_end == 64 * 48  # one byte per weight
    data[header_end + 5] ^= 1
    path8.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum mismatch \(corrupt data\) in tensors \['w'\]"):
        load_compressed(path8)


def test_save_rejects_fp8_beyond_240(tmp_path):
    with pytest.raises(ValueError, match=r"params leaves that Trainium cannot use: 'w' holds 1 value\(s\) beyond ±240"):
        save_compressed(tmp_path / "x.safetensors", {"w": np.array([[256.0, 1.0]], ml_dtypes.float8_e4m3fn)})


def test_errors():
    model = _llama()
    with pytest.raises(ValueError, match="quantize_model: weight_dtype='int8'; expected one of"):
        quantize_model(model, weight_dtype="int8")
    with pytest.raises(ValueError, match=r"quantize_model: targets=\('embed',\); expected a non-empty subset"):
        quantize_model(model, targets=("embed",))
    with pytest.raises(ValueError, match=r"quantize_model: calibration_ids has shape \(4,\) \(int\d+\); expected int"):
        quantize_model(model, calibration_ids=np.arange(4))
    with pytest.raises(ValueError, match=r"calibration_ids has shape \(2, 3\) \(float32\); expected int token ids"):
        quantize_model(model, calibration_ids=np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"quantize_model: calibration_ids: token id -1 is outside the vocabulary"):
        quantize_model(model, calibration_ids=np.full((2, 3), -1))
    with pytest.raises(TypeError, match="layer 0 q_proj is a Linear in FP8_E4M3"):
        quantize_model(quantize_model(model, targets="attention"), targets="attention")


def test_compress_model_with_fp8_factors():
    model = _llama()
    with pytest.warns(UserWarning, match="without calibration_ids"):
        compressed = compress_model(model, Recipe(keep=0.6, include=("mlp", "attention"), block=8))
        quantized = compress_model(
            model, Recipe(keep=0.6, include=("mlp", "attention"), block=8, weight_dtype="float8_e4m3")
        )
    assert _fp8(quantized.layers[0].mlp, SVDMLP) and _fp8(quantized.layers[0].self_attn.k_proj, SVDLinear)
    assert quantized.lm_head is None or isinstance(quantized.lm_head, nnx.Linear)  # the head is not included
    ids = _ids(2, 7, seed=3)
    want = np.asarray(_logits(_reference(compressed, quantized), ids), np.float64)
    np.testing.assert_allclose(
        np.asarray(_logits(quantized, ids), np.float64), want, rtol=0, atol=1e-4 * np.abs(want).max()
    )
    with pytest.raises(ValueError, match="weight_dtype: got 'fp8', expected None or one of"):
        compress_model(model, Recipe(weight_dtype="fp8"))


def test_compress_model_to_fp8_distills_through_the_rounding_unless_told(monkeypatch):
    from jax_neuronmm.pipeline import distill

    seen = []
    monkeypatch.setattr(distill, "distill_factors", lambda model, dense, ids, options, **_: seen.append(options))
    model, ids = _llama(), _ids(4, 9, seed=5)
    recipe = Recipe(keep=0.6, block=8, method="svd", steps=("distill",))
    for changes in (
        dict(weight_dtype="float8_e4m3"),
        dict(weight_dtype="float8_e4m3", distill=distill.DistillOptions(steps=3)),
        {},
    ):
        compress_model(model, dataclasses.replace(recipe, **changes), calibration_ids=ids, progress=False)
    assert [options.weight_dtype for options in seen] == ["float8_e4m3", None, None]
    assert seen[1].steps == 3  # the caller's options kept; without them the scaled defaults, fp8 above


def test_decode_weight_bytes_count_fp8_weights_as_stored():
    from jax_neuronmm.models.decode import decode_weight_bytes
    from jax_neuronmm.nn.nnx import SVDLinear

    model = _llama()
    with pytest.warns(UserWarning, match="without calibration_ids"):
        compressed = compress_model(model, Recipe(keep=0.6, include=("mlp", "attention"), block=8))
    for source in (model, compressed):
        scales = 211  # the head's, one per vocabulary entry
        for layer in source.layers:
            for module in (layer.self_attn, layer.mlp):
                for projection in vars(module).values():
                    if isinstance(projection, SVDLinear):
                        scales += projection.u.shape[1] + projection.v.shape[1]
                    elif isinstance(projection, nnx.Linear):
                        scales += projection.kernel.shape[1]
        quantized = quantize_model(source)
        # one byte per fp8 weight, four per float32 scale
        assert decode_weight_bytes(quantized) == decode_weight_bytes(source, bytes_per_weight=1) + 4 * scales
        assert decode_weight_bytes(quantized) < decode_weight_bytes(source)


def test_mlp_hidden_is_down_proj_input_for_every_mlp_form():
    """The calibration pass's down_proj inputs: hidden · W_down reproduces the MLP's output whether its projections
    are dense or factored, in fp8 or not (a model quantized in two calls, or compressed with fp8 factors)."""
    from jax_neuronmm.pipeline.quantization import _mlp_hidden, _projected

    model = _gemma3()
    with pytest.warns(UserWarning, match="without calibration_ids"):
        compressed = compress_model(model, Recipe(keep=0.6, include=("mlp",), block=8))
    mlps = [model.layers[0].mlp, compressed.layers[0].mlp]
    mlps += [quantize_model(m, targets="mlp").layers[0].mlp for m in (model, compressed)]
    kinds = [(type(p.down_proj).__name__, getattr(p.down_proj, "format", WeightFormat.FLOAT)) for p in mlps]
    fp8 = WeightFormat.FP8_E4M3
    assert kinds == [
        ("Linear", WeightFormat.FLOAT),
        ("SVDLinear", WeightFormat.FLOAT),
        ("Linear", fp8),
        ("SVDLinear", fp8),
    ]
    x = np.asarray(np.random.default_rng(4).standard_normal((5, 96)), np.float32)
    for mlp in mlps:
        want = np.asarray(mlp(jnp.asarray(x)), np.float64)
        got = np.asarray(_projected(mlp.down_proj, _mlp_hidden(mlp, x)), np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_quantize_and_compress_compose():
    """The LM head factored (whitened, fp8 factors) on a model whose projections are GPTQ fp8, and GPTQ on the
    dense weights of a model whose MLP factors are fp8; a weight compress_model would factor must be dense float."""
    model = _gemma3()
    ids = _ids(16, 32, seed=7)
    projections = quantize_model(model, targets=("attention", "mlp"), calibration_ids=ids, progress=False)
    factored = Recipe(keep=0.6, method="whitened", steps=(), include=("head",), block=8)
    bf16_head = compress_model(projections, factored, calibration_ids=ids, progress=False)
    fp8_head = compress_model(
        projections, dataclasses.replace(factored, weight_dtype="float8_e4m3"), calibration_ids=ids, progress=False
    )
    assert _fp8(fp8_head.lm_head, SVDLinear) and fp8_head.lm_head.rank == bf16_head.lm_head.rank
    for name in ("u", "v"):  # the bf16 factors rounded to fp8
        scale = getattr(fp8_head.lm_head, f"{name}_scale")[...]
        np.testing.assert_allclose(
            _dequantized(getattr(fp8_head.lm_head, name)[...], scale),
            np.asarray(getattr(bf16_head.lm_head, name)[...], np.float64),
            rtol=0.07,
            atol=float(np.max(scale)),
        )
    layer, source = fp8_head.layers[1], projections.layers[1]
    assert _fp8(layer.mlp.down_proj, Linear)
    np.testing.assert_array_equal(
        np.asarray(layer.mlp.down_proj.kernel[...], np.float32),
        np.asarray(source.mlp.down_proj.kernel[...], np.float32),
    )
    got = np.asarray(_logits(fp8_head, _ids(2, 9, seed=1)), np.float64)
    want = np.asarray(_logits(bf16_head, _ids(2, 9, seed=1)), np.float64)
    assert 0 < np.abs(got - want).max() <= 0.1 * np.abs(want).max()

    with pytest.warns(UserWarning, match="without calibration_ids"):
        fp8_mlps = compress_model(model, Recipe(keep=0.6, include=("mlp",), block=8, weight_dtype="float8_e4m3"))
    rest = quantize_model(fp8_mlps, targets=("attention", "head"), calibration_ids=ids, progress=False)
    assert _fp8(rest.layers[0].self_attn.q_proj, Linear) and _fp8(rest.lm_head, Linear)
    assert rest.layers[0].mlp.gate_proj.u[...].dtype == ml_dtypes.float8_e4m3fn

    with pytest.raises(
        TypeError, match="layer 0 gate_proj is a Linear in FP8_E4M3; compress_model factors dense float"
    ):
        compress_model(
            projections, Recipe(keep=0.6, include=("mlp",), method="whitened", steps=()), calibration_ids=ids
        )
    with pytest.raises(
        TypeError, match="the LM head is a Linear in FP8_E4M3; compress_model factors dense float weights"
    ):
        compress_model(quantize_model(model, targets="head"), factored, calibration_ids=ids, progress=False)


def test_model_spec_names_the_fp8_weights_and_counts_their_bytes():
    from jax_neuronmm.models.decode import decode_plan, decode_weight_bytes, model_spec
    from nki_kernels.decode import traffic

    model = _gemma3()
    with pytest.warns(UserWarning, match="without calibration_ids"):
        compressed = compress_model(model, Recipe(keep=0.6, include=("mlp", "head"), block=8))
    assert model_spec(model) == decode_plan(model).spec
    plan = decode_plan(compressed).spec
    mlp_ranks = tuple(
        tuple(getattr(layer.mlp, name).rank for layer in compressed.layers)
        for name in ("gate_proj", "up_proj", "down_proj")
    )
    assert plan.ranks == (None,) * 4 + mlp_ranks and plan.head_rank == compressed.lm_head.rank
    for targets, weights in (
        (("attention", "mlp", "head"), ("q", "k", "v", "o", "gate", "up", "down", "head")),
        (("mlp",), ("gate", "up", "down")),
        (("head",), ("head",)),
    ):
        quantized = quantize_model(compressed, targets=targets)
        assert model_spec(quantized) == plan.replace(fp8_weights=weights)
        assert traffic.weight_bytes(model_spec(quantized)) == decode_weight_bytes(quantized)
        assert decode_plan(quantized).spec == model_spec(quantized)
    mixed = quantize_model(model, targets="attention")
    mixed.layers[1].self_attn.k_proj = model.layers[1].self_attn.k_proj
    with pytest.raises(ValueError, match=r"model_spec: k_proj is fp8 in layer 0 but not in layer 1"):
        model_spec(mixed)


@pytest.mark.parametrize("make_model", [_llama, _gemma3])
@pytest.mark.parametrize("include", [(), ("mlp", "head")])
def test_fp8_models_decode_through_decode_step(make_model, include, monkeypatch):
    """generate decodes a quantize_model model (dense, or factored with one layer's MLP left dense: stacked as exact
    fp8 factors) through one decode_step per token: its logits at every step equal the model's own forward (the
    layer-by-layer path) to float32 rounding, and the greedy tokens are the same."""
    from jax_neuronmm.models import decode as decode_mod

    model = make_model()
    if include:
        with pytest.warns(UserWarning, match="without calibration_ids"):
            model = compress_model(model, Recipe(keep=0.6, include=include, block=8))
        model.layers[1].mlp = make_model().layers[1].mlp  # mixed: dense in layer 1, factored in the others
    quantized = quantize_model(model)
    plan = decode_mod.decode_plan(quantized)
    assert plan is not None and set(plan.spec.fp8_weights) == {"q", "k", "v", "o", "gate", "up", "down", "head"}
    weights = decode_mod.stack_weights(quantized, plan)
    ids = _ids(2, 5, seed=3)
    _, cache = quantized(ids, positions=jnp.tile(jnp.arange(5), (2, 1)), cache=quantized.init_cache(2, 12))
    own_cache = cache
    tokens = jnp.asarray(ids[:, -1])
    for step in range(3):
        positions = jnp.full((2, 1), 5 + step, jnp.int32)
        got, cache = decode_mod.decode(quantized, plan, weights, tokens[:, None], positions, cache)
        want, own_cache = quantized(tokens[:, None], positions=positions, cache=own_cache)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
        tokens = jnp.argmax(want[:, 0], axis=-1)
    through_decode_step = np.asarray(generate(quantized, ids, 4))
    monkeypatch.setattr(decode_mod, "decode_plan", lambda model: None)  # generate's layer-by-layer path
    np.testing.assert_array_equal(through_decode_step, np.asarray(generate(quantized, ids, 4)))
