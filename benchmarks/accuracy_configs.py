"""The accuracy report's configurations (the compress_model calls behind its rows), the sensitivity rows and the
targets the report checks."""

from __future__ import annotations

import dataclasses

from jax_neuronmm.pipeline.distill import DistillOptions
from jax_neuronmm.pipeline.recipe import RECOMMENDED_ALLOCATION_SOLVER, RECOMMENDED_METHOD, RECOMMENDED_STEPS

TEXTS = ("novel", "technical")


@dataclasses.dataclass(frozen=True)
class Config:
    """One report row: compress_model(dense, keep, method, include=include, steps=steps, block=block, distill=...,
    allow_dense=allow_dense, allocation_solver=allocation_solver, mlp_form=mlp_form)."""

    name: str
    keep: float
    include: tuple
    steps: tuple = RECOMMENDED_STEPS
    method: str = RECOMMENDED_METHOD
    block: int | None = None  # compress_model's default: 128, 64 for allocated ranks
    distill: DistillOptions = DistillOptions()
    allow_dense: bool = True  # the "allocate" step may leave a projection dense
    allocation_solver: str = RECOMMENDED_ALLOCATION_SOLVER
    distill_windows: int | None = None  # the first this many training windows (None: --distill_windows)
    mlp_form: str = "factored"  # compress_model's: "pruned" keeps a fraction of each MLP's neurons


# Factored MLPs + attention in fewer steps: within the 15-minute budget.
WITHIN_BUDGET = Config(
    "mlp+attention 0.8, 360 steps on 360 windows",
    0.8,
    ("mlp", "attention"),
    distill=DistillOptions(steps=360),
    distill_windows=360,
)
# Pruned MLPs within the budget, and pruned kernels trained at the factors' step size (the default before).
PRUNED_WITHIN_BUDGET = Config(
    "mlp 0.8 pruned, 360 steps on 360 windows",
    0.8,
    ("mlp",),
    mlp_form="pruned",
    distill=DistillOptions(steps=360),
    distill_windows=360,
)
AT_2E3 = DistillOptions(pruned_learning_rate=2e-3)
# Every configuration, most telling first. The sensitivity rows factor one projection type each, whitened + sequential
# without training: their perplexity cost per byte saved is what chooses what to compress.
CONFIGS = (
    Config("mlp 0.8 factored", 0.8, ("mlp",)),
    Config("mlp 0.8, top-k loss", 0.8, ("mlp",), distill=DistillOptions(loss="topk")),
    Config("mlp 0.8, KL at 128 sampled positions", 0.8, ("mlp",), distill=DistillOptions(positions=128)),
    Config("mlp+attention 0.8 factored", 0.8, ("mlp", "attention")),
    Config("mlp 0.6 factored", 0.6, ("mlp",)),
    Config("mlp 0.9 factored", 0.9, ("mlp",)),
    Config("mlp 0.8 pruned", 0.8, ("mlp",), mlp_form="pruned"),
    PRUNED_WITHIN_BUDGET,
    dataclasses.replace(
        PRUNED_WITHIN_BUDGET, name="mlp+attention 0.8 pruned, 360 steps on 360 windows", include=("mlp", "attention")
    ),
    dataclasses.replace(PRUNED_WITHIN_BUDGET, name="mlp 0.6 pruned, 360 steps on 360 windows", keep=0.6),
    dataclasses.replace(
        PRUNED_WITHIN_BUDGET,
        name="mlp 0.6 pruned, 360 steps on 360 windows, pruned kernels at 1e-3",
        keep=0.6,
        distill=DistillOptions(steps=360, pruned_learning_rate=1e-3),
    ),
    dataclasses.replace(
        PRUNED_WITHIN_BUDGET,
        name="mlp 0.6 pruned, 360 steps on 360 windows, pruned kernels at 2e-3",
        keep=0.6,
        distill=DistillOptions(steps=360, pruned_learning_rate=2e-3),
    ),
    dataclasses.replace(
        PRUNED_WITHIN_BUDGET,
        name="mlp+attention+head 0.8 pruned, 360 steps on 360 windows",
        include=("mlp", "attention", "head"),
    ),
    *(
        Config(f"{name}, pruned kernels at 2e-3", keep, include, mlp_form="pruned", distill=AT_2E3)
        for name, keep, include in (
            ("mlp 0.8 pruned", 0.8, ("mlp",)),
            ("mlp 0.6 pruned", 0.6, ("mlp",)),
            ("mlp+attention 0.8 pruned", 0.8, ("mlp", "attention")),
        )
    ),
    Config("head 0.8 whitened", 0.8, ("head",), steps=()),
    Config("mlp 0.8 whitened + sequential", 0.8, ("mlp",), steps=("sequential",)),
    Config("attention 0.8 whitened + sequential", 0.8, ("attention",), steps=("sequential",)),
    Config("mlp+attention+head 0.8 factored", 0.8, ("mlp", "attention", "head")),
    Config("mlp 0.8, exact allocation", 0.8, ("mlp",), allocation_solver="exact"),
    Config("mlp 0.6, exact allocation", 0.6, ("mlp",), allocation_solver="exact"),
    Config("mlp+attention 0.8, exact allocation", 0.8, ("mlp", "attention"), allocation_solver="exact"),
    Config("mlp 0.8, every projection factored", 0.8, ("mlp",), allow_dense=False, allocation_solver="exact"),
    Config(
        "mlp+attention 0.8, every projection factored",
        0.8,
        ("mlp", "attention"),
        allow_dense=False,
        allocation_solver="exact",
    ),
    Config("mlp 0.6, every projection factored", 0.6, ("mlp",), allow_dense=False, allocation_solver="exact"),
    WITHIN_BUDGET,
    dataclasses.replace(WITHIN_BUDGET, name=f"{WITHIN_BUDGET.name}, exact allocation", allocation_solver="exact"),
)
SENSITIVITY = ("mlp 0.8 whitened + sequential", "attention 0.8 whitened + sequential", "head 0.8 whitened")
# (configuration, perplexity x dense at most, top-1 agreement at least) asked of the report on every held-out text;
# a target listed more than once is met by any of its configurations (the same pipeline in fewer steps, with
# either allocation solver).
TARGETS = (
    ("mlp 0.8 factored", 1.05, 0.85),
    ("mlp+attention 0.8 factored", 1.10, None),
    ("mlp+attention 0.8, 360 steps on 360 windows", 1.10, None),
    ("mlp+attention 0.8, 360 steps on 360 windows, exact allocation", 1.10, None),
    ("mlp+attention 0.8 pruned, 360 steps on 360 windows", 1.10, None),
    ("mlp 0.6 factored", 1.20, None),
    ("mlp 0.8 pruned", 1.05, 0.85),
    ("mlp 0.8 pruned, 360 steps on 360 windows", 1.05, 0.85),
    ("mlp 0.6 pruned, pruned kernels at 2e-3", 1.20, None),
    ("mlp 0.6 pruned, 360 steps on 360 windows", 1.20, None),
    ("mlp 0.6 pruned, 360 steps on 360 windows, pruned kernels at 1e-3", 1.20, None),
    ("mlp 0.6 pruned, 360 steps on 360 windows, pruned kernels at 2e-3", 1.20, None),
)
BUDGET_SECONDS = 15 * 60
