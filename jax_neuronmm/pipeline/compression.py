"""compress_model: a copy of a model whose projections are SVD-factored (fused svd_mlp / svd_matmul modules) or
whose MLPs are pruned, with the recovery steps a `Recipe` names (Fisher weighting, rank allocation, layer-wise
calibration, v refit, local and end-to-end fine-tuning) and, optionally, fp8 weights."""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_neuronmm.compress import allocation, svd
from jax_neuronmm.compress.projections import ATTENTION_PROJECTIONS, MLP_PROJECTIONS, layer_projections
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.layers import GatedMLP
from jax_neuronmm.models.validation import check_token_windows
from jax_neuronmm.nn.nnx import FactorInit, Linear, SVDLinear, describe
from jax_neuronmm.pipeline import distill as distillation
from jax_neuronmm.pipeline import (
    fisher,
    local_finetune,
    pruning,
    quantization,
    self_distillation,
    sensitivity,
    sequential,
)
from jax_neuronmm.pipeline.recipe import (
    ALLOCATION_BLOCK,
    BLOCK,
    RECOMMENDED_METHOD,
    RECOMMENDED_MLP_FORM,
    RECOMMENDED_STEPS,
    STEPS,
    Recipe,
)


class NoCalibrationWarning(UserWarning):
    """compress_model ran without calibration_ids: plain SVD, which on real checkpoints loses far more accuracy."""


class RankRoundingWarning(UserWarning):
    """Rounding ranks to multiples of `block` kept a fraction of the parameters far from the requested `keep`."""


# How far the kept fraction may drift from keep before compress_model warns.
KEEP_TOLERANCE = 0.05


def _check_calibration(model, recipe: Recipe, calibration_ids):
    """calibration_ids checked as int token ids [B, T] where the resolved `recipe` needs them (ValueError where it
    needs none or lacks them)."""
    if recipe.method == "whitened" or recipe.steps:
        if calibration_ids is None:
            raise ValueError(
                f"calibration_ids: method={recipe.method!r} with steps {recipe.steps} needs calibration token ids "
                "[B, T]"
            )
        return check_token_windows(calibration_ids, model.config.vocab_size, name="calibration_ids")
    if calibration_ids is not None:
        raise ValueError(
            "calibration_ids: only used by method='whitened' or recovery steps; got it with method='svd' and no steps"
        )
    if recipe.mlp_form == "pruned":
        raise ValueError("calibration_ids: mlp_form='pruned' chooses neurons on calibration token ids [B, T]")
    return None


def _check_allocation_loss(allocation_loss, steps) -> str | None:
    """The "allocate" step's loss: allocation_loss as given, or its default for these steps (None without it)."""
    if allocation_loss is None:
        return None if "allocate" not in steps else "fisher" if "fisher" in steps else "kl"
    if "allocate" not in steps:
        raise ValueError(f"allocation_loss: only used by the 'allocate' step; got it with steps {steps}")
    if allocation_loss == "fisher" and "fisher" not in steps:
        raise ValueError(
            f"allocation_loss: 'fisher' predicts from the 'fisher' step's output weighting; got steps {steps} "
            "(add 'fisher', or use 'kl')"
        )
    return allocation_loss


def _check_dense(model, include) -> None:
    """TypeError when a weight `include` names is not a dense float one (fp8 from quantize_model, or factored):
    factor first, then quantize. Weights outside `include` may be anything the model runs with."""
    fix = "compress_model factors dense float weights: factor first, then quantize (weight_dtype= or quantize_model)"
    if "head" in include and model.lm_head is not None and not isinstance(model.lm_head, nnx.Linear):
        raise TypeError(f"model: the LM head is {describe(model.lm_head)}; {fix}")
    for index, layer in enumerate(model.layers):
        for group, names in (("attention", ATTENTION_PROJECTIONS), ("mlp", MLP_PROJECTIONS)):
            parent = layer.self_attn if group == "attention" else layer.mlp
            for name in names if group in include else ():
                module = getattr(parent, name)
                if isinstance(module, (Linear, SVDLinear)) and module.format.scaled:
                    raise TypeError(f"model: layer {index} {name} is {describe(module)}; {fix}")


def _projections(model: CausalLM, include) -> list:
    """[(layer_index, projection_name, dense linear)] of every projection in layers that `include` selects."""
    if "mlp" in include:
        for layer in model.layers:
            if not isinstance(layer.mlp, GatedMLP):
                raise TypeError(f"model: MLP is a {type(layer.mlp).__name__}; is it compressed already?")
    return [
        (index, name, getattr(getattr(model.layers[index], parent), name))
        for index, parent, name in layer_projections(len(model.layers), include)
    ]


def check_rank(model: CausalLM, include, rank) -> None:
    """ValueError naming `rank` when an int rank exceeds min(K, N) of a projection `include` selects (the LM head's
    [hidden, vocab] with "head"). Reads only the projections' shapes, so it runs on an abstract model (hf_loading.
    abstract_model) before any weight is loaded, where truncated_svd would fail one layer into the work."""
    if not isinstance(rank, int) or isinstance(rank, bool):
        return
    include = (include,) if isinstance(include, str) else tuple(include)
    shapes = {
        f"layers/{index}/{parent}/{name}": (linear.in_features, linear.out_features)
        for (index, parent, name), (_, _, linear) in zip(
            layer_projections(len(model.layers), include), _projections(model, include)
        )
    }
    if "head" in include:
        shapes["lm_head"] = (model.config.hidden_size, model.config.vocab_size)
    if not shapes:
        return
    path, (k, n) = min(shapes.items(), key=lambda item: min(item[1]))
    if rank > min(k, n):
        raise ValueError(
            f"rank: got {rank}, expected at most {min(k, n)}: {path} is {k} x {n} and a rank-r factorization "
            f"u [K, r], v [r, N] needs r <= min(K, N) (use rank='full' for each projection's full rank)"
        )


def _ranks(model: CausalLM, include, keep, rank, block) -> dict:
    """{(layer_index, projection_name): rank} for every projection to factor, one rule for all of them."""
    entries = _projections(model, include)
    shapes = [(linear.in_features, linear.out_features) for _, _, linear in entries]
    ranks = {}
    for (index, name, _), (k, n) in zip(entries, shapes):
        if rank is None:
            ranks[(index, name)] = svd.block_aligned_rank(k, n, keep, block)
        else:
            ranks[(index, name)] = min(k, n) if rank == "full" else rank
    if rank is None and shapes:
        kept = sum(r * (k + n) for r, (k, n) in zip(ranks.values(), shapes)) / sum(k * n for k, n in shapes)
        if abs(kept - keep) > KEEP_TOLERANCE:
            # e.g. 640 x 2048 projections: every keep from about 0.66 to 0.92 rounds to rank 384 at block 128.
            warnings.warn(
                f"keep={keep}: ranks rounded to multiples of block={block} keep {kept:.3f} of the "
                f"compressed projections' parameters; a smaller block follows keep more closely",
                RankRoundingWarning,
                stacklevel=4,
            )
    return ranks


def _allocated_ranks(dense: CausalLM, calibration_ids, include, plan: Recipe, output_chols, decompositions, progress):
    """The "allocate" step's ranks: each projection's loss at every rank, then the block-aligned ranks (None: stays
    dense, when plan.allow_dense) that plan.allocation_solver chooses under the budget keep·Σ K·N
    (`allocation.allocate_ranks`). plan.allocation_loss "fisher": the losses `sensitivity.fisher_losses` predicts from
    output_chols; "kl": the end-to-end KL measured at each projection's uniform rank and up to two blocks on either
    side (`sensitivity.kl_sensitivity`), interpolated between them. Both fill `decompositions` when a dict."""
    keep, block = plan.target_keep, plan.block or ALLOCATION_BLOCK
    entries = _projections(dense, include)
    if not entries:
        return {}
    shapes = [(linear.in_features, linear.out_features) for _, _, linear in entries]
    if plan.allocation_loss == "fisher":
        losses = sensitivity.fisher_losses(
            dense, calibration_ids, include, output_chols, decompositions=decompositions, progress=progress
        )
        curves = [losses[(index, name)] for index, name, _ in entries]
    else:
        probes = {}
        for (index, name, _), (k, n) in zip(entries, shapes):
            full, center = min(k, n), svd.block_aligned_rank(k, n, keep, block)
            # Two blocks either side, kept inside [one block, full rank): both ends of each curve are measured.
            low, high = max(center - 2 * block, min(block, center)), min(center + 2 * block, full - 1)
            probes[(index, name)] = sorted({r for r in (low, center, high) if 0 < r < full})
        measured = sensitivity.kl_sensitivity(
            dense,
            calibration_ids,
            include,
            probes,
            output_chols=output_chols,
            decompositions=decompositions,
            progress=progress,
        )
        curves = [
            allocation.loss_curve(measured[(index, name)], min(k, n))
            for (index, name, _), (k, n) in zip(entries, shapes)
        ]
    allocated = allocation.allocate_ranks(
        curves, shapes, keep, block, allow_dense=plan.allow_dense, solver=plan.allocation_solver
    )
    return {(index, name): r for (index, name, _), r in zip(entries, allocated)}


def resolve_pipeline(method, steps, calibration_ids, rank=None):
    """(method, steps) that `compress_model` runs: without method, the recommended pipeline when there are
    calibration ids (without "allocate" when one `rank` is asked for every projection), else plain SVD with a
    `NoCalibrationWarning`; steps default to none for an explicit method."""
    if isinstance(steps, (str, bytes)):  # tuple("sequential") would be its letters
        raise TypeError(
            f"steps: got the string {steps!r}, expected a sequence of step names from {STEPS}, e.g. ({steps!r},)"
        )
    if method is None:
        if calibration_ids is None:
            warnings.warn(
                "compress_model without calibration_ids uses plain SVD, which on real checkpoints multiplies "
                "perplexity many times over; pass calibration_ids (token ids of representative text) to get the "
                "recommended calibrated pipeline",
                NoCalibrationWarning,
                stacklevel=4,
            )
            return "svd", () if steps is None else tuple(steps)
        if steps is None:
            steps = tuple(step for step in RECOMMENDED_STEPS if rank is None or step != "allocate")
        return RECOMMENDED_METHOD, tuple(steps)
    return method, () if steps is None else tuple(steps)


def resolve_mlp_form(mlp_form, model, method, calibration_ids, include, rank=None) -> str:
    """The MLP form `compress_model` uses: mlp_form when given; without it, RECOMMENDED_MLP_FORM where the
    recommended pipeline runs (no method, calibration_ids given, keep rather than one rank, "mlp" included) on MLPs
    `prune_mlps` takes (gated, without biases), else "factored"."""
    if mlp_form is not None:
        return mlp_form
    include = (include,) if isinstance(include, str) else tuple(include)
    recommended = method is None and calibration_ids is not None and rank is None and "mlp" in include
    return RECOMMENDED_MLP_FORM if recommended and pruning.unprunable(model) is None else "factored"


def resolve(recipe: Recipe, model: CausalLM, calibration_ids) -> Recipe:
    """`recipe` with the choices it leaves to compress_model made (method and steps: `resolve_pipeline`; mlp_form:
    `resolve_mlp_form`), so what runs can be read, reported and run again as it is."""
    mlp_form = resolve_mlp_form(recipe.mlp_form, model, recipe.method, calibration_ids, recipe.include, recipe.rank)
    method, steps = resolve_pipeline(recipe.method, recipe.steps, calibration_ids, recipe.rank)
    return dataclasses.replace(recipe, method=method, steps=steps, mlp_form=mlp_form)


def compress_model(
    model: CausalLM, recipe: Recipe = Recipe(), calibration_ids=None, *, distill_ids=None, progress: bool = True
) -> CausalLM:
    """A copy of `model` compressed as `recipe` says (see `Recipe`); the input model is left unchanged.

    calibration_ids [B, T]: int token ids in [0, vocab_size) of representative text, which the whitening, the
    recovery steps and MLP pruning run on; with them and no recipe.method, the recommended pipeline runs
    (RECOMMENDED_METHOD, RECOMMENDED_STEPS, MLPs pruned where they can be); without them, plain SVD and a
    `NoCalibrationWarning`. distill_ids [B', T']: the "distill" step's training windows (default: calibration_ids;
    distillation gains from more text than layer-wise calibration needs). progress: tqdm bars.

    A factored gated MLP becomes one `SVDMLP` (the fused svd_mlp primitive) where its activation is fused-supported
    and it has no biases; otherwise, and for attention, each projection becomes an `SVDLinear` (svd_matmul). Weights
    outside recipe.include may already be fp8 (`quantize_model`); a weight in it must be a dense float one
    (TypeError otherwise: factor first, then quantize).
    """
    if not isinstance(model, CausalLM):
        raise TypeError(f"model: got {type(model).__name__}, expected a jax_neuronmm.models CausalLM")
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"recipe: got {type(recipe).__name__}, expected a jax_neuronmm.pipeline.Recipe (keep, include, method, "
            "steps and the steps' options are its fields)"
        )
    recommended = recipe.method is None and calibration_ids is not None
    plan = resolve(recipe, model, calibration_ids)
    self_text = _resolve_self_text(plan.self_text, recommended, plan.steps, distill_ids, calibration_ids)
    scale_distill = plan.distill is None
    distill = plan.distill
    if plan.weight_dtype is not None and distill is None:
        distill = distillation.DistillOptions(weight_dtype=plan.weight_dtype)
    calibration_ids = _check_calibration(model, plan, calibration_ids)
    _check_dense(model, plan.include)
    check_rank(model, plan.include, plan.rank)
    allocation_loss = _check_allocation_loss(plan.allocation_loss, plan.steps)
    if distill_ids is not None:
        if "distill" not in plan.steps:
            raise ValueError(f"distill_ids: only used by the 'distill' step; got it with steps {plan.steps}")
        distill_ids = check_token_windows(distill_ids, model.config.vocab_size, name="distill_ids")
    training_ids = calibration_ids if distill_ids is None else distill_ids
    if "distill" in plan.steps:
        training_ids, distill, generated = self_distillation.distillation_text(
            model, training_ids, distill, scale_distill, self_text, progress
        )
        if generated is not None and self_text.calibration_windows and generated.shape[1] == calibration_ids.shape[1]:
            calibration_ids = np.concatenate([calibration_ids, generated[: self_text.calibration_windows]])
    plan = dataclasses.replace(plan, allocation_loss=allocation_loss, distill=distill)
    with svd.single_threaded_blas(), svd.damping_summary():
        compressed = _compress(model, plan, calibration_ids, training_ids, progress)
    if plan.weight_dtype is None:
        return compressed
    return quantization.quantize_model(compressed, plan.weight_dtype, targets=plan.include, progress=progress)


def _resolve_self_text(self_text, recommended: bool, steps, distill_ids, calibration_ids):
    """The SelfTextOptions compress_model generates with, or None (no generated text). By default only where the
    user's windows are longer than the prompts cut from them, so short calibration windows keep working."""
    if self_text is None:
        options = self_distillation.SelfTextOptions()
        long_enough = calibration_ids is not None and np.shape(calibration_ids)[-1] > options.prompt_tokens
        wanted = recommended and "distill" in steps and distill_ids is None and long_enough
        return options if wanted else None
    if self_text is False:
        return None
    if self_text is True:
        self_text = self_distillation.SelfTextOptions()
    if "distill" not in steps:
        raise ValueError(f"self_text: generated text trains the 'distill' step; got steps {steps}")
    return self_text


def _compress(dense, plan: Recipe, calibration_ids, distill_ids, progress):
    """The compressed copy of `dense` that the resolved `plan` describes, its "distill" step on distill_ids."""
    include, steps, method, keep = plan.include, plan.steps, plan.method, plan.target_keep
    model = nnx.clone(dense)
    grams = output_chols = None
    if "fisher" in steps and set(include) - {"head"}:
        grams = fisher.output_grams(dense, calibration_ids, include, progress=progress)
        output_chols = {key: svd.output_whitening(gram) for key, gram in grams.items()}
    if plan.mlp_form == "pruned":
        width = pruning.mlp_width(dense.config.intermediate_size, keep, plan.block or ALLOCATION_BLOCK)
        pruning.prune_mlps(model, calibration_ids, width, grams, progress=progress)
        include = tuple(name for name in include if name != "mlp")
    # Allocation whitens and decomposes every projection already; compression without layer-wise steps reuses that.
    reusable = method == "whitened" and "allocate" in steps and not {"sequential", "refit", "local"} & set(steps)
    decompositions = {} if reusable else None
    if "allocate" in steps and set(include) - {"head"}:
        ranks = _allocated_ranks(dense, calibration_ids, include, plan, output_chols, decompositions, progress)
    else:
        ranks = _ranks(model, include, keep, plan.rank, plan.block or BLOCK)
    options = sequential.LayerwiseOptions(
        sequential="sequential" in steps,
        refit="refit" in steps,
        local=(plan.local or local_finetune.LocalFinetuneOptions()) if "local" in steps else None,
    )
    if set(include) - {"head"}:
        sequential.compress_layers(
            model,
            dense,
            calibration_ids,
            include,
            ranks,
            method,
            options,
            output_chols=output_chols,
            decompositions=decompositions,
            progress=progress,
        )
    if "head" in include:
        factor_head(model, head_rank(dense, keep, plan.rank, plan.block or BLOCK), method, calibration_ids)
    if "distill" in steps:
        distillation.distill_factors(
            model, dense, distill_ids, plan.distill or distillation.DistillOptions(), progress=progress
        )
    return model


def head_rank(model: CausalLM, keep, rank, block) -> int:
    """The LM head's rank: block_aligned_rank of [hidden, vocab] at keep, or `rank` ("full": hidden)."""
    width, vocab = model.config.hidden_size, model.config.vocab_size
    if rank is None:
        return svd.block_aligned_rank(width, vocab, keep, block)
    return min(width, vocab) if rank == "full" else rank


def factor_head(model: CausalLM, rank: int, method: str, calibration_ids) -> None:
    """Replaces model's LM head (the tied embedding's transpose when there is none) by an `SVDLinear` of `rank`.

    method "whitened" whitens by the final normed hidden states of `model` (its layers as they are now, so after
    layer compression the head sees what the compressed layers produce) on calibration_ids; "svd" truncates plainly.
    The token embedding is left as it is: with tied embeddings, the lookup stays exact and only the head is factored.
    """
    table = distillation.unembedding(model)  # [V, hidden]
    if method == "whitened":
        hidden = np.concatenate(
            [
                np.asarray(distillation.final_hidden(model, calibration_ids[i : i + 1]), np.float32)
                for i in range(len(calibration_ids))
            ]
        ).reshape(-1, table.shape[1])
        u, v = svd.whitened_svd(np.asarray(table).T, hidden, rank)
    else:
        u, v = svd.truncated_svd(np.asarray(table).T, rank)
    dtype = model.embed_tokens.embedding[...].dtype
    # nnx.data: with tied embeddings lm_head was None, which nnx records as a static attribute.
    model.lm_head = nnx.data(
        SVDLinear(
            table.shape[1],
            table.shape[0],
            rank,
            use_bias=False,
            dtype=model.dtype,
            param_dtype=dtype,
            init=FactorInit(lambda *_: jnp.asarray(u, dtype), lambda *_: jnp.asarray(v, dtype)),  # as given
            rngs=nnx.Rngs(0),
        )
    )
