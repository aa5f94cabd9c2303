"""pipeline.pruning and compress_model(mlp_form="pruned"): a small Gemma 3's and Llama's MLP neurons pruned layer by
layer against float64 references; the pruned model decodes through the decode step (XLA and the emulator's looped
kernel) and distillation trains its pruned kernels."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_compress_distill import _full_kl64

import jax_neuronmm
from jax_neuronmm.compress import prune
from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.models import decode, from_preset, generate
from jax_neuronmm.nn.nnx import Linear, SVDLinear
from jax_neuronmm.pipeline import Recipe, sequential
from jax_neuronmm.pipeline.compression import compress_model, resolve_mlp_form
from jax_neuronmm.pipeline.distill import DistillOptions
from jax_neuronmm.pipeline.pruning import NEURONS_PER_ROUND, SINK_WEIGHT, mlp_width, prune_mlps
from jax_neuronmm.weights import WeightFormat
from nki_kernels.activations import ACTIVATIONS, HF_ACTIVATIONS


def _tiny(family):
    model = from_preset(family, "tiny", num_layers=2, vocab_size=300, seed=3)
    return model, np.random.default_rng(11).integers(0, 300, (12, 29))


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny(request):
    return _tiny(request.param)


@pytest.fixture(scope="module")
def gemma3():
    # Gemma 3's sandwich norms, sliding windows and soft-capping: the richer of the two families.
    return _tiny("gemma3")


def _kernel64(linear):
    return np.asarray(linear.kernel[...], np.float64)


@pytest.mark.parametrize("metric", ["squared", "fisher"])
def test_each_layer_keeps_what_prune_neurons_picks_on_the_activations_the_pruned_layers_feed_it(tiny, metric):
    model, ids = tiny
    width = mlp_width(model.config.intermediate_size, 0.7, 8)
    assert width == 264  # 0.7 of 384 is 268.8: down to a multiple of 8
    rng = np.random.default_rng(2)
    grams = None
    if metric == "fisher":
        roots = [rng.standard_normal((model.config.hidden_size,) * 2) for _ in model.layers]
        grams = {(i, "down_proj"): r @ r.T for i, r in enumerate(roots)}
    pruned = nnx.clone(model)
    prune_mlps(pruned, ids, width, grams, progress=False)
    assert pruned.config.intermediate_size == width and model.config.intermediate_size == 384
    x, positions, masks = sequential.calibration_batch(model, ids)
    for index, (dense_layer, layer) in enumerate(zip(model.layers, pruned.layers)):
        mask = masks[layer.self_attn.spec.sliding_window]
        # The MLP's input as the pruned layers before it make it (layer 0: the dense model's own).
        _, (mlp_in,) = sequential.record_inputs(layer, x, positions, mask, [("mlp", "gate_proj")])
        mlp_in = mlp_in.astype(np.float64)
        dense_mlp = dense_layer.mlp
        act = ACTIVATIONS[HF_ACTIVATIONS[dense_mlp.activation]].reference
        hidden = act(mlp_in @ _kernel64(dense_mlp.gate_proj)) * (mlp_in @ _kernel64(dense_mlp.up_proj))
        metric_gram = None if grams is None else grams[(index, "down_proj")]
        # Each window's first position weighs SINK_WEIGHT in the Gram matrix (rows are window-major).
        weights = np.tile(np.where(np.arange(ids.shape[1]) == 0, SINK_WEIGHT, 1.0), ids.shape[0])
        kept, down = prune.prune_neurons(
            hidden.T @ (hidden * weights[:, None]),
            _kernel64(dense_mlp.down_proj),
            width,
            metric_gram,
            per_round=NEURONS_PER_ROUND,
        )
        mlp = layer.mlp
        assert all(isinstance(getattr(mlp, n).kernel, PrunedKernel) for n in ("gate_proj", "up_proj", "down_proj"))
        np.testing.assert_array_equal(_kernel64(mlp.gate_proj), _kernel64(dense_mlp.gate_proj)[:, kept])
        np.testing.assert_array_equal(_kernel64(mlp.up_proj), _kernel64(dense_mlp.up_proj)[:, kept])
        np.testing.assert_allclose(_kernel64(mlp.down_proj), down, rtol=1e-3, atol=1e-3 * np.abs(down).max())
        # The refit MLP tracks the dense one on these activations better than the kept rows left as they were.
        target = hidden @ _kernel64(dense_mlp.down_proj)
        refit_error = np.linalg.norm(hidden[:, kept] @ _kernel64(mlp.down_proj) - target)
        unfit_error = np.linalg.norm(hidden[:, kept] @ _kernel64(dense_mlp.down_proj)[kept] - target)
        assert refit_error < 0.9 * unfit_error, (index, refit_error, unfit_error)
        x = sequential.record_inputs(layer, x, positions, mask, [])[0]


def test_the_sink_weight_keeps_the_first_positions_output(gemma3):
    # Layer 0 sees the dense model's own inputs under either weight: weighing each window's first position (the
    # attention sink every later token reads) keeps that position's MLP output closer to the dense one.
    model, ids = gemma3
    x, positions, masks = sequential.calibration_batch(model, ids)
    mask = masks[model.layers[0].self_attn.spec.sliding_window]
    _, (hidden,) = sequential.record_inputs(model.layers[0], x, positions, mask, [("mlp", "down_proj")])
    first = hidden.astype(np.float64).reshape(ids.shape[0], ids.shape[1], -1)[:, 0]
    target = first @ _kernel64(model.layers[0].mlp.down_proj)
    errors = []
    for weight in (1.0, 1e4):
        pruned = nnx.clone(model)
        prune_mlps(pruned, ids, 96, sink_weight=weight, progress=False)
        kernel = pruned.layers[0].mlp.down_proj.kernel
        errors.append(
            np.linalg.norm(first[:, np.asarray(kernel.kept)] @ _kernel64(pruned.layers[0].mlp.down_proj) - target)
        )
    assert errors[1] < 0.1 * errors[0], errors


@pytest.mark.parametrize(
    "intermediate, keep, block, width",
    [(2048, 0.8, 64, 1600), (384, 0.7, 8, 264), (100, 0.29, 1, 29), (50, 0.1, 64, 5), (10, 0.01, 64, 1)],
)
def test_mlp_width_rounds_down_to_blocks(intermediate, keep, block, width):
    assert mlp_width(intermediate, keep, block) == width


def _greedy_without_cache(model, prompts, steps):
    tokens = np.asarray(prompts)
    for _ in range(steps):
        logits = np.asarray(model(jnp.asarray(tokens)), np.float64)[:, -1]
        tokens = np.concatenate([tokens, logits.argmax(-1)[:, None]], axis=1)
    return tokens[:, np.asarray(prompts).shape[1] :]


def test_a_pruned_model_decodes_through_the_decode_step(gemma3):
    model, ids = gemma3
    pruned = compress_model(
        model, Recipe(keep=0.6, mlp_form="pruned", steps=(), block=8), calibration_ids=ids, progress=False
    )
    width = mlp_width(384, 0.6, 8)
    plan = decode.decode_plan(pruned)
    assert plan.spec.intermediate == width == 224
    prompts = ids[:2, :6]
    expected = _greedy_without_cache(pruned, prompts, 4)
    np.testing.assert_array_equal(np.asarray(generate(pruned, prompts, 4))[:, prompts.shape[1] :], expected)
    with jax_neuronmm.use_backend("emulator"):
        on_emulator = np.asarray(generate(pruned, prompts, 3))[:, prompts.shape[1] :]
    np.testing.assert_array_equal(on_emulator, expected[:, :3])


def test_pruned_mlps_in_fp8_compute_their_dequantized_weights_and_decode(gemma3):
    model, ids = gemma3
    recipe = Recipe(keep=0.6, mlp_form="pruned", steps=(), block=8)
    pruned = compress_model(model, recipe, calibration_ids=ids, progress=False)
    quantized = compress_model(
        model, dataclasses.replace(recipe, weight_dtype="float8_e4m3"), calibration_ids=ids, progress=False
    )
    reference = nnx.clone(pruned)  # the pruned model with each MLP kernel replaced by its fp8 values · scales
    for layer, fp8_layer in zip(reference.layers, quantized.layers):
        for name in ("gate_proj", "up_proj", "down_proj"):
            fp8 = getattr(fp8_layer.mlp, name)
            assert isinstance(fp8, Linear) and fp8.format is WeightFormat.FP8_E4M3
            assert fp8.kernel[...].shape == getattr(layer.mlp, name).kernel[...].shape
            values = np.asarray(fp8.kernel[...], np.float64) * np.asarray(fp8.kernel_scale[...], np.float64)
            getattr(layer.mlp, name).kernel.set_value(jnp.asarray(values, jnp.float32))
    tokens = jnp.asarray(ids[:2, :9])
    got, want = (np.asarray(m(tokens), np.float64) for m in (quantized, reference))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert 0 < np.abs(got - np.asarray(pruned(tokens), np.float64)).max()  # the rounding shows
    plan = decode.decode_plan(quantized)
    assert plan.spec.intermediate == 224 and plan.spec.fp8_weights
    prompts = ids[:2, :6]
    np.testing.assert_array_equal(
        np.asarray(generate(quantized, prompts, 4))[:, prompts.shape[1] :], _greedy_without_cache(quantized, prompts, 4)
    )


def test_compress_model_prunes_the_mlps_factors_attention_and_distills_both(tiny):
    model, ids = tiny
    options = DistillOptions(
        steps=24,
        batch=2,
        learning_rate=3e-3,
        pruned_learning_rate=3e-3,
        warmup=3,
        positions=9,
        vocab_top_k=0,
        holdout=0,
    )
    recipe = Recipe(keep=0.7, include=("mlp", "attention"), mlp_form="pruned", block=8, steps=("fisher", "allocate"))
    before = compress_model(model, recipe, calibration_ids=ids, progress=False)
    # self_text=False: this checks that distillation trains the pruned kernels on the given text
    after = compress_model(
        model,
        dataclasses.replace(recipe, steps=("fisher", "allocate", "distill"), distill=options, self_text=False),
        calibration_ids=ids,
        progress=False,
    )
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    for compressed in (before, after):
        assert all(layer.mlp.up_proj.kernel[...].shape == (128, 264) for layer in compressed.layers)
        # The allocation may keep some attention projections dense, not all of them at keep 0.7.
        assert any(isinstance(getattr(layer.self_attn, n), SVDLinear) for layer in compressed.layers for n in attention)
    # Distillation moved the pruned kernels (and the factors), and the compressed model nearer the dense one.
    moved = np.abs(np.asarray(after.layers[1].mlp.down_proj.kernel[...] - before.layers[1].mlp.down_proj.kernel[...]))
    assert moved.max() > 1e-4
    assert _full_kl64(after, model, ids[:4]) < 0.9 * _full_kl64(before, model, ids[:4])


def test_bad_mlp_form_arguments_name_what_is_wrong(gemma3):
    model, ids = gemma3
    with pytest.raises(ValueError, match=r"mlp_form: got 'narrow', expected one of \('factored', 'pruned'\)"):
        compress_model(model, Recipe(keep=0.7, mlp_form="narrow"), calibration_ids=ids)
    with pytest.raises(ValueError, match=r"mlp_form: 'pruned' prunes the MLPs; got include \('attention',\)"):
        compress_model(model, Recipe(keep=0.7, include=("attention",), mlp_form="pruned"), calibration_ids=ids)
    with pytest.raises(ValueError, match=r"rank: got 64 with mlp_form='pruned'"):
        compress_model(model, Recipe(rank=64, mlp_form="pruned", steps=()), calibration_ids=ids)
    with pytest.raises(ValueError, match=r"calibration_ids: mlp_form='pruned' chooses neurons"):
        compress_model(model, Recipe(keep=0.7, mlp_form="pruned", method="svd"))
    with pytest.raises(ValueError, match=r"keep_count: got 0"):
        prune_mlps(nnx.clone(model), ids, 0, progress=False)
    for weight in (0.0, -1, True):
        with pytest.raises(ValueError, match=r"sink_weight: got .* expected a positive number"):
            prune_mlps(nnx.clone(model), ids, 8, sink_weight=weight, progress=False)
    factored = compress_model(model, Recipe(keep=0.7, method="svd", block=8), progress=False)
    with pytest.raises(TypeError, match=r"layer 0's MLP is a SVDMLP with factored or fp8 projections"):
        prune_mlps(factored, ids, 8, progress=False)


def test_the_recommended_pipeline_prunes_the_mlps_and_an_explicit_method_or_rank_factors_them(gemma3):
    model, ids = gemma3
    options = dict(block=8, distill=DistillOptions(steps=2, holdout=0))
    recommended = compress_model(model, Recipe(keep=0.7, **options), calibration_ids=ids, progress=False)
    assert recommended.config.intermediate_size == mlp_width(384, 0.7, 8)
    assert all(isinstance(layer.mlp.gate_proj.kernel, PrunedKernel) for layer in recommended.layers)
    explicit = compress_model(
        model, Recipe(keep=0.7, method="whitened", steps=("fisher",), block=8), calibration_ids=ids, progress=False
    )
    one_rank = compress_model(model, Recipe(rank=16, steps=("fisher",)), calibration_ids=ids, progress=False)
    for factored in (explicit, one_rank):
        assert factored.config.intermediate_size == 384
        assert all(isinstance(layer.mlp.gate_proj, SVDLinear) for layer in factored.layers)
    # MLPs pruning does not take (biases here) are factored by the recommended pipeline too.
    biased = from_preset("llama", "tiny", num_layers=2, vocab_size=300, seed=3, mlp_bias=True)
    assert resolve_mlp_form(None, biased, None, ids, ("mlp",)) == "factored"
    assert resolve_mlp_form(None, model, None, ids, ("mlp",)) == "pruned"
    assert resolve_mlp_form(None, model, None, ids, ("attention",)) == "factored"
    assert resolve_mlp_form("factored", model, None, ids, ("mlp",)) == "factored"
