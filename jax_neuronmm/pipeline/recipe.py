"""Recipe: what `compress_model` does to a model, as one value that checks itself when made.

The choices are the ones docs/compression.md walks through: how much to keep (a fraction, or one rank), which
projections (MLPs, attention, the LM head), how MLPs are compressed (factored or pruned), the truncation method and
the recovery steps in the order they run, how rank allocation prices and chooses ranks, the options of the fine-tuning
steps, the dense model's own text for distillation, and the weight format the result is stored in. A field left at
None takes the recommended choice where `compress_model` can tell it from the model and the calibration ids.
"""

from __future__ import annotations

import dataclasses

from jax_neuronmm.compress import allocation, svd
from jax_neuronmm.compress.quantize import WEIGHT_DTYPES
from jax_neuronmm.pipeline.distill import DistillOptions
from jax_neuronmm.pipeline.local_finetune import LocalFinetuneOptions
from jax_neuronmm.pipeline.self_distillation import SelfTextOptions

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
# The pipeline `compress_model` runs when given calibration ids and no method: the best measured in
# benchmarks/results/accuracy_report.md. "local" and "refit" trade one kind of text for another, and "sequential"
# measured no better once "fisher" weights the truncations, so they stay opt-in.
RECOMMENDED_METHOD = "whitened"
RECOMMENDED_STEPS = ("fisher", "allocate", "distill")
# How "allocate" chooses ranks from each projection's costs (`allocation.SOLVERS`).
RECOMMENDED_ALLOCATION_SOLVER = "lagrangian"
# How the recommended pipeline compresses MLPs: pruned measured nearer the dense model than factored at every keep
# and include the accuracy report compares, in less time.
RECOMMENDED_MLP_FORM = "pruned"
# The fraction kept when a recipe names neither keep nor rank.
DEFAULT_KEEP = 0.8
# Rank granularity: a PE tile for one rule for every projection; half a tile for allocated ranks, so that allocation
# can also give rank to projections whose uniform rank sits just under their largest whole tile.
BLOCK = 128
ALLOCATION_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What `compress_model` does; every field is checked when the recipe is made (ValueError or TypeError naming it).

    keep: fraction of each projection's parameters kept (rank from `block_aligned_rank(K, N, keep, block)`; with the
    "allocate" step, of all compressed projections' parameters together); rank: instead of keep, one rank for every
    projection, or "full" (min(K, N): reproduces the dense model). Give at most one; neither: keep DEFAULT_KEEP.
    include: "mlp", "attention" and/or "head" (the LM head, factored after the layers).
    mlp_form: "factored" (SVD factors, one fused SVDMLP where the activation allows) or "pruned" (each gated MLP keeps
    `pruning.mlp_width(I, keep, block or ALLOCATION_BLOCK)` of its I neurons); None: pruned where the recommended
    pipeline runs on MLPs pruning takes, else factored.
    method: "svd" (plain truncation) or "whitened" (SVD-LLM whitening by activations on the calibration ids); None:
    RECOMMENDED_METHOD with calibration ids, else "svd" (with a NoCalibrationWarning).
    steps: recovery steps from STEPS, run in that order: "fisher" (each whitened truncation also weighted on its
    output side by the dense model's Fisher information, `pipeline.fisher`), "allocate" (ranks across projections
    under one budget, `pipeline.sensitivity`), "sequential" (each layer calibrated on the compressed layers' outputs),
    "refit" (closed-form ridge update of v), "local" (per-MLP fine-tuning of the factors), "distill" (end-to-end
    fine-tuning of all compressed weights from the dense logits); None: RECOMMENDED_STEPS when method is None and
    there are calibration ids (without "allocate" for one rank), else none.
    block: ranks (and pruned widths) are multiples of it; None: BLOCK for uniform ranks and the head,
    ALLOCATION_BLOCK for allocated ranks and pruned widths.
    allocation_loss: what "allocate" ranks by, from ALLOCATION_LOSSES; None: "fisher" when the "fisher" step runs,
    else "kl". allow_dense: allocation may leave a projection dense where that buys more accuracy than its parameters
    spent elsewhere. allocation_solver: how allocation chooses from the costs, `allocation.SOLVERS`.
    local / distill: options of the "local" / "distill" steps (None: their defaults; distillation's scaled to the
    training windows). self_text: the dense model's own samples as more distillation text (SelfTextOptions, True:
    the defaults, False: none, None: the defaults where the recommended pipeline runs without distill_ids).
    weight_dtype: None (factors in the model's dtype) or "float8_e4m3": after recovery the included projections are
    rounded to fp8 with per-column scales (`quantize_model`), and distillation trains through that rounding.
    """

    keep: float | None = None
    rank: int | str | None = None
    include: tuple[str, ...] = ("mlp",)
    mlp_form: str | None = None
    method: str | None = None
    steps: tuple[str, ...] | None = None
    block: int | None = None
    allocation_loss: str | None = None
    allow_dense: bool = True
    allocation_solver: str = RECOMMENDED_ALLOCATION_SOLVER
    local: LocalFinetuneOptions | None = None
    distill: DistillOptions | None = None
    self_text: SelfTextOptions | bool | None = None
    weight_dtype: str | None = None

    def __post_init__(self):
        # Sequences become tuples (a recipe is hashable and its fields immutable); a lone string is one include.
        if isinstance(self.include, str):
            object.__setattr__(self, "include", (self.include,))
        object.__setattr__(self, "include", tuple(self.include))
        if isinstance(self.steps, (str, bytes)):  # tuple("sequential") would be its letters
            raise TypeError(
                f"Recipe.steps: got the string {self.steps!r}, expected a sequence of step names from {STEPS}, "
                f"e.g. ({self.steps!r},)"
            )
        if self.steps is not None:
            object.__setattr__(self, "steps", tuple(self.steps))
        self._check_size()
        self._check_choices()
        self._check_options()

    def _check_size(self) -> None:
        if self.keep is not None and self.rank is not None:
            raise ValueError(f"Recipe.keep, rank: got keep={self.keep!r} and rank={self.rank!r}, expected at most one")
        if self.rank is None:
            try:
                svd.check_keep(self.target_keep)
            except ValueError as error:
                raise ValueError(f"Recipe.{error}") from None
        elif self.rank != "full" and (not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1):
            raise ValueError(f"Recipe.rank: got {self.rank!r}, expected None, a positive int or 'full'")
        if self.block is not None and (
            not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1
        ):
            raise ValueError(f"Recipe.block: got {self.block!r}, expected None or a positive int")

    def _check_choices(self) -> None:
        if not self.include or set(self.include) - set(INCLUDE_CHOICES):
            raise ValueError(f"Recipe.include: got {self.include!r}, expected a non-empty subset of {INCLUDE_CHOICES}")
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"Recipe.method: got {self.method!r}, expected one of {METHODS} or None")
        steps = self.steps or ()
        if set(steps) - set(STEPS):
            raise ValueError(f"Recipe.steps: got {self.steps!r}, expected a subset of {STEPS}")
        if "allocate" in steps and self.rank is not None:
            raise ValueError(
                f"Recipe.rank: got {self.rank!r} with steps containing 'allocate'; allocation chooses ranks"
            )
        if "fisher" in steps and self.method == "svd":
            raise ValueError("Recipe.steps: 'fisher' weights the whitened truncation's outputs; got method 'svd'")
        if self.mlp_form is not None and self.mlp_form not in MLP_FORMS:
            raise ValueError(f"Recipe.mlp_form: got {self.mlp_form!r}, expected one of {MLP_FORMS} or None")
        if self.mlp_form == "pruned":
            if "mlp" not in self.include:
                raise ValueError(
                    f"Recipe.mlp_form: 'pruned' prunes the MLPs; got include {self.include!r} without 'mlp'"
                )
            if self.rank is not None:
                raise ValueError(
                    f"Recipe.rank: got {self.rank!r} with mlp_form='pruned'; pruning keeps a fraction `keep` of neurons"
                )
        if self.allocation_loss is not None and self.allocation_loss not in ALLOCATION_LOSSES:
            raise ValueError(
                f"Recipe.allocation_loss: got {self.allocation_loss!r}, expected None or one of {ALLOCATION_LOSSES}"
            )
        if not isinstance(self.allow_dense, bool):
            raise ValueError(f"Recipe.allow_dense: got {self.allow_dense!r}, expected a bool")
        if self.allocation_solver not in allocation.SOLVERS:
            raise ValueError(
                f"Recipe.allocation_solver: got {self.allocation_solver!r}, expected one of {allocation.SOLVERS}"
            )
        if self.weight_dtype is not None and self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"Recipe.weight_dtype: got {self.weight_dtype!r}, expected None or one of {WEIGHT_DTYPES}")

    def _check_options(self) -> None:
        for name, kind in (("local", LocalFinetuneOptions), ("distill", DistillOptions)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"Recipe.{name}: got {value!r}, expected None or a {kind.__name__}")
        if self.self_text is not None and not isinstance(self.self_text, (bool, SelfTextOptions)):
            raise TypeError(f"Recipe.self_text: got {self.self_text!r}, expected None, a bool or a SelfTextOptions")

    @property
    def target_keep(self) -> float | None:
        """The fraction kept: keep, DEFAULT_KEEP when neither keep nor rank is given, None with a rank."""
        if self.rank is not None:
            return None
        return DEFAULT_KEEP if self.keep is None else self.keep
