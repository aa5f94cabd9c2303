"""compress_model: swap a model's dense projections for SVD-factored modules (fused svd_mlp / svd_matmul), with the
accuracy-recovery steps of jax_neuronmm.compress (sequential calibration, v refit, rank allocation, local and
end-to-end fine-tuning of the factors)."""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_neuronmm.compress import allocation, svd
from jax_neuronmm.compress.projections import ATTENTION_PROJECTIONS, MLP_PROJECTIONS, layer_projections
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.layers import GatedMLP, fused_mlp_activation
from jax_neuronmm.models.validation import check_token_ids
from jax_neuronmm.nn.fp8 import Fp8Linear, Fp8SVDLinear
from jax_neuronmm.nn.nnx import SVDLinear
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

# "head": the LM head (for tied embeddings, a factored copy; the embedding lookup stays exact).
INCLUDE_CHOICES = ("mlp", "attention", "head")
# How "mlp" in include compresses the gated MLPs: SVD factors (the fused svd_mlp) or neurons pruned (pipeline.pruning).
MLP_FORMS = ("factored", "pruned")
METHODS = ("svd", "whitened")
# Recovery steps, in the order they run (allocate before factoring, distill after).
STEPS = ("fisher", "allocate", "sequential", "refit", "local", "distill")
# What the "allocate" step ranks projections by: "fisher", the Fisher-weighted truncation errors the "fisher" step's
# decompositions predict (`sensitivity.fisher_losses`), or "kl", end-to-end KL probes (`sensitivity.kl_sensitivity`).
ALLOCATION_LOSSES = ("fisher", "kl")
RECOMMENDED_METHOD = "whitened"
# The pipeline `compress_model` runs when given calibration ids and no method (benchmarks/accuracy_report.md).
# The best measured on Gemma 3 270M (keep 0.8, MLPs, 48 calibration windows, held-out perplexity / dense on a novel
# and a technical text): see benchmarks/results/accuracy_report.md; "local" and "refit" trade one text for the
# other, and "sequential" measured no better once "fisher" weights the truncations, so they stay opt-in.
RECOMMENDED_STEPS = ("fisher", "allocate", "distill")
# How "allocate" chooses ranks from each projection's costs (`allocation.SOLVERS`); the report's "exact allocation"
# rows measure the other solver.
RECOMMENDED_ALLOCATION_SOLVER = "lagrangian"
# How the recommended pipeline compresses MLPs: pruned (each keeps a fraction of its neurons) measured nearer the
# dense model than factored on Gemma 3 270M's held-out texts at every keep and include the report compares, in less
# time (benchmarks/results/accuracy_report.md).
RECOMMENDED_MLP_FORM = "pruned"


class NoCalibrationWarning(UserWarning):
    """compress_model ran without calibration_ids: plain SVD, which on real checkpoints loses far more accuracy."""


class RankRoundingWarning(UserWarning):
    """Rounding ranks to multiples of `block` kept a fraction of the parameters far from the requested `keep`."""


# How far the kept fraction may drift from keep before compress_model warns.
KEEP_TOLERANCE = 0.05
# Rank granularity: a PE tile for one rule for every projection; half a tile for allocated ranks, since at a full
# tile a 640 x 2048 projection's ranks stop at 384 (the largest multiple under its break-even rank 487), the uniform
# rank at keep 0.8, and allocation could only take rank away.
BLOCK = 128
ALLOCATION_BLOCK = 64


def _check_arguments(model, keep, rank, method, steps, include, calibration_ids):
    if rank is None:
        svd.check_keep(keep)
    elif rank != "full" and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise ValueError(f"rank: got {rank!r}, expected None, a positive int or 'full'")
    if method not in METHODS:
        raise ValueError(f"method: got {method!r}, expected one of {METHODS}")
    steps = (steps,) if isinstance(steps, str) else tuple(steps)
    if set(steps) - set(STEPS):
        raise ValueError(f"steps: got {steps!r}, expected a subset of {STEPS}")
    if "allocate" in steps and rank is not None:
        raise ValueError(f"rank: got {rank!r} with steps containing 'allocate'; allocation chooses the ranks")
    if "fisher" in steps and method != "whitened":
        raise ValueError(f"steps: 'fisher' weights the whitened truncation's outputs; got method {method!r}")
    include = (include,) if isinstance(include, str) else tuple(include)
    if not include or set(include) - set(INCLUDE_CHOICES):
        raise ValueError(f"include: got {include!r}, expected a non-empty subset of {INCLUDE_CHOICES}")
    if method == "whitened" or steps:
        if calibration_ids is None:
            raise ValueError(
                f"calibration_ids: method={method!r} with steps {steps} needs calibration token ids [B, T]"
            )
        calibration_ids = _check_ids(model, calibration_ids, "calibration_ids")
    elif calibration_ids is not None:
        raise ValueError(
            "calibration_ids: only used by method='whitened' or recovery steps; got it with method='svd' and no steps"
        )
    return include, steps, calibration_ids


def _check_mlp_form(mlp_form, include, rank, calibration_ids) -> None:
    if mlp_form not in MLP_FORMS:
        raise ValueError(f"mlp_form: got {mlp_form!r}, expected one of {MLP_FORMS}")
    if mlp_form == "pruned":
        if "mlp" not in include:
            raise ValueError(f"mlp_form: 'pruned' prunes the MLPs; got include {include!r} without 'mlp'")
        if rank is not None:
            raise ValueError(f"rank: got {rank!r} with mlp_form='pruned'; pruning keeps a fraction `keep` of neurons")
        if calibration_ids is None:
            raise ValueError("calibration_ids: mlp_form='pruned' chooses neurons on calibration token ids [B, T]")


def _check_allocation_loss(allocation_loss, steps) -> str | None:
    """The "allocate" step's loss: allocation_loss as given, or its default for these steps (None without it)."""
    if allocation_loss is None:
        return None if "allocate" not in steps else "fisher" if "fisher" in steps else "kl"
    if allocation_loss not in ALLOCATION_LOSSES:
        raise ValueError(f"allocation_loss: got {allocation_loss!r}, expected None or one of {ALLOCATION_LOSSES}")
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
        raise TypeError(f"model: the LM head is a {type(model.lm_head).__name__}; {fix}")
    for index, layer in enumerate(model.layers):
        for group, names in (("attention", ATTENTION_PROJECTIONS), ("mlp", MLP_PROJECTIONS)):
            parent = layer.self_attn if group == "attention" else layer.mlp
            for name in names if group in include else ():
                module = getattr(parent, name)
                if isinstance(module, (Fp8Linear, Fp8SVDLinear)):
                    raise TypeError(f"model: layer {index} {name} is a {type(module).__name__}; {fix}")


def _check_ids(model, ids, name: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.size == 0:
        raise ValueError(f"{name}: got shape {ids.shape}, expected int token ids [B, T]")
    return check_token_ids(ids, model.config.vocab_size, name=name)


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


def _allocated_ranks(
    dense: CausalLM,
    calibration_ids,
    include,
    keep,
    block,
    allocation_loss,
    allow_dense,
    allocation_solver,
    output_chols,
    decompositions,
    progress,
) -> dict:
    """The "allocate" step's ranks: each projection's loss at every rank, then the block-aligned ranks (None: stays
    dense, when allow_dense) that allocation_solver chooses under the budget keep·Σ K·N (`allocation.allocate_ranks`).
    allocation_loss "fisher": the losses
    `sensitivity.fisher_losses` predicts from output_chols; "kl": the end-to-end KL measured at each projection's
    uniform rank and up to two blocks on either side (`sensitivity.kl_sensitivity`), interpolated between them. Both
    fill `decompositions` when a dict."""
    entries = _projections(dense, include)
    if not entries:
        return {}
    shapes = [(linear.in_features, linear.out_features) for _, _, linear in entries]
    if allocation_loss == "fisher":
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
        curves, shapes, keep, block, allow_dense=allow_dense, solver=allocation_solver
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
                stacklevel=3,
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


def compress_model(
    model: CausalLM,
    keep: float = 0.8,
    method: str | None = None,
    calibration_ids=None,
    include=("mlp",),
    *,
    steps=None,
    rank: int | str | None = None,
    block: int | None = None,
    local: local_finetune.LocalFinetuneOptions | None = None,
    distill: distillation.DistillOptions | None = None,
    distill_ids=None,
    weight_dtype=None,
    allocation_loss: str | None = None,
    allow_dense: bool = True,
    allocation_solver: str = RECOMMENDED_ALLOCATION_SOLVER,
    mlp_form: str | None = None,
    self_text: self_distillation.SelfTextOptions | bool | None = None,
    progress: bool = True,
) -> CausalLM:
    """A copy of `model` whose projections are SVD-factored (or MLPs pruned: mlp_form); the input model is left
    unchanged.

    keep: fraction of each projection's parameters kept (rank from `block_aligned_rank(K, N, keep, block)`; with
    the "allocate" step, of all compressed projections' parameters together); rank: instead of keep, one rank for
    every projection, or "full" (min(K, N): reproduces the dense model). include: "mlp", "attention" and/or
    "head" (the LM head, factored by `factor_head` after the layers; a tied embedding's lookup stays exact).
    block: ranks are multiples of it; None: BLOCK (a PE tile) for uniform ranks and the head, ALLOCATION_BLOCK for
    the ranks "allocate" chooses.

    method: "svd" (plain truncation) or "whitened" (SVD-LLM whitening with activations on calibration_ids [B, T],
    int token ids in [0, vocab_size)). steps: recovery steps from STEPS, run in that order (each needs
    calibration_ids): "fisher" (method "whitened": each projection's truncation also weighted on its output side by
    the dense model's sampled Fisher Gram matrix there, `pipeline.fisher`; not the LM head, whose output is the
    vocabulary), "allocate" (ranks across projections under one budget by each projection's cost at every rank:
    allocation_loss "fisher", the Fisher-weighted truncation errors the "fisher" step predicts, or "kl", the
    end-to-end KL divergence measured at a few ranks, `pipeline.sensitivity`; None: "fisher" when the "fisher" step
    runs, else "kl"; both measured alike on Gemma 3 270M, "fisher" without the probes' forward passes; with
    allow_dense, a projection may also stay dense, at K·N parameters and no loss, where that buys more accuracy
    than its parameters spent on other projections' ranks: an MLP with a dense projection keeps a GatedMLP of
    SVDLinear and dense projections, not the fused SVDMLP, and "local" skips it; allocation_solver: how the ranks
    are chosen from those costs, `allocation.SOLVERS`: "lagrangian" (each projection's option of least
    loss + λ·parameters, λ the smallest that fits; measured better after distillation) or "exact" (the least
    predicted summed loss)),
    "sequential" (each layer calibrated on the compressed layers' outputs), "refit" (closed-form ridge update of v
    towards the dense outputs), "local" (per-MLP fine-tuning of the factors; options in `local`), "distill"
    (end-to-end fine-tuning of all factors from the dense logits; options in `distill`; it trains on
    distill_ids [B', T'] when given, else on calibration_ids: distillation gains from more text than layer-wise
    calibration needs, which costs a forward pass and a Gram matrix per token).

    Without method: with calibration_ids, the recommended pipeline (RECOMMENDED_METHOD + RECOMMENDED_STEPS, MLPs
    pruned: mlp_form); without, plain SVD and a `NoCalibrationWarning`. A factored gated MLP becomes one `SVDMLP`
    (the fused svd_mlp primitive) when its activation is fused-supported and it has no biases ("local" tunes only
    those); otherwise, and for attention, each projection becomes an `SVDLinear` (svd_matmul). progress: tqdm bars.

    mlp_form: "factored" (the above) or "pruned": every gated MLP instead keeps `pruning.mlp_width(I, keep, block or
    ALLOCATION_BLOCK)` of its I intermediate neurons, a narrower dense GatedMLP (`pipeline.pruning.prune_mlps`: neurons
    chosen and down_proj refit layer by layer on calibration_ids, under the "fisher" step's down_proj Fisher metric
    when it runs), the model's config saying the new intermediate_size; "allocate", "sequential", "refit" and
    "local" then apply to the other included projections, and "distill" trains the pruned kernels with any factors.
    None: `resolve_mlp_form` ("pruned", RECOMMENDED_MLP_FORM, where the recommended pipeline runs on MLPs pruning
    takes; else "factored"). On Gemma 3 270M, within 15 minutes (360 steps on 360 windows), pruned MLPs measured
    1.064x / 1.044x dense perplexity at keep 0.8 (factored, 480 steps: 1.105x / 1.089x), 1.060x / 1.060x with
    attention factored beside them (factored MLPs: 1.082x / 1.092x) and 1.202x / 1.146x at keep 0.6 with
    pruned_learning_rate 2e-3 (factored: 1.261x / 1.215x) (benchmarks/results/accuracy_report.md).

    self_text: the dense model's own samples as more training text for "distill" (`pipeline.self_distillation`):
    SelfTextOptions (or True: the defaults), False: none, None: the defaults where the recommended pipeline runs
    (no method, calibration_ids given) without distill_ids (a user's own corpus replaces them). Generated windows
    are mixed with the training windows (distill_ids, else calibration_ids), and the step kept is chosen on
    SelfTextOptions.holdout generated windows no step trains on; the first SelfTextOptions.calibration_windows
    generated windows also join calibration_ids for the layer-wise steps (when their windows are as long). Without
    `distill` options, the steps and step
    sizes scale with the training windows (`self_distillation.scaled_options`: at most two passes over small text).

    weight_dtype: None (factors in the model's dtype) or "float8_e4m3": after recovery the factors of the included
    projections are rounded to nearest in fp8 with per-column scales (`quantize_model`; GPTQ on factors measured
    worse, see pipeline/quantization.py). Without `distill` options, the "distill" step then trains through that
    rounding (DistillOptions(weight_dtype=weight_dtype)): on Gemma 3 270M's LM head at keep 0.69 it measured 1.070x
    / 1.056x dense perplexity against 1.076x / 1.070x distilled in float and rounded after
    (benchmarks/results/frontier.md).

    With `quantize_model`: weights outside `include` may already be fp8 (e.g. the LM head factored, whitened by the
    final hidden states of a model whose projections are fp8); a weight in `include` must be a dense float one
    (TypeError otherwise: factor first, then quantize).
    """
    if not isinstance(model, CausalLM):
        raise TypeError(f"model: got {type(model).__name__}, expected a jax_neuronmm.models CausalLM")
    if weight_dtype is not None and weight_dtype not in quantization.WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype: got {weight_dtype!r}, expected None or one of {quantization.WEIGHT_DTYPES}")
    mlp_form = resolve_mlp_form(mlp_form, model, method, calibration_ids, include, rank)
    recommended = method is None and calibration_ids is not None
    method, steps = resolve_pipeline(method, steps, calibration_ids, rank)
    self_text = _resolve_self_text(self_text, recommended, steps, distill_ids, calibration_ids)
    scale_distill = distill is None
    if weight_dtype is not None and distill is None:
        distill = distillation.DistillOptions(weight_dtype=weight_dtype)
    include, steps, calibration_ids = _check_arguments(
        model, keep, rank, method, () if steps is None else steps, include, calibration_ids
    )
    _check_dense(model, include)
    check_rank(model, include, rank)
    allocation_loss = _check_allocation_loss(allocation_loss, steps)
    if not isinstance(allow_dense, bool):
        raise ValueError(f"allow_dense: got {allow_dense!r}, expected a bool")
    if allocation_solver not in allocation.SOLVERS:
        raise ValueError(f"allocation_solver: got {allocation_solver!r}, expected one of {allocation.SOLVERS}")
    _check_mlp_form(mlp_form, include, rank, calibration_ids)
    if distill_ids is not None:
        if "distill" not in steps:
            raise ValueError(f"distill_ids: only used by the 'distill' step; got it with steps {steps}")
        distill_ids = _check_ids(model, distill_ids, "distill_ids")
    training_ids = calibration_ids if distill_ids is None else distill_ids
    if "distill" in steps:
        training_ids, distill, generated = _distill_text(
            model, training_ids, distill, scale_distill, self_text, progress
        )
        if generated is not None and self_text.calibration_windows and generated.shape[1] == calibration_ids.shape[1]:
            calibration_ids = np.concatenate([calibration_ids, generated[: self_text.calibration_windows]])
    with svd.single_threaded_blas(), svd.damping_summary():
        compressed = _compress(
            model,
            keep,
            method,
            calibration_ids,
            include,
            steps,
            rank,
            block,
            local,
            distill,
            training_ids,
            allocation_loss,
            allow_dense,
            allocation_solver,
            mlp_form,
            progress,
        )
    if weight_dtype is None:
        return compressed
    return quantization.quantize_model(compressed, weight_dtype, targets=include, progress=progress)


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
    if not isinstance(self_text, self_distillation.SelfTextOptions):
        raise TypeError(f"self_text: got {self_text!r}, expected None, a bool or a SelfTextOptions")
    if "distill" not in steps:
        raise ValueError(f"self_text: generated text trains the 'distill' step; got steps {steps}")
    return self_text


def _distill_text(dense, training_ids, distill, scale_distill: bool, self_text, progress: bool):
    """(the "distill" step's windows, its options, the generated windows or None): training_ids mixed with the
    dense model's own samples when self_text is given (the generated windows last held out), and options scaled to
    the windows trained on when the caller gave none (`self_distillation.scaled_options`)."""
    base = distill or distillation.DistillOptions()
    holdout, generated = base.holdout, None
    if self_text is not None:
        generated = self_distillation.generated_windows(dense, training_ids, self_text, progress=progress)
        training_ids = self_distillation.mixed_windows(training_ids, generated, self_text.holdout)
        holdout = self_text.holdout
    held = holdout if training_ids.shape[0] > holdout else 0
    if scale_distill:
        distill = self_distillation.scaled_options(training_ids.shape[0] - held, holdout, base)
    else:
        distill = dataclasses.replace(base, holdout=holdout)
    return training_ids, distill, generated


def _compress(
    dense,
    keep,
    method,
    calibration_ids,
    include,
    steps,
    rank,
    block,
    local,
    distill,
    distill_ids,
    allocation_loss,
    allow_dense,
    allocation_solver,
    mlp_form,
    progress,
):
    model = nnx.clone(dense)
    grams = output_chols = None
    if "fisher" in steps and set(include) - {"head"}:
        grams = fisher.output_grams(dense, calibration_ids, include, progress=progress)
        output_chols = {key: svd.output_whitening(gram) for key, gram in grams.items()}
    if mlp_form == "pruned":
        width = pruning.mlp_width(dense.config.intermediate_size, keep, block or ALLOCATION_BLOCK)
        pruning.prune_mlps(model, calibration_ids, width, grams, progress=progress)
        include = tuple(name for name in include if name != "mlp")
    # Allocation whitens and decomposes every projection already; compression without layer-wise steps reuses that.
    reusable = method == "whitened" and "allocate" in steps and not {"sequential", "refit", "local"} & set(steps)
    decompositions = {} if reusable else None
    if "allocate" in steps and set(include) - {"head"}:
        ranks = _allocated_ranks(
            dense,
            calibration_ids,
            include,
            keep,
            block or ALLOCATION_BLOCK,
            allocation_loss,
            allow_dense,
            allocation_solver,
            output_chols,
            decompositions,
            progress,
        )
    else:
        ranks = _ranks(model, include, keep, rank, block or BLOCK)
    options = sequential.LayerwiseOptions(
        sequential="sequential" in steps,
        refit="refit" in steps,
        local=(local or local_finetune.LocalFinetuneOptions()) if "local" in steps else None,
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
            fused_mlp_activation,
            output_chols=output_chols,
            decompositions=decompositions,
            progress=progress,
        )
    if "head" in include:
        factor_head(model, head_rank(dense, keep, rank, block or BLOCK), method, calibration_ids)
    if "distill" in steps:
        distillation.distill_factors(
            model, dense, distill_ids, distill or distillation.DistillOptions(), progress=progress
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
            u_init=lambda *_: jnp.asarray(u, dtype),  # the factors as given: nothing drawn at random
            v_init=lambda *_: jnp.asarray(v, dtype),
            rngs=nnx.Rngs(0),
        )
    )
