"""pipeline.Recipe: every field checked when the recipe is made (the error names the field), the recommended defaults,
`resolve` making the open choices explicit, and the pipeline's entry points taking at most 10 parameters."""

import dataclasses
import inspect

import numpy as np
import pytest

from jax_neuronmm.models import from_preset
from jax_neuronmm.pipeline import DistillOptions, LocalFinetuneOptions, Recipe, SelfTextOptions
from jax_neuronmm.pipeline.compressed_saving import compress_checkpoint
from jax_neuronmm.pipeline.compression import NoCalibrationWarning, compress_model, resolve
from jax_neuronmm.pipeline.recipe import DEFAULT_KEEP, RECOMMENDED_ALLOCATION_SOLVER, RECOMMENDED_STEPS
from jax_neuronmm.pipeline.sensitivity import KLProbes, kl_sensitivity
from jax_neuronmm.pipeline.sequential import compress_layers


def test_defaults_are_the_recommended_pipeline():
    recipe = Recipe()
    assert recipe.target_keep == DEFAULT_KEEP == 0.8 and recipe.include == ("mlp",)
    assert recipe.allocation_solver == RECOMMENDED_ALLOCATION_SOLVER and recipe.allow_dense is True
    assert Recipe(rank=16).target_keep is None and Recipe(keep=0.37).target_keep == 0.37
    # Sequences are kept as tuples (a recipe is hashable), a lone include name as a one-name tuple.
    recipe = Recipe(include="attention", steps=["fisher"])
    assert recipe.include == ("attention",) and recipe.steps == ("fisher",) and hash(recipe) == hash(recipe)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.keep = 0.5


@pytest.mark.parametrize(
    "fields, error, words",
    [
        (dict(keep=0.5, rank=4), ValueError, "Recipe.keep, rank: got keep=0.5 and rank=4, expected at most one"),
        (dict(keep=1.5), ValueError, r"Recipe.keep must be a fraction of parameters in \(0, 1\], got 1.5"),
        (dict(keep=0.0), ValueError, "Recipe.keep must be a fraction"),
        (dict(rank=0), ValueError, "Recipe.rank: got 0, expected None, a positive int or 'full'"),
        (dict(rank=True), ValueError, "Recipe.rank: got True"),
        (dict(block=0), ValueError, "Recipe.block: got 0, expected None or a positive int"),
        (dict(block=8.0), ValueError, "Recipe.block: got 8.0"),
        (dict(include=()), ValueError, "Recipe.include: got \\(\\), expected a non-empty subset"),
        (dict(include=("embedding",)), ValueError, "Recipe.include: got \\('embedding',\\)"),
        (dict(method="qr"), ValueError, "Recipe.method: got 'qr', expected one of"),
        (dict(steps="distill"), TypeError, "Recipe.steps: got the string 'distill'"),
        (dict(steps=("prune",)), ValueError, "Recipe.steps: got \\('prune',\\), expected a subset of"),
        (dict(rank=8, steps=("allocate",)), ValueError, "Recipe.rank: got 8 with steps containing 'allocate'"),
        (dict(method="svd", steps=("fisher",)), ValueError, "Recipe.steps: 'fisher' weights the whitened"),
        (dict(mlp_form="narrow"), ValueError, "Recipe.mlp_form: got 'narrow', expected one of"),
        (dict(mlp_form="pruned", include=("attention",)), ValueError, "Recipe.mlp_form: 'pruned' prunes the MLPs"),
        (dict(mlp_form="pruned", rank=8), ValueError, "Recipe.rank: got 8 with mlp_form='pruned'"),
        (dict(allocation_loss="l2"), ValueError, "Recipe.allocation_loss: got 'l2'"),
        (dict(allow_dense=1), ValueError, "Recipe.allow_dense: got 1, expected a bool"),
        (dict(allocation_solver="greedy"), ValueError, "Recipe.allocation_solver: got 'greedy'"),
        (dict(weight_dtype="int8"), ValueError, "Recipe.weight_dtype: got 'int8', expected None or one of"),
        (dict(local=DistillOptions()), TypeError, "Recipe.local: got .*expected None or a LocalFinetuneOptions"),
        (dict(distill=dict(steps=3)), TypeError, "Recipe.distill: got .*expected None or a DistillOptions"),
        (dict(self_text="yes"), TypeError, "Recipe.self_text: got 'yes', expected None, a bool or a SelfTextOptions"),
    ],
)
def test_each_field_is_checked_when_the_recipe_is_made(fields, error, words):
    with pytest.raises(error, match=words):
        Recipe(**fields)


def test_options_of_the_right_kind_are_accepted():
    recipe = Recipe(
        local=LocalFinetuneOptions(steps=3),
        distill=DistillOptions(steps=5),
        self_text=SelfTextOptions(windows=12, calibration_windows=4),
    )
    assert recipe.distill.steps == 5 and recipe.local.steps == 3 and recipe.self_text.windows == 12
    assert Recipe(self_text=False).self_text is False and Recipe(rank="full").rank == "full"


def test_resolve_makes_the_open_choices_and_compress_model_wants_a_recipe():
    model = from_preset("llama", "tiny", seed=0)
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, size=(4, 40))
    plan = resolve(Recipe(keep=0.6), model, ids)
    assert (plan.method, plan.steps, plan.mlp_form) == ("whitened", RECOMMENDED_STEPS, "pruned")
    assert resolve(Recipe(rank=16), model, ids).steps == tuple(s for s in RECOMMENDED_STEPS if s != "allocate")
    with pytest.warns(NoCalibrationWarning):
        plain = resolve(Recipe(), model, None)
    assert (plain.method, plain.steps, plain.mlp_form) == ("svd", (), "factored")
    with pytest.raises(TypeError, match="recipe: got float, expected a jax_neuronmm.pipeline.Recipe"):
        compress_model(model, 0.5)


def test_compress_checkpoint_refuses_fp8_before_reading_anything(tmp_path):
    with pytest.raises(ValueError, match="recipe.weight_dtype: got 'float8_e4m3', expected None"):
        compress_checkpoint(tmp_path / "missing", tmp_path / "out", Recipe(weight_dtype="float8_e4m3"))
    with pytest.raises(TypeError, match="recipe: got dict"):
        compress_checkpoint(tmp_path / "missing", tmp_path / "out", dict(keep=0.5))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("function", [compress_model, compress_checkpoint, compress_layers, kl_sensitivity])
def test_pipeline_entry_points_take_at_most_ten_parameters(function):
    assert len(inspect.signature(function).parameters) <= 10


def test_kl_probes_check_their_fields():
    assert KLProbes() == KLProbes(windows=2, top_k=64, vocab_chunk=16384)
    for name in ("windows", "top_k", "vocab_chunk"):
        with pytest.raises(ValueError, match=f"KLProbes.{name}: got 0, expected a positive int"):
            KLProbes(**{name: 0})
